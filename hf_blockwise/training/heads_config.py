"""`BlockwiseHeadsTrainingArguments`: the settings of [`BlockwiseHeadsTrainer`] (a validated
`Seq2SeqTrainingArguments`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments

from hf_blockwise.training.common import prepare_eval_decoding

HEAD_LOSSES = ("mean", "sampled")
BASE_TRAINING = ("frozen", "full", "lora")


@dataclass
class BlockwiseHeadsTrainingArguments(Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus what training proposal heads needs (Stern et al. §6).

    Args:
        head_loss (`str`, defaults to `"mean"`): `"mean"` averages the k − 1 head cross-entropies; `"sampled"`
            draws one head uniformly per minibatch and trains on its loss alone (Stern §6).
        base_training (`str`, defaults to `"frozen"`): `"frozen"` trains the heads only and keeps decoding
            lossless; `"full"` fine-tunes the base with them (Stern's "fine-tuned" setting): the base's own
            loss joins the objective and p1 changes with training.
            `"lora"` trains LoRA adapters on the base through `peft` instead (saved beside the heads in PEFT's
            format and merged on loading).
        base_loss_weight (`float`, defaults to 1.0): weight of the base's loss when it is trained.
        base_learning_rate (`float`, *optional*): with `base_training="full"`, the base's own peak learning rate
            (the heads keep `learning_rate`; both follow the same schedule). Fresh heads need a rate that would
            move a trained base too far (Medusa-2 trains the two at different rates). `None`: one rate for all.
        lora_r (`int`, defaults to 8), lora_alpha (`int`, defaults to 16), lora_dropout (`float`, defaults to 0.0):
            the LoRA adapter's rank, scale and dropout.
        lora_target_modules (`list[str]`, *optional*): module names to adapt; by default PEFT's choice for the
            architecture (PEFT raises if it has none, e.g. for Marian: pass `["q_proj", "v_proj"]`).
        eval_max_new_tokens (`int`, defaults to 128): length limit of the blockwise decoding run at evaluation.
        eval_decoding_batch_size (`int`, defaults to 32): batch size of that run.
        eval_decoding_samples (`int`, *optional*): decode only the first N evaluation examples.
    """

    head_loss: str = field(default="mean", metadata={"help": f"one of {HEAD_LOSSES}"})
    base_training: str = field(default="frozen", metadata={"help": f"one of {BASE_TRAINING}"})
    base_loss_weight: float = field(default=1.0)
    base_learning_rate: float | None = field(default=None)
    lora_r: int = field(default=8)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.0)
    lora_target_modules: list[str] | None = field(default=None)
    eval_max_new_tokens: int = field(default=128)
    eval_decoding_batch_size: int = field(default=32)
    eval_decoding_samples: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"head_loss must be one of {HEAD_LOSSES}, got {self.head_loss!r}")
        if self.base_training not in BASE_TRAINING:
            raise ValueError(f"base_training must be one of {BASE_TRAINING}, got {self.base_training!r}")
        if self.lora_r < 1:
            raise ValueError(f"lora_r must be >= 1, got {self.lora_r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.base_loss_weight < 0:
            raise ValueError(f"base_loss_weight must be >= 0, got {self.base_loss_weight}")
        if self.base_learning_rate is not None and self.base_training != "full":
            raise ValueError(
                f"base_learning_rate needs base_training='full' (the base is trained), got {self.base_training!r}"
            )
        if self.base_learning_rate is not None and self.base_learning_rate <= 0:
            raise ValueError(f"base_learning_rate must be > 0, got {self.base_learning_rate}")
        prepare_eval_decoding(self)
        super().__post_init__()


# names before 0.2, kept for one release (with a FutureWarning)

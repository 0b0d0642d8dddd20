"""`FeatureDrafterTrainingArguments`: the settings of [`FeatureDrafterTrainer`], a validated
`Seq2SeqTrainingArguments`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments

from hf_blockwise.training.common import prepare_eval_decoding


@dataclass
class FeatureDrafterTrainingArguments(Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus the loss weights of a feature drafter (EAGLE: feature regression plus
    token cross-entropy, summed over the unrolled drafting steps of `FeatureDrafterConfig.training_depth`).

    Args:
        feature_loss_weight (`float`, defaults to 1.0): weight of the smooth-L1 loss on predicted states.
        token_loss_weight (`float`, defaults to 0.5): weight of the cross-entropy against the base's greedy token.
        eval_max_new_tokens (`int`, defaults to 128): length limit when evaluation decodes with the drafter.
        eval_decoding_batch_size (`int`, defaults to 32): batch size of that run.
        eval_decoding_samples (`int`, *optional*): decode only the first N evaluation examples.
    """

    feature_loss_weight: float = field(default=1.0)
    token_loss_weight: float = field(default=0.5)
    eval_max_new_tokens: int = field(default=128)
    eval_decoding_batch_size: int = field(default=32)
    eval_decoding_samples: int | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("feature_loss_weight", "token_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.feature_loss_weight == 0 and self.token_loss_weight == 0:
            raise ValueError("feature_loss_weight and token_loss_weight cannot both be 0")
        prepare_eval_decoding(self)
        super().__post_init__()

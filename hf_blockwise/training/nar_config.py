"""`NARDrafterTrainingArguments`: the settings of [`NARDrafterTrainer`], a validated `Seq2SeqTrainingArguments`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments

from hf_blockwise.training.common import prepare_eval_decoding


@dataclass
class NARDrafterTrainingArguments(Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus what training a non-autoregressive drafter needs (Ge et al. §3.2.1).

    Each time an example is drawn, a prefix length p is sampled uniformly from the target's positions; the
    drafter reads the source, the target's first p tokens and `block_size - 2` masks, and is trained to
    predict target tokens p+1 .. p+block_size-1.

    Args:
        prefixes_per_example (`int`, defaults to 1): prefixes sampled per example and draw; more gives more
            training signal per pass over the data at the cost of a larger batch.
        freeze_encoder (`bool`, defaults to `False`): train the decoder only. A drafter initialised from its
            verifier already has a good encoder; freezing it roughly halves the cost of a step. Where the
            architecture shares embeddings between encoder, decoder and output projection (Marian, BART, T5),
            those stay frozen too.
        eval_max_new_tokens (`int`, defaults to 128): length limit when evaluation decodes with the drafter.
        eval_decoding_batch_size (`int`, defaults to 32): batch size of that run.
        eval_decoding_samples (`int`, *optional*): decode only the first N evaluation examples.
    """

    prefixes_per_example: int = field(default=1)
    freeze_encoder: bool = field(default=False)
    eval_max_new_tokens: int = field(default=128)
    eval_decoding_batch_size: int = field(default=32)
    eval_decoding_samples: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.prefixes_per_example < 1:
            raise ValueError(f"prefixes_per_example must be >= 1, got {self.prefixes_per_example}")
        prepare_eval_decoding(self)
        # compute_loss, not the model, consumes `labels` and builds the decoder inputs; pass columns through
        self.remove_unused_columns = False
        super().__post_init__()

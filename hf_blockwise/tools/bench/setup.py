"""What the bench decodes with and what it decodes: the [`BenchSetup`] (a loaded model and the bench's knobs), the
sources read and cut into padded batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hf_blockwise.engine import CompileOptions
from hf_blockwise.evaluation.harness import Batch
from hf_blockwise.loading import LoadedModel
from hf_blockwise.tools.bench.modes import DEFAULT_ORACLE_BLOCK_SIZES


@dataclass(frozen=True)
class BenchSetup:
    """What the modes decode with.

    Attributes:
        loaded ([`LoadedModel`]): the base and what it ships (heads, drafters, tokenizer, feature extractor);
            without a tokenizer, sources are token ids and no texts, words/s or BLEU are reported; with a feature
            extractor, sources are audio samples and word error rate is reported beside BLEU.
        max_new_tokens (`int`): length limit of every mode.
        iad_max_draft_length (`int`): most source tokens the IAD modes draft per step.
        gad_block_size (`int`, *optional*): tokens per GAD step (default: the drafter's trained block size).
        gad_top_beta (`int`), gad_tolerance (`float`): GAD++'s β and τ (mode `gad_pp`).
        oracle_block_sizes (`tuple[int, ...]`): the block sizes k of the `oracle` mode, one row `oracle_k{k}` each.
        ct2_threads (`int`): CTranslate2's threads (`intra_threads`) in the `ct2` modes.
        temperature (`float`), top_p (`float`): the `_sample` modes' warpers.
        sampling_seed (`int`): `torch.manual_seed` before each batch of a `_sample` mode: every mode draws alike.
        compiled_prefill (`bool`): the `_compiled` modes compile each generate's first call too
            (`CompileOptions(compiled_prefill=True)`, as the corpus job's `--compile` on CPU).
    """

    loaded: LoadedModel
    max_new_tokens: int = 128
    iad_max_draft_length: int = 32
    gad_block_size: int | None = None
    gad_top_beta: int = 3
    gad_tolerance: float = 1.0
    oracle_block_sizes: tuple[int, ...] = DEFAULT_ORACLE_BLOCK_SIZES
    ct2_threads: int = 1
    temperature: float = 0.7
    top_p: float = 0.9
    sampling_seed: int = 0
    compiled_prefill: bool = False

    def engine(self, compiled: bool) -> bool | CompileOptions:
        """`blockwise_compile=` for a mode that is `compiled` or not."""
        return CompileOptions(compiled_prefill=True) if compiled and self.compiled_prefill else compiled


def usable_batch_sizes(batch_sizes: Sequence[int], num_sentences: int) -> list[int]:
    """The batch sizes that fit `num_sentences`; a note is printed for each one skipped."""
    usable = []
    for batch_size in dict.fromkeys(batch_sizes):
        if batch_size < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_size}")
        if batch_size > num_sentences:
            print(f"skipping batch size {batch_size}: larger than the {num_sentences} sentences")
        else:
            usable.append(batch_size)
    if not usable:
        raise ValueError(f"every batch size in {list(batch_sizes)} is larger than the {num_sentences} sentences")
    return usable


def make_batches(
    sources: Sequence[str] | Sequence[Sequence[int]] | Sequence[np.ndarray],
    batch_size: int,
    tokenizer: Any,
    pad_token_id: int,
    device: torch.device,
    feature_extractor: Any = None,
) -> list[Batch]:
    """`sources` in consecutive batches of `batch_size` rows, right-padded, with attention masks.

    Args:
        sources: sentences (tokenized with `tokenizer`), lists of source token ids (without a tokenizer), or audio
            samples (with a `feature_extractor`).

    Returns:
        `list[dict]` with `input_ids` and `attention_mask` of shape `(rows, longest source of the batch)`, or the
        feature extractor's outputs (e.g. Whisper's `input_features` of shape `(rows, mel bins, frames)`).
    """
    chunks = [list(sources[start : start + batch_size]) for start in range(0, len(sources), batch_size)]
    if feature_extractor is not None:
        rate = feature_extractor.sampling_rate
        return [dict(feature_extractor(chunk, sampling_rate=rate, return_tensors="pt").to(device)) for chunk in chunks]
    if tokenizer is not None:
        return [dict(tokenizer(chunk, return_tensors="pt", padding=True).to(device)) for chunk in chunks]
    batches = []
    for chunk in chunks:
        width = max(len(ids) for ids in chunk)
        input_ids = torch.tensor([list(ids) + [pad_token_id] * (width - len(ids)) for ids in chunk], device=device)
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in chunk], device=device)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches

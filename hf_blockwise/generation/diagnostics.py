"""Telling a floating-point near-tie from a real bug when a decoding disagrees with greedy search.

A verification pass scores several positions in one matrix product where greedy search scores one; the sums are
ordered differently, so scores can differ in their last bits. Where the best two scores are that close, greedy
search itself would flip with batch size or hardware. [`greedy_divergences`] re-decodes a candidate output with
transformers' own greedy search, forcing the candidate's tokens, and reports every position where the candidate
took another token than the best of greedy's processed scores there (the scores greedy compares: repetition
penalty, bad words, n-gram bans and the rest applied), with how far the candidate's token was from the best, in
units of the scores' float spacing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_blockwise.boundary import ForcedPathRecorder

# A candidate token second among greedy's processed scores and at most this many float spacings (of the
# position's largest score) below the best is a near-tie: reordered float32 sums in the zoo's decoders move
# scores by a few spacings (the suite's largest allowed gap is printed in its closing summary).
NEAR_TIE_SPACINGS = 64


@dataclass(frozen=True)
class Divergence:
    """A position where a candidate decoding took another token than greedy search would have, on the candidate's
    own prefix.

    Attributes:
        row (`int`): batch row.
        position (`int`): index in the decoder sequence of the token.
        greedy_token (`int`): the best of greedy's processed scores there (the lowest id among equal bests).
        candidate_token (`int`): the token the candidate took.
        candidate_rank (`int`): the candidate token's place in greedy's order (1: second best; ties broken by id,
            as `argmax` breaks them).
        gap (`float`): best processed score minus the candidate token's (`inf` where the candidate's is `-inf`).
        spacing (`float`): the float spacing (one unit in the last place) of the position's largest finite score
            magnitude, in the scores' dtype.
    """

    row: int
    position: int
    greedy_token: int
    candidate_token: int
    candidate_rank: int
    gap: float
    spacing: float

    @property
    def gap_in_spacings(self) -> float:
        """`gap` in units of `spacing`."""
        return self.gap / self.spacing

    def is_near_tie(self, max_spacings: float = NEAR_TIE_SPACINGS) -> bool:
        """Whether the candidate token was greedy's second best, within `max_spacings` float spacings of the best."""
        return self.candidate_rank == 1 and self.gap_in_spacings <= max_spacings


def _rank_and_gap(scores: torch.Tensor, token: int) -> tuple[int, int, float, float]:
    """Greedy's choice in `scores` (V,), the place of `token` in greedy's order, the gap and the spacing."""
    best = int(scores.argmax())
    score = scores[token]
    ids = torch.arange(scores.shape[0])
    rank = int(((scores > score) | ((scores == score) & (ids < token))).sum())
    finite = scores[scores.isfinite()]
    scale = finite.abs().max() if finite.numel() else scores.new_tensor(1.0)
    spacing = float(torch.nextafter(scale, scale.new_tensor(float("inf"))) - scale)
    gap = float(scores[best] - score) if torch.isfinite(score) else float("inf")
    return best, rank, gap, spacing


def _row_end(candidate: torch.Tensor, prompt_length: int, eos_token_ids: set[int]) -> int:
    """One past the last token a row generated (its first EOS, or the output's end)."""
    for position in range(prompt_length, candidate.shape[0]):
        if int(candidate[position]) in eos_token_ids:
            return position + 1
    return candidate.shape[0]


@torch.no_grad()
def greedy_divergences(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    candidate: torch.Tensor,
    prompt_length: int = 1,
    **generate_kwargs: Any,
) -> list[Divergence]:
    """Every position where `candidate` departs from the model's greedy search on its own prefix.

    The model's greedy `generate` runs once on `inputs` (the batch the candidate was decoded from: rows decode as
    in the reference run) with `generate_kwargs` (the candidate's generation arguments) and a last logits processor
    that records the processed scores and forces the candidate's next token. Up to a row's first divergence its
    scores are bitwise those of the greedy run that the candidate is compared with; after it, they are the
    model's on the candidate's prefix, so a later departure is found too.

    Args:
        model: the seq2seq model whose greedy search is the reference (the base model).
        inputs (`Mapping[str, torch.Tensor]`): `generate`'s model inputs (`input_ids`, `attention_mask`, or an
            audio or image model's features) of shape `(batch_size, ...)`.
        candidate (`torch.LongTensor` of shape `(batch_size, length)`): the decoder sequences to check, decoder
            prompt included.
        prompt_length (`int`): decoder prompt tokens at the start of each row (1: the decoder start token).
        generate_kwargs: the generation arguments of the candidate's decoding (`max_new_tokens` and `max_length`
            are set from `candidate`).

    Returns:
        One [`Divergence`] per departing position, by row then position; an empty list when the candidate is
        greedy's own output.
    """
    # greedy search over the candidate's length: the length, search and sampling arguments are this function's
    set_here = ("max_new_tokens", "max_length", "do_sample", "num_beams")
    kwargs = {key: value for key, value in generate_kwargs.items() if key not in set_here}
    config = model.generation_config
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos_token_ids = set(torch.as_tensor(eos).reshape(-1).tolist()) if eos is not None else set()
    recorder = ForcedPathRecorder(candidate)
    processors = [*(kwargs.pop("logits_processor", None) or []), recorder]
    if candidate.shape[1] > prompt_length:
        model.generate(
            **inputs, **kwargs, logits_processor=processors, do_sample=False, num_beams=1,
            max_new_tokens=candidate.shape[1] - prompt_length,
        )  # fmt: skip
    found = []
    for row in range(candidate.shape[0]):
        for position in range(prompt_length, _row_end(candidate[row], prompt_length, eos_token_ids)):
            step = position - prompt_length
            if step >= len(recorder.scores):  # greedy stopped every row before this one ended: a stopping rule
                raise ValueError(
                    f"Row {row} goes on past position {position}, where greedy search stopped every row: the "
                    "candidate was not decoded with these generation arguments"
                )
            token = int(candidate[row, position])
            best, rank, gap, spacing = _rank_and_gap(recorder.scores[step][row], token)
            if rank:
                found.append(Divergence(row, position, best, token, rank, gap, spacing))
    return found

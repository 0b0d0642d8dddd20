"""The suite's one allowance for floating-point near-ties, counted.

Tests that compare a decoding with greedy search call [`assert_greedy_up_to_near_ties`]: every row equal to the
reference, or, where not, every position where the row departs from greedy's best processed score (on its own
prefix) a near-tie ([`hf_blockwise.Divergence.is_near_tie`]: greedy's second best, within `NEAR_TIE_SPACINGS`
float spacings). Each row compared and each near-tie allowed is counted; pytest's closing summary prints
`near-ties allowed: N of M comparisons` with the largest allowed gap (conftest.py's hooks add up xdist's workers),
and the run fails when N exceeds `NEAR_TIE_BUDGET`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_blockwise import Divergence, greedy_divergences

# Near-ties the whole suite may allow: a handful per run is floating-point noise; more says a loop or a compiled
# graph computes other scores than greedy's, while every single one still passes as a tie.
NEAR_TIE_BUDGET = 24


@dataclass
class NearTieTally:
    """Rows compared with greedy and near-ties allowed in this process (one xdist worker, or the whole run)."""

    comparisons: int = 0
    allowed: list[tuple[str, int, int, float]] = field(default_factory=list)  # (where, row, position, spacings)

    def add(self, comparisons: int, allowed: list) -> None:
        self.comparisons += comparisons
        self.allowed += [tuple(entry) for entry in allowed]

    def summary(self) -> str:
        largest = max((entry[-1] for entry in self.allowed), default=0.0)
        return (
            f"near-ties allowed: {len(self.allowed)} of {self.comparisons} comparisons (budget {NEAR_TIE_BUDGET}; "
            f"largest gap {largest:.1f} float spacings)"
        )


TALLY = NearTieTally()


def _current_test() -> str:
    """The running test's id, as pytest sets it in the environment (the summary names each near-tie by it)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)")


def assert_greedy_up_to_near_ties(
    model: Any,
    inputs: dict[str, torch.Tensor],
    reference: torch.Tensor,
    candidate: torch.Tensor,
    prompt_length: int = 1,
    **generate_kwargs: Any,
) -> list[Divergence]:
    """`candidate` equals `reference` (greedy's output, or a decoding taken as exact), or departs from the model's
    greedy search only at counted near-ties.

    Args:
        model: the base model whose eager greedy search is the reference.
        inputs: the batch both were decoded from (`generate`'s model inputs).
        reference (`torch.LongTensor` of shape `(batch_size, length)`): greedy's output for `inputs`.
        candidate (`torch.LongTensor` of shape `(batch_size, length')`): the decoding under test.
        generate_kwargs: the generation arguments both were decoded with.

    Returns:
        The near-ties allowed (empty where the outputs are equal).
    """
    TALLY.comparisons += candidate.shape[0]
    if reference.shape == candidate.shape and torch.equal(reference, candidate):
        return []
    divergences = greedy_divergences(model, inputs, candidate, prompt_length=prompt_length, **generate_kwargs)
    assert divergences, f"outputs differ, yet the candidate is greedy's own path: {reference} vs {candidate}"
    not_ties = [divergence for divergence in divergences if not divergence.is_near_tie()]
    assert not not_ties, f"the output departs from greedy beyond a near-tie: {not_ties}"
    where = _current_test()
    TALLY.add(0, [(where, d.row, d.position, d.gap_in_spacings) for d in divergences])
    return divergences


def count_beam_ties(sequences_scores: torch.Tensor, swaps: list[tuple[int, float]]) -> None:
    """Counts a beam comparison: each returned sequence compared, and each one that came back in another place of
    its group, its score tied with the one it swapped with (`swaps`: row and score gap, within the caller's
    tolerance), allowed as a near-tie, its gap given in float spacings of its score."""
    where = _current_test()
    allowed = []
    for row, gap in swaps:
        score = sequences_scores[row].abs().float()
        spacing = float(torch.nextafter(score, torch.tensor(float("inf"))) - score)
        allowed.append((where, row, -1, gap / spacing))
    TALLY.add(sequences_scores.shape[0], allowed)

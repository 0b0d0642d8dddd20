"""Acceptance rules: which drafted tokens a verification pass keeps.

A rule looks at the base model's (processed) scores at each drafted position and says, per position,
whether the draft there is acceptable. The decoding loop keeps the longest acceptable prefix of each row
(`accepted_lengths`) and then appends the base model's own greedy token at the first position it did not
accept, so every step yields at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides which drafted tokens are acceptable.

    Attributes:
        lossless (`bool`): `True` when the rule reproduces greedy decoding token for token.
    """

    lossless: bool

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """
        Args:
            scores (`torch.FloatTensor` of shape `(batch_size, num_drafts, vocab_size)`):
                the base model's processed scores at the position each draft must match.
            drafts (`torch.LongTensor` of shape `(batch_size, num_drafts)`): the drafted tokens.

        Returns:
            `torch.BoolTensor` of shape `(batch_size, num_drafts)`: whether each draft is acceptable.
        """
        ...


@dataclass(frozen=True)
class ExactAcceptance:
    """Accepts a draft only where it equals the base model's greedy choice (Stern §3): output = greedy."""

    lossless: bool = True

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        return scores.argmax(dim=-1) == drafts


def accepted_lengths(match: torch.Tensor) -> torch.Tensor:
    """Length of the all-accepted prefix of each row.

    Args:
        match (`torch.BoolTensor` of shape `(batch_size, num_drafts)`).

    Returns:
        `torch.LongTensor` of shape `(batch_size,)`.
    """
    return match.long().cumprod(dim=-1).sum(dim=-1)

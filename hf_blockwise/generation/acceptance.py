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
        match (`torch.BoolTensor` of shape `(batch_size, num_drafts)`): whether each draft was accepted.

    Returns:
        `torch.LongTensor` of shape `(batch_size,)`.
    """
    return match.long().cumprod(dim=-1).sum(dim=-1)


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class TopKAcceptance:
    """Accepts a draft that is among the base model's `top_k` highest-scoring tokens (Stern §5.1).

    `top_k=1` is exact acceptance.
    """

    top_k: int = 2

    def __post_init__(self) -> None:
        _check_positive_int("top_k", self.top_k)

    @property
    def lossless(self) -> bool:
        return self.top_k == 1

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        if self.top_k == 1:
            return ExactAcceptance()(scores, drafts)
        draft_scores = scores.gather(-1, drafts[..., None])  # (B, D, 1)
        # rank = how many tokens score strictly higher than the draft
        return (scores > draft_scores).sum(dim=-1) < self.top_k


@dataclass(frozen=True)
class DistanceAcceptance:
    """Accepts a draft whose value lies within `epsilon` of the value of the base model's choice (Stern §5.2).

    For ordinal tokens (pixel intensities, numbers): `token_values[i]` is the value token i stands for.
    `epsilon=0` with distinct values is exact acceptance.

    Args:
        token_values (`torch.Tensor` of shape `(vocab_size,)`): value of each token id; NaN for tokens that
            have none (they are accepted only when they equal the base model's choice).
        epsilon (`float`): largest accepted distance.
    """

    token_values: torch.Tensor
    epsilon: float = 1.0

    def __post_init__(self) -> None:
        if self.token_values.dim() != 1:
            raise ValueError(f"token_values must be one value per token id, got shape {tuple(self.token_values.shape)}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

    @property
    def lossless(self) -> bool:
        return self.epsilon == 0

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] != self.token_values.shape[0]:
            raise ValueError(
                f"token_values has {self.token_values.shape[0]} entries but the model scores {scores.shape[-1]} tokens"
            )
        chosen = scores.argmax(dim=-1)  # (B, D)
        values = self.token_values.to(scores.device)
        close = (values[drafts] - values[chosen]).abs() <= self.epsilon  # NaN compares False
        return (drafts == chosen) | close


@dataclass(frozen=True)
class GADPlusPlusAcceptance:
    """GAD++ verification (Ge et al. §3.2.3): a draft passes if it is in the verifier's top-β and its
    log-probability is within τ of the best token's.

    `top_beta=1, tolerance=0` is exact acceptance.
    """

    top_beta: int = 3
    tolerance: float = 1.0

    def __post_init__(self) -> None:
        _check_positive_int("top_beta", self.top_beta)
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")

    @property
    def lossless(self) -> bool:
        return self.top_beta == 1 or self.tolerance == 0

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        if self.lossless:
            return ExactAcceptance()(scores, drafts)
        log_probs = torch.log_softmax(scores.float(), dim=-1)  # (B, D, V)
        draft_log_probs = log_probs.gather(-1, drafts[..., None]).squeeze(-1)  # (B, D)
        in_top_beta = TopKAcceptance(self.top_beta)(scores, drafts)
        return in_top_beta & (draft_log_probs >= log_probs.max(dim=-1).values - self.tolerance)


@dataclass(frozen=True)
class MinimumBlockAcceptance:
    """Accepts at least `min_block` tokens per step (Stern §5.3): the first `min_block - 1` drafts always pass,
    later ones by `rule`.

    `min_block=1` is `rule` itself.
    """

    rule: AcceptanceRule = ExactAcceptance()
    min_block: int = 2

    def __post_init__(self) -> None:
        _check_positive_int("min_block", self.min_block)
        if not isinstance(self.rule, AcceptanceRule):
            raise TypeError(f"rule must be an AcceptanceRule, got {type(self.rule).__name__}")

    @property
    def lossless(self) -> bool:
        return self.min_block == 1 and self.rule.lossless

    def __call__(self, scores: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Drafts judged by their column, which is their place in the block on a chain ([`accepted_at`] takes the
        places of a tree's drafts)."""
        places = torch.arange(drafts.shape[-1], device=drafts.device).expand_as(drafts)
        return accepted_at(self, scores, drafts, places)


def accepted_at(rule: AcceptanceRule, scores: torch.Tensor, drafts: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """`rule(scores, drafts)`, with [`MinimumBlockAcceptance`] forcing drafts by their place in the block rather than
    by their column: on a chain the two are the same, on a tree a column holds a node of any depth.

    Args:
        scores (`torch.FloatTensor` of shape `(batch_size, num_drafts, vocab_size)`), drafts (`torch.LongTensor` of
            shape `(batch_size, num_drafts)`): as for an [`AcceptanceRule`].
        places (`torch.LongTensor` of shape `(batch_size, num_drafts)`): each draft's place in its block, 0 for a
            draft right after the tokens already decided.

    Returns:
        `torch.BoolTensor` of shape `(batch_size, num_drafts)`.
    """
    if isinstance(rule, MinimumBlockAcceptance):
        return accepted_at(rule.rule, scores, drafts, places) | (places < rule.min_block - 1)
    return rule(scores, drafts)


def check_rule_fits(rule: AcceptanceRule, block_size: int) -> None:
    """A `ValueError` naming both numbers when `rule` forces more tokens per step than a step can produce.

    Args:
        block_size (`int`): the drafter's k, tokens per step with the base model's own (1 without a drafter).
    """
    if not isinstance(rule, MinimumBlockAcceptance):
        return
    if rule.min_block > block_size:
        raise ValueError(
            f"MinimumBlockAcceptance(min_block={rule.min_block}) forces {rule.min_block} tokens per step, but the "
            f"drafter's block_size is {block_size} (tokens per step, the base model's own included): use "
            f"min_block <= {block_size}, or a drafter with block_size >= {rule.min_block}"
        )
    check_rule_fits(rule.rule, block_size)

"""Sampling as greedy search on perturbed scores: exact in distribution, and the same tokens with or without drafts.

The Gumbel-max trick: `argmax(scores + g)`, with `g` independent standard Gumbel noise per token, is a sample of
`softmax(scores)` (the scores' normalization is a constant per row, which the argmax ignores). Here the noise of a
row at a position is a fixed function of the call's seed, the row's index in the caller's batch, the position and
the token ([`shared_gumbel_noise`], a counter-based hash of `shared_noise.py`: no random state is consumed as
decoding goes). So a verification call that scores k positions perturbs each as a one-token call at that position
would, and the loop's exact acceptance (a draft is kept where it is the argmax) keeps exactly the tokens sampling
one at a time would draw: the output with drafts is the output without them, token for token, and each token is
drawn from the warped distribution `generate` builds from the generation config (`temperature`, `top_k`, `top_p`,
`min_p`, ...).

This stream is not transformers' `torch.multinomial` stream: the same distribution, other tokens than
transformers' own sampling for the same `torch.manual_seed`.
"""

from __future__ import annotations

import torch

from hf_blockwise.drafters.base import DraftNoise
from hf_blockwise.shared_noise import gumbel, position_keys, shared_gumbel_noise


def draft_noise(seed: int, rows: torch.Tensor, temperature: float) -> DraftNoise:
    """The call's shared noise as drafters read it ([`DraftNoise`]): the same draws the verification adds."""

    return DraftNoise(seed=seed, rows=rows, temperature=temperature)


def perturbed_scores(scores: torch.Tensor, seed: int, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`scores` (processed and warped) plus the shared Gumbel noise of their rows and positions: their argmax is a
    sample of `softmax(scores)`, the same wherever the position is scored.

    Args:
        scores (`torch.FloatTensor` of shape `(b, n, vocab_size)`).
        rows (`torch.LongTensor` of shape `(b,)`), positions (`torch.LongTensor` of shape `(b, n)`): as for
            [`shared_gumbel_noise`].

    Returns:
        `torch.FloatTensor` of shape `(b, n, vocab_size)` (`-inf` where the warpers removed a token).
    """
    scores = scores.float()
    kept = torch.isfinite(scores)  # (b, n, V): what the warpers left (top-k, top-p... keep a few tokens)
    if bool(kept.all()):
        return scores + shared_gumbel_noise(seed, rows, positions, scores.shape[-1])
    # the noise of the kept tokens only, each the value the whole vocabulary's noise holds there: hashing 16 rows of
    # a 16k vocabulary took ~6 ms a step, more than the decoder call at batch 16
    row, column, token = kept.nonzero(as_tuple=True)
    keys = position_keys(seed, rows, positions)[row, column]  # (K,)
    perturbed = torch.full_like(scores, float("-inf"))
    perturbed[row, column, token] = scores[row, column, token] + gumbel(keys, token)
    return perturbed


def call_seed(generator: torch.Generator | None = None) -> int:
    """A call's seed, drawn from torch's random state (`torch.manual_seed` before `generate` makes it reproducible)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))

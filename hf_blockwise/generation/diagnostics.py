"""Telling a floating-point near-tie from a real bug when two decodings of the same model disagree.

A verification pass scores several positions in one matrix product where greedy search scores one; the
sums are ordered differently, so logits can differ in the last bits. Where the top two logits are that
close, greedy search itself would flip with batch size or hardware. `first_divergence` finds the first
position where two outputs differ and measures how close the call was there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Divergence:
    """Where two decodings of one row first differ.

    Attributes:
        row (`int`): batch row.
        position (`int`): index in the decoder sequence of the first differing token.
        reference_token (`int`), candidate_token (`int`): the two tokens there.
        top2_gap (`float`): gap between the best and second-best logit of the model at that position, with the
            reference prefix teacher-forced.
        token_gap (`float`): gap between the logits of the two tokens.
    """

    row: int
    position: int
    reference_token: int
    candidate_token: int
    top2_gap: float
    token_gap: float

    def is_near_tie(self, tolerance: float = 1e-4) -> bool:
        """Whether the two tokens were within `tolerance` of each other and were the model's top two."""
        return self.token_gap <= tolerance and self.top2_gap <= tolerance


@torch.no_grad()
def first_divergence(
    model: nn.Module,
    input_ids: torch.Tensor,
    reference: torch.Tensor,
    candidate: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int = 0,
) -> list[Divergence]:
    """Finds, for each row where `reference` and `candidate` differ, the first divergent position and its gap.

    Args:
        model: the seq2seq model that produced both outputs (the base model).
        input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`): the source.
        reference (`torch.LongTensor` of shape `(batch_size, length_a)`): e.g. greedy `generate` output.
        candidate (`torch.LongTensor` of shape `(batch_size, length_b)`): e.g. blockwise output.
        attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): the source's mask.
        pad_token_id (`int`): fills the shorter output before comparing.

    Returns:
        One [`Divergence`] per differing row; an empty list when the outputs are identical.
    """
    width = max(reference.shape[1], candidate.shape[1])
    reference = nn.functional.pad(reference, (0, width - reference.shape[1]), value=pad_token_id)
    candidate = nn.functional.pad(candidate, (0, width - candidate.shape[1]), value=pad_token_id)
    divergences = []
    for row in torch.nonzero((reference != candidate).any(dim=1)).flatten().tolist():
        position = int(torch.nonzero(reference[row] != candidate[row])[0])
        if position == 0:
            raise ValueError(f"Row {row} differs in its first decoder token: the decoder prompts are not the same")
        mask = None if attention_mask is None else attention_mask[row : row + 1]
        logits = (
            model(
                input_ids=input_ids[row : row + 1],
                attention_mask=mask,
                decoder_input_ids=reference[row : row + 1, :position],
            )
            .logits[0, -1]
            .float()
        )  # (V,)
        top2 = logits.topk(2).values
        reference_token, candidate_token = int(reference[row, position]), int(candidate[row, position])
        divergences.append(
            Divergence(
                row=row,
                position=position,
                reference_token=reference_token,
                candidate_token=candidate_token,
                top2_gap=float(top2[0] - top2[1]),
                token_gap=float((logits[reference_token] - logits[candidate_token]).abs()),
            )
        )
    return divergences

"""`ReferenceDrafter`: proposes a known continuation per row, e.g. greedy's own output (the loop's ceiling).

With the greedy output as its reference, every draft is right, so what blockwise decoding then gains over
greedy is the most any drafter could gain with this loop on this model and data: `hf-blockwise bench`'s
`oracle` mode. Fed a reference with some tokens changed, it is also a drafter that is right most of the
time and wrong sometimes, which the exactness tests use.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts


class ReferenceDrafter(Drafter):
    """Drafts the tokens of `reference` that follow each row's verified prefix.

    Args:
        reference (`torch.LongTensor` of shape `(batch_size, length)`): per row of the batch it will decode,
            the decoder sequence to propose (decoder start included, as `generate` returns it).
        block_size (`int`): k; proposes up to `block_size - 1` tokens per step.
    """

    def __init__(self, reference: torch.Tensor, block_size: int) -> None:
        if reference.dim() != 2:
            raise ValueError(f"reference must be (batch_size, length), got shape {tuple(reference.shape)}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        self.reference = reference
        self.block_size = block_size

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        batch_size = None if encoder_input_ids is None else encoder_input_ids.shape[0]
        if batch_size is not None and batch_size != self.reference.shape[0]:
            raise ValueError(
                f"ReferenceDrafter holds references for {self.reference.shape[0]} rows but the batch has {batch_size}"
            )
        return self.reference.to(encoder_input_ids.device if encoder_input_ids is not None else self.reference.device)

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        return drafter_state.index_select(0, rows)  # a tensor: narrowed as a new value (`drafters/base.py`)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        reference = request.drafter_state  # (b, R)
        num_drafts, width = self.block_size - 1, reference.shape[1]
        positions = request.lengths[:, None] + torch.arange(num_drafts, device=reference.device)  # (b, k-1)
        tokens = reference.gather(1, positions.clamp(max=width - 1))
        return Drafts(tokens=tokens, lengths=(width - request.lengths).clamp(0, num_drafts))

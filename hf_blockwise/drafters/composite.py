"""`CompositeDrafter`: per row and step, the source copy where the output tracks the source, a model elsewhere.

For rewriting tasks (error correction, simplification) most of the output is a copy of the source, which input-
guided drafting (IAD, Ge et al. 2022) proposes for free and in long runs. Where the output departs from the
source (an edit), IAD has no draft until the output's last tokens match a unique place in the source again;
there a model drafter (feature drafter, heads) proposes instead, so every step of every row drafts something.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts


def _widen(drafts: Drafts, width: int) -> torch.Tensor:
    """`drafts.tokens` padded with zeros to `width` columns."""
    missing = width - drafts.tokens.shape[1]
    if missing <= 0:
        return drafts.tokens
    return torch.cat([drafts.tokens, drafts.tokens.new_zeros(drafts.tokens.shape[0], missing)], dim=1)


class CompositeDrafter(Drafter):
    """Source copy ([`InputCopyDrafter`]) for rows where it has a draft this step, `model_drafter` for the others.

    The model drafter still sees every step, but is asked for no drafts on rows the copy serves; when the copy
    serves every row it is only shown the step ([`Drafter.observe`]), so a feature drafter defers taking in the
    verification's states until a step needs its drafts.

    Args:
        copy_drafter ([`InputCopyDrafter`]): drafts from the source.
        model_drafter ([`Drafter`]): drafts where the copy has none, e.g. a [`FeatureDrafter`].
        min_copy_length (`int`, defaults to 1): a row uses the copy when it offers at least this many tokens.
    """

    def __init__(self, copy_drafter: Drafter, model_drafter: Drafter, min_copy_length: int = 1) -> None:
        if min_copy_length < 1:
            raise ValueError(f"min_copy_length must be >= 1, got {min_copy_length}")
        self.copy_drafter = copy_drafter
        self.model_drafter = model_drafter
        self.min_copy_length = min_copy_length
        self.block_size = max(copy_drafter.block_size, model_drafter.block_size)
        self.reads_decoder_states = copy_drafter.reads_decoder_states or model_drafter.reads_decoder_states

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        return (
            self.copy_drafter.prepare(encoder_input_ids, encoder_attention_mask),
            self.model_drafter.prepare(encoder_input_ids, encoder_attention_mask),
        )

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        """The pair of its drafters' states, each narrowed by its own drafter (the rule of `drafters/base.py`)."""
        copy_state, model_state = drafter_state
        return self.copy_drafter.select_rows(copy_state, rows), self.model_drafter.select_rows(model_state, rows)

    def check_base(self, model: nn.Module) -> None:
        self.copy_drafter.check_base(model)
        self.model_drafter.check_base(model)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        copy_state, model_state = request.drafter_state
        copy_drafts = self.copy_drafter.get_candidates(dataclasses.replace(request, drafter_state=copy_state))
        use_copy = copy_drafts.lengths >= self.min_copy_length  # (b,)
        model_request = dataclasses.replace(
            request,
            drafter_state=model_state,
            max_drafts=torch.where(use_copy, 0, request.max_drafts).clamp(max=self.model_drafter.block_size - 1),
        )
        if bool(use_copy.all()):  # the copy serves every row: the model drafter only keeps what it may need later
            self.model_drafter.observe(model_request)
            return copy_drafts
        model_drafts = self.model_drafter.get_candidates(model_request)
        width = max(copy_drafts.tokens.shape[1], model_drafts.tokens.shape[1])
        tokens = torch.where(use_copy[:, None], _widen(copy_drafts, width), _widen(model_drafts, width))  # (b, w)
        lengths = torch.where(
            use_copy, copy_drafts.lengths, model_drafts.lengths.clamp(max=model_drafts.tokens.shape[1])
        )
        return Drafts(tokens=tokens, lengths=lengths)

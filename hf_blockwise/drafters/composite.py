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


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` (`(b, n)`) padded with zeros to `width` columns."""
    missing = width - values.shape[1]
    if missing <= 0:
        return values
    return torch.cat([values, values.new_zeros(values.shape[0], missing)], dim=1)


def _parents(drafts: Drafts, width: int) -> torch.Tensor:
    """`drafts.parents` padded to `width` columns, or a chain's (`-1, 0, 1, ...`) for chain drafts."""
    if drafts.parents is None:
        chain = torch.arange(-1, width - 1, device=drafts.tokens.device)
        return chain.expand(drafts.tokens.shape[0], -1)
    return _widen(drafts.parents, width)


class CompositeDrafter(Drafter):
    """Source copy ([`InputCopyDrafter`]) for rows where it has a draft this step, `model_drafter` for the others.

    The model drafter still sees every step, but is asked for no drafts on rows the copy serves; when the copy
    serves every row it is only shown the step ([`Drafter.observe`]), so a feature drafter defers taking in the
    verification's states until a step needs its drafts. A model drafter of trees makes a drafter of trees: the
    copy's chains are trees of one branch.

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
        if model_drafter.tree_nodes is not None:
            self.tree_nodes = max(model_drafter.tree_nodes, copy_drafter.block_size - 1)

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
        tokens = torch.where(use_copy[:, None], _widen(copy_drafts.tokens, width), _widen(model_drafts.tokens, width))
        lengths = torch.where(
            use_copy, copy_drafts.lengths, model_drafts.lengths.clamp(max=model_drafts.tokens.shape[1])
        )
        if model_drafts.parents is None:
            return Drafts(tokens=tokens, lengths=lengths)
        parents = torch.where(use_copy[:, None], _parents(copy_drafts, width), _parents(model_drafts, width))
        return Drafts(tokens=tokens, lengths=lengths, parents=parents)

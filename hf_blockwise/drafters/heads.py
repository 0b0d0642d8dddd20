"""`HeadsDrafter`: proposals from the heads of a [`BlockwiseHeadsModel`] (Stern et al. 2018 §3–4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hf_blockwise.boundary import (
    check_same_dtype,
    check_same_projection,
    output_projection_logits,
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter, DraftNoise, DraftRequest, Drafts
from hf_blockwise.drafters.trees import check_tree_options, drafted_candidates, ranked_tree


class HeadsModel(Protocol):
    """What [`HeadsDrafter`] reads of a model with proposal heads; [`BlockwiseHeadsModel`] is one.

    The drafter reads these attributes and owns nothing of the model: weights and persistence stay with the model
    (`modeling/`), which imports this module, not the other way round.

    Attributes:
        blockwise_config: its `block_size` (k) and `sequential` (Hydra-style heads that read the earlier drafts).
        heads (`nn.Module`): called as `heads(states, num_heads=, token_embeddings=)` -> `(B, num_heads, d)`, or, when
            sequential, `heads.head(index, states, token_embeddings)` -> `(B, d)`; `heads.shortlist` is a vocabulary
            shortlist or `None`.
        base_model (`nn.Module`): the transformers model whose output projection turns head states into tokens.
    """

    blockwise_config: Any
    heads: nn.Module
    base_model: nn.Module

    def chosen_token_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """Embeddings of the tokens the base chose, `(B,)` -> `(B, e)`, for heads that read them, else `None`."""


@dataclass(frozen=True)
class ShortlistProjection:
    """The output projection restricted to a vocabulary shortlist, for one `generate` call.

    Attributes:
        token_ids (`torch.LongTensor` of shape `(shortlist_size,)`).
        weight (`torch.Tensor` of shape `(shortlist_size, hidden_size)`).
        bias (`torch.Tensor` of shape `(shortlist_size,)`, *optional*): projection bias plus logit bias.
    """

    token_ids: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


class HeadsDrafter(Drafter):
    """Drafts with the proposal heads of a [`BlockwiseHeadsModel`] (Stern et al. §3–4).

    The heads read the decoder state that predicted each row's last token, a by-product of the previous
    verification pass, so drafting costs no extra decoder call. Before the first pass there is no state,
    and the first step drafts nothing.

    Args:
        model ([`HeadsModel`], e.g. a [`BlockwiseHeadsModel`]): the model whose heads draft.
        block_size (`int`, *optional*): use only the first `block_size - 1` heads (2 <= block_size <= the
            model's block size). Fewer heads cost less per step when long blocks are rarely accepted.
        use_shortlist (`bool`, defaults to `True`): propose only among the model's vocabulary shortlist, if it
            has one (see [`BlockwiseHeadsModel.set_shortlist`]); `False` drafts over the whole vocabulary.
        tree_nodes (`int`, *optional*): propose a tree of this many drafts per row (Medusa's trees): the chain of
            every head's best token and each head's runners-up beside it, the best by cumulative probability
            (`drafters/trees.py`). `None` drafts a chain.
        tree_branching (`int`, defaults to 2): candidates per head in a tree.
    """

    reads_decoder_states = True

    def __init__(
        self,
        model: HeadsModel,
        block_size: int | None = None,
        use_shortlist: bool = True,
        tree_nodes: int | None = None,
        tree_branching: int = 2,
    ) -> None:
        trained = model.blockwise_config.block_size
        block_size = trained if block_size is None else block_size
        if not 2 <= block_size <= trained:
            raise ValueError(f"block_size must be between 2 and the model's block size {trained}, got {block_size}")
        check_tree_options(tree_nodes, tree_branching, block_size - 1)
        self.model = model
        self.block_size = block_size
        self.use_shortlist = use_shortlist
        self.tree_nodes = tree_nodes
        self.branching = 1 if tree_nodes is None else tree_branching

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        """The shortlist's rows of the output projection, derived once per `generate` call (slicing them every
        step would cost as much as using them), from the model as it is now (device, dtype, shortlist)."""
        shortlist = self.model.heads.shortlist if self.use_shortlist else None
        if shortlist is None:
            return None
        weight, bias = shortlist_projection(self.model.base_model, shortlist)
        return ShortlistProjection(token_ids=shortlist, weight=weight, bias=bias)

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        return drafter_state  # a frozen projection, nothing per row: the same value (`drafters/base.py`)

    def check_base(self, model: nn.Module) -> None:
        check_same_projection(self.model.base_model, model, "HeadsDrafter")
        check_same_dtype(self.model.heads, model, "HeadsDrafter")

    def get_candidates(self, request: DraftRequest) -> Drafts:
        batch_size = request.lengths.shape[0]
        if request.last_states is None:
            return Drafts.empty(batch_size, request.lengths.device)
        states = request.last_states.to(self.model.base_model.get_output_embeddings().weight.dtype)
        # the last verified token is the base model's own choice from `last_states`
        last_tokens = request.sequences.gather(1, (request.lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
        chosen = self.model.chosen_token_embeddings(last_tokens)  # (B, e) or None
        # head i drafts the token at position lengths + i (sampling calls draft on their noise there)
        positions = request.lengths[:, None] + torch.arange(self.block_size - 1, device=request.lengths.device)
        sampling = request.sampling
        if self.model.blockwise_config.sequential:
            tokens, probabilities = self._draft_sequentially(
                states, chosen, request.drafter_state, sampling, positions
            )  # (B, k-1, m)
        else:
            head_states = self.model.heads(states, num_heads=self.block_size - 1, token_embeddings=chosen)
            tokens, probabilities = self._project(head_states, request.drafter_state, sampling, positions)
        if self.tree_nodes is not None:
            return ranked_tree(tokens, probabilities, self.tree_nodes)
        lengths = torch.full((batch_size,), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens[..., 0], lengths=lengths)

    def _project(
        self,
        head_states: torch.Tensor,
        projection: ShortlistProjection | None,
        sampling: DraftNoise | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `branching` most likely tokens of each head state (shape `(..., d)` -> `(..., m)`), over the
        shortlist if any, and their probabilities; a sampling call's chains draw on its noise at `positions`."""
        if projection is None:
            logits = output_projection_logits(self.model.base_model, head_states)
        else:
            weight, bias = projection.weight, projection.bias
            logits = torch.nn.functional.linear(head_states.to(weight.dtype), weight, bias)
        token_ids = None if projection is None else projection.token_ids
        if sampling is None or positions is None:
            return drafted_candidates(logits, token_ids, self.branching)
        return drafted_candidates(logits, token_ids, self.branching, sampling.keys(positions), sampling.temperature)

    def _draft_sequentially(
        self,
        states: torch.Tensor,
        chosen: torch.Tensor,
        projection: ShortlistProjection | None,
        sampling: DraftNoise | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sequential heads: head i reads the embeddings of t_0 and of the drafts of heads 1..i-1.

        Args:
            states (`torch.Tensor` of shape `(B, d)`), chosen (`torch.Tensor` of shape `(B, e)`): t_0's embedding.
            sampling ([`DraftNoise`], *optional*), positions (`torch.LongTensor` of shape `(B, block_size - 1)`):
                a sampling call's noise and the position each head's draft takes.

        Returns:
            tokens (`torch.LongTensor` of shape `(B, block_size - 1, m)`), best first (each head reads the chain of
            the earlier heads' best), and their probabilities.
        """
        embedded, tokens, probabilities = [chosen], [], []
        for index in range(self.block_size - 1):
            ranked, probability = self._project(
                self.model.heads.head(index, states, torch.stack(embedded, dim=1)),
                projection,
                sampling,
                None if positions is None else positions[:, index],
            )
            tokens.append(ranked)
            probabilities.append(probability)
            embedded.append(self.model.chosen_token_embeddings(ranked[:, 0]))
        return torch.stack(tokens, dim=1), torch.stack(probabilities, dim=1)

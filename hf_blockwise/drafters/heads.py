"""`HeadsDrafter`: proposals from the heads of a [`BlockwiseHeadsModel`] (Stern et al. 2018 §3–4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hf_blockwise.boundary import (
    check_same_dtype,
    check_same_projection,
    decoder_input_embeddings,
    output_projection_logits,
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts
from hf_blockwise.drafters.trees import check_tree_options, drafted_candidates, ranked_tree
from hf_blockwise.engine import CompiledModule, compiled_block


class HeadsModel(Protocol):
    """What [`HeadsDrafter`] reads of a model with proposal heads; [`BlockwiseHeadsModel`] is one.

    The drafter reads these attributes and owns nothing of the model: weights and persistence stay with the model
    (`modeling/`), which imports this module, not the other way round.

    Attributes:
        blockwise_config: its `block_size` (k), `sequential` (Hydra-style heads that read the earlier drafts) and
            `condition_on_token` (heads that also read the embedding of the token the base chose).
        heads (`nn.Module`): called as `heads(states, num_heads=, token_embeddings=)` -> `(B, num_heads, d)`, or, when
            sequential, `heads.head(index, states, token_embeddings)` -> `(B, d)`; `heads.shortlist` is a vocabulary
            shortlist or `None`.
        base_model (`nn.Module`): the transformers model whose output projection turns head states into tokens and
            whose decoder's input embeddings embed the tokens that heads read.
    """

    blockwise_config: Any
    heads: nn.Module
    base_model: nn.Module


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
            return HeadsDraftState(projection=None)
        weight, bias = shortlist_projection(self.model.base_model, shortlist)
        return HeadsDraftState(projection=ShortlistProjection(token_ids=shortlist, weight=weight, bias=bias))

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        return drafter_state  # nothing per row: the same state (`drafters/base.py`)

    def check_base(self, model: nn.Module) -> None:
        check_same_projection(self.model.base_model, model, "HeadsDrafter")
        check_same_dtype(self.model.heads, model, "HeadsDrafter")

    def get_candidates(self, request: DraftRequest) -> Drafts:
        batch_size = request.lengths.shape[0]
        if request.last_states is None:
            return Drafts.empty(batch_size, request.lengths.device)
        state: HeadsDraftState = request.drafter_state
        states = request.last_states.to(self.model.base_model.get_output_embeddings().weight.dtype)
        # the last verified token is the base model's own choice from `last_states`
        last_tokens = request.sequences.gather(1, (request.lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
        keys, temperature = None, 1.0
        if request.sampling is not None:  # head i drafts the token at position lengths + i, on the call's noise there
            positions = request.lengths[:, None] + torch.arange(self.block_size - 1, device=request.lengths.device)
            keys, temperature = request.sampling.keys(positions), request.sampling.temperature
        tokens, probabilities = self._block(request, state)(states, last_tokens, keys, temperature)  # (B, k-1, m)
        if self.tree_nodes is not None:
            return ranked_tree(tokens, probabilities, self.tree_nodes)
        lengths = torch.full((batch_size,), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens[..., 0], lengths=lengths)

    def _block(self, request: DraftRequest, state: HeadsDraftState) -> CompiledModule | HeadsDraftBlock:
        """The drafting block of this call: compiled under the engine at batch 1 (looked up once per call), a plain
        module otherwise, as the feature drafter's block (a compiled batch graph is not measured to pay for either:
        the feature drafter's ran at half the eager speed at batch 16)."""
        if request.compile is not None and request.lengths.shape[0] == 1:
            if not state.compiled_ready:
                state.compiled, state.compiled_ready = self._compiled_block(request, state.projection), True
            if state.compiled is not None:
                return state.compiled
        if state.eager is None:
            state.eager = HeadsDraftBlock(self.model, state.projection, self.block_size - 1, self.branching)
        return state.eager

    def _compiled_block(self, request: DraftRequest, projection: ShortlistProjection | None) -> CompiledModule | None:
        """The model's compiled [`HeadsDraftBlock`] for this drafter's block size, branching and projection."""
        key = f"heads_k{self.block_size}_m{self.branching}_"
        key += "full" if projection is None else str(projection.token_ids.shape[0])
        # the block reads the heads, the base's embeddings and a copy of the base's output projection: its snapshots
        # watch those (the engine watches the base's other layers once per generate)
        projection_source = self.model.base_model.get_output_embeddings()
        return compiled_block(
            self.model,
            key,
            lambda: HeadsDraftBlock(self.model, projection, self.block_size - 1, self.branching),
            request.compile,
            reads=lambda _: [projection_source],
        )


@dataclass
class HeadsDraftState:
    """What a [`HeadsDrafter`] keeps for one `generate` call (its `drafter_state`; the same for every row).

    Attributes:
        projection ([`ShortlistProjection`], *optional*): the shortlist's rows of the output projection.
        compiled ([`CompiledModule`], *optional*): the compiled drafting block, looked up once per call
            (`compiled_ready`); `None` where compilation is unavailable.
        eager ([`HeadsDraftBlock`], *optional*): the drafting block as a plain module, built on first use.
    """

    projection: ShortlistProjection | None
    compiled: CompiledModule | None = None
    compiled_ready: bool = False
    eager: HeadsDraftBlock | None = None


class HeadsDraftBlock(nn.Module):
    """The heads' drafts of one step as one module: the one drafting implementation of [`HeadsDrafter`], compiled
    (no host reads, the heads and the shortlist projection in one graph) or run as a plain module.

    Args:
        model ([`HeadsModel`]): its heads, and the base's token embeddings and output projection.
        projection ([`ShortlistProjection`], *optional*): the shortlist rows of the output projection (buffers, so
            that freezing prepacks them); `None` projects onto the whole vocabulary.
        num_heads (`int`): drafts per row, `block_size - 1`.
        branching (`int`): ranked candidates per head (the first is the chain's token).
    """

    def __init__(
        self, model: HeadsModel, projection: ShortlistProjection | None, num_heads: int, branching: int
    ) -> None:
        super().__init__()
        self.heads = model.heads
        self.sequential = model.blockwise_config.sequential
        reads_tokens = model.blockwise_config.sequential or model.blockwise_config.condition_on_token
        self.embeddings = decoder_input_embeddings(model.base_model) if reads_tokens else None
        self.base_model = model.base_model if projection is None else None
        self.num_heads = num_heads
        self.branching = branching
        self.register_buffer("token_ids", None if projection is None else projection.token_ids)
        self.register_buffer("weight", None if projection is None else projection.weight)
        self.register_buffer("bias", None if projection is None else projection.bias)

    def forward(
        self,
        states: torch.Tensor,
        last_tokens: torch.Tensor,
        draft_keys: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            states (`torch.Tensor` of shape `(B, d)`): the decoder state that predicted each row's last token.
            last_tokens (`torch.LongTensor` of shape `(B,)`): that token (t_0), which token-reading heads embed.
            draft_keys (`torch.LongTensor` of shape `(B, num_heads)`, *optional*): a sampling call's noise keys at
                each head's position ([`DraftNoise.keys`]); `None` for greedy calls.
            temperature (`float`): the sampling call's temperature.

        Returns:
            tokens (`torch.LongTensor` of shape `(B, num_heads, branching)`), best first, and their probabilities.
        """
        chosen = None if self.embeddings is None else self.embeddings(last_tokens)  # (B, e)
        if not self.sequential:
            head_states = self.heads(states, num_heads=self.num_heads, token_embeddings=chosen)  # (B, n, d)
            return self._candidates(head_states, draft_keys, temperature)
        # sequential heads: head i reads the embeddings of t_0 and of the best drafts of heads 1..i-1
        embedded, tokens, probabilities = [chosen], [], []
        for index in range(self.num_heads):
            head_state = self.heads.head(index, states, torch.stack(embedded, dim=1))  # (B, d)
            keys = None if draft_keys is None else draft_keys[:, index]
            ranked, probability = self._candidates(head_state, keys, temperature)
            tokens.append(ranked)
            probabilities.append(probability)
            embedded.append(self.embeddings(ranked[:, 0]))
        return torch.stack(tokens, dim=1), torch.stack(probabilities, dim=1)

    def _candidates(
        self, head_states: torch.Tensor, keys: torch.Tensor | None, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `branching` most likely tokens of each head state (`(..., d)` -> `(..., m)`), over the shortlist if
        any, and their probabilities; a sampling call's chains draw on its noise `keys` (`(...)`)."""
        if self.weight is None:
            logits = output_projection_logits(self.base_model, head_states)
        else:
            logits = torch.nn.functional.linear(head_states.to(self.weight.dtype), self.weight, self.bias)
        return drafted_candidates(logits, self.token_ids, self.branching, keys, temperature)

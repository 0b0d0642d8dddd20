"""The feature drafter's drafting block ([`FeatureDraftBlock`]): the take-in of a verified chunk and a step's drafts
as one module over fixed-capacity buffers, for `torch.compile` (and eager trees), with what it reads of the drafter
model ([`FeatureModel`]) and the cross-attention memory ([`AttentionMemory`]). The drafter (`drafters/feature.py`)
decides when it runs and keeps its cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hf_blockwise.boundary import decoder_input_embeddings, output_projection_logits
from hf_blockwise.drafters.heads import ShortlistProjection
from hf_blockwise.drafters.trees import drafted_candidates, expanded_depths, select_tree_tensors
from hf_blockwise.quantization import Int8Linear, is_int8


class FeatureModel(Protocol):
    """What [`FeatureDrafter`] reads of a model with a feature drafter; [`FeatureDrafterModel`] is one.

    The drafter owns proposing and nothing of the model: weights and persistence stay with the model (`modeling/`),
    which imports this module, not the other way round.

    Attributes:
        feature_config: its `block_size` and `threshold` (defaults of the drafter).
        layer (`nn.Module`): the drafter layer (`modeling/feature_layer.py: FeatureDrafterLayer`): `inputs`,
            `self_memory`, `encoder_memory`, its call, `out` and its `shortlist` buffer (or `None`).
        base_model (`nn.Module`): the transformers model whose output projection turns states into tokens.
    """

    feature_config: Any
    layer: nn.Module
    base_model: nn.Module

    def token_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The base decoder's input embeddings of `token_ids` (any shape `S` -> `S + (e,)`), as the layer reads them."""


@dataclass
class AttentionMemory:
    """Keys and values one attention reads, with a mask over them.

    Attributes:
        keys (`torch.Tensor` of shape `(batch_size, num_heads, length, head_size)`).
        values (`torch.Tensor` of shape `(batch_size, num_heads, length, head_size)`).
        mask (`torch.BoolTensor` broadcastable to `(batch_size, 1, num_queries, length)`, *optional*): True where
            a query may attend.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None


class FeatureDraftBlock(nn.Module):
    """The feature drafter's take-in and `num_drafts` drafts as one module over its key/value buffers: the one
    drafting implementation, compiled (`torch.compile`: no host reads, no shapes that depend on values, the drafts
    unrolled and the shortlist projection inside) or run as a plain module.

    Args:
        model ([`FeatureDrafterModel`]): its layer, and the base's token embeddings and output projection.
        projection ([`ShortlistProjection`], *optional*): the shortlist rows of the output projection (kept as
            buffers, so that freezing prepacks them); `None` projects onto the whole vocabulary.
        num_drafts (`int`): drafts per row and call, `block_size - 1` (the depth of a tree).
        branching (`int`, defaults to 1): ranked candidates per drafted state (the first is the chain's token).
        frontier (`int`, defaults to 0): `0` drafts one chain (with each depth's runners-up when `branching > 1`);
            more grows a tree EAGLE-2's way: at each depth the `frontier` candidates of highest cumulative
            probability are expanded together (one layer pass over `frontier` queries, each attending to its own
            ancestors), each proposing its `branching` best children.
        num_nodes (`int`, *optional*): with a `frontier`, the tree's size: the best `num_nodes` candidates by
            cumulative probability are selected inside the block.
    """

    def __init__(
        self,
        model: FeatureModel,
        projection: ShortlistProjection | None,
        num_drafts: int,
        branching: int = 1,
        frontier: int = 0,
        num_nodes: int | None = None,
    ) -> None:
        super().__init__()
        self.branching = branching
        self.frontier = frontier
        self.num_nodes = num_nodes
        self.layer = model.layer
        self.embeddings = decoder_input_embeddings(model.base_model)
        self.base_model = model.base_model if projection is None else None
        self.num_drafts = num_drafts
        self.register_buffer("token_ids", None if projection is None else projection.token_ids)
        self.register_buffer("weight", None if projection is None else projection.weight.detach().clone())
        bias = None if projection is None or projection.bias is None else projection.bias.detach().clone()
        self.register_buffer("bias", bias)
        # a drafter layer in int8 projects onto its shortlist in int8 too: a quarter of the bytes, on the int8 kernel
        # (measured on the EPYC Zen 4: 2,000 float32 rows on MKL cost ~0.26 ms a draft in an int8 graph, which takes
        # no GEMM template); drafts only propose, so the output stays the base's
        self.int8_projection = None if self.weight is None or not is_int8(self.layer) else _int8_rows(self.weight, bias)

    def forward(
        self,
        states: torch.Tensor,
        sequences: torch.Tensor,
        num_valid: torch.Tensor,
        start: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder_keys: torch.Tensor | None,
        encoder_values: torch.Tensor | None,
        encoder_mask: torch.Tensor | None,
        draft_keys: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            states (`torch.Tensor` of shape `(b, W, d)`): the verified chunk's states, positions `start..start+W-1`;
                columns past a row's `num_valid` are ignored.
            sequences (`torch.LongTensor` of shape `(b, L)`): the verified tokens (the token after each state).
            num_valid (`torch.LongTensor` of shape `(b,)`), start (`torch.LongTensor` of shape `()`).
            keys, values (`torch.Tensor` of shape `(b, H, C, d/H)`): the drafter's cache, written in place; slots
                before `start` hold verified positions of every row, `C >= start + W + num_drafts`.
            encoder_keys, encoder_values, encoder_mask: the cross-attention memory, or `None`s without one.
            draft_keys (`torch.LongTensor` of shape `(b, num_drafts)`, *optional*): a sampling call's noise keys at
                each draft's position ([`DraftNoise.keys`]); chains then draft what sampling would draw from the
                drafter's distribution ([`drafted_candidates`]).
            temperature (`float`, defaults to 1.0): the sampling call's temperature.

        Returns:
            tokens (`torch.LongTensor` of shape `(b, num_drafts, branching)`): each depth's best tokens, best first
            (the drafts follow the first); their probabilities under the drafter (`torch.FloatTensor`, same shape).
            With a `frontier`: the tree's tokens and parents instead (`(b, num_nodes)` each, [`_grow`]).
        """
        columns = torch.arange(states.shape[1], device=states.device)  # (W,)
        follow = sequences[:, (start + 1 + columns).clamp(max=sequences.shape[1] - 1)]  # (b, W)
        encoder = None if encoder_keys is None else AttentionMemory(encoder_keys, encoder_values, encoder_mask)
        return self._take_in_and_draft(states, follow, num_valid, start, keys, values, encoder, draft_keys, temperature)

    def _take_in_and_draft(
        self,
        states: torch.Tensor,
        follow: torch.Tensor,
        num_valid: torch.Tensor,
        start: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder: AttentionMemory | None,
        draft_keys: torch.Tensor | None,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk `(b, W, d)` with the token after each column (`follow`, `(b, W)`) taken in at slots `start..`,
        then the drafts from each row's last valid column (the arguments and result of [`forward`])."""
        batch, width = states.shape[:2]
        columns = torch.arange(width, device=states.device)  # (W,)
        slots = torch.arange(keys.shape[2], device=states.device)  # (C,)
        # the chunk: column c sees every slot up to its own position (before `start`, every row's are verified)
        chunk_visible = slots <= (start + columns)[:, None]  # (W, C)
        predicted = self._attend(states, follow, keys, values, start + columns, chunk_visible, encoder)
        lengths = start + num_valid  # (b,)
        predicted = predicted[torch.arange(batch, device=states.device), (num_valid - 1).clamp(min=0)]  # (b, d)
        # drafts go after the chunk; draft i sees its row's verified slots and drafts 0..i
        filled = start + width
        if self.frontier:
            return self._grow(predicted, lengths, filled, keys, values, encoder)
        tokens, probabilities = [], []
        for index in range(self.num_drafts):
            ranked, probability = self._choose(
                predicted, None if draft_keys is None else draft_keys[:, index], temperature
            )
            tokens.append(ranked)  # (b, m), with `probability` (b, m)
            probabilities.append(probability)
            token = ranked[:, 0]
            if index + 1 < self.num_drafts:
                slot = (filled + index).reshape(1)
                visible = (slots < lengths[:, None]) | ((slots >= filled) & (slots <= slot))  # (b, C)
                predicted = self._attend(
                    predicted[:, None], token[:, None], keys, values, slot, visible[:, None, None, :], encoder
                )[:, 0]
        return torch.stack(tokens, dim=1), torch.stack(probabilities, dim=1)

    def _grow(
        self,
        predicted: torch.Tensor,
        lengths: torch.Tensor,
        filled: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder: AttentionMemory | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-2's expansion: the `frontier` best candidates of each depth proposed together.

        Drafted keys go to slots `filled + depth * frontier + j` (frontier node j); a node attends to its row's
        verified slots and to the slots of its own path (`path`, over the `num_drafts * frontier` drafted slots).

        Returns:
            tokens and parents (`(b, num_nodes)`): the best `num_nodes` of every candidate (`m + (num_drafts - 1) *
            frontier * m`) by cumulative draft probability, as [`select_tree`] lays a tree out.
        """
        batch, frontier, room = predicted.shape[0], self.frontier, self.num_drafts * self.frontier
        ranked, probability = self._choose(predicted)  # (b, m)
        tokens, parents, scores = [ranked], [torch.full_like(ranked, -1)], [probability]
        score, pick = probability.topk(frontier, dim=1)  # (b, B): the first frontier
        nodes, node_tokens = pick, ranked.gather(1, pick)  # candidate index and token of each frontier node
        states = predicted[:, None].expand(-1, frontier, -1)  # (b, B, d): the state each frontier node follows
        path = torch.zeros(batch, frontier, room, dtype=torch.bool, device=predicted.device)
        slots = torch.arange(keys.shape[2], device=predicted.device)  # (C,)
        drafted = (slots - filled).clamp(0, room - 1)[None, None].expand(batch, frontier, -1)  # (b, B, C)
        offset = ranked.shape[1]
        for depth in range(self.num_drafts - 1):
            own = depth * frontier + torch.arange(frontier, device=predicted.device)  # (B,)
            path = path | torch.nn.functional.one_hot(own, room).bool()[None]
            visible = (slots < lengths[:, None])[:, None] | (
                path.gather(2, drafted) & (slots >= filled) & (slots < filled + room)
            )  # (b, B, C)
            states = self._attend(states, node_tokens, keys, values, filled + own, visible[:, None], encoder)
            ranked, probability = self._choose(states)  # (b, B, m)
            children = (score[..., None] * probability).reshape(batch, -1)  # (b, B * m)
            tokens.append(ranked.reshape(batch, -1))
            parents.append(nodes[..., None].expand_as(ranked).reshape(batch, -1))
            scores.append(children)
            score, pick = children.topk(frontier, dim=1)  # the next frontier
            nodes, node_tokens = offset + pick, ranked.reshape(batch, -1).gather(1, pick)
            came_from = (pick // self.branching)[..., None]  # (b, B, 1): its parent's frontier place
            states = states.gather(1, came_from.expand(-1, -1, states.shape[2]))
            path = path.gather(1, came_from.expand(-1, -1, room))
            offset += children.shape[1]
        tokens, parents, scores = torch.cat(tokens, dim=1), torch.cat(parents, dim=1), torch.cat(scores, dim=1)
        depth = expanded_depths(self.num_drafts, self.branching, frontier, tokens.device).expand(batch, -1)
        return select_tree_tensors(tokens, parents, depth, scores, self.num_nodes, self.num_drafts)

    def _attend(
        self,
        states: torch.Tensor,
        tokens: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        write: torch.Tensor,
        visible: torch.Tensor,
        encoder: AttentionMemory | None = None,
    ) -> torch.Tensor:
        """The layer over `(b, Q)` positions: their keys written at slots `write` (shape `(Q,)`), attention through
        `visible` (broadcastable to `(b, 1, Q, C)`); returns predicted next states `(b, Q, d)`."""
        inputs = self.layer.inputs(states, self.embeddings(tokens))  # (b, Q, d)
        return self._attend_inputs(inputs, keys, values, write, visible, encoder)

    def _attend_inputs(
        self,
        inputs: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        write: torch.Tensor,
        visible: torch.Tensor,
        encoder: AttentionMemory | None,
    ) -> torch.Tensor:
        """[`_attend`] from the layer's inputs `(b, Q, d)` (fused states and tokens, or mask inputs)."""
        layer = self.layer
        fresh, normed = layer.self_memory(inputs)  # (b, H, Q, d/H)
        keys.index_copy_(2, write, fresh.keys)
        values.index_copy_(2, write, fresh.values)
        return layer(inputs, normed, AttentionMemory(keys, values, visible), encoder)

    def _choose(
        self, predicted: torch.Tensor, keys: torch.Tensor | None = None, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `branching` best drafts from its predicted state `(b, d)`, with their probabilities (a chain's
        token drawn on a sampling call's noise under `keys`, `(b,)`, when given)."""
        if self.weight is None:
            logits = output_projection_logits(self.base_model, predicted)  # (b, V)
        elif self.int8_projection is not None:
            logits = self.int8_projection(predicted)  # (b, S)
        else:
            logits = F.linear(predicted.to(self.weight.dtype), self.weight, self.bias)  # (b, S)
        return drafted_candidates(logits, self.token_ids, self.branching, keys, temperature)


def _int8_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """An int8 layer over a shortlist's rows `(S, d)` of the output projection (and their bias `(S,)`)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).eval()
    linear.weight = nn.Parameter(weight.float(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.float(), requires_grad=False)
    return Int8Linear(linear)

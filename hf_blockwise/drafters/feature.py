"""`FeatureDrafter`: autoregressive drafts from a feature-level drafter (EAGLE-style) for seq2seq models.

Per step, the drafter first takes in what the last verification pass established: for every newly verified
position p, the base's state h_p (at its output projection) and the token verified after it. Those enter the
drafter's own key/value cache, laid out per row (rows verify different numbers of tokens). Its output at each
row's last verified position predicts the state that follows, hence the first draft; each draft is then fed
back with the predicted state to draft the next, up to `block_size - 1`, and a row stops early when the
drafter's probability of its next token falls below `threshold`. Drafted positions never enter the cache:
the next verification pass supplies the true states.

Under the compiled engine (`blockwise_compile=`) at batch size 1, the take-in and every draft of a step are one
compiled call
([`FeatureDraftBlock`]): the drafts are unrolled, the cache is a fixed-capacity buffer read through masks, and the
threshold cuts each row's drafts with a cumulative product instead of stopping early, so drafting reads nothing
back to the host.

A parallel drafter (`FeatureDrafterConfig(parallel_drafts=True)`, PARD-style) drafts a step's tokens in one layer
pass instead: the chunk and one mask query per later draft together ([`FeatureDraftBlock`], eager or compiled).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from hf_blockwise.boundary import (
    check_same_dtype,
    check_same_projection,
    decoder_input_embeddings,
    output_projection_logits,
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter, DraftNoise, DraftRequest, Drafts, VerifiedStates
from hf_blockwise.drafters.heads import ShortlistProjection
from hf_blockwise.drafters.trees import (
    check_tree_options,
    drafted_candidates,
    expanded_depths,
    ranked_candidates,
    ranked_tree,
    select_tree_tensors,
)
from hf_blockwise.engine import CompiledModule, DraftingInVerification, compiled_block
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


@dataclass
class FeatureDraftCache:
    """The drafter's per-call state: its key/value cache and the encoder memory, updated in place by each step and
    narrowed in place as rows leave (the rule of `drafters/base.py`; the decoder's own cache is handled the same way).

    Attributes:
        keys, values (`torch.Tensor` of shape `(num_rows, num_heads, capacity, head_size)`, *optional*): entries
            of verified positions 0..length-1; `None` before the first step.
        lengths (`torch.LongTensor` of shape `(num_rows,)`, *optional*): verified positions held per row.
        filled (`int`): positions written in the last step (every row's length is at most this).
        backlog (`list[VerifiedStates]`): verifications observed but not yet taken in ([`FeatureDrafter.observe`]).
        encoder (`AttentionMemory`, *optional*): cross-attention keys and values of the encoder output.
        projection ([`ShortlistProjection`], *optional*): the output projection's shortlist rows.
        block ([`CompiledModule`], *optional*): the compiled drafting block, looked up once per call (the lookup
            checks the weights' fingerprint) when the call is compiled and down to one row; `block_ready` says the
            lookup was made (`None` then means compilation is unavailable).
        eager_block ([`FeatureDraftBlock`], *optional*): the drafting block run as a plain module, for trees drafted
            outside the compiled engine (built once per call).
        drafted (`tuple`, *optional*): drafts made inside the last verification call
            ([`FeatureDrafter.drafting_in_verification`]): the decoder position of that call's column 0 and the
            block's outputs, handed out by the next [`FeatureDrafter.get_candidates`].
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    encoder: AttentionMemory | None = None
    encoder_ready: bool = False
    filled: int = 0
    projection: ShortlistProjection | None = None
    backlog: list[VerifiedStates] = field(default_factory=list)
    block: CompiledModule | None = None
    block_ready: bool = False
    eager_block: nn.Module | None = None
    drafted: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None


def check_draft_threshold(threshold: object, name: str) -> None:
    """A `ValueError` naming `name` unless `threshold` is `None` or a number in [0, 1): the probability below which
    a row stops drafting (the drafter's argument, its config's `draft_threshold`, a bench mode's `_t<threshold>`)."""
    number = isinstance(threshold, int | float) and not isinstance(threshold, bool)
    if threshold is not None and not (number and 0.0 <= threshold < 1.0):
        raise ValueError(f"{name} must be a number in [0, 1) or None, got {threshold!r}")


class FeatureDrafter(Drafter):
    """Drafts with a [`FeatureDrafterModel`]: one small decoder layer run autoregressively on predicted states.

    Args:
        model ([`FeatureDrafterModel`]): the base with its trained drafter.
        block_size (`int`, *optional*): k; up to `block_size - 1` drafts per row and step (default: the config's).
        threshold (`float`, *optional*): a row stops drafting when the drafter's probability of its next draft is
            below this, so the verification pass does not pay for tokens likely to be rejected. `None` always
            drafts `block_size - 1`. Deciding when every row has stopped reads the device once per draft.
        use_shortlist (`bool`, defaults to `True`): draft among the model's shortlist, if it has one.
        tree_nodes (`int`, *optional*): propose a tree of this many drafts per row instead of a chain, all verified
            in one call: grown EAGLE-2's way (`tree_frontier`), the best by cumulative draft probability
            (`drafters/trees.py`). `None` drafts a chain. Not combined with `threshold` (the tree's own selection
            replaces it).
        tree_branching (`int`, defaults to 2): candidates per drafted state of a tree (best first).
        tree_frontier (`int`, defaults to 2): how many nodes of each depth of a tree are expanded (EAGLE-2: those of
            highest cumulative probability, drafted together in one layer pass); `0` ranks runners-up beside one
            chain only. At most `tree_branching`.
    """

    reads_decoder_states = True

    def __init__(
        self,
        model: FeatureModel,
        block_size: int | None = None,
        threshold: float | None = None,
        use_shortlist: bool = True,
        tree_nodes: int | None = None,
        tree_branching: int = 2,
        tree_frontier: int = 2,
    ) -> None:
        block_size = model.feature_config.block_size if block_size is None else block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        check_draft_threshold(threshold, "threshold")
        check_tree_options(tree_nodes, tree_branching, block_size - 1, tree_frontier)
        if tree_nodes is not None and threshold is not None:
            raise ValueError("threshold cuts chains of drafts; a tree (tree_nodes=) selects its nodes by cumulative "
                             "probability instead: pass one of them")  # fmt: skip
        masks = model.layer.mask_inputs
        if masks is not None and (tree_nodes is not None or block_size - 2 > masks.shape[0]):
            raise ValueError(
                f"this drafter drafts in parallel from {masks.shape[0]} learned mask inputs: it proposes chains "
                f"(no tree_nodes) of at most {masks.shape[0] + 1} drafts (block_size <= {masks.shape[0] + 2}), got "
                f"block_size={block_size}, tree_nodes={tree_nodes}"
            )
        self.parallel = masks is not None
        self.model = model
        self.block_size = block_size
        self.threshold = threshold
        self.use_shortlist = use_shortlist
        self.tree_nodes = tree_nodes
        self.branching = 1 if tree_nodes is None else tree_branching
        self.frontier = 0 if tree_nodes is None else tree_frontier

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        shortlist = self.model.layer.shortlist if self.use_shortlist else None
        projection = None
        if shortlist is not None:
            weight, bias = shortlist_projection(self.model.base_model, shortlist)
            projection = ShortlistProjection(token_ids=shortlist, weight=weight, bias=bias)
        return FeatureDraftCache(projection=projection)

    def select_rows(self, drafter_state: FeatureDraftCache, rows: torch.Tensor) -> FeatureDraftCache:
        """Narrows the per-call cache to `rows` in place and returns it (the rule of `drafters/base.py`)."""

        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(0, rows)

        cache = drafter_state
        cache.keys, cache.values, cache.lengths = pick(cache.keys), pick(cache.values), pick(cache.lengths)
        cache.drafted = None  # drafted in a verification call of every row (never made for several rows)
        encoder = cache.encoder
        if encoder is not None:
            cache.encoder = AttentionMemory(pick(encoder.keys), pick(encoder.values), pick(encoder.mask))
        cache.backlog = [
            VerifiedStates(entry.states.index_select(0, rows), entry.start, entry.num_valid.index_select(0, rows))
            for entry in cache.backlog
        ]
        return cache

    def observe(self, request: DraftRequest) -> None:
        """Keeps the verification's states for later: taking them in costs a layer pass, which a step whose drafts
        come from elsewhere does not need; the next [`get_candidates`] takes in every kept one in a single pass."""
        if request.verified_states is not None:
            request.drafter_state.backlog.append(request.verified_states)

    def check_base(self, model: nn.Module) -> None:
        check_same_projection(self.model.base_model, model, "FeatureDrafter")
        check_same_dtype(self.model.layer, model, "FeatureDrafter")

    def get_candidates(self, request: DraftRequest) -> Drafts:
        batch_size, device = request.lengths.shape[0], request.lengths.device
        verified, cache = request.verified_states, request.drafter_state
        if verified is None:  # before the first verification there are no states to read
            return Drafts.empty(batch_size, device)
        drafted, cache.drafted = cache.drafted, None
        if drafted is not None and drafted[0] == verified.start and not cache.backlog:  # taken in by that call
            return self._drafts(*drafted[1], None)
        if cache.backlog:
            verified = merge_verified([*cache.backlog, verified])
            cache.backlog = []
        layer = self.model.layer
        if not cache.encoder_ready:
            if request.encoder_hidden_states is not None:
                cache.encoder = layer.encoder_memory(request.encoder_hidden_states, request.encoder_attention_mask)
            cache.encoder_ready = True
        # measured: the compiled block pays at batch 1 only; at batch 16 it ran at half the eager drafter's speed
        # (it attends over the whole cache buffer per row), so batches draft eagerly
        compiled = request.compile is not None and batch_size == 1
        if compiled and not cache.block_ready:
            cache.block, cache.block_ready = self._compiled_block(request, cache), True
        if compiled and cache.block is not None:
            return self._draft_compiled(cache.block, request, verified, cache)
        if self.frontier or self.parallel:  # trees and parallel drafts come from the drafting block, eager here
            if cache.eager_block is None:
                cache.eager_block = self._new_block(cache.projection)
            return self._draft_compiled(cache.eager_block, request, verified, cache)
        # the step's one host read: how many verified columns to take in, and how many drafts any row can use
        width, most_drafts = torch.stack([verified.num_valid.max(), request.max_drafts.max()]).tolist()
        # (b, d): the predicted state after each row's last verified token
        predicted = self._take_in(request.sequences, verified, cache, width)
        limit = min(self.block_size - 1, most_drafts)
        if limit <= 0:
            return Drafts.empty(batch_size, device)
        # drafted positions: each row's verified cache, then this step's drafts, written after every row's entries
        positions = torch.arange(cache.filled + limit, device=device)
        visible = (positions[None, :] < cache.lengths[:, None]) | (positions[None, :] >= cache.filled)  # (b, F + n)
        tokens, probabilities, lengths = [], [], None
        alive = torch.ones(batch_size, dtype=torch.bool, device=device)
        for index in range(limit):
            # (b, m), (b, m); a sampling call's chain draws on its noise at the draft's position
            ranked, probability = self._choose(predicted, cache, request.sampling, request.lengths + index)
            tokens.append(ranked)
            probabilities.append(probability)
            if self.threshold is not None:
                alive = alive & (probability[:, 0] >= self.threshold)
                lengths = alive.long() if lengths is None else lengths + alive.long()
                if not bool(alive.any()):  # the draft loop's one host read per draft, with a threshold only
                    break
            if index + 1 < limit:
                predicted = self._draft_next(
                    predicted, ranked[:, 0], cache, index, visible[:, : cache.filled + index + 1]
                )
        return self._drafts(torch.stack(tokens, dim=1), torch.stack(probabilities, dim=1), lengths)

    def drafting_in_verification(
        self, request: DraftRequest, start: int, num_pending: torch.Tensor, num_fed: torch.Tensor, width: int
    ) -> DraftingInVerification | None:
        """The compiled drafting block inside the verification call, for chains of one row drafted greedily (no
        threshold, no sampling, no tree) once the block has run in this `generate` (its weights checked then):
        the call takes in every fed column and drafts from the last the raw logits verify. Where the logits
        processors accept otherwise, the drafts only start from another column: the loop's acceptance decides the
        output, and the next take-in starts at its cache length."""
        cache = request.drafter_state
        one_chain = not self.frontier and self.branching == 1 and self.threshold is None
        if not (one_chain and request.sampling is None and request.lengths.shape[0] == 1 and cache.block_ready):
            return None
        if cache.block is None or cache.keys is None or cache.backlog:
            return None
        keys = cache.keys
        needed = start + max(width, self.block_size) + self.block_size  # the chunk, then this call's drafts
        like = keys.new_empty(keys.shape[0], 0, keys.shape[1] * keys.shape[3])  # (b, 0, d): the states' shape
        self._reserve(cache, like, needed=needed, rounding=request.sequences.shape[1])
        encoder = cache.encoder
        inputs = (
            torch.tensor(start, device=keys.device), cache.keys, cache.values,
            *((None, None, None) if encoder is None else (encoder.keys, encoder.values, encoder.mask)),
        )  # fmt: skip
        keep = functools.partial(_keep_drafted, cache, start)
        return DraftingInVerification(cache.block, inputs, num_pending, num_fed, keep)

    def _drafts(self, tokens: torch.Tensor, probabilities: torch.Tensor, lengths: torch.Tensor | None) -> Drafts:
        """A chain of each depth's best token (cut at `lengths`, or whole), or with `tree_nodes` a tree over the
        ranked candidates `(b, n, m)` and their probabilities."""
        if self.tree_nodes is not None:
            return ranked_tree(tokens, probabilities, min(self.tree_nodes, tokens.shape[1] * tokens.shape[2]))
        if lengths is None:
            lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens[..., 0], lengths=lengths)

    def _compiled_block(self, request: DraftRequest, cache: FeatureDraftCache) -> CompiledModule | None:
        """The model's compiled [`FeatureDraftBlock`] for this drafter's block size and projection."""
        projection = cache.projection
        key = f"feature_k{self.block_size}_m{self.branching}_f{self.frontier}_n{self.tree_nodes}_"
        key += "full" if projection is None else str(projection.token_ids.shape[0])
        # the block reads its layer, the base's embeddings and a copy of the base's output projection: its snapshots
        # watch those (the engine watches the base's other layers once per generate too)
        projection_source = self.model.base_model.get_output_embeddings()
        return compiled_block(
            self.model, key, lambda: self._new_block(projection), request.compile, reads=lambda _: [projection_source]
        )

    def _new_block(self, projection: ShortlistProjection | None) -> FeatureDraftBlock:
        return FeatureDraftBlock(
            self.model, projection, self.block_size - 1, self.branching, self.frontier, self.tree_nodes
        )

    def _draft_compiled(
        self,
        block: CompiledModule | FeatureDraftBlock,
        request: DraftRequest,
        verified: VerifiedStates,
        cache: FeatureDraftCache,
    ) -> Drafts:
        """The step's take-in and drafts in one call of the drafting block (compiled, or the module itself); every
        row gets `block_size - 1` drafts or a whole tree (the feed cuts them to what each row may use), so nothing
        is read back to the host. A sampling call's chains draw on its noise, computed here for every draft's
        position (the block takes it as an input: the seed changes with every call, the graph does not)."""
        sequences = request.sequences
        states = verified.states.to(self.model.layer.out.weight.dtype)  # (b, W, d)
        # narrower chunks are zero-padded to the block size: one graph serves every step (padded columns are masked)
        width = max(states.shape[1], self.block_size)
        states = F.pad(states, (0, 0, 0, width - states.shape[1]))
        room = self.block_size + (self.block_size - 1) * self.frontier  # drafted slots after the chunk
        self._reserve(cache, states, needed=verified.start + width + room, rounding=sequences.shape[1])
        encoder = cache.encoder
        start = torch.tensor(verified.start, device=states.device)
        noise, temperature = self._block_noise(request, cache)
        outputs = block(
            states, sequences, verified.num_valid, start, cache.keys, cache.values,
            *((None, None, None) if encoder is None else (encoder.keys, encoder.values, encoder.mask)),
            noise, temperature,
        )  # fmt: skip
        if self.frontier:  # the block selected the tree
            tokens, parents = outputs
            lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
            return Drafts(tokens=tokens, lengths=lengths, parents=parents)
        tokens, probabilities = outputs
        lengths = None
        if self.threshold is not None:
            lengths = (probabilities[..., 0] >= self.threshold).long().cumprod(dim=1).sum(dim=1)
        return self._drafts(tokens, probabilities, lengths)

    def _block_noise(self, request: DraftRequest, cache: FeatureDraftCache) -> tuple[torch.Tensor | None, float]:
        """The noise of a sampling call at each chain draft's position, `(b, block_size - 1, S)`, and its
        temperature; `None` for greedy calls and trees."""
        if request.sampling is None or self.frontier or self.branching > 1:
            return None, 1.0
        positions = request.lengths[:, None] + torch.arange(self.block_size - 1, device=request.lengths.device)
        projection = cache.projection
        token_ids = None if projection is None else projection.token_ids
        vocab_size = self.model.base_model.get_output_embeddings().weight.shape[0]
        return request.sampling.at(positions, token_ids, vocab_size), request.sampling.temperature

    def _reserve(self, cache: FeatureDraftCache, states: torch.Tensor, needed: int, rounding: int) -> None:
        """Fixed-capacity key/value buffers for the compiled block (capacity a multiple of `rounding`, the
        sequence buffer's length, so a call normally allocates once)."""
        if cache.keys is not None and cache.keys.shape[2] >= needed:
            return
        layer = self.model.layer
        heads = layer.self_attention.num_heads
        capacity = -(-needed // rounding) * rounding
        shape = (states.shape[0], heads, capacity, states.shape[2] // heads)
        keys, values = states.new_zeros(shape), states.new_zeros(shape)
        if cache.keys is not None:
            keys[:, :, : cache.keys.shape[2]] = cache.keys
            values[:, :, : cache.values.shape[2]] = cache.values
        cache.keys, cache.values = keys, values

    def _take_in(
        self, sequences: torch.Tensor, verified: VerifiedStates, cache: FeatureDraftCache, width: int
    ) -> torch.Tensor:
        """Feeds the newly verified positions into the cache; returns the prediction at each row's last one.

        The verified chunk starts at position `start` for every row, and every row's cache already holds at
        least `start` positions, so the chunk's queries see the cache before `start` and the chunk causally.
        """
        layer = self.model.layer
        # only the verified columns: a pass that rejected most of a long draft (source copy) fed many more
        states = verified.states[:, :width].to(layer.out.weight.dtype)  # (b, W, d)
        start = verified.start
        columns = torch.arange(width, device=states.device)
        follow = sequences[:, (start + 1 + columns).clamp(max=sequences.shape[1] - 1)]  # (b, W)
        inputs = layer.inputs(states, self.model.token_embeddings(follow))  # (b, W, d)
        fresh, normed = layer.self_memory(inputs)  # (b, H, W, dh)
        self._store(cache, fresh, start, room=self.block_size)
        causal = columns[None, :] <= columns[:, None]  # (W, W)
        mask = torch.cat([causal.new_ones(width, start), causal], dim=1)  # (W, start + W)
        memory = AttentionMemory(cache.keys[:, :, : start + width], cache.values[:, :, : start + width], mask)
        predicted = layer(inputs, normed, memory, cache.encoder)  # (b, W, d)
        cache.lengths = start + verified.num_valid  # (b,)
        cache.filled = start + width
        last = (verified.num_valid - 1).clamp(min=0)
        return predicted[torch.arange(predicted.shape[0], device=predicted.device), last]  # (b, d)

    @staticmethod
    def _store(cache: FeatureDraftCache, fresh: AttentionMemory, start: int, room: int) -> None:
        """Writes the chunk's keys and values at positions start.., growing the buffers when needed so that `room`
        more entries (this step's drafts) fit after them."""
        end = start + fresh.keys.shape[2]
        if cache.keys is None or cache.keys.shape[2] < end + room:
            capacity = max(end + room, 2 * (0 if cache.keys is None else cache.keys.shape[2]), 32)
            shape = (*fresh.keys.shape[:2], capacity, fresh.keys.shape[3])
            keys, values = fresh.keys.new_zeros(shape), fresh.values.new_zeros(shape)
            if cache.keys is not None:
                keys[:, :, :start] = cache.keys[:, :, :start]
                values[:, :, :start] = cache.values[:, :, :start]
            cache.keys, cache.values = keys, values
        cache.keys[:, :, start:end] = fresh.keys
        cache.values[:, :, start:end] = fresh.values

    def _choose(
        self,
        predicted: torch.Tensor,
        cache: FeatureDraftCache,
        sampling: DraftNoise | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `branching` best draft tokens per row from predicted states (shape `(b, d)`), best first, and their
        probabilities: both `(b, m)`; with `sampling`, a chain's token is the one sampling would draw from the
        drafter's distribution at `positions` (`(b,)`)."""
        projection = cache.projection
        if projection is None:
            logits = output_projection_logits(self.model.base_model, predicted)  # (b, V)
        else:
            logits = F.linear(predicted.to(projection.weight.dtype), projection.weight, projection.bias)  # (b, S)
        token_ids = None if projection is None else projection.token_ids
        return drafted_candidates(logits, token_ids, self.branching, sampling, positions)

    def _draft_next(
        self, predicted: torch.Tensor, token: torch.Tensor, cache: FeatureDraftCache, index: int, visible: torch.Tensor
    ) -> torch.Tensor:
        """One autoregressive drafting step: the predicted state with its draft token in, the next state out.

        The draft's keys are written at column `filled + index` of the cache, after every row's verified entries
        (the layer has no positional encoding, so a column is only a slot); the next step's take-in overwrites
        them. A drafted position attends to its row's verified entries and to this step's drafts up to itself.

        Args:
            predicted (`torch.Tensor` of shape `(b, d)`), token (`torch.LongTensor` of shape `(b,)`): the last draft.
            visible (`torch.BoolTensor` of shape `(b, filled + index + 1)`): the slots this draft attends to.

        Returns:
            `torch.Tensor` of shape `(b, d)`: the predicted state after `token`.
        """
        layer = self.model.layer
        inputs = layer.inputs(predicted, self.model.token_embeddings(token))[:, None]  # (b, 1, d)
        fresh, normed = layer.self_memory(inputs)  # (b, H, 1, dh)
        slot = cache.filled + index
        cache.keys[:, :, slot : slot + 1] = fresh.keys
        cache.values[:, :, slot : slot + 1] = fresh.values
        memory = AttentionMemory(
            cache.keys[:, :, : slot + 1], cache.values[:, :, : slot + 1], visible[:, None, None, :]
        )
        return layer(inputs, normed, memory, cache.encoder)[:, 0]


class FeatureDraftBlock(nn.Module):
    """The feature drafter's take-in and `num_drafts` drafts as one module over fixed-capacity buffers, for
    `torch.compile`: no host reads, no shapes that depend on values, the drafts unrolled and the shortlist
    projection inside (the eager [`FeatureDrafter`] does the same work op by op).

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
        noise: torch.Tensor | None = None,
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
            noise (`torch.FloatTensor` of shape `(b, num_drafts, S)`, *optional*): a sampling call's noise at each
                draft's position over the drafter's vocabulary (or shortlist); chains then draft `argmax(logits /
                temperature + noise)` ([`ranked_candidates`]).

        Returns:
            tokens (`torch.LongTensor` of shape `(b, num_drafts, branching)`): each depth's best tokens, best first
            (the drafts follow the first); their probabilities under the drafter (`torch.FloatTensor`, same shape).
            With a `frontier`: the tree's tokens and parents instead (`(b, num_nodes)` each, [`_grow`]).
        """
        columns = torch.arange(states.shape[1], device=states.device)  # (W,)
        follow = sequences[:, (start + 1 + columns).clamp(max=sequences.shape[1] - 1)]  # (b, W)
        encoder = None if encoder_keys is None else AttentionMemory(encoder_keys, encoder_values, encoder_mask)
        return self._take_in_and_draft(states, follow, num_valid, start, keys, values, encoder, noise, temperature)

    def after_verification(
        self,
        states: torch.Tensor,
        follow: torch.Tensor,
        num_valid: torch.Tensor,
        start: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder_keys: torch.Tensor | None,
        encoder_values: torch.Tensor | None,
        encoder_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[`forward`] inside the verification's graph ([`hf_blockwise.engine.DraftingInVerification`]): every fed
        column taken in, with the token after each its greedy token (`follow`, `(b, W)`), and the chain drafted from
        the last of each row's `num_valid` columns. The take-in of the columns past them is overwritten by the next
        step's (the cache's valid length is the loop's acceptance, set when the drafts are handed out)."""
        encoder = None if encoder_keys is None else AttentionMemory(encoder_keys, encoder_values, encoder_mask)
        states = states.to(self.layer.out.weight.dtype)
        return self._take_in_and_draft(states, follow, num_valid, start, keys, values, encoder, None, 1.0)

    def _take_in_and_draft(
        self,
        states: torch.Tensor,
        follow: torch.Tensor,
        num_valid: torch.Tensor,
        start: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder: AttentionMemory | None,
        noise: torch.Tensor | None,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk `(b, W, d)` with the token after each column (`follow`, `(b, W)`) taken in at slots `start..`,
        then the drafts from each row's last valid column (the arguments and result of [`forward`])."""
        if self.layer.mask_inputs is not None:
            return self._in_one_pass(states, follow, num_valid, start, keys, values, encoder, noise, temperature)
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
            ranked, probability = self._choose(predicted, None if noise is None else noise[:, index], temperature)
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

    def _in_one_pass(
        self,
        states: torch.Tensor,
        follow: torch.Tensor,
        num_valid: torch.Tensor,
        start: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        encoder: AttentionMemory | None,
        noise: torch.Tensor | None,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[`_take_in_and_draft`] for parallel drafts (PARD-style): the chunk and `num_drafts - 1` mask inputs in one
        layer pass. The first draft comes from each row's last valid column, draft i + 1 from mask i (that column's
        input plus the layer's offset i, its keys at slot `start + W + i`), which sees its row's verified slots and
        masks 0..i: no draft waits for the one before."""
        batch, width = states.shape[:2]
        device = states.device
        num_masks = self.num_drafts - 1
        columns, offsets = torch.arange(width, device=device), torch.arange(num_masks, device=device)  # (W,), (n-1,)
        slots = torch.arange(keys.shape[2], device=device)  # (C,)
        filled, lengths = start + width, start + num_valid  # (), (b,)
        chunk_visible = (slots <= (start + columns)[:, None]).expand(batch, -1, -1)  # (b, W, C)
        mask_visible = (slots < lengths[:, None])[:, None] | (
            (slots >= filled) & (slots <= (filled + offsets)[:, None])
        )  # (b, n-1, C)
        rows, last = torch.arange(batch, device=device), (num_valid - 1).clamp(min=0)  # (b,), (b,)
        chunk = self.layer.inputs(states, self.embeddings(follow))  # (b, W, d)
        masks = chunk[rows, last][:, None] + self.layer.mask_inputs[:num_masks]  # (b, n-1, d)
        write = torch.cat([start + columns, filled + offsets])  # (W + n-1,)
        visible = torch.cat([chunk_visible, mask_visible], dim=1)[:, None]  # (b, 1, W + n-1, C)
        predicted = self._attend_inputs(torch.cat([chunk, masks], 1), keys, values, write, visible, encoder)
        drafted = torch.cat([predicted[rows, last][:, None], predicted[:, width:]], dim=1)  # (b, n, d)
        return self._choose(drafted, noise, temperature)  # (b, n, m) each

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
        self, predicted: torch.Tensor, noise: torch.Tensor | None = None, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `branching` best drafts from its predicted state `(b, d)`, with their probabilities (a chain's
        token drawn on a sampling call's `noise`, `(b, S)`, when given)."""
        if self.weight is None:
            logits = output_projection_logits(self.base_model, predicted)  # (b, V)
            return ranked_candidates(logits, None, self.branching, noise, temperature)
        if self.int8_projection is not None:
            logits = self.int8_projection(predicted)  # (b, S)
        else:
            logits = F.linear(predicted.to(self.weight.dtype), self.weight, self.bias)  # (b, S)
        return ranked_candidates(logits, self.token_ids, self.branching, noise, temperature)


def _keep_drafted(cache: FeatureDraftCache, start: int, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Keeps drafts made inside the verification call at decoder position `start` for the next step."""
    cache.drafted = (start, outputs)


def _int8_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """An int8 layer over a shortlist's rows `(S, d)` of the output projection (and their bias `(S,)`)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).eval()
    linear.weight = nn.Parameter(weight.float(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.float(), requires_grad=False)
    return Int8Linear(linear)


def merge_verified(entries: list[VerifiedStates]) -> VerifiedStates:
    """Several consecutive verifications as one, as if a single pass had produced every state they verified.

    Each verification starts at or before the end of every row's verified run in the one before (the loop crops
    its cache to the shortest run), so writing their columns in order leaves, at each position before a row's
    final end, the state of the last verification that verified it.
    """
    first = entries[0].start
    width = max(entry.start + entry.states.shape[1] for entry in entries) - first
    merged = entries[0].states.new_zeros(entries[0].states.shape[0], width, entries[0].states.shape[2])
    for entry in entries:
        offset = entry.start - first
        merged[:, offset : offset + entry.states.shape[1]] = entry.states
    last = entries[-1]
    return VerifiedStates(states=merged, start=first, num_valid=last.start - first + last.num_valid)

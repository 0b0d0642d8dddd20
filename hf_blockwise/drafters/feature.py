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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hf_blockwise.boundary import (
    check_same_dtype,
    check_same_projection,
    output_projection_logits,
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter, DraftNoise, DraftRequest, Drafts, VerifiedStates
from hf_blockwise.drafters.feature_block import AttentionMemory, FeatureDraftBlock, FeatureModel
from hf_blockwise.drafters.heads import ShortlistProjection
from hf_blockwise.drafters.trees import (
    check_tree_options,
    drafted_candidates,
    ranked_tree,
)
from hf_blockwise.engine import CompiledModule, compiled_block


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
        if self.frontier:  # trees come from the drafting block, eager here
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

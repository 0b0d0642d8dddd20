"""`FeatureDrafter`: autoregressive drafts from a feature-level drafter (EAGLE-style) for seq2seq models.

Per step, the drafter first takes in what the last verification pass established: for every newly verified
position p, the base's state h_p (at its output projection) and the token verified after it. Those enter the
drafter's own key/value cache, laid out per row (rows verify different numbers of tokens). Its output at each
row's last verified position predicts the state that follows, hence the first draft; each draft is then fed
back with the predicted state to draft the next, up to `block_size - 1`, and a row's drafts are cut where the
drafter's probability of its next token falls below `threshold`. Drafted positions never enter the cache:
the next verification pass supplies the true states.

The take-in and every draft of a step are one call of the drafting block ([`FeatureDraftBlock`], the one
implementation): compiled under the compiled engine (`blockwise_compile=`) at batch size 1, a plain module
otherwise. The drafts are unrolled, the cache is a buffer read through masks, and the threshold cuts each row's
drafts with a cumulative product instead of stopping early, so drafting reads nothing back to the host.
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
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts, VerifiedStates
from hf_blockwise.drafters.feature_block import AttentionMemory, FeatureDraftBlock, FeatureModel
from hf_blockwise.drafters.heads import ShortlistProjection
from hf_blockwise.drafters.trees import (
    check_tree_options,
    ranked_tree,
)
from hf_blockwise.engine import CompiledModule, compiled_block


@dataclass
class FeatureDraftCache:
    """The drafter's per-call state: its key/value cache and the encoder memory, updated in place by each step and
    narrowed in place as rows leave (the rule of `drafters/base.py`; the decoder's own cache is handled the same way).

    Attributes:
        keys, values (`torch.Tensor` of shape `(num_rows, num_heads, capacity, head_size)`, *optional*): the
            drafting block's buffers: entries of verified positions from slot 0, then the last step's drafts; `None`
            before the first step.
        backlog (`list[VerifiedStates]`): verifications observed but not yet taken in ([`FeatureDrafter.observe`]).
        encoder (`AttentionMemory`, *optional*): cross-attention keys and values of the encoder output.
        projection ([`ShortlistProjection`], *optional*): the output projection's shortlist rows.
        block ([`CompiledModule`], *optional*): the compiled drafting block, looked up once per call (the lookup
            checks the weights' fingerprint) when the call is compiled and down to one row; `block_ready` says the
            lookup was made (`None` then means compilation is unavailable).
        eager_block ([`FeatureDraftBlock`], *optional*): the drafting block run as a plain module, where the call is
            not compiled or has several rows (built once per call).
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    encoder: AttentionMemory | None = None
    encoder_ready: bool = False
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
        threshold (`float`, *optional*): a row's drafts are cut before the first whose probability under the drafter
            is below this, so the verification pass does not pay for tokens likely to be rejected. `None` always
            drafts `block_size - 1`.
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
        cache.keys, cache.values = pick(cache.keys), pick(cache.values)
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
        # (it attends over the whole cache buffer per row), so batches draft through the block as a plain module, on
        # the buffers' used slots only
        compiled = request.compile is not None and batch_size == 1
        if compiled and not cache.block_ready:
            cache.block, cache.block_ready = self._compiled_block(request, cache), True
        if compiled and cache.block is not None:
            return self._draft(cache.block, request, verified, cache, compiled=True)
        if cache.eager_block is None:
            cache.eager_block = self._new_block(cache.projection)
        return self._draft(cache.eager_block, request, verified, cache, compiled=False)

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

    def _draft(
        self,
        block: CompiledModule | FeatureDraftBlock,
        request: DraftRequest,
        verified: VerifiedStates,
        cache: FeatureDraftCache,
        compiled: bool,
    ) -> Drafts:
        """The step's take-in and drafts in one call of the drafting block; every row gets `block_size - 1` drafts
        or a whole tree (the feed cuts them to what each row may use), and a threshold cuts chains with a cumulative
        product, so nothing is read back to the host for drafting. A sampling call's chains draw on its noise at
        every draft's position (the block takes the noise keys as an input: the seed changes with every call, the
        graph does not).

        Compiled, the chunk is zero-padded to at least the block size and the block reads the whole buffers (one
        graph serves every step; padded columns and unused slots are masked); eager, the chunk is cut to the widest
        row's verified columns (a pass that rejected most of a long draft, a source copy's, fed many more: one host
        read) and the block reads the buffers' used slots only."""
        sequences = request.sequences
        states = verified.states.to(self.model.layer.out.weight.dtype)  # (b, W, d)
        if compiled:
            width = max(states.shape[1], self.block_size)
            states = F.pad(states, (0, 0, 0, width - states.shape[1]))
        else:
            width = int(verified.num_valid.max())
            states = states[:, :width]
        room = self.block_size + (self.block_size - 1) * self.frontier  # drafted slots after the chunk
        needed = verified.start + width + room
        self._reserve(cache, states, needed=needed, rounding=sequences.shape[1])
        keys, values = cache.keys, cache.values
        if not compiled:  # views of the used slots: the block's writes reach the buffers
            keys, values = keys[:, :, :needed], values[:, :, :needed]
        encoder = cache.encoder
        start = torch.tensor(verified.start, device=states.device)
        draft_keys, temperature = self._draft_keys(request)
        outputs = block(
            states, sequences, verified.num_valid, start, keys, values,
            *((None, None, None) if encoder is None else (encoder.keys, encoder.values, encoder.mask)),
            draft_keys, temperature,
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

    def _draft_keys(self, request: DraftRequest) -> tuple[torch.Tensor | None, float]:
        """A sampling call's noise keys at each chain draft's position, `(b, block_size - 1)`, and its temperature;
        `None` for greedy calls and trees (which rank by the drafter's own probabilities)."""
        if request.sampling is None or self.frontier or self.branching > 1:
            return None, 1.0
        positions = request.lengths[:, None] + torch.arange(self.block_size - 1, device=request.lengths.device)
        return request.sampling.keys(positions), request.sampling.temperature

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

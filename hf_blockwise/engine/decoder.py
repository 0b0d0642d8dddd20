"""The compiled engine's decoder ([`CompiledDecoder`]): transformers' decoder forward of one model, compiled over a
static cache, with the decoder states as a second output ([`_DecoderStep`]).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.compile_options import CompileOptions, on_cpu_inductor
from hf_blockwise.engine.compiled_module import CompiledModule
from hf_blockwise.fixed_order import GraphProducts
from hf_blockwise.quantization import is_int8

# static cache buffers are rounded up to this many positions, so that calls of similar lengths share their shape
_CACHE_ROUNDING = 64
# every compiled call feeds at least this many columns, so that one graph serves every width: dynamo specializes a
# size of 1 (the arithmetic does not depend on the width; see the engine's docstring, `engine/__init__.py`)
MIN_FEED_WIDTH = 2
# the static cache's room past max_length, the same for every drafter whose feeds fit it (block_size + 1 columns),
# so that greedy and drafting decodes of one input use buffers of the same length
_CACHE_SLACK = 16
# a compiled call attends over the positions in use rounded up to this (the vector width of float32 on AVX-512)
_WINDOW_ROUNDING = 16


@dataclass(frozen=True)
class ArithmeticVerdict:
    """What [`engine.probe.check_arithmetic`] found for one kind of decode.

    Attributes:
        claimed (`bool`): the graphs own every float product ([`fixed_order.own_products`]), so the engine claims
            one arithmetic; `False` where a float product stays with a library (float32 `linear`s by default).
        bitwise (`bool`): every probed call computed what one-token calls compute, bit for bit.
        difference (`str`): which comparison differed first and by how much; empty when bitwise.
        seconds (`float`): the probe's wall time, compilation of the graphs it is the first to run included.
    """

    claimed: bool
    bitwise: bool
    difference: str
    seconds: float


class CompiledDecoder:
    """transformers' decoder forward of one model, compiled, with the decoder states as a second output.

    Args:
        model: the transformers seq2seq model (held weakly: the registry that keeps the engine is keyed by it).
        options ([`CompileOptions`]).

    Attributes:
        compiled_calls (`int`): forwards run through the compiled graph since the engine was built; each generate
            call reports its own in [`DecodingStats.compiled_forwards`].
    """

    def __init__(self, model: nn.Module, options: CompileOptions) -> None:
        cpu_inductor = on_cpu_inductor(options, next(model.parameters()).device)
        if options.compiled_prefill and not cpu_inductor:  # a graph measured and tested there only
            raise ValueError("CompileOptions(compiled_prefill=True) compiles on CPU with inductor (and no mode) only")
        self.options = options
        self.position_limit = hf.decoder_position_limit(model)
        self.num_layers = hf.decoder_layer_count(model)
        self._step = _DecoderStep(model)
        self._compiled = CompiledModule(self._step, options, model, own_products=True, int8=is_int8(model))
        # the first call of a generate writes the cross-attention cache: eager, or a compiled module of its own (its
        # graphs are then guarded apart from the decoding calls')
        self._prefill_step = _DecoderStep(model) if options.compiled_prefill else self._step
        self._prefill: CompiledModule | None = None
        if options.compiled_prefill:
            self._prefill = CompiledModule(self._prefill_step, options, model, own_products=True, int8=is_int8(model))
        self.weights = self._compiled.weights  # the model's weights as the graph freezes them
        self.module_state = self._compiled.module_state  # its modules as the graph was traced from them
        self.freezing = self._compiled.freezing
        # attention windows where the graphs own attention's arithmetic (CPU inductor); CUDA graphs need fixed shapes
        self.windowed = self._compiled.cpu_inductor
        self.compiled_calls = 0
        # probe results by (kind of decode: "one row", "several rows" or "several rows, then one"; tree feed): what
        # this machine computes does not change between calls
        self.verdicts: dict[tuple[str, bool], ArithmeticVerdict] = {}

    def products(self) -> GraphProducts:
        """The float products of the graphs compiled so far, by kind: those computed in an order the graphs own, and
        those left to library kernels (their bits depend on the row count; none where the contract is claimed)."""
        reports = self._compiled.graph_products
        kernels = dict.fromkeys(report.linear_kernels for report in reports)  # each kind once, in order
        merged = GraphProducts(linear_kernels=", ".join(kernels) or "libraries")
        for report in reports:
            merged.merged_int8 += report.merged_int8
            for kind, count in report.owned.items():
                merged.owned[kind] = merged.owned.get(kind, 0) + count
            for kind, count in report.library.items():
                merged.library[kind] = merged.library.get(kind, 0) + count
        return merged

    def model(self) -> nn.Module:
        """The model this engine compiles (held weakly)."""
        return self._step.model_ref()

    def tree(self, owner: nn.Module) -> nn.Module:
        """The module tree whose weights and state the snapshots cover: the model's whole tree (`owner`)."""
        return self._compiled.tree(owner)

    def owns_products(self) -> bool:
        """Whether the graphs compiled so far went through the fixed-order pass and own every float product (the
        engine then claims one arithmetic); `False` for other backends and modes (CUDA graphs, a `mode=` of the
        caller's), whose graphs the pass does not see."""
        return bool(self._compiled.graph_products) and not self.products().library

    def close(self) -> None:
        """Removes the engine's hooks from the model (done when an engine is dropped)."""
        for step in dict.fromkeys((self._step, self._prefill_step)):
            for handle in step.hook_handles:
                handle.remove()

    def new_cache(self, max_length: int, block_size: int = 1) -> Any:
        """A static cache for a decode of up to `max_length` tokens fed up to `block_size` tokens per row and call.

        Its capacity depends on `block_size` only where the feeds do not fit the fixed slack: every decode of one
        input then uses buffers of the same length, whatever drafts it (each call attends over a window of them).
        """
        needed = max_length + max(_CACHE_SLACK, block_size + MIN_FEED_WIDTH)
        capacity = -(-needed // _CACHE_ROUNDING) * _CACHE_ROUNDING
        # with attention windows, positions that no window shows: every window is then a view short of its buffer,
        # the layout the graphs were traced on (a window as long as the buffer is contiguous: another graph)
        return hf.static_decoder_cache(self.num_layers, capacity + (_WINDOW_ROUNDING if self.windowed else 0))

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        cache_length: int,
        tree: hf.TreeInputs | None = None,
        full_cache: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached decoder pass over `tokens`, compiled after the first.

        On CPU a compiled call attends over the cache's first `cache_length + width` positions, rounded up to a
        multiple of 16 ([`hf.attention_window`]), not its whole capacity: the graphs' attention
        ([`fixed_order.fixed_order_attention`]) sums over the keys in slot order, so the masked positions left out
        would only have added exact zeros at the end of each sum (the probe checks it against `full_cache` calls).

        Args:
            tokens (`torch.LongTensor` of shape `(batch_size, width)`).
            cache: from [`new_cache`]; `cache_length` positions of it are valid.
            tree ([`hf.TreeInputs`], *optional*): the feed is a tree of drafts (`generation/tree.py`); its graph is
                another than a chain's.
            full_cache (`bool`): attend over the whole capacity (the probe's reference).

        Returns:
            logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`) and the states at the output
            projection (`torch.Tensor` of shape `(batch_size, width, hidden_size)`).
        """
        if cache_length == 0 and self._prefill is None:  # writes the cross-attention cache, eagerly, once per call
            outputs = self._step(tokens, cache, forward_kwargs, *self._tree_inputs(cache, 0, tree))
            if self.freezing:
                hf.unpin_static_cache(cache)
            return outputs
        width = tokens.shape[1]
        tokens = self._padded(tokens, cache_length)
        tree = None if tree is None else tree.padded_to(tokens.shape[1])
        if cache_length == 0:  # the compiled first call: greedy's (the prompt) and a drafted one's share its graph
            return self._compiled_first_call(tokens, cache, forward_kwargs, tree, width)
        with self._window(cache, cache_length, tokens.shape[1], full_cache):
            # the batch-1 graph (dynamo specializes a size of 1) on the GEMM template, the batches' on the libraries
            logits, states = self._compiled(
                tokens, cache, forward_kwargs, *self._tree_inputs(cache, cache_length, tree),
                few_rows=tokens.shape[0] == 1,
            )  # fmt: skip
        self.compiled_calls += 1
        return logits[:, :width], states[:, :width]

    def _padded(self, tokens: torch.Tensor, cache_length: int) -> torch.Tensor:
        """`tokens` with filler columns up to [`MIN_FEED_WIDTH`] (copies of the last: causal attention hides them)."""
        width = tokens.shape[1]
        padded = max(width, MIN_FEED_WIDTH)
        if self.position_limit is not None:  # filler needs positions too (a learned table ends)
            padded = max(width, min(padded, self.position_limit - cache_length))
        if padded > width:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - width)], dim=1)
        return tokens

    def _window(self, cache: Any, cache_length: int, width: int, full_cache: bool) -> contextlib.AbstractContextManager:
        """The attention window of a call of `width` columns at `cache_length` (CPU inductor), or no window."""
        if not self.windowed:
            return contextlib.nullcontext()
        # the positions written so far and this call's, rounded up, within those a window may show
        shown = hf.static_cache_capacity(cache) - _WINDOW_ROUNDING  # (`new_cache`)
        needed = -(-(cache_length + width) // _WINDOW_ROUNDING) * _WINDOW_ROUNDING
        return hf.attention_window(cache, shown if full_cache else min(needed, shown))

    def _compiled_first_call(
        self, tokens: torch.Tensor, cache: Any, forward_kwargs: dict[str, Any], tree: hf.TreeInputs | None, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[`forward`] at cache length 0 with `compiled_prefill`: `tokens` (shape `(b, padded)`) of which the first
        `width` are the decode's, through the first call's own compiled module."""
        extra = self._tree_inputs(cache, 0, tree)
        logits, states = self._prefill(tokens, cache, forward_kwargs, *extra, few_rows=tokens.shape[0] == 1)
        self.compiled_calls += 1
        if tokens.shape[1] > width:  # the filler's positions are not the decode's: the cache holds the real tokens only
            hf.crop_cache(cache, width)
        return logits[:, :width], states[:, :width]

    def _tree_inputs(self, cache: Any, cache_length: int, tree: hf.TreeInputs | None) -> tuple[torch.Tensor, ...]:
        """What [`_DecoderStep`] takes besides a chain's inputs for a tree feed: the depths and the 4D mask."""
        if tree is None:
            return ()
        return tree.depth, hf.tree_attention_mask(self.model(), cache, cache_length, tree)


class _DecoderStep(nn.Module):
    """transformers' forward of `model` with the input of its output projection as a second output, for a chain feed
    or (with `depth` and `tree_mask`) a tree feed, whose positions a second hook, on the decoder's position module,
    takes by depth (`boundary/tree.py`); it reads `depth` only while `forward` runs, like the states.

    The projection's forward hook is registered once, before compilation, so that dynamo traces it into the graph
    (a hook cannot be handed arguments, and one added per call would change what the graph is guarded on). So that
    eager calls of the model elsewhere (plain `generate`, another compiled forward) are left alone, it keeps the
    tensor only while this module's forward runs: `capturing` is `True` only inside `forward`, and `states` is
    handed back and cleared before `forward` returns; no tensor outlives a call.

    The model is held through a weak reference, not as a submodule: the engine registry is keyed weakly by the
    model, and a value that held its key would keep it alive for good.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model_ref = weakref.ref(model)
        self.cache_argument = hf.cache_argument(model)  # read once, outside the traced forward
        self.capturing = False
        self.states: torch.Tensor | None = None
        projection = model.get_output_embeddings()
        if projection is None:
            raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")
        self.depth: torch.Tensor | None = None
        self.hook_handles = [projection.register_forward_hook(self._keep_states)]
        positions = hf.decoder_position_module(model)
        if positions is not None:
            self.hook_handles.append(positions.register_forward_hook(self._place_nodes))

    def _keep_states(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.capturing:
            self.states = args[0]

    def _place_nodes(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return None if self.depth is None else hf.positions_at_depth(output, self.depth)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        depth: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain feed, or with `depth` and `tree_mask` a tree feed (`boundary/tree.py`)."""
        self.capturing, self.depth = True, depth
        mask = hf.static_cache_mask(cache, tokens) if tree_mask is None else tree_mask
        outputs = self.model_ref()(
            decoder_input_ids=tokens, use_cache=True, return_dict=True,
            **{self.cache_argument: cache, **forward_kwargs, "decoder_attention_mask": mask},
        )  # fmt: skip
        self.capturing, self.depth = False, None
        states, self.states = self.states, None
        return outputs.logits, states

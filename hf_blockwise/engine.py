"""The compiled engine: the verification forward of the loop through `torch.compile`, over a static cache.

Decoding a few tokens per call on a CPU is bound by moving the weights, not by arithmetic, and eager PyTorch adds
two costs on top: its float32 `linear` for a few rows goes through kernels that re-read the weights per row, and
each of the decoder's few hundred small ops pays its own dispatch. The engine compiles transformers' own decoder
forward (no modeling code of ours) with inductor: on CPU with `freezing`, so the weights are prepacked for oneDNN
and a call that feeds 8 tokens costs about what one costs; on CUDA with mode `reduce-overhead` (CUDA graphs).

What keeps the compiled graph from recompiling during a call:

- the self-attention cache is static ([`boundary.static_decoder_cache`]): keys and values live in preallocated
  buffers, cropping moves a write position (a tensor, no host read), and the buffer length is rounded up to a
  multiple of 64 so that calls of similar lengths share it;
- shapes are dynamic (`dynamic=True`): one graph serves every feed width from 3 up and every source length;
  batch size 1 gets a graph of its own (dynamo specializes sizes of 1); duck shaping is off, so sizes that happen
  to be equal when a graph is traced (3 rows feeding 3 columns) are not taken for one;
- the first forward of a call, which writes the cross-attention cache, runs eagerly;
- the decoder states that state-reading drafters need are an output of the same graph: a hook on the output
  projection, registered before compilation and traced into the graph, hands over its input.

One arithmetic for every call of a decode. A token's logits must not depend on how many tokens its call feeds, or
a verification call of k tokens could round differently from greedy's one-token calls. Measured on this CPU, two
kernels do depend on it, only below 3 rows: float32 `linear` and attention's products take another path (gemv) for
one row, and attention at opus-mt's head size for two as well; from 3 up to ~13 rows they give a row the same bits
(sgemm). So the engine
feeds every call at least `MIN_FEED_WIDTH` (3) columns, greedy's one-token calls padded with filler that causal
attention hides, and every cache of a decode has the same capacity, whatever the drafter's block size (attention
reads the whole buffer; a longer one may group its masked sums differently). With int8 products, which are exact
(int32 sums) for any number of rows, a k-token call then computes bit for bit what k one-token calls compute, at
any batch size: the engine's greedy (`blockwise_compile=True`, no assistant) *is* the int8 model's greedy output,
and every drafter reproduces it by construction (`tests/test_one_arithmetic.py` checks the logits with
`torch.equal`).
float32 products depend on the rows of the whole call (batch x width), so in float32 this holds only where that
count stays within one sgemm path; elsewhere, and against transformers' eager greedy (other kernels, fused
differently), an output may differ only at a near-tie, which [`first_divergence`] shows.

Where the compiled objects live, and when they are dropped:

- engines and drafting blocks are kept in one registry, keyed by model (weakly: a model that is garbage-collected
  takes its entries with it); [`engine_of`] reads it and [`drop_compiled`] empties a model's entries;
- each compiled module gets a code object of its own for its `forward`. Dynamo keeps graphs per code object,
  guarded by the objects a frame reads but not by weight values: with a shared code object, a new engine of a
  model whose weights changed in place would be served the old frozen graph (measured), and dropping it would take
  a process-wide `torch.compiler.reset()`. With its own code object an engine's graphs can be reached only through
  it, so weights changed after compilation (training, `load_state_dict`, writes through `.data`), seen by a
  [`WeightsSnapshot`], replace that model's engine alone; other models keep their graphs. It also keeps each
  engine's few graphs (2-4) within dynamo's default recompile limit, which is per code object: no global limit is
  raised;
- inductor's `freezing` is a global flag read when a graph is compiled; it is set around the engine's calls only
  and restored after each.
"""

from __future__ import annotations

import shutil
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config
import torch.fx.experimental._config as fx_config
from torch import nn

from hf_blockwise import boundary as hf

# static cache buffers are rounded up to this many positions, so that calls of similar lengths share their shape
_CACHE_ROUNDING = 64
# every compiled call feeds at least this many columns: kernels give a row the same bits at every width from 3 up
# (below, one row and two take other paths); see the module docstring
MIN_FEED_WIDTH = 3
# the static cache's room past max_length, the same for every drafter whose feeds fit it (block_size + 1 columns),
# so that greedy and drafting decodes of one input attend over buffers of the same length
_CACHE_SLACK = 16


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler for inductor on CPU, a torch without dynamo)."""


@dataclass(frozen=True)
class CompileOptions:
    """How `blockwise_compile=` compiles the verification forward.

    Args:
        backend (`str`, defaults to `"inductor"`): the `torch.compile` backend.
        mode (`str`, *optional*): the `torch.compile` mode; `None` picks `"reduce-overhead"` (CUDA graphs) on CUDA
            and the default on CPU.
        freezing (`bool`, defaults to `True`): inductor's freezing on CPU: weights become constants of the graph,
            prepacked for oneDNN (the gain on CPU). The graph then holds its own copy of the weights.
    """

    backend: str = "inductor"
    mode: str | None = None
    freezing: bool = True

    @classmethod
    def coerce(cls, value: bool | CompileOptions | None) -> CompileOptions | None:
        """`blockwise_compile=` as given: `True` for the defaults, `False`/`None` for eager, or options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"blockwise_compile= takes a bool or a CompileOptions, got {type(value).__name__}")


def check_compile_available(device: torch.device, options: CompileOptions) -> None:
    """Raises [`CompileUnavailableError`] naming what is missing for `torch.compile` on `device`."""
    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnavailableError(f"torch.compile is not supported by this torch ({torch.__version__}) here")
    if (
        options.backend == "inductor"
        and device.type == "cpu"
        and not any(shutil.which(name) for name in ("g++", "c++", "clang++"))
    ):
        raise CompileUnavailableError("inductor needs a C++ compiler on CPU (g++, c++ or clang++), and none is on PATH")


# one value in this many of every weight is compared with its value at compile time (a prime: it falls on every
# column of a row-major matrix in turn), so that writes through `.data`, which leave version counters alone, are seen
_SAMPLE_STEP = 1021


class WeightsSnapshot:
    """What a compiled graph's frozen weights were, to tell when the model's own have changed since.

    Two parts: each parameter's and buffer's storage address and version counter (a replaced tensor, an in-place
    change that autograd sees: an optimizer step, `load_state_dict`, `p.mul_()` under `no_grad`), and the values of
    a fixed sample of every tensor, one in `_SAMPLE_STEP` elements, compared bit for bit: writes through
    `p.data` (weight averaging, EMA, pruning), which move no version counter, change sampled values unless they
    touch fewer than about one value in a thousand of every tensor they change (for such an edit, call
    [`drop_compiled`]). The sample is read through views of the weights themselves, ~25,000 values for a 43M
    model (`scripts/stale_weights_check.py` times it).

    Args:
        model (`nn.Module`): the model whose weights a compiled graph holds.
    """

    def __init__(self, model: nn.Module) -> None:
        self.identity = self._identity(model)
        self.samples = self._sample_views(model)  # dtype -> views into the weights
        self.reference = {dtype: torch.cat(views) for dtype, views in self.samples.items()}  # copies

    @staticmethod
    def _tensors(model: nn.Module) -> list[torch.Tensor]:
        return [*model.parameters(), *model.buffers()]

    @classmethod
    def _identity(cls, model: nn.Module) -> tuple[tuple[int, int], ...]:
        return tuple(
            (tensor.data_ptr(), 0 if tensor.is_inference() else tensor._version) for tensor in cls._tensors(model)
        )

    @classmethod
    def _sample_views(cls, model: nn.Module) -> dict[torch.dtype, list[torch.Tensor]]:
        views: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in cls._tensors(model):
            if tensor.numel() == 0 or tensor.is_meta:
                continue
            count = -(-tensor.numel() // _SAMPLE_STEP)
            # (count,): elements 0, step, 2 step, ... of the tensor's span of its storage; a view, not a copy
            view = tensor.detach().as_strided((count,), (_SAMPLE_STEP,), tensor.storage_offset())
            views.setdefault(tensor.dtype, []).append(view)
        return views

    def matches(self, model: nn.Module) -> bool:
        """Whether `model`'s weights are still those of the snapshot (same tensors, versions and sampled values)."""
        if self._identity(model) != self.identity:
            return False
        return all(torch.equal(torch.cat(views), self.reference[dtype]) for dtype, views in self.samples.items())


def own_code(function: Callable) -> types.FunctionType:
    """`function` with a copy of its code object: the same behaviour, and a dynamo cache of its own.

    Dynamo keeps compiled graphs on the code object of the frame it compiles. Every module of one class shares its
    `forward`'s code, so their graphs share one cache (and one recompile limit), and only a process-wide reset
    could drop one model's graphs. A copy gives a compiled module graphs that no other module can be served.
    """
    code, name = function.__code__.replace(), function.__name__
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


class CompiledModule:
    """`module` through `torch.compile` with the engine's options: dynamic shapes, and on CPU frozen (prepacked)
    weights. The verification forward and the drafters' drafting blocks are compiled with it.

    Args:
        module (`nn.Module`): what to compile, built for this engine alone: its `forward` is given a code object of
            its own ([`own_code`]), so that its graphs are its own; dynamo sees its weights as parameters.
        options ([`CompileOptions`]).
        owner (`nn.Module`): the model whose weights `module` uses (or derives buffers from): the snapshot that
            tells a stale graph ([`WeightsSnapshot`]) is taken of it.
    """

    def __init__(self, module: nn.Module, options: CompileOptions, owner: nn.Module) -> None:
        device = next(owner.parameters()).device
        check_compile_available(device, options)
        self.options = options
        self.weights = WeightsSnapshot(owner)
        mode = options.mode
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        # freezing: weights become prepacked constants (CPU); not with CUDA graphs, which need the cache's static
        # addresses that freezing would fold
        self.freezing = options.freezing and options.backend == "inductor" and mode != "reduce-overhead"
        module.forward = types.MethodType(own_code(type(module).forward), module)
        self._compiled = torch.compile(module, backend=options.backend, mode=mode, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        # inductor reads `freezing` from its global config when it compiles (torch.compile's options= do not reach
        # that decision), so it is set for the call only and restored after it. Duck shaping is off for the same
        # span: it would give sizes that happen to be equal when a graph is traced (a first call of 3 rows feeding
        # 3 columns) one symbol, and every later call where they differ would compile again
        with torch._inductor.config.patch(freezing=self.freezing), fx_config.patch(use_duck_shape=False):
            return self._compiled(*args)

    def close(self) -> None:
        """Nothing to release (the engine of a decoder removes its hook)."""


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
        self.options = options
        self.position_limit = hf.decoder_position_limit(model)
        self.num_layers = hf.decoder_layer_count(model)
        self._step = _DecoderStep(model)
        self._compiled = CompiledModule(self._step, options, model)
        self.weights = self._compiled.weights  # the model's weights as the graph freezes them
        self.freezing = self._compiled.freezing
        self.compiled_calls = 0

    def close(self) -> None:
        """Removes the engine's hooks from the model (done when an engine is dropped)."""
        for handle in self._step.hook_handles:
            handle.remove()

    def new_cache(self, max_length: int, block_size: int = 1) -> Any:
        """A static cache for a decode of up to `max_length` tokens fed up to `block_size` tokens per row and call.

        Its capacity depends on `block_size` only where the feeds do not fit the fixed slack: every decode of one
        input then attends over buffers of the same length, whatever drafts it (one arithmetic).
        """
        needed = max_length + max(_CACHE_SLACK, block_size + MIN_FEED_WIDTH)
        return hf.static_decoder_cache(self.num_layers, -(-needed // _CACHE_ROUNDING) * _CACHE_ROUNDING)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        cache_length: int,
        tree: hf.TreeInputs | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached decoder pass over `tokens`, compiled after the first.

        Args:
            tokens (`torch.LongTensor` of shape `(batch_size, width)`).
            cache: from [`new_cache`]; `cache_length` positions of it are valid.
            tree ([`hf.TreeInputs`], *optional*): the feed is a tree of drafts (`generation/tree.py`); its graph is
                another than a chain's.

        Returns:
            logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`) and the states at the output
            projection (`torch.Tensor` of shape `(batch_size, width, hidden_size)`).
        """
        if cache_length == 0:  # writes the cross-attention cache: another graph, run once per call
            outputs = self._step(tokens, cache, forward_kwargs, *self._tree_inputs(cache, 0, tree))
            if self.freezing:
                hf.unpin_static_cache(cache)
            return outputs
        width = tokens.shape[1]
        padded = max(width, MIN_FEED_WIDTH)
        if self.position_limit is not None:  # filler needs positions too (a learned table ends)
            padded = max(width, min(padded, self.position_limit - cache_length))
        if padded > width:  # filler columns are hidden by causal attention; see MIN_FEED_WIDTH
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - width)], dim=1)
        tree = None if tree is None else tree.padded_to(padded)
        logits, states = self._compiled(tokens, cache, forward_kwargs, *self._tree_inputs(cache, cache_length, tree))
        self.compiled_calls += 1
        return logits[:, :width], states[:, :width]

    def _tree_inputs(self, cache: Any, cache_length: int, tree: hf.TreeInputs | None) -> tuple[torch.Tensor, ...]:
        """What [`_DecoderStep`] takes besides a chain's inputs for a tree feed: the depths and the 4D mask."""
        if tree is None:
            return ()
        return tree.depth, hf.tree_attention_mask(self._step.model_ref(), cache, cache_length, tree)


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
            decoder_input_ids=tokens, past_key_values=cache, use_cache=True, return_dict=True,
            **{**forward_kwargs, "decoder_attention_mask": mask},
        )  # fmt: skip
        self.capturing, self.depth = False, None
        states, self.states = self.states, None
        return outputs.logits, states


# Every compiled object, per model: its engine under "decoder", a drafter model's drafting blocks under "block:<key>".
# Keyed weakly (as transformers keeps its own compiled forward on the model, `_compiled_call`, it goes with it).
_COMPILED: weakref.WeakKeyDictionary[nn.Module, dict[str, CompiledDecoder | CompiledModule]] = (
    weakref.WeakKeyDictionary()
)
_DECODER_KEY = "decoder"


def compiled_decoder(model: nn.Module, options: CompileOptions) -> CompiledDecoder | None:
    """The model's compiled engine, built on first use and kept in the registry; `None`, with a warning that says
    why, where compilation is unavailable (the loop then runs eagerly, with the same output rules).

    Weights changed since the engine was built make a new one (a recompilation of this model only, with a
    warning): a frozen graph holds the weights it was compiled with.
    """
    return _kept(model, _DECODER_KEY, options, lambda: CompiledDecoder(model, options))


def compiled_block(
    owner: nn.Module, key: str, build: Callable[[], nn.Module], options: CompileOptions
) -> CompiledModule | None:
    """A drafter's compiled drafting block, kept for the drafter's model `owner` as the decoder's engine is kept
    for its model, with the same rules: rebuilt when `owner`'s weights change, `None` with a warning where
    compilation is unavailable.

    Args:
        owner (`nn.Module`): the drafter's model (its weights and the base's it reads).
        key (`str`): which block of `owner` (a drafter model may have one per block size).
        build (`Callable[[], nn.Module]`): makes the module to compile, on first use; it must not hold `owner`
            itself (the registry is keyed weakly by `owner`).
    """
    return _kept(owner, f"block:{key}", options, lambda: CompiledModule(build(), options, owner))


def _kept(owner: nn.Module, key: str, options: CompileOptions, build: Callable[[], Any]) -> Any:
    """The compiled object kept for `owner` under `key`, (re)built by `build` when missing, compiled with other
    options or holding stale weights."""
    entries = _COMPILED.setdefault(owner, {})
    engine = entries.get(key)
    if engine is not None and engine.options == options:
        if engine.weights.matches(owner):
            return engine
        warnings.warn(
            f"The weights of this {type(owner).__name__} changed since it was compiled; compiling it again "
            "(other models keep their compiled graphs)",
            stacklevel=4,
        )
    if engine is not None:  # its graphs are reachable through it only (its own code object): dropping it drops them
        engine.close()
        del entries[key]
    try:
        replacement = build()
    except CompileUnavailableError as error:
        warnings.warn(f"blockwise_compile: {error}; decoding eagerly instead", stacklevel=4)
        return None
    entries[key] = replacement
    return replacement


def engine_of(model: nn.Module) -> CompiledDecoder | None:
    """The engine `blockwise_compile=` built for `model`, or `None` where it has none."""
    return _COMPILED.get(model, {}).get(_DECODER_KEY)


def drop_compiled(model: nn.Module | None = None) -> None:
    """Drops the compiled engine and drafting blocks kept for `model` (every model's with `None`); the next
    compiled call compiles again. Other models' graphs are untouched.

    Freeing the memory of a dropped graph is up to torch: in torch 2.13 the frozen weights of a dropped graph stayed
    resident, measured alike after `torch.compiler.reset()`.
    """
    owners = list(_COMPILED) if model is None else [model]
    for owner in owners:
        for compiled in _COMPILED.pop(owner, {}).values():
            compiled.close()

"""The compiled engine: the verification forward of the loop through `torch.compile`, over a static cache.

Decoding a few tokens per call on a CPU is bound by moving the weights, not by arithmetic, and eager PyTorch adds
two costs on top: its float32 `linear` for a few rows goes through kernels that re-read the weights per row, and
each of the decoder's few hundred small ops pays its own dispatch. The engine compiles transformers' own decoder
forward (no modeling code of ours) with inductor: on CPU with `freezing`, so the weights are packed once and a call
that feeds 8 tokens costs about what one costs, its float linears on inductor's C++ GEMM template (the libraries
read a few rows' weights at a third of the memory's speed on the EPYC: [`CompileOptions.gemm_template`]); on CUDA
with mode `reduce-overhead` (CUDA graphs).

What keeps the compiled graph from recompiling during a call:

- the self-attention cache is static ([`boundary.static_decoder_cache`]): keys and values live in preallocated
  buffers, cropping moves a write position (a tensor, no host read), and the buffer length is rounded up to a
  multiple of 64 so that calls of similar lengths share it; on CPU a call is shown views of the positions in use
  ([`boundary.attention_window`]: its attention reads no more), whose length is one more dynamic size;
- shapes are dynamic (`dynamic=True`): one graph serves every feed width from 3 up and every source length;
  batch size 1 gets a graph of its own (dynamo specializes sizes of 1); duck shaping is off, so sizes that happen
  to be equal when a graph is traced (3 rows feeding 3 columns) are not taken for one;
- the first forward of a call, which writes the cross-attention cache, runs eagerly, or with
  `CompileOptions(compiled_prefill=True)` through graphs of its own (a second compiled module);
- the decoder states that state-reading drafters need are an output of the same graph: a hook on the output
  projection, registered before compilation and traced into the graph, hands over its input.

One arithmetic for every call of a decode. A token's logits must not depend on how many tokens its call feeds, or
a verification call of k tokens could round differently from greedy's one-token calls. Library kernels choose their
path by the call's shape and the machine (gemv for one row, small-matrix kernels, split K; other thresholds on each
CPU vendor), so on CPU the engine compiles through [`fixed_order.inductor_backend`]: attention's products (and
any float `matmul`) become inductor loops whose reduction order is fixed by the generated code, the same for every
feed width, batch size and attention window (the keys are summed in slot order: the positions a window leaves out
would add exact zeros last). With int8 linears (exact int32 sums) every product of the decoder is then exact or in an
order the graph owns, and a k-token call computes bit for bit what k one-token calls compute, on any CPU: the int8
engine's greedy (`blockwise_compile=True`, no assistant) *is* the int8 model's greedy output, and every drafter
reproduces it by construction. float32 `linear`s run on inductor's GEMM template (the batch-1 graph) or the
libraries (a batch's), whose code (not ours) orders their sums (inductor's plain loops cost ~1.4x a call on the
2-core EPYC), so a float32 engine is exact up to near-ties ([`greedy_divergences`]), unless
`CompileOptions(fixed_order_linears=True)` owns them too. A decode of b rows that shrinks to one row moves to the
batch-1 graph; the generated kernels give a row the same bits in both.

Checked where it runs: the first drafted decode of each kind (one row, several rows, several rows left with one;
chains or trees) runs [`CompiledDecoder.check_arithmetic`]: a wide call against one-token calls on the call's own
encoder output, the one-token calls over the whole cache (another attention window than the wide call's); a row
left of several against the same row in a two-row call; a tree's side branch against its path as a chain;
`torch.equal` on logits. Where the graphs own every float product, it passes or a
[`OneArithmeticWarning`] (once per engine) names what differed and by how much: outputs are then exact up to
near-ties on this machine, never a silent claim. Every call feeds at least `MIN_FEED_WIDTH` (2)
columns, filler that causal attention hides, so that one graph serves every width (dynamo specializes a size of 1);
every cache of a decode has one capacity, whatever the drafter's block size.

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

import contextlib
import functools
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch._inductor.config
import torch.fx.experimental._config as fx_config
from torch import fx, nn

from hf_blockwise import boundary as hf
from hf_blockwise.fixed_order import GraphProducts, inductor_backend
from hf_blockwise.fixed_order import own_products as own_products_pass
from hf_blockwise.kernels import cpp_compiler
from hf_blockwise.merged_products import merge_int8_products
from hf_blockwise.quantization import is_int8, refresh_int8
from hf_blockwise.snapshot import ModuleState, TensorSnapshot

# static cache buffers are rounded up to this many positions, so that calls of similar lengths share their shape
_CACHE_ROUNDING = 64
# every compiled call feeds at least this many columns, so that one graph serves every width: dynamo specializes a
# size of 1 (the arithmetic does not depend on the width; see the module docstring)
MIN_FEED_WIDTH = 2
# the static cache's room past max_length, the same for every drafter whose feeds fit it (block_size + 1 columns),
# so that greedy and drafting decodes of one input use buffers of the same length
_CACHE_SLACK = 16
# a compiled call attends over the positions in use rounded up to this (the vector width of float32 on AVX-512)
_WINDOW_ROUNDING = 16


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler for inductor on CPU, a torch without dynamo)."""


class OneArithmeticWarning(UserWarning):
    """The engine's probe found, on this machine, a verification call that does not compute bit for bit what
    one-token calls compute: outputs are exact up to near-ties here, not bitwise."""


@dataclass(frozen=True)
class ArithmeticVerdict:
    """What [`CompiledDecoder.check_arithmetic`] found for one kind of decode.

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


@dataclass(frozen=True)
class DraftingInVerification:
    """A drafter's block run inside the verification call: one compiled call per step verifies the feed, accepts
    on the raw logits and drafts the next step ([`CompiledDecoder.verify_and_draft`]).

    Attributes:
        block ([`CompiledModule`]): the drafter's compiled drafting block (its registry entry, which keeps the graphs
            made with it). Its module's `after_verification(states, follow, num_valid, *inputs)` is traced into the
            verification's graph, with `states` `(b, W, d)` at the output projection, `follow` `(b, W)` each
            column's greedy token (the argmax of its logits, before any logits processor) and `num_valid` `(b,)`
            the leading columns the raw logits verify ([`greedy_verified`]).
        inputs (`tuple`): the block's other arguments.
        num_pending (`torch.LongTensor` of shape `(b,)`): verified tokens leading each row's feed.
        num_fed (`torch.LongTensor` of shape `(b,)`): real tokens of each row's feed (filler after them).
        keep (`Callable`): hands what the block returned back to the drafter (its per-call state), for the next step.
    """

    block: CompiledModule
    inputs: tuple[Any, ...]
    num_pending: torch.Tensor
    num_fed: torch.Tensor
    keep: Callable[[Any], None]


@dataclass(frozen=True)
class CompileOptions:
    """How `blockwise_compile=` compiles the verification forward.

    Every field is checked when the options are made: a `TypeError` names a field of another type (a bool field
    takes `True` or `False` only: the string `"no"` would read as true), a `ValueError` a backend or mode that
    `torch.compile` does not know, before anything compiles.

    Args:
        backend (`str` or `Callable`, defaults to `"inductor"`): the `torch.compile` backend: a registered name
            (`torch._dynamo.list_backends()`, e.g. `"inductor"`, `"eager"`) or a backend function.
        mode (`str`, *optional*): the `torch.compile` mode (`"default"`, `"reduce-overhead"`, `"max-autotune"`,
            ...); `None` picks `"reduce-overhead"` (CUDA graphs) on CUDA and the default on CPU.
        freezing (`bool`, defaults to `True`): inductor's freezing on CPU: weights become constants of the graph,
            packed for the GEMM template or oneDNN (the gain on CPU). The graph then holds its own copy of the weights.
        fixed_order_linears (`bool`, defaults to `False`): on CPU, float `linear`s computed by inductor's own loops
            too ([`fixed_order.own_products`]), so that a float32 k-token call computes what k one-token calls of
            the same rows compute (int8 linears are exact either way). A decode of several rows that shrinks to one
            moves to the batch-1 graph, whose loops inductor may vectorize otherwise: there the probe compares the
            two and warns where they differ (a `OneArithmeticWarning`; float32 is then exact up to near-ties).
            Slower: ~1.4x a float32 call on the 2-core EPYC.
        gemm_template (`bool`, defaults to `True`): on CPU with `freezing`, float `linear`s through inductor's C++
            GEMM template (`max_autotune` restricted to the `"CPP"` backend: weights packed at freezing, inductor's
            own micro-kernels) instead of oneDNN and MKL. A call of a few rows is bound by reading the weights;
            measured on the 2-core AMD EPYC (Zen 4), the libraries read them at ~10 GB/s there, the template at
            the ~31 GB/s the machine streams from memory: a one-token float32 call of `marian-base-en-de` 6.2 ms
            against 10.3 ms. Graphs of one sequence only: the verification graph of a batch (and every graph of
            int8 linears: the template takes no int8 product) keeps the libraries (measured: batch 16 ran 7-14% slower
            on the template); a graph with a product the template cannot take compiles on the libraries, its report
            says so ([`fixed_order.inductor_backend`]).
        merge_int8_products (`bool`, defaults to `True`): on CPU, int8 products that take the same rows (a layer's
            q, k and v) computed as one product on their weights side by side ([`merged_products`]): the same
            integers, fewer products (each costs mostly a fixed time at decoding's few rows).
        compiled_prefill (`bool`, defaults to `False`): on CPU with inductor, the first decoder call of each
            `generate` (the decoder start token; it writes the cross-attention cache) through a graph of its own
            instead of eagerly. Measured on the 2-core Intel Xeon (AMX), `marian-base-en-de` in int8, 30 captions
            (`hf-blockwise profile step --int8 --compiled [--compiled-prefill]`, docs/guides/compiled-engine.md):
            greedy 52.5 -> 46.0 ms a sentence. It costs a second graph per batch class (~22 s more compiling on a
            cold cache) holding its own frozen copy of the weights, so it pays off on long runs (the corpus job
            turns it on), not on a few sentences. Both the drafted decodes and the greedy
            reference run the same first call, so the one-arithmetic contract is unchanged.
        drafting_in_verification (`bool`, defaults to `False`): a drafter that offers it (the feature drafter's
            chains at batch 1) drafts the next step inside the verification's compiled call: one call per step
            ([`CompiledDecoder.verify_and_draft`]), a graph of its own per engine and drafting block. Measured on the
            2-core Intel Xeon (AMX), `marian-base-en-de` in int8: 2.9 ms a step in one call against 2.1-2.4 ms +
            1.2-1.3 ms in two (`hf-blockwise profile step`), yet 36.5 against 36.3 ms a sentence over 60 captions in
            one process (the first step drafts in a call of its own, the last drafts for nothing), for ~30-45 s more
            compiling: off by default.
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    freezing: bool = True
    fixed_order_linears: bool = False
    gemm_template: bool = True
    merge_int8_products: bool = True
    compiled_prefill: bool = False
    drafting_in_verification: bool = False

    def __post_init__(self) -> None:
        for option in fields(self):
            value = getattr(self, option.name)
            if option.type == "bool" and not isinstance(value, bool):
                raise TypeError(_option_error(option.name, value, "a bool (True or False)"))
        if not isinstance(self.backend, str) and not callable(self.backend):
            raise TypeError(_option_error("backend", self.backend, "a str naming a torch.compile backend"))
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(_option_error("mode", self.mode, "a str naming a torch.compile mode, or None"))
        # the default backend skips the registry: listing it imports every backend module (~0.5 s)
        if isinstance(self.backend, str) and self.backend != "inductor":
            known = torch._dynamo.list_backends(exclude_tags=())  # debug and experimental ones included
            _check_known("backend", self.backend, known, shown=["eager", "aot_eager", *torch._dynamo.list_backends()])
        if self.mode is not None:
            modes = list(torch._inductor.list_mode_options())
            _check_known("mode", self.mode, modes, shown=modes)

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


def _option_error(name: str, value: Any, expected: str) -> str:
    return f"CompileOptions({name}={value!r}): {name} takes {expected}, got {type(value).__name__}"


def _check_known(name: str, value: str, known: Sequence[str], shown: Sequence[str]) -> None:
    """A `ValueError` naming the usual choices (`shown`) when `value` is none of `known` (what `torch.compile` would
    fail on once it compiles)."""
    if value not in known:
        raise ValueError(f"CompileOptions({name}={value!r}): torch.compile knows no such {name}; choose one of {shown}")


def on_cpu_inductor(options: CompileOptions, device: torch.device) -> bool:
    """Whether `options` compile with inductor on CPU without a `mode` (no CUDA graphs): where the engine's graph
    passes, freezing's packed weights, attention windows and the CPU-only options run."""
    return options.backend == "inductor" and device.type == "cpu" and options.mode is None


def check_compile_available(device: torch.device, options: CompileOptions) -> None:
    """Raises [`CompileUnavailableError`] naming what is missing for `torch.compile` on `device`."""
    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnavailableError(f"torch.compile is not supported by this torch ({torch.__version__}) here")
    if options.backend == "inductor" and device.type == "cpu" and cpp_compiler() is None:
        raise CompileUnavailableError("inductor needs a C++ compiler on CPU (g++, c++ or clang++), and none is on PATH")


class WeightsSnapshot:
    """What a compiled graph's frozen weights were, to tell when the model's own have changed since: a
    [`TensorSnapshot`] of every parameter and buffer (int8 layers' copies included, which
    [`hf_blockwise.quantization.refresh_int8`] rewrites in place when their float weights change). A write through
    `p.data` that touches fewer than about one value in a thousand of every tensor it changes goes unseen: for such
    an edit, call [`drop_compiled`]. ~66,000 values are compared for a 43M model in float32, ~109,000 in int8 (its
    int8 copies too): ~0.8 ms (`scripts/stale_weights_check.py` counts and times it).

    Args:
        model (`nn.Module`): the model whose weights a compiled graph holds.
    """

    def __init__(self, model: nn.Module) -> None:
        self.tensors = TensorSnapshot(self._tensors(model))

    @staticmethod
    def _tensors(model: nn.Module) -> list[torch.Tensor | None]:
        # one walk of the module tree (`parameters()` and `buffers()` walk it once each: 0.27 ms against 0.08 for
        # marian-base-en-de in int8 on the EPYC Zen 4); a tensor two modules share (tied embeddings) is listed under
        # each, and a `None` entry (a layer without bias) is kept: the list is only compared with one made alike
        return [
            tensor
            for module in model.modules()
            for tensors in (module._parameters, module._buffers)
            for tensor in tensors.values()
        ]

    def matches(self, model: nn.Module) -> bool:
        """Whether `model`'s weights are still those of the snapshot (same tensors, versions and sampled values)."""
        return self.tensors.matches(self._tensors(model))


@contextlib.contextmanager
def _settings(*settings: tuple[types.ModuleType, dict[str, Any]]) -> Iterator[None]:
    """Config values (config module, {name: value}) set for the span of a block and restored after it, as
    `config.patch` does, by plain assignment: a third of its cost (~25 against ~75 µs a compiled call)."""
    saved = [(config, {name: getattr(config, name) for name in values}) for config, values in settings]
    try:
        for config, values in settings:
            for name, value in values.items():
                setattr(config, name, value)
        yield
    finally:
        for config, values in saved:
            for name, value in values.items():
                setattr(config, name, value)


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
        owner (`nn.Module`): the model whose weights `module` uses (or derives buffers from): the snapshots that
            tell a stale graph ([`WeightsSnapshot`], [`ModuleState`]) are taken of it (or of `watched`). Dynamo's
            guards on module attributes are left out of the compiled calls (`guard_filter_fn`): the snapshots,
            compared once per `generate` ([`compiled_decoder`]), watch what they watched, so `owner` (or `watched`)
            must hold every module that `module` reads (a drafter's model holds its base).
        own_products (`bool`): on CPU with inductor, run [`fixed_order.own_products`] on each graph (the
            verification forward: one arithmetic; the drafting blocks too, whose bits decide nothing: their
            one-row attention measured a little faster so, and it is the arithmetic they have inside a verification
            call). Either goes through [`fixed_order.inductor_backend`], on the GEMM template where
            `options.gemm_template` holds, nothing is int8 and the compiling call says `few_rows`.
        int8 (`bool`, *optional*): whether the graph has int8 linears (they keep the libraries); by default, whether
            `module` holds one (the decoder's step holds its model weakly: its engine says).
        watched (`nn.Module`, *optional*): the module tree the snapshots cover instead of `owner`'s whole tree: what
            `module` reads (a drafting block watches itself and the base's output projection its shortlist is copied
            from, not the base's layers, which the engine watches). Held strongly: it must not hold `owner`.

    Attributes:
        graph_products (`list[GraphProducts]`): one report per graph compiled through that backend.
        cpu_inductor (`bool`): compiled by inductor on CPU without CUDA graphs (where the graph passes run).
    """

    def __init__(
        self,
        module: nn.Module,
        options: CompileOptions,
        owner: nn.Module,
        own_products: bool = False,
        int8: bool | None = None,
        watched: nn.Module | None = None,
    ) -> None:
        device = next(owner.parameters()).device
        check_compile_available(device, options)
        self.options = options
        self.watched = watched
        self.graph_products: list[GraphProducts] = []
        mode = options.mode
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        # freezing: weights become prepacked constants (CPU); not with CUDA graphs, which need the cache's static
        # addresses that freezing would fold
        self.freezing = options.freezing and options.backend == "inductor" and mode != "reduce-overhead"
        self.module = module
        # graphs that trace this module inside an engine's verification call ([`DraftingInVerification`]), per
        # engine: they go with this object when a stale block is rebuilt, and with an engine that is dropped
        self.fused: weakref.WeakKeyDictionary[CompiledDecoder, CompiledModule | None] = weakref.WeakKeyDictionary()
        module.forward = types.MethodType(own_code(type(module).forward), module)
        # after the line above: a watched module's `forward` attribute is part of its state
        tree = self.tree(owner)
        self.weights, self.module_state = WeightsSnapshot(tree), ModuleState(tree)
        backend: Any = options.backend
        cpu_inductor = on_cpu_inductor(options, device)
        self.cpu_inductor = cpu_inductor
        # the template has no int8 product: a graph of int8 linears keeps the libraries
        int8 = is_int8(module) if int8 is None else int8
        self.template = cpu_inductor and self.freezing and options.gemm_template and not int8
        merge = cpu_inductor and int8 and self.freezing and options.merge_int8_products
        if cpu_inductor and (own_products or self.template or merge):
            passes = functools.partial(
                _graph_passes, own=own_products, own_linears=options.fixed_order_linears, merge=merge
            )
            backend = inductor_backend(passes, self.graph_products.append)
        mode = None if callable(backend) else mode
        # dynamo's guards on module attributes (~0.3 of a marian-base-en-de call's ~0.4 ms of guards on the EPYC) are
        # left out: `module_state` and `weights` are compared once per generate instead ([`compiled_decoder`])
        compile_options: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if mode is not None and backend == "inductor":  # torch.compile takes a mode or options: the mode as options
            compile_options.update(torch._inductor.list_mode_options(mode))
            mode = None
        # another backend given a mode keeps dynamo's module guards (the snapshots are then checked on top)
        options = compile_options if mode is None else None
        self._compiled = torch.compile(module, backend=backend, mode=mode, dynamic=True, options=options)

    def __call__(self, *args: Any, few_rows: bool = True) -> Any:
        """The compiled module on `args`; a call that compiles a graph compiles it on the GEMM template where the
        module takes it and `few_rows` says the graph's calls feed one sequence's rows (measured on the EPYC: the
        template reads 1-4 rows' weights at 2-3x the libraries' speed, and a batch of 16 ran 7-14% slower on it)."""
        # inductor reads `freezing` from its global config when it compiles (torch.compile's options= do not reach
        # that decision), so it is set for the call only and restored after it. Duck shaping is off for the same
        # span: it would give sizes that happen to be equal when a graph is traced (a first call of 3 rows feeding
        # 3 columns) one symbol, and every later call where they differ would compile again
        # Python floats (attention's scale) are constants of the graph: traced as symbols, they made dynamo restart
        # its analysis once per graph (measured: ~12% of a tiny decoder's compile time)
        inductor = {"freezing": self.freezing}
        if self.template and few_rows:
            inductor.update(max_autotune=True, max_autotune_gemm_backends="CPP")
        settings = [(torch._inductor.config, inductor), (fx_config, {"use_duck_shape": False})]
        with _settings(*settings, (torch._dynamo.config, {"specialize_float": True})):
            return self._compiled(*args)

    def tree(self, owner: nn.Module) -> nn.Module:
        """The module tree whose weights and state the snapshots cover: `watched`, or `owner`'s whole tree."""
        return owner if self.watched is None else self.watched

    def close(self) -> None:
        """Nothing to release (the engine of a decoder removes its hook)."""


def _graph_passes(graph_module: fx.GraphModule, own: bool, own_linears: bool, merge: bool) -> GraphProducts:
    """The engine's passes over one dynamo graph, before inductor: int8 products that share their rows merged
    ([`merged_products.merge_int8_products`]), then the float products put in the graph's own order
    ([`fixed_order.own_products`]) where `own`."""
    merged = merge_int8_products(graph_module) if merge else 0
    report = own_products_pass(graph_module, own_linears=own_linears) if own else GraphProducts()
    report.merged_int8 = merged
    return report


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
        for name in ("compiled_prefill", "drafting_in_verification"):  # graphs measured and tested there only
            if getattr(options, name) and not cpu_inductor:
                raise ValueError(f"CompileOptions({name}=True) compiles on CPU with inductor (and no mode) only")
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

    def verify_and_draft(
        self,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        cache_length: int,
        drafting: DraftingInVerification,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """[`forward`] of a chain feed (`cache_length > 0`) with a drafter's block in the same compiled call: the
        verification, the raw acceptance ([`greedy_verified`]) and the next step's drafts in one graph.

        The first call of each engine and block also runs the engine's own graph on the same feed and compares the
        logits bit for bit: where they differ (another lowering of the shared part), it warns
        ([`OneArithmeticWarning`]), keeps the engine's logits and this block drafts in calls of its own from then on.

        Returns:
            logits `(b, W, V)` and states `(b, W, d)` as [`forward`]'s, and the block's drafts (whatever its
            `after_verification` returns), or `None` where the block drafts in calls of its own.
        """
        block = drafting.block
        fused = block.fused.get(self, False)
        if fused is None:
            return (*self.forward(tokens, cache, forward_kwargs, cache_length), None)
        width = tokens.shape[1]
        tokens = self._padded(tokens, cache_length)
        inputs = (drafting.num_pending, drafting.num_fed, *drafting.inputs)
        with self._window(cache, cache_length, tokens.shape[1], False):
            if fused is False:  # the first call of this engine and block: made and checked
                logits, states, drafts = self._check_fused(block, tokens, cache, forward_kwargs, cache_length, inputs)
            else:
                logits, states, drafts = fused(tokens, cache, forward_kwargs, *inputs, few_rows=tokens.shape[0] == 1)
        self.compiled_calls += 1
        return logits[:, :width], states[:, :width], drafts

    def _check_fused(
        self,
        block: CompiledModule,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        cache_length: int,
        inputs: tuple[Any, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Compiles the verify-and-draft graph of this engine and `block` on the call's feed (inside its window) and
        keeps it (in `block.fused`) where its logits equal the engine graph's bit for bit on that feed, else keeps
        `None` and warns. The engine's graph runs last, so the cache holds its writes. Returns the engine graph's
        logits and states, and the drafts where the graph is kept (else `None`)."""
        model = self._step.model_ref()
        fused = CompiledModule(
            _VerifyAndDraft(self._step, block.module), self.options, model, own_products=True, int8=is_int8(model),
            watched=block.module,
        )  # fmt: skip
        few_rows = tokens.shape[0] == 1
        logits, _, drafts = fused(tokens, cache, forward_kwargs, *inputs, few_rows=few_rows)
        hf.crop_cache(cache, cache_length)
        reference, states = self._compiled(tokens, cache, forward_kwargs, few_rows=few_rows)
        same = torch.equal(logits, reference)
        if not same:
            warnings.warn(
                f"Drafting inside the verification call computed other logits than the engine's own graph on this "
                f"machine (largest difference {(logits - reference).abs().max().item():.3g}); the drafter drafts in "
                "calls of its own instead (the output is the engine's)",
                OneArithmeticWarning,
                stacklevel=4,
            )
        block.fused[self] = fused if same else None
        return reference, states, drafts if same else None

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
        return tree.depth, hf.tree_attention_mask(self._step.model_ref(), cache, cache_length, tree)

    def check_arithmetic(
        self,
        prompt: torch.Tensor,
        forward_kwargs: dict[str, Any],
        max_length: int,
        width: int,
        tree: bool = False,
        shrunk: bool = False,
    ) -> ArithmeticVerdict:
        """Probes, on this machine and this model, whether a `width`-token call computes what one-token calls
        compute; once per engine for each kind of decode (one row, several rows, several rows shrunk to one; chains
        or trees).

        On the call's own encoder output, over scratch caches of the decode's capacity: `width` random tokens fed
        in one call against the same tokens fed one per call (`torch.equal` on logits); with `shrunk` (a decode of
        several rows left with one, which moves to the batch-1 graph), the row's logits against the same row in a
        two-row call; with `tree`, a tree of the same tokens (a chain and a side branch) through the tree graph
        against its paths fed as chains; with a compiled first call (`compiled_prefill`), the first call of the
        prompt and the tokens against the first call of the prompt alone (greedy's). A difference, where the graphs
        claim one arithmetic, warns once
        ([`OneArithmeticWarning`]). The probe's calls are not counted in `compiled_calls`.

        Args:
            prompt (`torch.LongTensor` of shape `(batch_size, prompt_length)`): the decoder start (and prompt).
            forward_kwargs (`dict`): the encoder outputs and attention mask of those rows.
            max_length (`int`): the decode's length limit (the scratch caches get the decode's capacity).
            width (`int`): the widest feed of the decode.
            tree (`bool`): the decode feeds trees.
            shrunk (`bool`): `prompt` is the one row left of a decode of several.

        Returns:
            [`ArithmeticVerdict`].
        """
        kind = "several rows, then one" if shrunk else "several rows" if prompt.shape[0] > 1 else "one row"
        key = (kind, tree)
        if key not in self.verdicts:
            begin, calls = time.perf_counter(), self.compiled_calls
            with torch.no_grad():
                difference = self._probe(prompt, forward_kwargs, max_length, width, tree, shrunk)
            self.compiled_calls = calls  # the probe's calls are no decode's forwards
            seconds = time.perf_counter() - begin
            verdict = ArithmeticVerdict(self.owns_products(), not difference, difference, seconds)
            if verdict.claimed and difference and all(old.bitwise for old in self.verdicts.values() if old.claimed):
                warnings.warn(
                    f"The compiled engine's one-arithmetic probe failed on this machine: {difference}. Verification "
                    "calls do not compute bit for bit what one-token calls compute here, so outputs are exact up to "
                    "near-ties (see hf_blockwise.greedy_divergences), not bitwise.",
                    OneArithmeticWarning,
                    stacklevel=4,
                )
            self.verdicts[key] = verdict
        return self.verdicts[key]

    def _probe(
        self,
        prompt: torch.Tensor,
        forward_kwargs: dict[str, Any],
        max_length: int,
        width: int,
        tree: bool,
        shrunk: bool,
    ) -> str:
        """The probe's comparisons; the first that differs, described, or an empty string."""
        if self.position_limit is not None:
            width = max(1, min(width, self.position_limit - prompt.shape[1]))
        vocab_size = self._step.model_ref().get_input_embeddings().num_embeddings
        generator = torch.Generator().manual_seed(0)  # the caller's random state is left alone
        tokens = torch.randint(vocab_size, (prompt.shape[0], width), generator=generator).to(prompt.device)
        # a tree decode's calls go through the tree graph: the probe's too, each chain fed as a tree of one chain
        probe = functools.partial(self._probe_logits, max_length=max_length, as_tree=tree)
        together = probe(prompt, forward_kwargs, tokens, one_call=True)  # (b, width, V)
        comparisons = [
            (f"a {width}-token call against one-token calls", together,
             lambda: probe(prompt, forward_kwargs, tokens, one_call=False)),
        ]  # fmt: skip
        if shrunk:  # the row, decoded alone now, against the same row in the several-row graph
            twice = torch.zeros(2, dtype=torch.long, device=prompt.device)
            pair = hf.select_forward_rows(forward_kwargs, twice)
            comparisons.append(
                ("a row alone against the same row in a two-row call", together,
                 lambda: probe(prompt[twice], pair, tokens[twice], one_call=True)[:1])
            )  # fmt: skip
        if self._prefill is not None and not tree:  # a drafted decode's first call feeds drafts after the prompt
            first = functools.partial(self._first_call_logits, forward_kwargs=forward_kwargs, max_length=max_length)
            start = prompt.shape[1]
            comparisons.append(
                ("a first call of the prompt and drafts against one of the prompt alone",
                 first(torch.cat([prompt, tokens], dim=1))[:, :start], lambda: first(prompt)[:, :start])
            )  # fmt: skip
        if tree and width > 2:  # a chain of width - 1 and a side branch after its first node
            in_tree = probe(prompt, forward_kwargs, tokens, one_call=True, side_branch=True)
            branch = tokens[:, [0, width - 1]]  # the side branch's path, fed as a chain
            comparisons += [
                ("a tree call's main chain against a chain call", in_tree[:, :-1], lambda: together[:, :-1]),
                ("a tree call's side branch against its path as a chain", in_tree[:, -1:],
                 lambda: probe(prompt, forward_kwargs, branch, one_call=True)[:, -1:]),
            ]  # fmt: skip
        for description, logits, reference in comparisons:
            expected = reference()
            if not torch.equal(logits, expected):
                largest = float((logits - expected).abs().max())
                return f"{description} (batch {logits.shape[0]}): max |logit difference| {largest:.3g}"
        return ""

    def _first_call_logits(self, tokens: torch.Tensor, forward_kwargs: dict[str, Any], max_length: int) -> torch.Tensor:
        """Logits `(b, n, V)` of the first call of a decode that feeds `tokens` (shape `(b, n)`), in a fresh cache."""
        return self.forward(tokens, self.new_cache(max_length, tokens.shape[1]), forward_kwargs, cache_length=0)[0]

    def _probe_logits(
        self,
        prompt: torch.Tensor,
        forward_kwargs: dict[str, Any],
        tokens: torch.Tensor,
        one_call: bool,
        max_length: int,
        as_tree: bool = False,
        side_branch: bool = False,
    ) -> torch.Tensor:
        """Logits of `tokens` (shape `(b, n)`) after `prompt` in a fresh cache: fed in one call, or one token per
        call with the cache cropped back after each call's filler (as the loop does) and attending over the whole
        capacity; with `as_tree` every call is a tree (a chain's shape, or with `side_branch` a chain of n - 1 and a
        branch after the first node)."""
        cache = self.new_cache(max_length, tokens.shape[1])
        self.forward(prompt, cache, forward_kwargs, cache_length=0)
        start, batch = prompt.shape[1], tokens.shape[0]
        if one_call:
            tree = _probe_tree(batch, tokens.shape[1], side_branch, tokens.device) if as_tree else None
            return self.forward(tokens, cache, forward_kwargs, start, tree)[0]
        logits = []
        one = _probe_tree(batch, 1, False, tokens.device) if as_tree else None
        for column in range(tokens.shape[1]):  # over the whole capacity: another window than the wide call's
            fed = tokens[:, column : column + 1]
            logits.append(self.forward(fed, cache, forward_kwargs, start + column, one, full_cache=True)[0])
            hf.crop_cache(cache, start + column + 1)
        return torch.cat(logits, dim=1)


def _probe_tree(batch_size: int, width: int, side_branch: bool, device: torch.device) -> hf.TreeInputs:
    """A probe's tree of `width` nodes: a chain, or with `side_branch` a chain of `width - 1` and a last node
    after the first."""
    ancestors = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (width, width)
    depth = torch.arange(width, device=device)
    if side_branch:
        ancestors[-1, 1:-1] = False  # the last node's ancestors: node 0 only
        depth[-1] = 1
    return hf.TreeInputs(depth=depth.repeat(batch_size, 1), ancestors=ancestors.repeat(batch_size, 1, 1))


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


def greedy_verified(
    tokens: torch.Tensor, logits: torch.Tensor, num_pending: torch.Tensor, num_fed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the raw logits of a chain feed verify: each column's greedy token and how many leading columns hold
    verified tokens (the pending ones, then each draft equal to the greedy token of the column before, up to the
    first that is not: a cumulative product of the match mask). Without logits processors this is the loop's own
    acceptance; with them the loop's decides the output, and this one only where a drafter continues from.

    Args:
        tokens (`torch.LongTensor` of shape `(b, W)`), logits (`torch.FloatTensor` of shape `(b, W, V)`).
        num_pending, num_fed (`torch.LongTensor` of shape `(b,)`): see [`DraftingInVerification`].

    Returns:
        follow (`torch.LongTensor` of shape `(b, W)`) and num_valid (`torch.LongTensor` of shape `(b,)`).
    """
    follow = logits.argmax(dim=-1)  # (b, W)
    columns = torch.arange(1, tokens.shape[1], device=tokens.device)  # (W - 1,)
    pending = columns < num_pending[:, None]  # (b, W - 1)
    is_draft = ~pending & (columns < num_fed[:, None])
    run = (pending | (is_draft & (tokens[:, 1:] == follow[:, :-1]))).long().cumprod(dim=1)  # (b, W - 1)
    return follow, num_pending + (run * is_draft.long()).sum(dim=1)


class _VerifyAndDraft(nn.Module):
    """The engine's decoder step, [`greedy_verified`] and a drafter's block in one module: one graph per step."""

    def __init__(self, step: _DecoderStep, block: nn.Module) -> None:
        super().__init__()
        self.step, self.block = step, block

    def forward(
        self,
        tokens: torch.Tensor,
        cache: Any,
        forward_kwargs: dict[str, Any],
        num_pending: torch.Tensor,
        num_fed: torch.Tensor,
        *inputs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        logits, states = self.step(tokens, cache, forward_kwargs)
        follow, num_valid = greedy_verified(tokens, logits, num_pending, num_fed)
        return logits, states, self.block.after_verification(states, follow, num_valid, *inputs)


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
    owner: nn.Module,
    key: str,
    build: Callable[[], nn.Module],
    options: CompileOptions,
    reads: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
) -> CompiledModule | None:
    """A drafter's compiled drafting block, kept for the drafter's model `owner` as the decoder's engine is kept
    for its model, with the same rules: rebuilt when `owner`'s weights change, `None` with a warning where
    compilation is unavailable.

    Args:
        owner (`nn.Module`): the drafter's model (its weights and the base's it reads).
        key (`str`): which block of `owner` (a drafter model may have one per block size).
        build (`Callable[[], nn.Module]`): makes the module to compile, on first use; it must not hold `owner`
            itself (the registry is keyed weakly by `owner`).
        reads (`Callable`, *optional*): given the built module, the modules it reads besides its own (the sources of
            what it copied): the snapshots then watch those and the module, not `owner`'s whole tree.
    """

    def compile_block() -> CompiledModule:
        module = build()
        watched = None if reads is None else nn.ModuleList([module, *reads(module)])
        return CompiledModule(module, options, owner, own_products=True, watched=watched)

    return _kept(owner, f"block:{key}", options, compile_block)


def _kept(owner: nn.Module, key: str, options: CompileOptions, build: Callable[[], Any]) -> Any:
    """The compiled object kept for `owner` under `key`, (re)built by `build` when missing, compiled with other
    options or holding stale weights."""
    entries = _COMPILED.setdefault(owner, {})
    engine = entries.get(key)
    if engine is not None and engine.options == options:
        # the snapshot covers the float weights too, taken after their int8 copies were made: no change, none stale
        tree = engine.tree(owner)  # the owner's, or the part of it that the compiled module reads
        weights, modules = engine.weights.matches(tree), engine.module_state.matches(tree)
        if weights and modules:
            return engine
        changed = "weights" if not weights else "modules, training flags, plain attributes or config"
        warnings.warn(
            f"The {changed} of this {type(owner).__name__} changed since it was compiled; compiling it again "
            "(other models keep their compiled graphs)",
            stacklevel=4,
        )
    if engine is not None:  # its graphs are reachable through it only (its own code object): dropping it drops them
        engine.close()
        del entries[key]
    refresh_int8(owner)  # int8 copies made again from changed float weights before the graph freezes them
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

"""A compiled module of the engine ([`CompiledModule`]: the decoder step, or a drafter's drafting block) with the
snapshots that tell when the model it was compiled from has changed ([`WeightsSnapshot`], `snapshot.ModuleState`).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._inductor.config
import torch.fx.experimental._config as fx_config
from torch import fx, nn

from hf_blockwise.compile_options import CompileOptions, check_compile_available, on_cpu_inductor
from hf_blockwise.fixed_order import GraphProducts, inductor_backend
from hf_blockwise.fixed_order import own_products as own_products_pass
from hf_blockwise.merged_products import merge_int8_products
from hf_blockwise.quantization import is_int8
from hf_blockwise.snapshot import ModuleState, TensorSnapshot


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

"""How the compiled engine compiles ([`CompileOptions`]), and whether it can here.

Kept apart from the engine (`hf_blockwise/engine/`): the drafter contract (`drafters/base.py`) hands the options to
drafters that compile blocks of their own, and imports nothing of the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch._inductor.config

from hf_blockwise.kernels import cpp_compiler


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler for inductor on CPU, a torch without dynamo)."""


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
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    freezing: bool = True
    fixed_order_linears: bool = False
    gemm_template: bool = True
    merge_int8_products: bool = True
    compiled_prefill: bool = False

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

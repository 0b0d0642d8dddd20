"""Where the compiled objects live: engines and drafting blocks in one registry keyed weakly by model, rebuilt when
the model's weights or modules change ([`compiled_decoder`], [`compiled_block`], [`engine_of`], [`drop_compiled`]).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from hf_blockwise.compile_options import CompileOptions, CompileUnavailableError
from hf_blockwise.engine.compiled_module import CompiledModule
from hf_blockwise.engine.decoder import CompiledDecoder
from hf_blockwise.quantization import refresh_int8

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

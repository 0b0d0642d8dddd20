"""What a set of tensors was, to tell later whether any of them changed: the one check behind the compiled engine's
stale-graph test ([`hf_blockwise.engine.WeightsSnapshot`]) and the int8 layers' requantization
([`hf_blockwise.quantization.refresh_int8`]); and what a module tree's Python state was ([`ModuleState`]), which the
engine compares instead of dynamo's per-call guards on module attributes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# one element in this many of every tensor is compared by value (a prime, so that the sample does not line up with
# rows or columns of any usual width)
SAMPLE_STEP = 1021
# CPU samples of these dtypes are read through NumPy views of the same memory, compared as bytes: `np.concatenate`
# of a model's ~500 strided views takes half the time of `torch.cat` (measured: 0.42 against 0.82 ms for
# marian-base-en-de in int8 on the EPYC Zen 4); other dtypes (bfloat16) and devices keep torch's views
_NUMPY_DTYPES = frozenset(
    (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
     torch.bool)
)  # fmt: skip

_Views = list[torch.Tensor] | list[np.ndarray]


class TensorSnapshot:
    """Each tensor's storage address and version counter, and the values of a fixed sample of its elements.

    The addresses and version counters tell a replaced tensor (`p.data = ...`) and every in-place change that
    autograd sees (an optimizer step, `load_state_dict`, `p.mul_()` under `no_grad`). The sample, one element in
    [`SAMPLE_STEP`] compared bit for bit, tells writes through `p.data` (weight averaging, EMA, pruning), which move
    no version counter, unless they touch fewer than about one value in a thousand of every tensor they change. It
    is read through views of the tensors themselves, not copies.

    Args:
        tensors (`Sequence[torch.Tensor | None]`): what to watch; `None` entries (a layer without bias) are kept as
            `None`, so that a tensor appearing there later counts as a change.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self.identity = self._identity(tensors)
        self.samples = self._sample_views(tensors)  # (device, dtype) -> views into the tensors
        self.reference = {key: _read(views) for key, views in self.samples.items()}  # copies
        self.num_sampled = sum(len(view) for views in self.samples.values() for view in views)  # values compared

    @staticmethod
    def _identity(tensors: Sequence[torch.Tensor | None]) -> tuple[tuple[int, int] | None, ...]:
        return tuple(
            None if tensor is None else (tensor.data_ptr(), 0 if tensor.is_inference() else tensor._version)
            for tensor in tensors
        )

    @staticmethod
    def _sample_views(tensors: Sequence[torch.Tensor | None]) -> dict[tuple[str, torch.dtype], _Views]:
        views: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        for tensor in tensors:
            if tensor is None or tensor.numel() == 0 or tensor.is_meta:
                continue
            count = -(-tensor.numel() // SAMPLE_STEP)
            # (count,): elements 0, step, 2 step, ... of the tensor's span of its storage; a view, not a copy
            view = tensor.detach().as_strided((count,), (SAMPLE_STEP,), tensor.storage_offset())
            views.setdefault((str(view.device), view.dtype), []).append(view)
        return {
            key: [view.numpy() for view in group] if _numpy_readable(key, group) else group
            for key, group in views.items()
        }

    def matches(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether `tensors` are still those of the snapshot: the same storages, versions and sampled values."""
        # the storages first: a sample is read only from memory that is still the tensor's (a NumPy view would
        # read a storage that was reallocated, `resize_` or `set_`, where the identity has already changed)
        if self._identity(tensors) != self.identity:
            return False
        return all(_same(_read(views), self.reference[key]) for key, views in self.samples.items())


def _numpy_readable(key: tuple[str, torch.dtype], views: list[torch.Tensor]) -> bool:
    return (
        key[0] == "cpu"
        and key[1] in _NUMPY_DTYPES
        and all(type(view) is torch.Tensor and not (view.is_neg() or view.is_conj()) for view in views)
    )


def _read(views: _Views) -> torch.Tensor | bytes:
    """The sampled values, copied: the bytes of NumPy views, or a tensor."""
    if isinstance(views[0], np.ndarray):
        return np.concatenate(views).tobytes()
    return torch.cat(views)  # type: ignore[arg-type]


def _same(values: torch.Tensor | bytes, reference: torch.Tensor | bytes) -> bool:
    # bit for bit (a NaN equals itself, -0.0 differs from 0.0: what a frozen graph holds): bytes, or tensors as bytes
    if isinstance(values, bytes):
        return values == reference
    return torch.equal(values.view(torch.uint8), reference.view(torch.uint8))  # type: ignore[union-attr]


# attribute values compared by value (floats by their text, so that a NaN equals itself); any other attribute is
# compared by identity (the object it names)
_VALUE_TYPES = (bool, int, str, bytes, type(None), torch.dtype, torch.device)
_EXACT_VALUE_TYPES = frozenset(_VALUE_TYPES)  # the fast path of the same rule (subclasses go through `_value`)


class ModuleState:
    """What a module tree's Python state was, besides its weights: every submodule (by identity, so that a replaced
    layer counts), its `training` flag and the plain attributes of each (`embed_scale`, `gradient_checkpointing`,
    a dropout's `p`; numbers, strings and flags by value, other objects by identity), and the model's config as a
    dict.

    A compiled graph was traced against these. Dynamo would guard each forward on them; the compiled engine drops
    those guards on modules (measured: ~0.3 ms of each ~5 ms call of `marian-base-en-de` on the 2-core EPYC) and
    compares this snapshot once per `generate` instead, where a change rebuilds the engine.

    Args:
        model (`torch.nn.Module`): the module tree a compiled graph was traced from.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.state = self._state(model)

    @staticmethod
    def _state(model: torch.nn.Module) -> tuple:
        # plain loops over each module's `__dict__`, the usual types looked up by exact type first: compared once
        # per compiled object and `generate`, this is ~0.4 ms for marian-base-en-de in int8 on the EPYC Zen 4
        # (generator expressions with an `isinstance` per attribute took 1.2 ms)
        modules = []
        for module in model.modules():
            entry: list = [id(module), module.training]
            for name, value in module.__dict__.items():
                if name[0] != "_":  # parameters, buffers, submodules and hooks: watched elsewhere
                    entry.append(name)
                    entry.append(value if type(value) in _EXACT_VALUE_TYPES else _value(value))
            modules.append(tuple(entry))
        config = getattr(model, "config", None)
        return tuple(modules), None if config is None else repr(config.to_dict())

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s modules, flags, plain attributes and config are still those of the snapshot."""
        return self._state(model) == self.state


def _value(value: object) -> object:
    if isinstance(value, float):
        return repr(value)
    return value if isinstance(value, _VALUE_TYPES) else (type(value), id(value))

"""What a set of tensors was, to tell later whether any of them changed: the one check behind the compiled engine's
stale-graph test ([`hf_blockwise.engine.WeightsSnapshot`]) and the int8 layers' requantization
([`hf_blockwise.quantization.refresh_int8`])."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# one element in this many of every tensor is compared by value (a prime, so that the sample does not line up with
# rows or columns of any usual width)
SAMPLE_STEP = 1021


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
        self.samples = self._sample_views(tensors)  # dtype -> views into the tensors
        self.reference = {dtype: torch.cat(views) for dtype, views in self.samples.items()}  # copies

    @staticmethod
    def _identity(tensors: Sequence[torch.Tensor | None]) -> tuple[tuple[int, int] | None, ...]:
        return tuple(
            None if tensor is None else (tensor.data_ptr(), 0 if tensor.is_inference() else tensor._version)
            for tensor in tensors
        )

    @staticmethod
    def _sample_views(tensors: Sequence[torch.Tensor | None]) -> dict[torch.dtype, list[torch.Tensor]]:
        views: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            if tensor is None or tensor.numel() == 0 or tensor.is_meta:
                continue
            count = -(-tensor.numel() // SAMPLE_STEP)
            # (count,): elements 0, step, 2 step, ... of the tensor's span of its storage; a view, not a copy
            view = tensor.detach().as_strided((count,), (SAMPLE_STEP,), tensor.storage_offset())
            views.setdefault(tensor.dtype, []).append(view)
        return views

    def matches(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether `tensors` are still those of the snapshot: the same storages, versions and sampled values."""
        if self._identity(tensors) != self.identity:
            return False
        return all(torch.equal(torch.cat(views), self.reference[dtype]) for dtype, views in self.samples.items())

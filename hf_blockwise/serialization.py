"""Persistence: atomic file writes, so that an interrupted save never leaves a half-written checkpoint behind; the
one way an adapter (proposal heads, a feature drafter, a NAR drafter) is saved and loaded, as PEFT does it: a small
JSON config naming its base beside safetensors of only the adapter's own weights; and the JSON round trip of the
package's config dataclasses."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Calls `write(tmp_path)` on a temporary file beside `path`, then renames it over `path`.

    The rename is atomic on POSIX and Windows, so readers see either the old file or the complete new one.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(handle)
    try:
        write(tmp_path)
        os.chmod(tmp_path, 0o666 & ~_current_umask())  # mkstemp creates 0600; give the usual permissions
        os.replace(tmp_path, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    def write(tmp_path: str) -> None:
        with open(tmp_path, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    atomic_write(path, write)


def save_adapter(
    save_directory: str | os.PathLike,
    config: JsonConfigMixin,
    weights_name: str | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
    write_beside: Sequence[Callable[[str], None]] = (),
) -> None:
    """Saves an adapter as PEFT does: `config` (its `file_name`, naming the base) and the adapter's own weights only.

    Every file is first written into a staging directory inside `save_directory`; only once all of them are
    complete are they moved into place, each with an atomic rename and the config last. A save that fails or is
    interrupted while writing thus leaves the directory as it was (the staging directory is removed), and a config
    in place always comes with complete weights. Other files of `save_directory` (a base model saved there, a
    tokenizer, a `Trainer`'s optimizer state) are left alone.

    Args:
        save_directory: where to write; created if needed.
        config ([`JsonConfigMixin`]): written as `config.file_name`.
        weights_name (`str`, *optional*): file name of the safetensors of `tensors`.
        tensors (`Mapping[str, torch.Tensor]`, *optional*): the weights to store, e.g. `module.state_dict()`.
        dtype (`torch.dtype`, *optional*): store floating-point tensors in this dtype (e.g. `torch.float16`).
        metadata (`Mapping[str, str]`, *optional*): the safetensors header's metadata, e.g. `{"format": "pt"}`.
        write_beside: functions called with the staging directory that write more files there (PEFT's own
            adapter files, a whole transformers model); staged and moved like the rest.
    """
    if (weights_name is None) != (tensors is None):
        raise ValueError("save_adapter takes weights_name and tensors together (or neither)")
    save_directory = os.fspath(save_directory)
    os.makedirs(save_directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".staging-", dir=save_directory) as staging:
        if tensors is not None:
            stored = {name: _storable(tensor, dtype) for name, tensor in tensors.items()}
            save_file(
                stored, os.path.join(staging, weights_name), metadata=None if metadata is None else dict(metadata)
            )
        for write in write_beside:
            write(staging)
        atomic_write_text(os.path.join(staging, config.file_name), config.to_json_string())
        names = [*sorted(name for name in os.listdir(staging) if name != config.file_name), config.file_name]
        for name in names:
            staged = os.path.join(staging, name)
            if os.path.isfile(staged):  # safetensors writes 0600; give the usual permissions, as `atomic_write` does
                os.chmod(staged, 0o666 & ~_current_umask())
            os.replace(staged, os.path.join(save_directory, name))


def _storable(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous CPU copy, in `dtype` when floating point; a copy, as safetensors refuses tensors that share
    memory (tied weights)."""
    stored = tensor.detach().to(dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
    return stored.contiguous().cpu().clone()


def read_adapter_weights(
    path: str,
    expected: Mapping[str, torch.Tensor],
    what: str,
    base_weights: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Reads the safetensors file `path` of an adapter and checks it against the tensors it is to replace.

    Without `base_weights`, the file must hold exactly the `expected` names with their shapes. With them (an
    adapter saved relative to its base: only the weights that differ are stored), the base provides each expected
    tensor the file does not hold.

    Args:
        path (`str`): the local safetensors file.
        expected (`Mapping[str, torch.Tensor]`): the tensors to be loaded into, e.g. `module.state_dict()`.
        what (`str`): what the weights are, for the errors, e.g. `"Head"`.
        base_weights (`Mapping[str, torch.Tensor]`, *optional*): the base's tensors, e.g. `base.state_dict()`.

    Returns:
        `dict[str, torch.Tensor]`: a tensor for every expected name, ready for `load_state_dict`.

    Raises:
        `ValueError` naming the file: it cannot be read (corrupt or truncated), or it lacks expected tensors, holds
        unexpected ones or tensors of other shapes; with a base, a tensor neither provides points at the wrong base.
    """
    try:
        found = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"Cannot read {what.lower()} weights from {path}: {error}. The file is corrupt or truncated"
        ) from error
    base = {
        name: tensor
        for name, tensor in (base_weights or {}).items()
        if name in expected and name not in found and tensor.shape == expected[name].shape
    }
    problems = _weight_problems(found, expected, base)
    if problems:
        hint = ": the wrong base, or a corrupt file?" if base_weights is not None else ""
        raise ValueError(f"{what} weights in {path} do not match the config{hint} " + "; ".join(problems))
    return {**base, **found}


def _weight_problems(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> list[str]:
    """What keeps `found` (plus `base`) from being loaded in place of `expected`: missing, unexpected and misshaped
    tensors, by name."""
    missing = sorted(set(expected) - set(found) - set(base))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [
        f"{name}: expected {tuple(expected[name].shape)}, found {tuple(tensor.shape)}"
        for name, tensor in sorted(found.items())
        if name in expected and tensor.shape != expected[name].shape
    ]
    problems = [f"missing {missing}"] if missing else []
    problems += [f"unexpected {unexpected}"] if unexpected else []
    return problems + ([f"other shapes ({'; '.join(misshaped)})"] if misshaped else [])


def load_adapter_weights(
    path: str, module: nn.Module, what: str, base_weights: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Loads the adapter weights in the safetensors file `path` into `module`, checked by [`read_adapter_weights`]
    against the module's own tensors (`base_weights`: the base provides what the file does not hold)."""
    module.load_state_dict(read_adapter_weights(path, module.state_dict(), what, base_weights))


class JsonConfigMixin:
    """JSON round trip of a config dataclass: unknown keys and corrupt files are errors, writes are atomic."""

    file_name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown {cls.__name__} keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Writes the config file into `save_directory` atomically and returns its path."""
        path = os.path.join(save_directory, self.file_name)
        atomic_write_text(path, self.to_json_string())
        return path

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> Self:
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); the checkpoint is corrupt") from error
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ValueError as error:  # a field of the wrong type or range: which file holds it
            raise ValueError(f"{path}: {error}") from error

"""Atomic file writes, so that an interrupted save never leaves a half-written checkpoint behind, the checked
loading of an adapter's weights, and the JSON round trip of the package's config dataclasses."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, ClassVar

from safetensors import SafetensorError
from safetensors.torch import load_file
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


def load_checked_weights(path: str, module: nn.Module, what: str) -> None:
    """Loads the safetensors file `path` into `module`, with a `ValueError` naming the file when it cannot be read
    or its tensors are not the module's (names and shapes), e.g. `what="Head"` for proposal heads."""
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"Cannot read {what.lower()} weights from {path}: {error}. The file is corrupt or truncated"
        ) from error
    expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if found != expected:
        raise ValueError(f"{what} weights in {path} do not match the config: expected {expected}, found {found}")
    module.load_state_dict(tensors)


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
        return cls.from_dict(data)

"""Atomic file writes, so that an interrupted save never leaves a half-written checkpoint behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import suppress


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

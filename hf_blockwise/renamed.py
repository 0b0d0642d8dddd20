"""Names kept for one release after a rename: the old name still works, with a `FutureWarning` naming the new one."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed_names(module: str, namespace: Mapping[str, Any], renames: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) that serves each old name of `renames` (old -> new) as the object now
    called the new name in `namespace` (the module's `globals()`), with a `FutureWarning`.

    Example: `__getattr__ = renamed_names(__name__, globals(), {"BlockwiseConfig": "BlockwiseHeadsConfig"})`.
    """

    def __getattr__(name: str) -> Any:
        if name not in renames:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{name} is now {renames[name]}; the old name will be removed in the next release",
            FutureWarning,
            stacklevel=_callers_level(),
        )
        return namespace[renames[name]]

    return __getattr__


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_renamed_module(old: str, new: str) -> None:
    """The `FutureWarning` of a module kept under its old name `old` for one release (now `new`), pointing at the
    user's import."""
    warnings.warn(
        f"{old} is now {new}; the old module will be removed in the next release",
        FutureWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The `stacklevel` of the first frame outside hf_blockwise and the import machinery: the user's line that
    named the old name, whether directly (`module.OldName`), through the package's lazy `__getattr__` (`from
    hf_blockwise import OldName`) or by importing an old module (`importlib.import_module` included).
    `warnings.warn` does not count importlib's bootstrap frames, nor does this."""
    frame, level = sys._getframe(2), 2  # the frame that called `__getattr__`, or the old module's
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if not (os.path.abspath(name).startswith(_PACKAGE) or name == importlib.__file__):
            break
        frame, level = frame.f_back, level + 1
    return level

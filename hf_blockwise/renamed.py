"""Names kept for one release after a rename: the old name still works, with a `FutureWarning` naming the new one."""

from __future__ import annotations

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
            stacklevel=2,
        )
        return namespace[renames[name]]

    return __getattr__

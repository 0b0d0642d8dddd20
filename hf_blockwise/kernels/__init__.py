"""Kernels of hf_blockwise's own, compiled on the user's machine the first time they are needed.

`int8`: exact int8 matrix products on weights packed once for AVX-512 VNNI ([`hf_blockwise.kernels.int8`]).
"""

from __future__ import annotations

import shutil

_CPP_COMPILERS = ("g++", "c++", "clang++")


def cpp_compiler() -> str | None:
    """The path of the first C++ compiler on `PATH` (g++, c++ or clang++), or `None`: what inductor needs on CPU
    and what builds these kernels."""
    return next((found for name in _CPP_COMPILERS if (found := shutil.which(name))), None)

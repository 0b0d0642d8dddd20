"""Exact int8 products on weights packed once, for AVX-512 VNNI and for AVX2: `torch.ops.hf_blockwise.int8_mm` and
`int8_mm_avx2`.

`torch._int_mm` on CPU calls oneDNN's s8s8s32 GEMM with the weight unpacked, so every call reorders the weight and
sums its columns again: 14-23 us for a 512x512 product of 1-8 rows and 0.6 ms for `marian-base-en-de`'s 512x16,000
output projection (2-core Zen 4 EPYC, 2 threads), against 8-12 us and 0.15 ms here; on a CPU without VNNI it is
slower still (0.4-0.8 GMAC/s on the 2-core Zen 3: an int8 model ran ~7x slower than in float32). `int8_vnni.cpp`
(beside this file) keeps the weight in `vpdpbusd`'s layout and its column sums, made once when a layer is quantized;
a call only streams the weight. Its int32 sums are exact, so they are the very integers `torch._int_mm` computes:
which path a layer uses changes its speed, never a bit of its output (`tests/test_int8_kernel.py` checks
`torch.equal` against `torch._int_mm` on each path this CPU runs). Eager int8 layers on a packed weight call
`hf_blockwise::int8_linear` (`int8_linear_avx2`) instead ([`int8_linear`]): the rows' quantization, the product and
the scaling in one call, computing the bits of [`hf_blockwise.quantization.int8_linear_steps`] (the library is built
with `-ffp-contract=off`, so no product and sum become a fused multiply-add).

The kernel is compiled with the machine's C++ compiler the first time an int8 layer is made (~15 s, once: the
library is kept under `$HF_BLOCKWISE_CACHE`, by default `~/.cache/hf_blockwise`, keyed by the source, torch's
version and the compiler). [`kernel_path`] says which path int8 products take now: `"avx512_vnni"` where the CPU has
AVX-512 VNNI (Zen 4 and 5 EPYCs, Cascade Lake and later Xeons), else `"avx2"` (Zen 3, Intel client CPUs), else (no
AVX2, no C++ compiler, aarch64) `"int_mm"`, `torch._int_mm` (a build that fails warns, naming why).
`HF_BLOCKWISE_INT8_KERNEL` chooses: `avx512_vnni`, `avx2`, or `0` for `torch._int_mm` (a path this CPU cannot run is
an error, never a quiet substitute).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.utils.cpp_extension

from hf_blockwise.kernels import cpp_compiler

try:
    import fcntl  # the build's lock (Linux, macOS)
except ImportError:  # Windows: no g++/clang++ build here either (`_loaded` finds no such compiler first)
    fcntl = None

_SOURCE = Path(__file__).with_name("int8_vnni.cpp")
_COLUMNS = 64  # output columns of one packed block (int8_vnni.cpp's kColumns)
MAX_FEATURES = 65536  # int8_vnni.cpp's kMaxFeatures: its running int32 sums stay exact up to this many inputs
_ENVIRONMENT = "HF_BLOCKWISE_INT8_KERNEL"


PATHS = ("avx512_vnni", "avx2", "int_mm")


def kernel_path() -> str:
    """The path int8 products take now (layers made now are packed for it unless it is `"int_mm"`): one of
    [`PATHS`], the fastest this CPU runs, or the one `HF_BLOCKWISE_INT8_KERNEL` names (`0` for `"int_mm"`).

    Raises:
        `ValueError`: `HF_BLOCKWISE_INT8_KERNEL` names an unknown path, or one this machine cannot run.
    """
    return _path_named(os.environ.get(_ENVIRONMENT, ""))


@functools.cache  # eager int8 layers ask at every product
def _path_named(chosen: str) -> str:
    if chosen in ("0", "int_mm"):
        return "int_mm"
    runs = _paths_this_cpu_runs()
    if chosen in ("", "1", "auto"):
        return runs[0]
    if chosen not in PATHS:
        raise ValueError(f"{_ENVIRONMENT}={chosen!r}: expected one of {', '.join(PATHS)}, 0 or auto")
    if chosen not in runs:
        raise ValueError(
            f"{_ENVIRONMENT}={chosen}, but this machine runs only {', '.join(runs)} (its CPU's instruction sets, "
            "and a C++ compiler to build the kernel)"
        )
    return chosen


def available() -> bool:
    """Whether int8 layers made now use hf_blockwise's packed kernel ([`kernel_path`] is not `"int_mm"`)."""
    return kernel_path() != "int_mm"


@functools.cache
def _paths_this_cpu_runs() -> tuple[str, ...]:
    packed = ("avx512_vnni",) if torch.cpu._is_vnni_supported() else ()
    packed += ("avx2",) if torch.cpu._is_avx2_supported() else ()
    return (*packed, "int_mm") if packed and _loaded() else ("int_mm",)


@functools.cache
def _loaded() -> bool:
    compiler = cpp_compiler()
    if compiler is None:
        return False  # no compiler: inductor cannot compile either, and int8 products stay on torch._int_mm
    try:
        torch.ops.load_library(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr[-2000:] if isinstance(error, subprocess.CalledProcessError) else str(error)
        warnings.warn(
            f"hf_blockwise could not build its int8 kernel with {compiler}; int8 products run on torch._int_mm "
            f"instead (the same integers, slower):\n{detail}",
            stacklevel=3,
        )
        return False
    for name in ("int8_mm", "int8_mm_avx2"):
        torch.library.register_fake(f"hf_blockwise::{name}")(_int8_mm_shape)
    for name in ("int8_linear", "int8_linear_avx2"):
        torch.library.register_fake(f"hf_blockwise::{name}")(_int8_linear_shape)
    return True


def _int8_mm_shape(rows: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, out_features: int) -> torch.Tensor:
    # what the operator returns, for torch.compile's tracing
    return rows.new_empty((rows.shape[0], out_features), dtype=torch.int32)


def _int8_linear_shape(
    inputs: torch.Tensor,
    packed: torch.Tensor,
    offsets: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return inputs.new_empty((inputs.shape[0], weight_scale.shape[0]))


def _build(compiler: str) -> Path:
    """The kernel's shared library, compiled once into the cache (written to a temporary name, then renamed, so a
    build killed half-way or two processes building at once never leave a half-written library)."""
    flags = [
        "-O3", "-shared", "-fPIC", "-std=c++20", "-fopenmp", "-w", "-ffp-contract=off",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in torch.utils.cpp_extension.include_paths()),
    ]  # fmt: skip
    libraries = [*(f"-L{path}" for path in torch.utils.cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), compiler.encode(), *map(str.encode, flags)]))
    root = Path(
        os.environ.get("HF_BLOCKWISE_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_blockwise"
    )
    library = root / "kernels" / f"int8_vnni-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        # one build at a time on this machine (test workers, a notebook beside a script): a process that waited
        # finds the library built
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            descriptor, temporary = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
            os.close(descriptor)
            try:
                command = [compiler, *flags, str(_SOURCE), "-o", temporary, *libraries]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(temporary, library)
            finally:
                Path(temporary).unlink(missing_ok=True)
    return library


def takes(in_features: int) -> bool:
    """Whether the kernel takes a weight of `in_features` inputs: a multiple of 4 (it reads inputs in fours), at
    most [`MAX_FEATURES`] (its int32 sums stay exact)."""
    return in_features % 4 == 0 and in_features <= MAX_FEATURES


def pack(weight_int8_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight laid out for the kernel, and its column sums times 128.

    Args:
        weight_int8_t (`torch.CharTensor` of shape `(in_features, out_features)`): `torch._int_mm`'s layout;
            `in_features` one the kernel [`takes`].

    Returns:
        packed (`torch.CharTensor` of shape `(ceil(out_features / 64), in_features / 4, 64, 4)`): 64 output columns
        at a time, 4 inputs of a column together (zeros past `out_features`); offsets (`torch.IntTensor` of shape
        `(64 * ceil(out_features / 64),)`): `128 * weight_int8_t.sum(0)`, what feeding rows as unsigned bytes adds.
    """
    features, outputs = weight_int8_t.shape
    if not takes(features):
        raise ValueError(
            f"the int8 kernel takes in_features that are a multiple of 4, at most {MAX_FEATURES}, not {features}"
        )
    blocks = -(-outputs // _COLUMNS)
    padded = torch.zeros(features, blocks * _COLUMNS, dtype=torch.int8)
    padded[:, :outputs] = weight_int8_t
    # (in, blocks * 64) -> (blocks, in / 4, 64, 4)
    packed = padded.view(features // 4, 4, blocks, _COLUMNS).permute(2, 0, 3, 1).contiguous()
    offsets = padded.sum(0, dtype=torch.int32).mul_(128)
    return packed, offsets


def int8_mm(rows: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, out_features: int) -> torch.Tensor:
    """`torch._int_mm(rows, weight_int8_t)` on the packed weight: the same int32 integers.

    Args:
        rows (`torch.CharTensor` of shape `(N, in_features)`): the quantized inputs, one row per token.
        packed, offsets: [`pack`]'s.
        out_features (`int`): the weight's outputs (the packed blocks hold up to 63 columns of padding).

    Returns:
        `torch.IntTensor` of shape `(N, out_features)`.
    """
    product = torch.ops.hf_blockwise.int8_mm_avx2 if _packed_path() == "avx2" else torch.ops.hf_blockwise.int8_mm
    return product(rows, packed, offsets, out_features)


def int8_linear(
    inputs: torch.Tensor,
    packed: torch.Tensor,
    offsets: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """[`hf_blockwise.quantization.int8_linear`] on a packed weight in one call: the rows quantized, multiplied and
    scaled by the same float32 operations in the same order, so the same bits, in one dispatch instead of ~8 (a row
    holding a NaN gives NaN outputs, as the torch steps do).

    Args:
        inputs (`torch.FloatTensor` of shape `(N, in_features)`).
        packed, offsets: [`pack`]'s.
        weight_scale (`torch.FloatTensor` of shape `(out_features,)`), bias (`torch.FloatTensor` of shape
            `(out_features,)`, *optional*).

    Returns:
        `torch.FloatTensor` of shape `(N, out_features)`.
    """
    linear = torch.ops.hf_blockwise.int8_linear_avx2 if _packed_path() == "avx2" else torch.ops.hf_blockwise.int8_linear
    return linear(inputs, packed, offsets, weight_scale, bias)


@torch.compiler.assume_constant_result
def _packed_path() -> str:
    """The packed path a product on a packed weight takes: [`kernel_path`]'s, or with `HF_BLOCKWISE_INT8_KERNEL=0`
    (layers packed earlier) this CPU's fastest; read when a graph is traced (the paths compute the same integers)."""
    path = kernel_path()
    return path if path != "int_mm" else _paths_this_cpu_runs()[0]

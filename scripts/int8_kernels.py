"""Candidate int8 matrix-product kernels for exact (batch-invariant) int8 decoding, timed against float32.

For each shape of `marian-base-en-de`'s decoder (output projection 512→16000, FFN 512→2048 and 2048→512,
attention 512→512) and 1, 2, 4, 8, 16 rows: ms per call of float32 `nn.Linear`, fbgemm's dynamic int8 (one scale
per tensor: not batch-invariant), fbgemm fed one scale per row, oneDNN's `qlinear_pointwise` fed one scale per row
(the kernel `hf_blockwise.quantization` used before), and `torch._int_mm` (the one it uses); then whether
16 rows scored together give exactly what each row gives alone (`inv`), and the largest difference from float32.

    python scripts/int8_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

SHAPES = ((512, 16000), (512, 2048), (2048, 512), (512, 512))
ROWS = (1, 2, 4, 8, 16)


def per_row(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row rounded to integers in [-127, 127] with its own scale: (integers as floats, scales)."""
    scale = inputs.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127.0
    return torch.round(inputs / scale), scale


def kernels(n_in: int, n_out: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    linear = torch.nn.Linear(n_in, n_out).requires_grad_(False)
    weight, bias = linear.weight, linear.bias
    scale = weight.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    weight_int8 = torch.round(weight / scale[:, None]).to(torch.int8)
    with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepacking still needs one
        warnings.simplefilter("ignore")
        zeros = torch.zeros(n_out, dtype=torch.long)
        quantized = torch._make_per_channel_quantized_tensor(weight_int8, scale.double(), zeros, 0)
    fbgemm = torch.ops.quantized.linear_prepack(quantized, None)
    onednn = torch.ops.onednn.qlinear_prepack(weight_int8, [1, n_in])
    transposed = weight_int8.t().contiguous()

    def fbgemm_rows(inputs):
        integers, row_scale = per_row(inputs)
        products = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(integers, 1.0, 128, fbgemm)
        return products * row_scale + bias

    def onednn_rows(inputs):
        integers, row_scale = per_row(inputs)
        products = torch.ops.onednn.qlinear_pointwise(
            (integers + 128).to(torch.uint8), 1.0, 128, onednn, scale, zeros, None, 1.0, 0, torch.float32, "none",
            [], "",
        )  # fmt: skip
        return products * row_scale + bias

    def int_mm(inputs):
        integers, row_scale = per_row(inputs)
        return torch._int_mm(integers.to(torch.int8), transposed) * (row_scale * scale) + bias

    return {
        "float32": linear,
        "fbgemm dynamic (per tensor)": lambda inputs: torch.ops.quantized.linear_dynamic(inputs, fbgemm, True),
        "fbgemm, per-row scales": fbgemm_rows,
        "oneDNN, per-row scales": onednn_rows,
        "torch._int_mm": int_mm,
    }


def milliseconds(function: Callable[[torch.Tensor], torch.Tensor], rows: int, n_in: int, repeats: int) -> float:
    inputs = torch.randn(rows, n_in)
    for _ in range(5):
        function(inputs)
    started = time.perf_counter()
    for _ in range(repeats):
        function(inputs)
    return 1000 * (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"ms per call by rows ({', '.join(map(str, ROWS))}), {args.threads} threads")
    with torch.no_grad():
        for n_in, n_out in SHAPES:
            print(f"\n{n_in}->{n_out}")
            table = kernels(n_in, n_out)
            for name, function in table.items():
                times = [milliseconds(function, rows, n_in, 20 if n_out > 4000 else 100) for rows in ROWS]
                inputs = torch.randn(16, n_in) * torch.rand(16, 1) * 3
                alone = torch.cat([function(inputs[i : i + 1]) for i in range(16)])
                invariant = torch.equal(function(inputs), alone)
                error = (function(inputs) - table["float32"](inputs)).abs().max().item()
                row = " ".join(f"{value:7.3f}" for value in times)
                print(f"{name:28s} {row}  inv={invariant} max|diff from float32|={error:.3f}")


if __name__ == "__main__":
    main()

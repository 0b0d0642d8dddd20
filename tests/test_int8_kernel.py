"""hf_blockwise's int8 kernel (`hf_blockwise/kernels/`): on a CPU with AVX-512 VNNI or AVX2, int8 layers multiply on
weights packed once, and the products are the very integers `torch._int_mm` computes on every path this CPU runs, at
every row count and shape (ragged column blocks, one row, rows in fours and not, the int8 extremes); a model decodes
the same bits with the kernel as without it; `HF_BLOCKWISE_INT8_KERNEL` picks a path, and one this CPU cannot run is
an error; turned off, layers keep `torch._int_mm`'s layout; a build that fails warns and leaves `torch._int_mm`."""

from __future__ import annotations

import subprocess
import warnings

import pytest
import torch
from conftest import build_model, random_batch

from hf_blockwise import quantization, quantize_dynamic_int8
from hf_blockwise.engine import CompiledModule, CompileOptions
from hf_blockwise.kernels import int8 as int8_kernel
from hf_blockwise.quantization import Int8Linear

CPU_RUNS = {"avx512_vnni": torch.cpu._is_vnni_supported(), "avx2": torch.cpu._is_avx2_supported()}
packed_path = pytest.mark.parametrize(
    "path",
    [
        pytest.param(path, marks=pytest.mark.skipif(not runs, reason=f"this CPU has no {path}"))
        for path, runs in CPU_RUNS.items()
    ],
)


@pytest.fixture
def on_path(monkeypatch):
    """Sets `HF_BLOCKWISE_INT8_KERNEL` to a packed path (the test's `path`) and checks that products take it."""

    def choose(path: str) -> None:
        monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", path)
        assert int8_kernel.kernel_path() == path and int8_kernel.available()

    return choose


@packed_path
@pytest.mark.parametrize(("features", "outputs"), [(4, 1), (8, 64), (64, 65), (36, 200), (512, 100), (2048, 130)])
def test_the_kernel_computes_int_mms_integers(on_path, path: str, features: int, outputs: int) -> None:
    on_path(path)
    generator = torch.Generator().manual_seed(features * outputs)
    weight = torch.randint(-128, 128, (features, outputs), dtype=torch.int8, generator=generator)
    weight[0] = 127  # the extremes, where a saturating product would show
    weight[-1] = -128
    packed, offsets = int8_kernel.pack(weight)
    assert packed.shape == (-(-outputs // 64), features // 4, 64, 4) and offsets.dtype == torch.int32
    for count in (1, 2, 3, 4, 5, 9, 17):
        rows = torch.randint(-128, 128, (count, features), dtype=torch.int8, generator=generator)
        rows[0] = -128
        assert torch.equal(int8_kernel.int8_mm(rows, packed, offsets, outputs), torch._int_mm(rows, weight))


@packed_path
def test_the_kernel_refuses_what_does_not_fit_it(on_path, path: str) -> None:
    on_path(path)
    packed, offsets = int8_kernel.pack(torch.ones(8, 70, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="rows of 12 features against a weight of 8"):
        int8_kernel.int8_mm(torch.ones(2, 12, dtype=torch.int8), packed, offsets, 70)
    with pytest.raises(RuntimeError, match="200 outputs do not fit 2 blocks"):
        int8_kernel.int8_mm(torch.ones(2, 8, dtype=torch.int8), packed, offsets, 200)
    with pytest.raises(ValueError, match="multiple of 4, at most 65536, not 6"):
        int8_kernel.pack(torch.ones(6, 70, dtype=torch.int8))
    rows = int8_kernel.MAX_FEATURES + 4  # where an int32 running sum could wrap: refused, never computed
    with pytest.raises(RuntimeError, match=f"{rows} features; at most 65536"):
        int8_kernel.int8_mm(torch.ones(1, rows, dtype=torch.int8), torch.zeros(1, rows // 4, 64, 4, dtype=torch.int8),
                            torch.zeros(64, dtype=torch.int32), 64)  # fmt: skip


def test_a_model_decodes_the_same_bits_with_the_kernel_as_with_int_mm(monkeypatch) -> None:
    """Where the kernel runs, every layer whose inputs come in fours is packed; turned off, none is; the logits and
    greedy outputs are equal bit for bit (on a CPU without AVX2 both models use `torch._int_mm`)."""
    models, kernel = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", setting)
        kernel[setting] = int8_kernel.available()
        models[setting] = quantize_dynamic_int8(build_model("bart", seed=2))
    assert kernel == {"1": any(CPU_RUNS.values()), "0": False}
    layers = {setting: [m for m in model.modules() if isinstance(m, Int8Linear)] for setting, model in models.items()}
    assert layers["0"] and all(layer.weight_offsets is None for layer in layers["0"])
    assert all((layer.weight_offsets is not None) == kernel["1"] for layer in layers["1"])
    batch = random_batch(models["0"], 3, seed=4)
    with torch.no_grad():
        logits = [model(**batch, decoder_input_ids=batch["input_ids"][:, :5]).logits for model in models.values()]
        outputs = [
            model.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=12) for model in models.values()
        ]
    assert torch.equal(*logits) and torch.equal(*outputs)


@packed_path
def test_a_requantized_layer_stays_packed_and_follows_its_weights(on_path, path: str) -> None:
    on_path(path)
    linear = torch.nn.Linear(16, 70)
    layer = Int8Linear(linear)
    with torch.no_grad():
        linear.weight.mul_(-2)
    layer.requantize()
    fresh = Int8Linear(linear)  # made from the weights as they are now
    assert layer.weight_offsets is not None and torch.equal(layer.weight_int8, fresh.weight_int8)
    assert torch.equal(layer.weight_offsets, fresh.weight_offsets)
    rows = torch.randn(3, 16)
    assert torch.equal(layer(rows), fresh(rows))


@packed_path
@pytest.mark.parametrize(("features", "outputs"), [(4, 1), (36, 200), (512, 512), (2048, 130)])
def test_the_one_call_layer_computes_the_bits_of_the_torch_steps(
    on_path, path: str, features: int, outputs: int
) -> None:
    """Eager int8 layers on a packed weight run `int8_linear` in one call of the kernel's library: its outputs equal
    the torch operations' (what a compiled graph traces) bit for bit, with and without bias, at every row count,
    for rows of zeros (the scale's floor), rows whose features are not a multiple of 16 and values at the int8
    scale's rounding edges."""
    on_path(path)
    generator = torch.Generator().manual_seed(features + outputs)
    linear = torch.nn.Linear(features, outputs)
    weight_int8_t, weight_scale, bias = quantization._quantized(linear.weight, linear.bias)
    packed, offsets = int8_kernel.pack(weight_int8_t)
    for count in (0, 1, 2, 3, 4, 5, 9, 17):
        inputs = torch.randn(count, features, generator=generator) * 4
        if count > 1:
            inputs[1] = 0.0
        if count > 2:  # halves of the scale: ties that round to even
            inputs[2] = torch.arange(features) % 255 - 127.0
            inputs[2, 0] = 254.0
        for with_bias in (bias, None):
            fused = int8_kernel.int8_linear(inputs, packed, offsets, weight_scale, with_bias)
            steps = quantization.int8_linear_steps(inputs, packed, offsets, weight_scale, with_bias)
            assert torch.equal(fused, steps), (count, with_bias is None)
        strided = (inputs.t().contiguous().t(), weight_scale.repeat_interleave(2)[::2], bias.repeat_interleave(2)[::2])
        assert torch.equal(
            int8_kernel.int8_linear(strided[0], packed, offsets, *strided[1:]),
            quantization.int8_linear_steps(inputs, packed, offsets, weight_scale, bias),
        )
    poisoned = torch.randn(3, features, generator=generator)
    poisoned[1, -1] = float("nan")  # the last feature: past the 16-wide lanes where features are not a multiple
    poisoned[2, 0] = float("nan")
    for outputs_of in (int8_kernel.int8_linear, quantization.int8_linear_steps):
        result = outputs_of(poisoned, packed, offsets, weight_scale, bias)
        assert result[1:].isnan().all() and not result[0].isnan().any()  # NaN kept, never a finite output
    with pytest.raises(RuntimeError, match="bias must be a float32 tensor of"):
        int8_kernel.int8_linear(inputs, packed, offsets, weight_scale, bias[:-1])


def test_the_path_is_the_fastest_this_cpu_runs_or_the_one_named(monkeypatch) -> None:
    runs = [path for path, runs in CPU_RUNS.items() if runs]
    monkeypatch.delenv("HF_BLOCKWISE_INT8_KERNEL", raising=False)
    assert int8_kernel.kernel_path() == (runs[0] if runs else "int_mm")
    monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", "0")
    assert int8_kernel.kernel_path() == "int_mm" and not int8_kernel.available()
    for path in ("avx512_vnni", "avx2"):
        monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", path)
        if path in runs:
            assert int8_kernel.kernel_path() == path
        else:  # never a quiet substitute
            with pytest.raises(ValueError, match=f"HF_BLOCKWISE_INT8_KERNEL={path}, but this machine runs only"):
                int8_kernel.kernel_path()
    monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", "avx10")
    with pytest.raises(ValueError, match=r"'avx10': expected one of avx512_vnni, avx2, int_mm, 0 or auto"):
        int8_kernel.available()


def test_int8_on_int_mm_says_once_that_float32_is_faster(monkeypatch) -> None:
    monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", "0")
    quantization._warn_slow_int8.cache_clear()
    with pytest.warns(quantization.Int8SpeedWarning, match="torch._int_mm on this machine"):
        quantize_dynamic_int8(build_model("bart", seed=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", quantization.Int8SpeedWarning)
        quantize_dynamic_int8(build_model("bart", seed=3))  # once a process
        if any(CPU_RUNS.values()):
            quantization._warn_slow_int8.cache_clear()
            monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", "auto")
            quantize_dynamic_int8(build_model("bart", seed=4))  # a packed path: nothing to say


def test_a_failed_build_warns_and_leaves_int_mm(monkeypatch) -> None:
    def failing_build(compiler: str):
        raise subprocess.CalledProcessError(1, [compiler], stderr="int8_vnni.cpp:1: error: no such header")

    monkeypatch.setattr(int8_kernel, "_build", failing_build)
    with pytest.warns(UserWarning, match=r"could not build its int8 kernel(.|\n)*no such header"):
        assert int8_kernel._loaded.__wrapped__() is False


class _SharedRows(torch.nn.Module):
    """Three int8 linears on one input (a layer's q, k and v), one on other rows; with `write`, the input is written
    in place between the first and the second product, so that their rows differ."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.write = write
        self.q, self.k, self.v = (Int8Linear(torch.nn.Linear(64, width)) for width in (64, 100, 64))
        self.other = Int8Linear(torch.nn.Linear(64, 64))

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        states = inputs * 1.5
        query = self.q(states)
        if self.write:
            states.add_(1.0)
        return query, self.k(states), self.v(states), self.other(states * 2)


@pytest.mark.parametrize("kernel", ["avx512_vnni", "avx2", "0"])
def test_int8_products_that_take_the_same_rows_are_merged_with_the_same_bits(monkeypatch, kernel: str) -> None:
    """The engine's graph pass (`merged_products`) computes q, k and v as one product (on the VNNI kernel's packed
    weights, ragged widths included, or `torch._int_mm`'s): the outputs equal the eager layers' bit for bit, at 1-5
    rows; rows written in place between two products, or made otherwise, are never merged."""
    if kernel != "0" and not CPU_RUNS[kernel]:
        pytest.skip(f"this CPU has no {kernel}")
    monkeypatch.setenv("HF_BLOCKWISE_INT8_KERNEL", kernel)
    for write, merged in ((False, 2), (True, 0)):
        module = _SharedRows(write).eval()
        compiled = CompiledModule(module, CompileOptions(), owner=module)
        with torch.no_grad():
            for count in (1, 3, 5):
                inputs = torch.randn(count, 64)
                assert all(map(torch.equal, compiled(inputs), module(inputs))), (write, count)
        # two graphs: dynamo specializes one row
        assert [report.merged_int8 for report in compiled.graph_products] == [merged, merged]

"""int8 matrix products for CPU decoding (Devlin 2017, §3: low-precision arithmetic), batch-invariant and fast.

torch's own dynamic quantization scales a layer's input by its largest value over *all* the tokens of a call,
so a token's logits depend on which other tokens were scored with it: a verification pass that scores k
positions would round differently from greedy search's one position, and blockwise decoding would no longer
reproduce greedy decoding. [`Int8Linear`] scales each token (row) by its own largest value instead, so each row
is quantized the same whatever else is in the call, and multiplies in int32 arithmetic, which is exact (integer
sums do not depend on their order, so on how a kernel blocks the rows). The result of a row is then a fixed
function of that row.

The product runs in oneDNN's int8 kernel (`onednn::qlinear_pointwise`) over weights prepacked once, fed the
already-quantized rows as uint8 with scale 1 and zero point 128: the kernel's activation scale is per tensor, and
a scale of 1 over values that are already integers is lossless, so the per-row scales are applied to its float
output. Measured on the 2-core EPYC (1 thread; `scripts/int8_kernels.py`, `docs/results.md`): a 512→16000
projection costs 0.14 ms at 1 row and 0.16 ms at 4 (float32: 2.1-3.2 ms); `torch._int_mm` 0.27-0.29 ms; fbgemm fed
one scale per row 0.11-0.13 ms, but its prepacking needs quantized tensors, deprecated in this torch.

Only the integer product is an operator of its own (`torch.ops.hf_blockwise.int8_product`), opaque to
`torch.compile`; the rows' quantization and the result's scaling are plain torch operations, which the compiled
engine fuses with the layer norm before and the residual after, computing the same bits as eager decoding.

Quantizing changes the model, and so its greedy output (the benchmark reports the quality change); blockwise
decoding of the quantized model is then exact with respect to the quantized model's greedy decoding.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from hf_blockwise import boundary as hf

_INT8_MAX = 127.0
# uint8 zero point of the kernel's input: integer rows in [-127, 127] are stored as row + 128
_ZERO_POINT = 128
# oneDNN's weights prepacked once per int8 weight tensor (its layout for this CPU), with the tensor's version
# when packed: derived data, not state; a weight changed in place is packed again
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# A low-level operator definition: its dispatch costs ~4 us a call here, `torch.library.custom_op`'s ~20 us (a
# decoder step of marian-base-en-de makes 49 of these calls)
_LIBRARY = torch.library.Library("hf_blockwise", "DEF")
_LIBRARY.define(
    "int8_product(Tensor rows, Tensor weight_int8, Tensor weight_scale, Tensor weight_zero_points) -> Tensor"
)


def int8_kernel_available() -> bool:
    """Whether this torch has oneDNN's int8 linear kernel (x86 CPU builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def _packed(weight_int8: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked copy of `weight_int8` (`(out, in)` int8), packed on first use."""
    entry = _PACKED.get(weight_int8)
    if entry is None or entry[0] != weight_int8._version:
        entry = (weight_int8._version, torch.ops.onednn.qlinear_prepack(weight_int8, [1, weight_int8.shape[1]]))
        _PACKED[weight_int8] = entry
    return entry[1]


def int8_product(
    rows: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor, weight_zero_points: torch.Tensor
) -> torch.Tensor:
    """`weight_scale * (rows - 128) @ weight_int8.T`, the integer sums exact in int32 (the CPU kernel of
    `torch.ops.hf_blockwise.int8_product`, oneDNN's `qlinear_pointwise` over weights prepacked once).

    Args:
        rows (`torch.ByteTensor` of shape `(rows, in_features)`): quantized rows, stored as value + 128.
        weight_int8 (`torch.CharTensor` of shape `(out_features, in_features)`): per-output-channel quantized.
        weight_scale (`torch.FloatTensor` of shape `(out_features,)`).
        weight_zero_points (`torch.LongTensor` of shape `(out_features,)`): zeros (symmetric weights).

    Returns:
        `torch.FloatTensor` of shape `(rows, out_features)`.
    """
    return torch.ops.onednn.qlinear_pointwise(
        rows,
        1.0,
        _ZERO_POINT,
        _packed(weight_int8),
        weight_scale,
        weight_zero_points,
        None,
        1.0,
        0,
        torch.float32,
        "none",
        [],
        "",
    )  # fmt: skip


_LIBRARY.impl("int8_product", int8_product, "CPU")


@torch.library.register_fake("hf_blockwise::int8_product")
def _int8_product_shape(
    rows: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor, weight_zero_points: torch.Tensor
) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight_int8.shape[0], dtype=torch.float32)


def int8_linear(
    inputs: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_points: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`inputs @ dequantized(weight).T + bias`, each row of `inputs` quantized to int8 with its own scale.

    Only the integer product is an opaque operator ([`int8_product`]); quantizing the rows and scaling the result
    are plain torch operations, so that `torch.compile` fuses them with what precedes and follows them (one kernel
    instead of ~8 dispatches each). Every one of them is exact or correctly rounded elementwise (a maximum, IEEE
    division and rounding, a product, a sum; inductor compiles with `-fno-unsafe-math-optimizations` and no
    floating-point contraction), so eager and compiled calls compute the same bits.

    Args:
        inputs (`torch.FloatTensor` of shape `(rows, in_features)`).
        weight_int8 (`torch.CharTensor` of shape `(out_features, in_features)`): per-output-channel quantized.
        weight_scale (`torch.FloatTensor` of shape `(out_features,)`).
        weight_zero_points (`torch.LongTensor` of shape `(out_features,)`): zeros (symmetric weights).
        bias (`torch.FloatTensor` of shape `(out_features,)`, *optional*).

    Returns:
        `torch.FloatTensor` of shape `(rows, out_features)`.
    """
    # (N, 1): each row's largest magnitude maps to 127
    scale = torch.linalg.vector_norm(inputs, float("inf"), dim=1, keepdim=True)
    scale = scale.clamp_(min=torch.finfo(torch.float32).tiny).div_(_INT8_MAX)
    rows = inputs.div(scale).round_().add_(_ZERO_POINT).to(torch.uint8)  # (N, in), exact integers
    products = torch.ops.hf_blockwise.int8_product(rows, weight_int8, weight_scale, weight_zero_points)  # (N, out)
    # in place on tensors made here (eager allocates less; the compiled graph is functionalized either way)
    outputs = products.mul_(scale)
    return outputs if bias is None else outputs.add_(bias)


class Int8Linear(nn.Module):
    """A `nn.Linear` whose product runs in int8 with per-output-channel weight and per-token input scales.

    The float `weight` is kept (shared, not copied) for code that reads it, such as tied embeddings, a
    vocabulary shortlist's rows or dtype checks; only the int8 copy is used by `forward`.

    Args:
        linear (`nn.Linear`): the layer to replace, on the CPU.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not int8_kernel_available():
            raise RuntimeError(
                "int8 decoding here uses oneDNN's int8 kernel (`torch.ops.onednn.qlinear_pointwise`), which this "
                f"torch ({torch.__version__}) does not have; it ships with x86 CPU builds"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _INT8_MAX  # (out,)
        quantized = torch.round(weight / scale[:, None]).to(torch.int8)
        self.register_buffer("weight_int8", quantized, persistent=False)  # (out, in)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer("weight_zero_points", torch.zeros(scale.shape, dtype=torch.long), persistent=False)
        # the bias as a plain float tensor for the operator (a view of the parameter, not a copy)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias_float", bias, persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """
        Args:
            inputs (`torch.FloatTensor` of shape `(..., in_features)`).

        Returns:
            `torch.FloatTensor` of shape `(..., out_features)`.
        """
        rows = inputs.reshape(-1, self.in_features)  # (N, in)
        if rows.dtype != torch.float32:
            rows = rows.float()
        outputs = int8_linear(rows, self.weight_int8, self.weight_scale, self.weight_zero_points, self.bias_float)
        outputs = outputs.reshape(*inputs.shape[:-1], self.out_features)
        return outputs if inputs.dtype == torch.float32 else outputs.to(inputs.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears_int8(module: nn.Module) -> None:
    """Replaces every `nn.Linear` inside `module` by an [`Int8Linear`], in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))


class Int8StateDictWarning(UserWarning):
    """The state dict of an int8 model holds the float weights its int8 copies were made from."""


def _warn_float_state_dict(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, metadata: Any) -> None:
    # a state_dict post-hook on the quantized base: `save_pretrained` (and any checkpoint) takes this path
    warnings.warn(
        f"{type(module).__name__} was quantized to int8 by hf_blockwise; its state dict (what `save_pretrained` "
        "writes) holds the float weights the int8 copies were made from, so it loads back as a float model. Call "
        "`quantize_dynamic_int8(model)` after loading to get the same int8 model, bit for bit.",
        Int8StateDictWarning,
        stacklevel=3,
    )


def float_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` without the int8 save warning: for code that reads the float weights on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Int8StateDictWarning)
        return module.state_dict()


def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """Replaces every `nn.Linear` of the base model by an [`Int8Linear`], in place (CPU only).

    Args:
        model: a transformers seq2seq model, or a [`BlockwiseHeadsModel`] whose *base* is quantized. Its heads
            stay in full precision: they are small and only propose; their vocabulary projection is the base's
            output layer, quantized with the rest.

    Returns:
        The same `model`, for chaining. Its state dict, and so `save_pretrained`, holds the float weights the
        int8 copies are made from (with an [`Int8StateDictWarning`]): quantize again after loading.
    """

    hf.check_model_argument("quantize_dynamic_int8(model)", model)
    base = hf.unwrap_base(model)
    devices = {parameter.device.type for parameter in base.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"int8 quantization here targets CPU decoding; the model is on {sorted(devices)}. On a GPU, load the "
            "model in float16 or bfloat16 instead."
        )
    if not any(isinstance(module, Int8Linear) for module in base.modules()):
        base.register_state_dict_post_hook(_warn_float_state_dict)
    quantize_linears_int8(base)
    return model

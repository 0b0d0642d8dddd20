"""int8 matrix products for CPU decoding (Devlin 2017, §3: low-precision arithmetic), batch-invariant and fast.

torch's own dynamic quantization scales a layer's input by its largest value over *all* the tokens of a call,
so a token's logits depend on which other tokens were scored with it: a verification pass that scores k
positions would round differently from greedy search's one position, and blockwise decoding would no longer
reproduce greedy decoding. [`Int8Linear`] scales each token (row) by its own largest value instead, so each row
is quantized the same whatever else is in the call, and multiplies in int32 arithmetic, which is exact (integer
sums do not depend on their order, so on how a kernel blocks the rows). The result of a row is then a fixed
function of that row.

The integer product is `torch._int_mm` (int8 rows times the int8 weights, transposed once at quantization, summed
in int32), an ATen operator that `torch.compile` calls as it is; the rows' quantization before it and the scaling
after it are plain elementwise torch operations, which the compiled engine fuses with the layer norm before and the
residual after, computing the same bits as eager decoding. Measured on the 2-core Xeon, 2 threads, rows quantized
eagerly (`scripts/int8_kernels.py`, `docs/bench/int8-kernels-2threads.md`): 512x512 at 4 rows 0.041 ms against
oneDNN's `qlinear_pointwise` 0.063 (float32 0.023), 512x2048 0.064 against 0.071; oneDNN wins the 512->16000 output
projection (0.30 ms against 0.49). Inside the compiled engine, where oneDNN needed an opaque operator of our own
(~28 us of Python per product), one decoder call went from 7.9-8.5 ms to 5.9-7.0 ms (`scripts/int8_call_cost.py`).

Quantizing changes the model, and so its greedy output (the benchmark reports the quality change); blockwise
decoding of the quantized model is then exact with respect to the quantized model's greedy decoding.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf

_INT8_MAX = 127.0


def int8_linear(
    inputs: torch.Tensor, weight_int8_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`inputs @ dequantized(weight).T + bias`, each row of `inputs` quantized to int8 with its own scale.

    The integer product is `torch._int_mm`; quantizing the rows and scaling the result are plain torch operations,
    so that `torch.compile` fuses them with what precedes and follows them (one kernel instead of ~8 dispatches
    each). Every one of them is exact or correctly rounded elementwise (a maximum, IEEE
    division and rounding, a product, a sum; inductor compiles with `-fno-unsafe-math-optimizations` and no
    floating-point contraction), so eager and compiled calls compute the same bits.

    Args:
        inputs (`torch.FloatTensor` of shape `(rows, in_features)`).
        weight_int8_t (`torch.CharTensor` of shape `(in_features, out_features)`): the weight quantized per output
            channel, transposed (contiguous).
        weight_scale (`torch.FloatTensor` of shape `(out_features,)`).
        bias (`torch.FloatTensor` of shape `(out_features,)`, *optional*).

    Returns:
        `torch.FloatTensor` of shape `(rows, out_features)`.
    """
    # (N, 1): each row's largest magnitude maps to 127
    scale = torch.linalg.vector_norm(inputs, float("inf"), dim=1, keepdim=True)
    scale = scale.clamp_(min=torch.finfo(torch.float32).tiny).div_(_INT8_MAX)
    rows = inputs.div(scale).round_().to(torch.int8)  # (N, in), exact integers in [-127, 127]
    products = torch._int_mm(rows, weight_int8_t)  # (N, out) int32, exact: integer sums do not depend on order
    # one product by the (N, out) scales, not two in turn: under `freezing`, inductor rewrites `_int_mm -> float ->
    # mul -> mul` as torchao's int8 linear (oneDNN's qlinear), taking the first factor for the rows' scale, which
    # for other factors or another order computes garbage (torch 2.13, `_register_smooth_quant_int_mm_pattern`)
    outputs = products.float().mul_(scale * weight_scale)  # in place on a tensor made here
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
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        weight = linear.weight.detach().float()  # (out, in)
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _INT8_MAX  # (out,)
        quantized = torch.round(weight / scale[:, None]).to(torch.int8)
        # (in, out): `_int_mm`'s layout, transposed once here rather than in every call
        self.register_buffer("weight_int8_t", quantized.t().contiguous(), persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
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
        outputs = int8_linear(rows, self.weight_int8_t, self.weight_scale, self.bias_float)
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

"""int8 matrix products for CPU decoding (Devlin 2017, §3: low-precision arithmetic), batch-invariant and fast.

torch's own dynamic quantization scales a layer's input by its largest value over *all* the tokens of a call,
so a token's logits depend on which other tokens were scored with it: a verification pass that scores k
positions would round differently from greedy search's one position, and blockwise decoding would no longer
reproduce greedy decoding. [`Int8Linear`] scales each token (row) by its own largest value instead, so each row
is quantized the same whatever else is in the call, and multiplies in int32 arithmetic, which is exact (integer
sums do not depend on their order, so on how a kernel blocks the rows). The result of a row is then a fixed
function of that row.

The integer product runs on hf_blockwise's kernel for AVX-512 VNNI on weights packed once when a layer is made
([`hf_blockwise.kernels.int8`]), or on `torch._int_mm` (oneDNN, the int8 weights transposed once) where that kernel
does not run: both sum in exact int32, so they compute the same integers. Both are operators that `torch.compile`
calls as they are; the rows' quantization before them and the scaling after are plain elementwise torch operations,
which the compiled engine fuses with the layer norm before and the residual after, computing the same bits as eager
decoding. Eagerly, on the kernel's packed weight, a layer runs the three steps in one call of the kernel's library
(`int8_kernel.int8_linear`: the same float32 operations in the same order, so the same bits as the torch steps,
[`int8_linear_steps`]), one dispatch instead of ~8. A compiled int8 decoder call of `marian-base-en-de` (2-core
Zen 4 EPYC, `hf-blockwise profile calls --threads 2 --kinds "int8 compiled"`) takes 2.7-3.7 ms at 1-8 tokens on the
kernel against 3.9-4.7 ms on `torch._int_mm`, whose 49 products a call cost 2.5 ms against 0.8 ms.

Quantizing changes the model, and so its greedy output (the benchmark reports the quality change); blockwise
decoding of the quantized model is then exact with respect to the quantized model's greedy decoding.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.kernels import int8 as int8_kernel
from hf_blockwise.snapshot import TensorSnapshot

_INT8_MAX = 127.0


def int8_linear(
    inputs: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_offsets: torch.Tensor | None,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`inputs @ dequantized(weight).T + bias`, each row of `inputs` quantized to int8 with its own scale.

    The integer product is hf_blockwise's VNNI kernel on a packed weight ([`hf_blockwise.kernels.int8`]) or
    `torch._int_mm`: the same exact int32 sums either way. Quantizing the rows and scaling the result are plain torch
    operations, so that `torch.compile` fuses them with what precedes and follows them (one kernel instead of ~8
    dispatches each). Every one of them is exact or correctly rounded elementwise (a maximum, IEEE division and
    rounding, a product, a sum; inductor compiles with `-fno-unsafe-math-optimizations` and no floating-point
    contraction), so eager and compiled calls compute the same bits.

    Args:
        inputs (`torch.FloatTensor` of shape `(rows, in_features)`).
        weight_int8 (`torch.CharTensor`): the weight quantized per output channel, either packed for the kernel, of
            shape `(ceil(out_features / 64), in_features / 4, 64, 4)`, or transposed for `torch._int_mm`, of shape
            `(in_features, out_features)` (contiguous).
        weight_offsets (`torch.IntTensor` of shape `(64 * ceil(out_features / 64),)`, *optional*): the packed
            weight's column sums times 128; `None` with a transposed weight.
        weight_scale (`torch.FloatTensor` of shape `(out_features,)`).
        bias (`torch.FloatTensor` of shape `(out_features,)`, *optional*).

    Returns:
        `torch.FloatTensor` of shape `(rows, out_features)`.
    """
    if weight_offsets is not None and not torch.compiler.is_compiling():
        # eager, on the packed weight: `int8_linear_steps` in one call of the kernel's library, computing each step
        # as those torch operations do (the same float32 operations in the same order, no contraction): the same
        # bits, one dispatch instead of ~8 (under torch.compile the steps stay torch's, for inductor to fuse with
        # their neighbours)
        return int8_kernel.int8_linear(inputs, weight_int8, weight_offsets, weight_scale, bias)
    return int8_linear_steps(inputs, weight_int8, weight_offsets, weight_scale, bias)


def int8_linear_steps(
    inputs: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_offsets: torch.Tensor | None,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """[`int8_linear`] as torch operations, step by step (what `torch.compile` traces, and eager decoding on
    `torch._int_mm`'s layout): the arguments and result are [`int8_linear`]'s."""
    # (N, 1): each row's largest magnitude maps to 127
    scale = torch.linalg.vector_norm(inputs, float("inf"), dim=1, keepdim=True)
    scale = scale.clamp_(min=torch.finfo(torch.float32).tiny).div_(_INT8_MAX)
    rows = inputs.div(scale).round_().to(torch.int8)  # (N, in), exact integers in [-127, 127]
    # (N, out) int32, exact: integer sums do not depend on their order, so on the kernel
    if weight_offsets is None:
        products = torch._int_mm(rows, weight_int8)
    else:
        products = int8_kernel.int8_mm(rows, weight_int8, weight_offsets, weight_scale.shape[0])
    # one product by the (N, out) scales, not two in turn: under `freezing`, inductor rewrites `_int_mm -> float ->
    # mul -> mul` as torchao's int8 linear (oneDNN's qlinear), taking the first factor for the rows' scale, which
    # for other factors or another order computes garbage (torch 2.13, `_register_smooth_quant_int_mm_pattern`)
    outputs = products.float().mul_(scale * weight_scale)  # in place on a tensor made here
    return outputs if bias is None else outputs.add_(bias)


def _laid_out(weight_int8_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The int8 weight in the layout of the product that will take it: packed for the VNNI kernel where it runs,
    else `torch._int_mm`'s `(in, out)` with no offsets."""
    if int8_kernel.available() and int8_kernel.takes(weight_int8_t.shape[0]):
        return int8_kernel.pack(weight_int8_t)
    return weight_int8_t, None


def _quantized(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The int8 copy of a linear layer's weights.

    Args:
        weight (`torch.Tensor` of shape `(out_features, in_features)`), bias (`torch.Tensor` of shape
            `(out_features,)`, *optional*).

    Returns:
        weight_int8_t (`torch.CharTensor` of shape `(in_features, out_features)`), weight_scale
        (`torch.FloatTensor` of shape `(out_features,)`) and the bias as float32 (a view of a float32 bias).
    """
    weight = weight.detach().float()  # (out, in)
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _INT8_MAX  # (out,)
    quantized = torch.round(weight / scale[:, None]).to(torch.int8)
    return quantized.t().contiguous(), scale, None if bias is None else bias.detach().float()


class _InferenceOnly(torch.autograd.Function):
    """Passes an int8 layer's output through; its backward refuses: int8 products have no useful gradient."""

    @staticmethod
    def forward(ctx: Any, outputs: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        return outputs.view_as(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        raise RuntimeError(
            "A backward pass reached an int8 layer of hf_blockwise (quantize_dynamic_int8): int8 models are for "
            "inference. Train the float model (or heads and drafters on a frozen base: base.requires_grad_(False)) "
            "and call quantize_dynamic_int8 on it afterwards."
        )


class Int8Linear(nn.Module):
    """A `nn.Linear` whose product runs in int8 with per-output-channel weight and per-token input scales.

    The float `weight` is kept (shared, not copied) for code that reads it, such as tied embeddings, a
    vocabulary shortlist's rows or dtype checks; only the int8 copy is used by `forward`.

    Args:
        linear (`nn.Linear`): the layer to replace, on the CPU.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.train(linear.training)  # in the mode of the model it joins (a module starts in training mode)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        weight_int8_t, weight_scale, bias_float = _quantized(self.weight, self.bias)
        # laid out once here for the product that takes it, rather than in every call
        weight_int8, weight_offsets = _laid_out(weight_int8_t)
        self.register_buffer("weight_int8", weight_int8, persistent=False)
        self.register_buffer("weight_offsets", weight_offsets, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        # the bias as a plain float tensor for the operator (a view of the parameter, not a copy)
        self.register_buffer("bias_float", bias_float, persistent=False)
        self.sources = TensorSnapshot([self.weight, self.bias])  # what the int8 copy was made from

    def is_stale(self) -> bool:
        """Whether the float weight or bias changed since the int8 copy was made (see [`TensorSnapshot`])."""
        return not self.sources.matches([self.weight, self.bias])

    @torch.inference_mode(False)  # normal tensors even when called under inference mode (the corpus job's)
    @torch.no_grad()
    def requantize(self) -> None:
        """Makes the int8 copy again from the float weight and bias as they are now. The buffers are written in
        place where their shapes allow, so that their version counters move: the compiled engine's snapshot of the
        model's tensors sees the change and compiles again."""
        weight_int8_t, weight_scale, bias_float = _quantized(self.weight, self.bias)
        if weight_int8_t.shape != (self.in_features, self.out_features):
            raise ValueError(
                f"the weight of this Int8Linear is now {tuple(self.weight.shape)}, not ({self.out_features}, "
                f"{self.in_features}): quantize a model with its final shapes"
            )
        # in the layout the layer was made with (a packed weight stays packed)
        weight_int8, weight_offsets = (
            int8_kernel.pack(weight_int8_t) if self.weight_offsets is not None else (weight_int8_t, None)
        )
        for name, value in (
            ("weight_int8", weight_int8),
            ("weight_offsets", weight_offsets),
            ("weight_scale", weight_scale),
        ):
            if value is None:
                continue
            buffer = getattr(self, name)
            if buffer.is_inference():  # made under inference mode: replaced (a new address tells the engine too)
                setattr(self, name, value)
            else:
                buffer.copy_(value)
        self.bias_float = bias_float  # a view of the bias (or a float copy): never stale in place
        self.sources = TensorSnapshot([self.weight, self.bias])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """
        Args:
            inputs (`torch.FloatTensor` of shape `(..., in_features)`): the layer's input, any leading shape.

        Returns:
            `torch.FloatTensor` of shape `(..., out_features)`.
        """
        rows = inputs.reshape(-1, self.in_features)  # (N, in)
        if rows.dtype != torch.float32:
            rows = rows.float()
        tracked = torch.is_grad_enabled() and any(
            tensor is not None and tensor.requires_grad for tensor in (rows, self.weight, self.bias)
        )
        outputs = int8_linear(
            rows.detach() if tracked else rows,
            self.weight_int8,
            self.weight_offsets,
            self.weight_scale,
            self.bias_float,
        )
        if tracked:  # a graph whose backward refuses with advice, rather than autograd's in-place error
            outputs = _InferenceOnly.apply(outputs, rows, self.weight)
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

    Whenever the float weights change afterwards (in place, through `.data`, by `copy_`, `load_state_dict` or an
    optimizer step), the int8 copies are made again before the next `generate` or forward from input ids (a hook on
    the encoder, [`refresh_int8`]) and before the compiled engine is built again. A backward pass is refused: train the
    float model, then quantize it.

    Raises:
        TypeError: for a lone `nn.Linear` (wrap it as `Int8Linear(layer)`).
        ValueError: for a model without linear layers or one whose weights are not loaded or not on the CPU.
    """
    hf.check_model_argument("quantize_dynamic_int8(model)", model)
    if isinstance(model, nn.Linear | Int8Linear):
        raise TypeError(
            f"quantize_dynamic_int8 quantizes the linear layers inside a model, in place, and cannot replace the "
            f"{type(model).__name__} it is given: use Int8Linear(layer) for a single layer"
        )
    base = hf.unwrap_base(model)
    hf.check_materialized(base)
    if not any(isinstance(module, nn.Linear | Int8Linear) for module in base.modules()):
        raise ValueError(f"{type(base).__name__} has no nn.Linear layer: there is nothing to quantize")
    devices = {parameter.device.type for parameter in base.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"int8 quantization here targets CPU decoding; the model is on {sorted(devices)}. On a GPU, load the "
            "model in float16 or bfloat16 instead."
        )
    if not is_int8(base):
        base.register_state_dict_post_hook(_warn_float_state_dict)
        encoder = base.get_encoder() if hasattr(base, "get_encoder") else base
        # once per `generate` (and per forward from input ids): decoder steps, given the encoder's output, skip it
        encoder.register_forward_pre_hook(functools.partial(_refresh_before_forward, weakref.ref(base)))
    quantize_linears_int8(base)
    refresh_int8(base)  # an already quantized model whose float weights changed
    if int8_kernel.kernel_path() == "int_mm":
        _warn_slow_int8()
    return model


class Int8SpeedWarning(UserWarning):
    """int8 products run on `torch._int_mm` here, which is slower than float32 on the CPUs measured."""


@functools.cache  # once per process
def _warn_slow_int8() -> None:
    warnings.warn(
        "int8 products run on torch._int_mm on this machine (no AVX2 or AVX-512 VNNI path of hf_blockwise's kernel: "
        "another CPU, no C++ compiler, or HF_BLOCKWISE_INT8_KERNEL=0); measured on a 2-core AMD EPYC Zen 3, its "
        "compiled int8 decoder call took ~7x the float32 one. Decode in float32 here: the output of either is exact "
        "for its own model.",
        Int8SpeedWarning,
        stacklevel=3,
    )


def _refresh_before_forward(base: weakref.ref[nn.Module], _module: nn.Module, _args: Any) -> None:
    # a forward pre-hook on the encoder of an int8 base (held weakly: the hook lives inside the base)
    model = base()
    if model is not None:
        refresh_int8(model)


def is_int8(model: nn.Module) -> bool:
    """Whether `model` holds an [`Int8Linear`] (was quantized by [`quantize_dynamic_int8`])."""
    return any(isinstance(module, Int8Linear) for module in model.modules())


def refresh_int8(model: nn.Module, force: bool = False) -> bool:
    """Makes each [`Int8Linear`] of `model` again whose float weight or bias changed since it was quantized.

    [`quantize_dynamic_int8`] runs this before every encoder forward and the compiled engine before it builds; a
    decoding loop of one's own that changes weights between decoder calls given `encoder_outputs` calls it itself.
    It reads each layer's version counters and a sample of its weights (see [`TensorSnapshot`]): ~0.7 ms for a 43M
    model, ~1.1 ms with its weights out of cache (EPYC Zen 4). Not while `torch.compile` traces (a graph must not
    requantize).

    Args:
        force (`bool`): make every layer again, changed or not: after a write through `.data` that touches fewer than
            about one value in a thousand of each tensor it changes, which the sample may miss.

    Returns:
        `bool`: whether any layer was made again.
    """
    if torch.compiler.is_compiling():
        return False
    stale = [module for module in model.modules() if isinstance(module, Int8Linear) and (force or module.is_stale())]
    for module in stale:
        module.requantize()
    return bool(stale)


def warn_if_int8_base(model: nn.Module, what: str) -> None:
    """An [`Int8StateDictWarning`] when the base of `model`, a wrapper saving only its own weights, is int8: the
    saved `what` load onto the float base named in their config."""
    if is_int8(hf.unwrap_base(model)):
        warnings.warn(
            f"{type(model).__name__}.save_pretrained wrote the {what} only; they were used on an int8 base, which is "
            "not saved with them: from_pretrained attaches them to the float base their config names. Call "
            "quantize_dynamic_int8(model) after loading to decode with the same int8 base, bit for bit.",
            Int8StateDictWarning,
            stacklevel=3,
        )

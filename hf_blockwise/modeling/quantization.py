"""int8 matrix products for CPU decoding (Devlin 2017, §3: low-precision arithmetic), batch-invariant.

torch's own dynamic quantization scales a layer's input by its largest value over *all* the tokens of a call,
so a token's logits depend on which other tokens were scored with it: a verification pass that scores k
positions would round differently from greedy search's one position, and blockwise decoding would no longer
reproduce greedy decoding. [`Int8Linear`] scales each token (row) by its own largest value instead, and
multiplies in exact int32 arithmetic, so every row's result is the same whatever else is in the call.

Quantizing changes the model, and so its greedy output (the benchmark reports the quality change); blockwise
decoding of the quantized model is then exact with respect to the quantized model's greedy decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_blockwise import boundary as hf

_INT8_MAX = 127.0


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
        self.register_buffer("weight_int8_t", quantized.t().contiguous(), persistent=False)  # (in, out)
        self.register_buffer("weight_scale", scale, persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """
        Args:
            inputs (`torch.FloatTensor` of shape `(..., in_features)`).

        Returns:
            `torch.FloatTensor` of shape `(..., out_features)`.
        """
        rows = inputs.reshape(-1, self.in_features).float()  # (N, in)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / _INT8_MAX
        products = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.weight_int8_t)  # (N, out) int32
        outputs = products * (scale * self.weight_scale)
        if self.bias is not None:
            outputs = outputs + self.bias
        return outputs.reshape(*inputs.shape[:-1], self.out_features).to(inputs.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """Replaces every `nn.Linear` of the base model by an [`Int8Linear`], in place (CPU only).

    Args:
        model: a transformers seq2seq model, or a [`BlockwiseHeadsModel`] whose *base* is quantized. Its heads
            stay in full precision: they are small and only propose; their vocabulary projection is the base's
            output layer, quantized with the rest.

    Returns:
        The same `model`, for chaining.
    """

    base = hf.unwrap_base(model)
    devices = {parameter.device.type for parameter in base.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"int8 quantization here targets CPU decoding; the model is on {sorted(devices)}. On a GPU, load the "
            "model in float16 or bfloat16 instead."
        )
    for module in list(base.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model

"""int8 matrix products for CPU decoding (Devlin 2017, §3: low-precision arithmetic).

Dynamic quantization stores each linear layer's weights in int8 and quantizes its input on the fly, so a
decoder step reads a quarter of the weight memory. It changes the model's logits, hence its greedy output:
blockwise decoding of a quantized model is exact with respect to *that* model's greedy decoding, and the
benchmark reports the quality change against the full-precision model.
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """Replaces the base model's `nn.Linear` layers by int8 dynamically quantized ones, in place (CPU only).

    Args:
        model: a transformers seq2seq model, or a [`BlockwiseHeadsModel`] whose *base* is quantized. Its heads
            stay in full precision: they are small, and their vocabulary projection is the base's own output
            layer, which is quantized with the rest.

    Returns:
        The same `model`, for chaining.
    """
    from .modeling import BlockwiseHeadsModel

    base = model.base_model if isinstance(model, BlockwiseHeadsModel) else model
    devices = {parameter.device.type for parameter in base.parameters()}
    if devices != {"cpu"}:
        raise ValueError(
            f"int8 dynamic quantization runs on the CPU only; the model is on {sorted(devices)}. On a GPU, load "
            "the model in float16 or bfloat16 instead."
        )
    torch.ao.quantization.quantize_dynamic(base, {nn.Linear}, dtype=torch.qint8, inplace=True)
    return model

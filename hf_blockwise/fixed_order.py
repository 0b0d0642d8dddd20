"""Float products whose reduction order the compiled graph owns: the engine's one arithmetic on any CPU.

A token's logits must not depend on how many tokens its call feeds, or a verification call of k tokens could round
differently from greedy's one-token calls. Library kernels (oneDNN and MKL's sgemm, ATen's CPU flash attention)
choose their path by the call's shape and by the machine: gemv for one row, small-matrix kernels, K split across
threads, each CPU vendor and ISA its own thresholds. So whether a k-row product gives a row the bits a one-row
product gives is a property of the machine, not of our code (measured: equal from 3 rows up on a Xeon, different
at 3 and 5 rows on an AMD EPYC).

This module takes those products away from the libraries inside the engine's graphs. A graph pass over dynamo's
graph ([`own_products`]) replaces scaled-dot-product attention and float matrix products with plain broadcast
products and sums ([`fixed_order_attention`], [`fixed_order_matmul`], optionally [`fixed_order_linear`]), which
inductor compiles into loops of its own. A generated kernel is one piece of code for every size (the engine
compiles with dynamic shapes): each output element is reduced in an order fixed by that code and by the element's
own reduction length, never by how many other rows the call has. With int8 linears (exact int32 sums) every product
of the decoder is then either exact or computed in an order we own, and a k-token call computes bit for bit what
k one-token calls compute, at any batch size, on any CPU inductor compiles for. [`inductor_backend`] is the
`torch.compile` backend that runs the pass before inductor; the engine's probe (`engine.py`) still checks the
result on the machine, once per engine.

What stays with kernels we do not write is reported, not hidden: float32 `linear`s (unless asked for, they cost
~1.4x a call's time in inductor's loops on the 2-core EPYC; they run on inductor's C++ GEMM template or on the
libraries, [`GraphProducts.linear_kernels`]), and any product the pass does not recognise; a graph that keeps one
is row-count dependent as far as we can promise, and the engine then makes no bitwise claim for it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx


def fixed_order_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (without dropout) as broadcast products and sums that inductor compiles into
    its own loops.

    Args:
        query (`torch.FloatTensor` of shape `(..., heads, L, head_dim)`).
        key, value (`torch.FloatTensor` of shape `(..., kv_heads, S, head_dim)`).
        attn_mask (`torch.Tensor` broadcastable to `(..., heads, L, S)`, *optional*): bool (`True` attends) or
            additive.

    Returns:
        `torch.FloatTensor` of shape `(..., heads, L, head_dim)`; a row that attends nowhere gets zeros (as
        torch's own attention does).
    """
    if dropout_p:
        raise ValueError(f"fixed_order_attention computes attention without dropout; got dropout_p={dropout_p}")
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query.unsqueeze(-2) * key.unsqueeze(-3)).sum(-1) * scale  # (..., L, S): one dot per (query, key)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    peak = scores.amax(dim=-1, keepdim=True)  # (..., L, 1); exact in any order
    weights = torch.exp(scores - peak)  # (..., L, S); 0 where masked
    # the normalizer is summed with the values, as a last column of ones: both sums run over the keys in slot order
    # (the keys are not the contiguous dimension of `value`), so the zeros of masked keys change no bit, and a tree
    # node gets what its path gets as a chain, whatever slots its ancestors hold
    ones = torch.ones_like(value[..., :1])
    sums = (weights.unsqueeze(-1) * torch.cat([value, ones], dim=-1).unsqueeze(-3)).sum(-2)  # (..., L, head_dim + 1)
    normalizer = sums[..., -1:]
    return torch.where(normalizer > 0, sums[..., :-1] / normalizer, 0.0)  # a row that attends nowhere: zeros


def fixed_order_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`left @ right` for operands of 2 or more dimensions, as a broadcast product summed over the inner dimension.

    Args:
        left (`torch.Tensor` of shape `(..., M, K)`), right (`torch.Tensor` of shape `(..., K, N)`).

    Returns:
        `torch.Tensor` of shape `(..., M, N)`.
    """
    return (left.unsqueeze(-1) * right.unsqueeze(-3)).sum(-2)


def fixed_order_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` as a broadcast product summed over the input features.

    Args:
        inputs (`torch.FloatTensor` of shape `(..., in_features)`), weight (`(out_features, in_features)`).

    Returns:
        `torch.FloatTensor` of shape `(..., out_features)`.
    """
    outputs = (inputs.unsqueeze(-2) * weight).sum(-1)
    return outputs if bias is None else outputs + bias


_ATTENTION = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_MATMUL = (torch.matmul, operator.matmul, torch.bmm, torch.mm)
_LINEAR = (F.linear, torch._C._nn.linear)
# what the pass cannot own, named in reports: float products that would stay with a library
_OTHER_PRODUCTS = {
    torch.addmm: "addmm", torch.baddbmm: "baddbmm", torch.addbmm: "addbmm", torch.einsum: "einsum",
    torch.tensordot: "tensordot", F.conv1d: "conv1d", F.conv2d: "conv2d",
}  # fmt: skip
_METHODS = {"matmul": torch.matmul, "bmm": torch.bmm, "mm": torch.mm, "addmm": torch.addmm, "baddbmm": torch.baddbmm}


@dataclass
class GraphProducts:
    """What [`own_products`] did to one graph.

    Attributes:
        owned (`dict[str, int]`): products now computed in the graph's own loops, by kind.
        library (`dict[str, int]`): float products left to library kernels, by kind (their bits depend on the row
            count); empty where the graph owns every float product.
        linear_kernels (`str`): what computes the `linear`s left to kernels: `"template"` (inductor's C++ GEMM
            template), or `"libraries"` (oneDNN, MKL; with the reason where the template was asked for and took no
            choice); an engine's merged report names each its graphs use, in order.
        merged_int8 (`int`): int8 products merged into another that takes the same rows
            ([`merged_products.merge_int8_products`], run by the engine before this pass).
    """

    owned: dict[str, int] = field(default_factory=dict)
    library: dict[str, int] = field(default_factory=dict)
    linear_kernels: str = "libraries"
    merged_int8: int = 0


def _is_float(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _count(counts: dict[str, int], kind: str) -> None:
    counts[kind] = counts.get(kind, 0) + 1


def _attention_without_dropout(node: fx.Node) -> bool:
    dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return isinstance(dropout, (int, float)) and dropout == 0


def _replacement(node: fx.Node, own_linears: bool) -> tuple[str, Callable[..., Any] | None]:
    """The kind of float product `node` is ("" for none) and what computes it in a fixed order (`None`: a library)."""
    target = node.target
    if node.op == "call_method" and target in _METHODS:
        target = _METHODS[str(target)]
    elif node.op != "call_function":
        return "", None
    if not _is_float(node):
        return "", None
    if target in _ATTENTION:
        return "attention", fixed_order_attention if _attention_without_dropout(node) else None
    if target in _MATMUL:
        operands = [argument.meta.get("example_value") for argument in node.args[:2] if isinstance(argument, fx.Node)]
        two_dimensional = len(operands) == 2 and all(operand.dim() >= 2 for operand in operands)
        return "matmul", fixed_order_matmul if two_dimensional and not node.kwargs else None
    if target in _LINEAR:
        return "linear", fixed_order_linear if own_linears else None
    if target in _OTHER_PRODUCTS:
        return _OTHER_PRODUCTS[target], None
    return "", None


def own_products(graph_module: fx.GraphModule, own_linears: bool = False) -> GraphProducts:
    """Replaces, in place, the float products of a dynamo graph that [`fixed_order_attention`],
    [`fixed_order_matmul`] and (with `own_linears`) [`fixed_order_linear`] compute, and reports what is left.

    Args:
        graph_module (`fx.GraphModule`): a graph as dynamo hands it to a backend (torch-level calls, with
            `example_value` metadata).
        own_linears (`bool`): float `linear`s too (int8 products, on hf_blockwise's kernel or `torch._int_mm`, are
            exact and stay as they are).

    Returns:
        [`GraphProducts`].
    """
    report = GraphProducts()
    for node in graph_module.graph.nodes:
        kind, replacement = _replacement(node, own_linears)
        if not kind:
            continue
        if replacement is None:
            _count(report.library, kind)
            continue
        if node.op == "call_method":  # `a.matmul(b)`: the tensor is the first argument of the function
            node.op = "call_function"
        node.target = replacement
        _count(report.owned, kind)
    graph_module.recompile()
    return report


def inductor_backend(
    transform: Callable[[fx.GraphModule], GraphProducts] | None, record: Callable[[GraphProducts], None]
) -> Callable[[fx.GraphModule, Sequence[torch.Tensor]], Callable[..., Any]]:
    """A `torch.compile` backend: `transform` (such as [`own_products`]) on each graph dynamo hands over, then
    inductor (`compile_fx`, reading inductor's config as it is when the graph compiles).

    Where that config asks for inductor's C++ GEMM template alone (`max_autotune` with `max_autotune_gemm_backends`
    `"CPP"`, as the engine sets it around a call), a graph with a product the template cannot take (inductor finds
    no choice for it: a product of two activations, an int8 product) compiles again on the libraries, and its
    report says so ([`GraphProducts.linear_kernels`]).

    Args:
        transform (`Callable[[fx.GraphModule], GraphProducts]`, *optional*): rewrites the graph in place and reports
            its products; `None` leaves the graph as dynamo traced it.
        record (`Callable[[GraphProducts], None]`): given each graph's report.
    """
    import torch._inductor.config as inductor_config  # inductor loads on first compilation, not with the engine
    from torch._inductor.compile_fx import compile_fx

    def backend(graph_module: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        report = GraphProducts() if transform is None else transform(graph_module)
        record(report)
        if not (inductor_config.max_autotune and inductor_config.max_autotune_gemm_backends == "CPP"):
            return compile_fx(graph_module, list(example_inputs))
        try:
            compiled = compile_fx(graph_module, list(example_inputs))
        except Exception as error:  # inductor wraps its errors: only "no choice for a product" is handled
            reason = _template_refusal(error)
            if reason is None:
                raise
        else:
            report.linear_kernels = "template"
            return compiled
        report.linear_kernels = f"libraries (the GEMM template took no choice: {reason})"
        with inductor_config.patch(max_autotune=False):
            return compile_fx(graph_module, list(example_inputs))

    return backend


def _template_refusal(error: BaseException) -> str | None:
    """The message of the `NoValidChoicesError` behind an inductor error (inductor wraps it in a lowering error,
    wrapped again in its own), or `None` where the error is another."""
    from torch._inductor.select_algorithm import NoValidChoicesError

    seen: BaseException | None = error
    for _depth in range(8):
        if seen is None:
            return None
        if isinstance(seen, NoValidChoicesError):
            return str(seen).split(". ")[0]
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    return None

"""The graph pass that merges int8 products sharing an input: one product where a layer's q, k and v took three.

An int8 linear ([`quantization.int8_linear`]) quantizes its input rows, multiplies them by its int8 weight (on
hf_blockwise's VNNI kernel or `torch._int_mm`) and scales the exact int32 sums. Where several linears read the same
input (a self-attention layer's query, key and value projections; the feature drafter's), each quantizes the same
rows to the same int8 values, so their products can be one product on the weights side by side, each layer taking
its own columns of the result. Integer sums do not depend on how the columns are grouped, so the merged product
computes every bit the separate ones computed: the pass changes the speed, never an output.

Why: at decoding's row counts (1-16 tokens) a product's cost is mostly fixed (a call, a pass over the rows), not
its weight's bytes. Measured on the 2-core AMD EPYC (Zen 4), 2 threads, the VNNI kernel called eagerly: three 512x512
products of 3 rows ~18 us against ~11 us for one 512x1536 product (`marian-base-en-de`'s self-attention). In a
compiled `marian-base-en-de` call the 12 products it saves were within the machine's noise (see the changelog).

The pass runs on dynamo's graph before inductor ([`fixed_order.inductor_backend`]), where each int8 linear's
quantization is traced as the same short chain of operations (a norm, a clamp, divisions, a rounding, a cast). Two
products take the same rows when their chains apply the same operations with the same arguments to the same node of
the graph, and nothing that could alias that node is written in place between the chains and the last product (a
write anywhere there, other than to the chains' own tensors and the products' scaled outputs, refuses the merge).
The merged weight is a `cat` of the graph's weights, which inductor's freezing folds into one constant when the
graph compiles (the engine runs the pass only with freezing, and compiles again when a weight changes, as it does
for every frozen weight). Float linears are left as they are: a float product's bits may depend on how many columns
its kernel computes at once.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Hashable

import torch
from torch import fx

# operations of an int8 linear's input chain (`int8_linear`, `Int8Linear.forward`): rows made from them are equal
# when the operations and their arguments are
_CHAIN_METHODS = frozenset({"reshape", "view", "to", "float", "contiguous", "clamp_", "clamp", "div_", "div", "round_"})
_CHAIN_FUNCTIONS = frozenset(
    {torch._C._linalg.linalg_vector_norm, torch.linalg.vector_norm, torch.div, torch.round, torch.clamp}
)
_COLUMNS = 64  # output columns of one packed block of the VNNI kernel (hf_blockwise.kernels.int8)


def _is_int8_product(node: fx.Node) -> str:
    """`"kernel"` for hf_blockwise's `int8_mm` (or `int8_mm_avx2`) on a weight that is a constant of the graph,
    `"int_mm"` for `torch._int_mm` on one, `""` otherwise."""
    if node.op != "call_function" or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return ""
    if node.args[1].op != "get_attr":
        return ""
    kernel = getattr(torch.ops, "hf_blockwise", None)
    packed_products = [
        target
        for name in ("int8_mm", "int8_mm_avx2")  # the VNNI and AVX2 paths: one packed layout, the same integers
        if kernel is not None and hasattr(kernel, name)
        for target in (getattr(kernel, name), getattr(kernel, name).default)
    ]
    if node.target in packed_products:
        offsets = node.args[2]
        fits = isinstance(offsets, fx.Node) and offsets.op == "get_attr" and isinstance(node.args[3], int)
        return "kernel" if fits and not node.kwargs else ""
    if node.target in (torch._int_mm, torch.ops.aten._int_mm.default) and len(node.args) == 2 and not node.kwargs:
        return "int_mm"
    return ""


_IN_PLACE_OPERATORS = frozenset(
    {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
     operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
)  # fmt: skip


def _writes_in_place(node: fx.Node) -> bool:
    """Whether `node` may write a tensor in place: a method or function named like `add_`, an in-place operator
    (`x[i] = v`, `x += v`), an operator whose schema mutates, or one given an `out=`."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    schema = getattr(node.target, "_schema", None)
    return node.target in _IN_PLACE_OPERATORS or "out" in node.kwargs or bool(schema and schema.is_mutable)


def _is_chain(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _CHAIN_METHODS) or (
        node.op == "call_function" and node.target in _CHAIN_FUNCTIONS
    )


def _rows_key(node: fx.Node, keys: dict[fx.Node, Hashable], chain: set[fx.Node]) -> Hashable:
    """A key equal for two nodes of an int8 linear's input chain when they apply the same operations with the same
    arguments to the same node of the graph (a node outside the chain keys as itself); the chain's nodes are added
    to `chain`."""
    if node in keys:
        if _is_chain(node):
            chain.add(node)  # (its inputs were added when its key was made)
        return keys[node]
    if not _is_chain(node):
        keys[node] = ("node", node)
        return keys[node]

    def argument(value: object) -> Hashable:
        if isinstance(value, fx.Node):
            return _rows_key(value, keys, chain)
        if isinstance(value, (tuple, list)):
            return tuple(argument(item) for item in value)
        return ("value", type(value), repr(value))

    chain.add(node)
    keys[node] = (node.op, node.target, argument(node.args), tuple((k, argument(v)) for k, v in node.kwargs.items()))
    return keys[node]


def _fresh(node: fx.Node) -> bool:
    """Whether `node`'s tensor was surely allocated by the graph after an int8 product: the product itself, a change
    of its dtype, or an in-place operation on one (an int8 linear's scaling, `products.float().mul_(...)`)."""
    for _depth in range(8):
        if node.op == "call_function" and _is_int8_product(node):
            return True
        if node.op == "call_method" and node.target in ("float", "to"):
            value, source = node.meta.get("example_value"), node.args[0]
            before = source.meta.get("example_value") if isinstance(source, fx.Node) else None
            return isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) and value.dtype != before.dtype
        if not (_writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node)):
            return False
        node = node.args[0]  # an in-place operation returns the tensor it wrote
    return False


def _unwritten_between(group: list[fx.Node], chain: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether nothing that could alias the rows' sources is written in place from the first operation of the
    group's input chains to its last product: the rows the first product takes are then those every other product
    of the group would have made. Writes to the chains' own tensors and to the products' scaled outputs are
    harmless; any other write refuses the merge."""
    start, end = min(order[node] for node in chain), order[group[-1]]
    for node, position in order.items():
        if start <= position <= end and _writes_in_place(node):
            written = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            if written is None or not (written in chain or _fresh(written)):
                return False
    return True


def _constant(graph_module: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    return functools.reduce(getattr, str(node.target).split("."), graph_module)


def merge_int8_products(graph_module: fx.GraphModule) -> int:
    """Merges, in place, the int8 products of a dynamo graph that take the same rows into one product per group.

    Args:
        graph_module (`fx.GraphModule`): a graph as dynamo hands it to a backend, the int8 weights its constants
            (`get_attr`).

    Returns:
        `int`: products merged away (a group of three counts two).
    """
    keys: dict[fx.Node, Hashable] = {}
    order = {node: position for position, node in enumerate(graph_module.graph.nodes)}
    groups: dict[tuple[str, Hashable], tuple[list[fx.Node], set[fx.Node]]] = {}
    for node in graph_module.graph.nodes:
        kind = _is_int8_product(node)
        if kind and isinstance(node.args[0], fx.Node):
            chain: set[fx.Node] = set()
            key = _rows_key(node.args[0], keys, chain)
            products, chains = groups.setdefault((kind, key), ([], set()))
            products.append(node)
            chains |= chain
    merged = 0
    for (kind, _key), (products, chains) in groups.items():
        if len(products) > 1 and chains and _unwritten_between(products, chains, order):
            _merge(graph_module, kind, products)
            merged += len(products) - 1
    if merged:
        graph_module.recompile()
    return merged


def _merge(graph_module: fx.GraphModule, kind: str, products: list[fx.Node]) -> None:
    """One product in place of `products` (in graph order, same rows): their weights side by side (a `cat` of the
    graph's constants, which inductor's freezing folds into one constant), each product replaced by its columns of
    the result."""
    graph, first = graph_module.graph, products[0]
    weights = [_constant(graph_module, product.args[1]) for product in products]
    if kind == "kernel":  # packed (blocks, in / 4, 64, 4): blocks side by side, so each output starts at a block
        widths = [_COLUMNS * weight.shape[0] for weight in weights]
        outputs = [product.args[3] for product in products]
    else:  # torch._int_mm's (in, out): columns side by side
        widths = outputs = [weight.shape[1] for weight in weights]
    starts = [sum(widths[:index]) for index in range(len(products))]
    separate = {argument for product in products for argument in product.args[1:3] if isinstance(argument, fx.Node)}
    with graph.inserting_before(first):  # the later products' weights are read before the first product now

        def constants(position: int) -> list[fx.Node]:
            return [graph.get_attr(str(product.args[position].target)) for product in products]

        weight = graph.call_function(torch.cat, (constants(1), 0 if kind == "kernel" else 1))
        if kind == "kernel":
            offsets = graph.call_function(torch.cat, (constants(2),))
            product = graph.call_function(first.target, (first.args[0], weight, offsets, starts[-1] + outputs[-1]))
        else:
            product = graph.call_function(first.target, (first.args[0], weight))
    for node, start, width in zip(products, starts, outputs, strict=True):
        with graph.inserting_after(product):
            columns = graph.call_function(torch.narrow, (product, 1, start, width))
        node.replace_all_uses_with(columns)
        graph.erase_node(node)
    for constant in separate:
        if not constant.users:
            graph.erase_node(constant)

"""A tree of drafted tokens through transformers' decoder forward: positions by depth, attention by ancestry.

A tree feed lays a row's candidate tokens out flat, each after its parent (`generation/tree.py`). Two things then
differ from a chain, and both are set from outside the model's code:

- **Positions.** transformers' seq2seq decoders number the fed columns from the cache length, `L + c` for column `c`,
  while a node must sit at `L + depth`. Decoders with an absolute position module (`decoder.embed_positions`: BART,
  Marian, Pegasus, mBART, Whisper...) compute the embeddings of positions `L..L+W-1`; since a node's depth is never
  more than its column, a forward hook on that module hands each column the embedding computed for column `depth`
  ([`positions_at_depth`]): the position a chain would have given it. Decoders with relative positions (T5) have no
  such module and are refused.
- **Attention.** A node attends to the cache and to its ancestors only: a 4D mask in the format transformers builds
  for the model's attention implementation (boolean for `sdpa`, additive for `eager`), which transformers' mask
  functions pass through unchanged.

After the verification, the cache keeps the accepted path only: [`compact_cache`] moves its keys and values to
consecutive slots (a gather on each layer's buffer, no host read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hf_blockwise.boundary.cache import is_static_cache, static_cache_capacity

# attention implementations whose 4D mask format is known: True = boolean (True attends), False = additive
_MASK_IS_BOOLEAN = {"sdpa": True, "eager": False}


@dataclass(frozen=True)
class TreeInputs:
    """The tree structure of one feed.

    Attributes:
        depth (`torch.LongTensor` of shape `(batch_size, width)`): each column's position after the cache (its
            path length from the first fed column); never more than its column index.
        ancestors (`torch.BoolTensor` of shape `(batch_size, width, width)`): `[b, i, j]` is True when column `j` is
            column `i` or one of its ancestors (what column `i` attends to among the fed columns).
    """

    depth: torch.Tensor
    ancestors: torch.Tensor

    def padded_to(self, width: int) -> TreeInputs:
        """The same tree with filler columns up to `width`; each filler column attends to itself only (after the
        cache) and takes the position of its own column."""
        batch, current = self.depth.shape
        if width <= current:
            return self
        columns = torch.arange(current, width, device=self.depth.device)
        depth = torch.cat([self.depth, columns.expand(batch, -1)], dim=1)
        ancestors = torch.eye(width, dtype=torch.bool, device=self.depth.device).repeat(batch, 1, 1)
        ancestors[:, :current, :current] = self.ancestors
        return TreeInputs(depth=depth, ancestors=ancestors)


def decoder_position_module(model: nn.Module) -> nn.Module | None:
    """The decoder's absolute position module (`embed_positions`), or `None` when positions are relative or
    rotary (T5, and any decoder without one)."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    module = getattr(decoder, "embed_positions", None)
    return module if isinstance(module, nn.Module) else None


def tree_support(model: nn.Module) -> str | None:
    """Why `model`'s decoder cannot take a tree feed, or `None` when it can (the capability probe then checks the
    logits)."""
    if decoder_position_module(model) is None:
        return "its decoder has no absolute position module (decoder.embed_positions), so nodes cannot be placed"
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in _MASK_IS_BOOLEAN:
        known = sorted(_MASK_IS_BOOLEAN)
        return f"its attention implementation {implementation!r} takes no 4D mask here (only {known})"
    return None


def positions_at_depth(embeddings: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """The position embeddings of a chain feed, `(width, d)` or `(1 or b, width, d)`, taken at each node's depth:
    shape `(b, width, d)`."""
    if embeddings.dim() == 2:
        return embeddings[depth]
    index = depth[..., None].expand(-1, -1, embeddings.shape[-1])
    return embeddings.expand(depth.shape[0], -1, -1).gather(1, index)


@contextmanager
def tree_positions(model: nn.Module, depth: torch.Tensor) -> Iterator[None]:
    """Within the block, the decoder's position module places each fed column at `L + depth` (eager forwards; the
    compiled engine registers its own hook once, before compiling)."""
    module = decoder_position_module(model)
    if module is None:
        raise ValueError(f"{type(model).__name__}: {tree_support(model)}")
    handle = module.register_forward_hook(lambda _module, _args, output: positions_at_depth(output, depth))
    try:
        yield
    finally:
        handle.remove()


def tree_attention_mask(model: nn.Module, cache, cache_length: int, tree: TreeInputs) -> torch.Tensor:
    """The decoder self-attention mask of a tree feed: every valid cache slot, then the column's ancestors.

    Returns:
        `torch.Tensor` of shape `(batch_size, 1, width, key_length)`, `key_length` the static buffer's capacity or
        `cache_length + width`; boolean or additive as the model's attention implementation takes it.
    """
    batch, width = tree.depth.shape
    keys = static_cache_capacity(cache) if is_static_cache(cache) else cache_length + width
    allowed = torch.zeros(batch, width, keys, dtype=torch.bool, device=tree.depth.device)
    allowed[:, :, :cache_length] = True
    allowed[:, :, cache_length : cache_length + width] = tree.ancestors
    allowed = allowed[:, None]
    if _MASK_IS_BOOLEAN[model.config._attn_implementation]:
        return allowed
    dtype = model.get_output_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def compact_cache(cache, start: int, columns: torch.Tensor) -> None:
    """Moves each row's accepted path to consecutive self-attention slots: slot `start + d` receives the keys and
    values of slot `start + columns[b, d]` (cross-attention is untouched).

    Args:
        columns (`torch.LongTensor` of shape `(batch_size, width)`): per row, the fed column at each depth of the path.
    """
    for layer in cache.self_attention_cache.layers:
        for name in ("keys", "values"):
            buffer = getattr(layer, name)  # (b, H, T, dh)
            width = min(columns.shape[1], buffer.shape[2] - start)
            index = columns[:, None, :width, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
            block = buffer[:, :, start : start + width]
            block.copy_(block.gather(2, index))

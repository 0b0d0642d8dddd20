"""The decoder KV caches the loop decodes with, and what a blockwise step does to them.

A dynamic cache whose self-attention layers can all be cropped, for the eager loop ([`new_decoder_cache`],
[`loop_decoder_cache`], which also checks the one `generate` prepared); preallocated static self-attention buffers
for the compiled engine ([`static_decoder_cache`], with its capacity, attention mask, unpinning and the window a call
attends over, [`attention_window`]); and, for
either, cropping back to the verified length ([`crop_cache`]), keeping only the rows still decoding
([`select_cache_rows`]) and beam search's reorder ([`reorder_cache_rows`]). [`check_cache_settings`] refuses the
`generate` arguments that would give the loop another cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticLayer

# The names a seq2seq forward (and generate's model kwargs) take the KV cache by: transformers 5.25 renamed
# `past_key_values` to `cache` (the old name deprecated until 5.40, and ignored where both are given)
CACHE_ARGUMENTS = ("cache", "past_key_values")


def check_cache_settings(generation_config: Any) -> None:
    """Raises a `ValueError` naming `use_cache=False` or a `cache_implementation` other than the dynamic one: the
    loop (greedy or beam) crops and reorders a cache of its own after every verification step."""
    if generation_config.use_cache is False:
        raise ValueError(
            "Blockwise decoding needs the KV cache; use_cache=False is not supported (some configs default to it, "
            "e.g. Pix2Struct's text config: pass use_cache=True to generate)"
        )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} is not supported; blockwise "
            "decoding crops a dynamic cache after every verification step"
        )


def new_decoder_cache() -> EncoderDecoderCache:
    """An empty dynamic encoder-decoder cache whose self-attention layers can all be cropped.

    Built without the model's config on purpose: with one, transformers gives sliding-window layers
    (T5Gemma) a rolling buffer that cannot be cropped back once it is full. Plain layers keep every
    position; the model's attention mask still applies the sliding window, so the logits are the same.
    """
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def loop_decoder_cache(model_kwargs: dict[str, Any]) -> EncoderDecoderCache:
    """Checks that `generate` prepared an empty cache, and returns a croppable one to decode with instead."""
    # generate's own cache, under either name (`CACHE_ARGUMENTS`)
    cache = next((model_kwargs[name] for name in CACHE_ARGUMENTS if model_kwargs.get(name) is not None), None)
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"Blockwise decoding needs a transformers Cache, got {type(cache).__name__}")
    if cache is not None and cache.get_seq_length() != 0:
        raise ValueError("Blockwise decoding starts from an empty cache; a pre-filled cache was passed")
    return new_decoder_cache()


def crop_cache(cache: Cache, length: int) -> None:
    """Crops the decoder self-attention cache to its first `length` positions (cross-attention is kept).

    A static cache ([`static_decoder_cache`]) is cropped by moving its write position back, with no host read:
    the entries past it stay in the buffer, where causal attention hides them until they are overwritten.
    """
    if is_static_cache(cache):
        for layer in cache.self_attention_cache.layers:
            layer.cumulative_length.fill_(length)
        return
    current = cache.get_seq_length()
    if length < current:
        cache.crop(length - current)


def select_cache_rows(cache: EncoderDecoderCache, rows: torch.Tensor) -> None:
    """Keeps only `rows` (batch indices, shape `(num_rows,)`) of the cache, in place, self- and cross-attention."""
    if not is_static_cache(cache):
        cache.batch_select_indices(rows)
        return
    for layer in cache.self_attention_cache.layers:  # transformers selects rows of dynamic caches only
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
    cache.cross_attention_cache.batch_select_indices(rows)


def reorder_cache_rows(cache: EncoderDecoderCache, rows: torch.Tensor, length: int) -> None:
    """Row `i` of the self-attention cache becomes row `rows[i]` (beam search's reorder; `rows` may repeat), in place,
    for its first `length` positions (the rest of a static buffer is stale and never attended to).

    Cross-attention is left as it is: beam search reorders beams within a row of the caller's batch, whose beams
    share one source, so their cross-attention entries are equal. A static cache keeps its buffers (a copy into
    them), so compiled graphs and CUDA graphs keep their addresses; only the positions in use move, not the whole
    capacity (at batch 16 and 4 beams, copying it all cost more than the decoder call).
    """
    for layer in cache.self_attention_cache.layers:
        if is_static_cache(cache):
            for buffer in (layer.keys, layer.values):  # (rows, heads, capacity, head_dim)
                used = buffer[:, :, :length]
                used.copy_(used.index_select(0, rows))
        else:
            layer.reorder_cache(rows)


def static_decoder_cache(num_layers: int, max_cache_len: int) -> EncoderDecoderCache:
    """An encoder-decoder cache whose self-attention layers are preallocated buffers of `max_cache_len` positions
    (transformers' `StaticLayer`, one per decoder layer), for the compiled engine.

    The layers exist from the start (transformers sizes the attention mask of the first forward from them; a layer
    created on first write would get a mask as long as the new tokens only). They are plain, not sliding-window
    layers, which could not be cropped back: the model's mask applies any window.

    Every forward then sees keys and values of the same shape, whatever the decoded length, so one compiled graph
    serves the whole call; cropping is a write-position move ([`crop_cache`]). Cross-attention keeps a dynamic
    cache: it is written once, by the (eager) first forward, and read unchanged afterwards.
    """
    layers = [StaticLayer(max_cache_len=max_cache_len) for _ in range(num_layers)]
    return EncoderDecoderCache(Cache(layers=layers), DynamicCache())


@contextlib.contextmanager
def attention_window(cache: EncoderDecoderCache, length: int) -> Iterator[None]:
    """For the span of one call, each self-attention layer of a [`static_decoder_cache`] shows the model only its
    first `length` positions: views of the same buffers (writes go to them) and a capacity of `length`, from which
    transformers sizes the attention mask ([`static_cache_mask`], `StaticLayer.get_mask_sizes`).

    Why: attention reads every position of the buffers it is given, and a buffer holds the decode's whole length
    limit (a model whose `generation_config` says 512 gets 576 positions, while a caption uses ~20): timed on the
    2-core AMD EPYC (an ad-hoc script; the changelog has the figures), a compiled 3-token `marian-base-en-de` int8
    call cost 2.45 ms over 64 positions and 3.68 ms over 576. The positions left out are the ones causal masking
    hides anyway.

    Args:
        length (`int`): positions shown, at most the capacity; at least the call's cache length plus its width.
    """
    layers = cache.self_attention_cache.layers
    full = [(layer.keys, layer.values, layer.max_cache_len) for layer in layers]
    try:
        for layer, (keys, values, capacity) in zip(layers, full, strict=True):
            if length > capacity:
                raise ValueError(f"an attention window of {length} positions in a cache of {capacity}")
            layer.keys, layer.values, layer.max_cache_len = keys[:, :, :length], values[:, :, :length], length
        yield
    finally:
        for layer, (keys, values, capacity) in zip(layers, full, strict=True):
            layer.keys, layer.values, layer.max_cache_len = keys, values, capacity


def static_cache_capacity(cache: EncoderDecoderCache) -> int:
    """Positions each self-attention buffer of a [`static_decoder_cache`] holds."""
    return cache.self_attention_cache.layers[0].max_cache_len


def static_cache_mask(cache: EncoderDecoderCache, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder attention mask that goes with a static cache: every buffer position may be attended to as far as
    padding goes (causal masking from the cache's write position hides the ones not written yet).

    Without it, transformers' decoders build a padding mask as long as the valid positions only, while the
    attention reads the whole buffer, and the empty slots are attended to.

    Returns:
        `torch.LongTensor` of shape `(batch_size, capacity)` (inside an [`attention_window`], the window's length).
    """
    return tokens.new_ones(tokens.shape[0], static_cache_capacity(cache))


def unpin_static_cache(cache: EncoderDecoderCache) -> None:
    """Clears the static-address marks transformers' `StaticLayer` puts on its buffers (for CUDA graphs).

    Inductor's freezing turns marked inputs into constants of the graph, like the weights: the cache would then be
    frozen at its compile-time contents. Called after the first forward, which allocates the buffers.
    """
    for layer in cache.self_attention_cache.layers:
        for tensor in (layer.keys, layer.values, layer.cumulative_length):
            if hasattr(tensor, "_dynamo_static_input_type"):
                del tensor._dynamo_static_input_type


def is_static_cache(cache: Cache) -> bool:
    """Whether `cache` is one of [`static_decoder_cache`]'s."""
    if not isinstance(cache, EncoderDecoderCache):
        return False
    self_attention = cache.self_attention_cache
    return bool(self_attention.layers) and all(isinstance(layer, StaticLayer) for layer in self_attention.layers)

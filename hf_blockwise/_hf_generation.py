"""Every contact with transformers' generation internals, in one place.

hf_blockwise plugs its decoding loop into `GenerationMixin.generate` as a callable `custom_generate`, so
transformers does all the preparation (generation config merging, encoder pass, decoder start tokens,
logits processors, stopping criteria, KV cache) and this package only replaces the decoding loop. What
that loop needs from transformers beyond public API is collected here and tested against the pinned
range below (`pyproject.toml`): when transformers changes, this is the one file to revisit.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateEncoderDecoderOutput

TESTED_TRANSFORMERS_RANGE = ">=5.23,<5.24"

# generate() arguments whose meaning a blockwise loop cannot keep; each maps to the reason shown.
_UNSUPPORTED_FLAGS = {
    "output_scores": "per-step scores",
    "output_logits": "per-step logits",
    "output_attentions": "attention maps",
    "output_hidden_states": "hidden states",
}


def validate_generation_config(generation_config: GenerationConfig) -> None:
    """Raises a `ValueError` naming the first `generate` argument that blockwise decoding cannot honour.

    Blockwise decoding reproduces *greedy* search; every other mode (sampling, beam search, contrastive
    search, DoLa, transformers' own assisted generation) changes what "the right output" is.
    """
    mode = generation_config.get_generation_mode()
    if mode != GenerationMode.GREEDY_SEARCH:
        raise ValueError(
            f"Blockwise decoding reproduces greedy search, but these generate arguments select {mode.value!r} "
            f"(do_sample={generation_config.do_sample}, num_beams={generation_config.num_beams}, "
            f"penalty_alpha={generation_config.penalty_alpha}, "
            f"prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens}). Use do_sample=False and "
            "num_beams=1, or call the base model's generate without hf_blockwise."
        )
    if getattr(generation_config, "dola_layers", None) is not None:
        raise ValueError("dola_layers (DoLa decoding) is not supported by blockwise decoding")
    if generation_config.use_cache is False:
        raise ValueError("Blockwise decoding needs the KV cache; use_cache=False is not supported")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"{flag}=True is not supported by blockwise decoding: {what} are not produced one token at a "
                "time. Generate without it, or use the base model's greedy generate."
            )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} is not supported; blockwise "
            "decoding crops a dynamic cache after every verification step"
        )


def pad_token_tensor(generation_config: GenerationConfig) -> torch.Tensor | None:
    """The pad id as prepared by `generate` (it may have been set from `eos_token_id`)."""
    return generation_config._pad_token_tensor


def encoder_decoder_only(model: nn.Module) -> None:
    if not getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"hf_blockwise decodes encoder-decoder (seq2seq) models; {type(model).__name__} has "
            "config.is_encoder_decoder=False"
        )


@dataclass
class StopRules:
    """The stopping criteria of one `generate` call, split into the parts a blockwise step handles in bulk.

    Attributes:
        max_length (`int`): total length (decoder prompt included) at which every row stops.
        eos_token_ids (`torch.LongTensor` of shape `(num_eos,)`, *optional*): ids that end a row.
        others (`list[StoppingCriteria]`): any other criteria, evaluated token by token.
    """

    max_length: int
    eos_token_ids: torch.Tensor | None
    others: list[StoppingCriteria]


def split_stopping_criteria(stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig) -> StopRules:
    max_length = generation_config.max_length
    eos_token_ids = None
    others: list[StoppingCriteria] = []
    for criterion in stopping_criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = min(max_length, criterion.max_length)
        elif isinstance(criterion, EosTokenCriteria):
            ids = criterion.eos_token_id.reshape(-1)
            eos_token_ids = ids if eos_token_ids is None else torch.cat([eos_token_ids, ids.to(eos_token_ids)])
        else:
            others.append(criterion)
    return StopRules(max_length=max_length, eos_token_ids=eos_token_ids, others=others)


def crop_cache(cache: Cache, length: int) -> None:
    """Crops the decoder self-attention cache to its first `length` positions (cross-attention is kept)."""
    current = cache.get_seq_length()
    if length < current:
        cache.crop(length - current)


def decoder_cache(model_kwargs: dict[str, Any]) -> EncoderDecoderCache:
    """The empty dynamic encoder-decoder cache that `generate` prepared for this call."""
    cache = model_kwargs.get("past_key_values")
    if not isinstance(cache, EncoderDecoderCache):
        raise ValueError(
            "Blockwise decoding needs the dynamic EncoderDecoderCache that generate prepares, got "
            f"{type(cache).__name__}"
        )
    if cache.get_seq_length() != 0:
        raise ValueError("Blockwise decoding starts from an empty cache; a pre-filled past_key_values was passed")
    return cache


def new_decoder_cache(model: nn.Module) -> EncoderDecoderCache:
    """An empty dynamic encoder-decoder cache for `model`, built as `generate` builds its own."""
    config = model.config.get_text_config(decoder=True)
    return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))


# Arguments that `generate` leaves in `model_kwargs` and that a decoder forward must not receive again.
_GENERATE_ONLY_KWARGS = {"use_cache", "past_key_values", "logits_to_keep", "output_attentions",
                         "output_hidden_states", "return_dict", "decoder_input_ids", "cache_position"}  # fmt: skip


def forward_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model kwargs of `generate` that every decoder forward receives unchanged (encoder outputs, mask)."""
    return {key: value for key, value in model_kwargs.items() if key not in _GENERATE_ONLY_KWARGS}


@contextmanager
def capture_output_projection_input(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Records what the model feeds its output projection (`get_output_embeddings()`) during the block.

    That tensor is the decoder state *after* whatever the architecture does before its logits (T5 rescales
    it by `d_model ** -0.5` when embeddings are tied), so heads built on it need no per-architecture code.

    Yields:
        A list that receives one tensor of shape `(batch_size, num_tokens, hidden_size)` per forward.
    """
    projection = model.get_output_embeddings()
    if projection is None:
        raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")
    captured: list[torch.Tensor] = []
    handle = projection.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


@contextmanager
def project_columns(model: nn.Module, columns: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's output projection sees only the given decoder positions.

    Seq2seq models in transformers project every decoder position onto the vocabulary; a drafter that needs
    a few positions per row would spend most of its time there. The states are selected at the projection's
    input, after whatever the architecture does before its logits, so the logits equal those of a full pass.

    Args:
        columns (`torch.LongTensor` of shape `(batch_size, num_columns)`): positions to keep per row; the model's
            `logits` then have shape `(batch_size, num_columns, vocab_size)`.
    """
    projection = model.get_output_embeddings()
    if projection is None:
        raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")

    def select(module: nn.Module, args: tuple) -> tuple:
        states = args[0]  # (B, W, d)
        index = columns[..., None].expand(-1, -1, states.shape[-1]).to(states.device)
        return (states.gather(1, index), *args[1:])

    handle = projection.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def streamer_from_generate_call() -> BaseStreamer | None:
    """The `streamer` passed to the `GenerationMixin.generate` call that is running this loop, if any.

    transformers 5.23 passes a callable `custom_generate` only the keyword arguments that its signature adds
    to `_sample`'s; `streamer` is not one of them, so it is dropped after the prompt was already streamed.
    Without this, a `TextIteratorStreamer` consumer would wait forever for tokens and the end signal.
    """
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        while caller is not None:
            if caller.f_code is GenerationMixin.generate.__wrapped__.__code__:
                return caller.f_locals.get("streamer")
            caller = caller.f_back
        return None
    finally:
        del frame


@dataclass
class BlockwiseGenerateOutput(GenerateEncoderDecoderOutput):
    """[`~generation.GenerateEncoderDecoderOutput`] plus the statistics of a blockwise decoding run.

    `past_key_values` is left `None`: rows end a blockwise run with caches of different valid lengths.

    Attributes:
        decoding_stats ([`DecodingStats`]): decoder forwards, tokens accepted per step and row, mean block.
    """

    decoding_stats: Any = None

"""Every contact with transformers' generation internals, in one place.

hf_blockwise plugs its decoding loop into `GenerationMixin.generate` as a callable `custom_generate`, so
transformers does all the preparation (generation config merging, encoder pass, decoder start tokens,
logits processors, stopping criteria, KV cache) and this package only replaces the decoding loop. What
that loop needs from transformers beyond public API is collected here and tested against the pinned
range below (`pyproject.toml`): when transformers changes, this is the one file to revisit.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticLayer
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateEncoderDecoderOutput
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)
from transformers.utils import ModelOutput, cached_file

from hf_blockwise.serialization import atomic_write_text

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
            "num_beams=1, or call the base model's generate without hf_blockwise (the automatic-speech-recognition "
            "pipeline adds num_beams=5 unless generate_kwargs or the model's generation config set num_beams)."
        )
    validate_segment_options(generation_config)
    if getattr(generation_config, "dola_layers", None) is not None:
        raise ValueError("dola_layers (DoLa decoding) is not supported by blockwise decoding")
    if generation_config.use_cache is False:
        raise ValueError(
            "Blockwise decoding needs the KV cache; use_cache=False is not supported (some configs default to it, "
            "e.g. Pix2Struct's text config: pass use_cache=True to generate)"
        )
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


# Whisper's generate writes its segment-loop options onto the generation config it passes to `generate` for each
# segment; these ones change what a segment's decoding is beyond greedy search.
_FALLBACK_THRESHOLDS = ("compression_ratio_threshold", "logprob_threshold")


def validate_segment_options(generation_config: GenerationConfig) -> None:
    """Raises a `ValueError` for the options of a segment-by-segment speech `generate` (Whisper's) that blockwise
    decoding cannot keep exact; decided from the generation config each segment's search receives.

    Every segment is an ordinary greedy search, decoded exactly (long-form audio, timestamps, language and task
    tokens, `prompt_ids` included). Refused:

    - temperature fallback: with `compression_ratio_threshold` or `logprob_threshold`, a segment whose output
      crosses a threshold is decoded again by *sampling* at the next temperature (`logprob_threshold` also needs
      per-step scores). The temperatures themselves never reach the search, so any threshold is refused; without
      one, `temperature=(0.0, ...)` decodes greedily at 0.0 only.
    - `condition_on_prev_tokens=True`: each segment's decoder prompt starts with the previous segment's tokens,
      left-padded per row under a `decoder_attention_mask`.
    - `return_token_timestamps=True` (word-level timestamps): read from every step's scores and cross-attention.
    """
    thresholds = {name: getattr(generation_config, name, None) for name in _FALLBACK_THRESHOLDS}
    set_thresholds = ", ".join(f"{name}={value}" for name, value in thresholds.items() if value is not None)
    if set_thresholds:
        raise ValueError(
            f"Temperature fallback ({set_thresholds}) is not supported by blockwise decoding: a segment whose output "
            "crosses the threshold is decoded again by sampling at the next temperature, and logprob_threshold needs "
            "per-step scores, while blockwise decoding reproduces greedy search. Generate without "
            "compression_ratio_threshold and logprob_threshold (temperature=0.0 alone is greedy), or use the base "
            "model's generate without hf_blockwise."
        )
    if getattr(generation_config, "condition_on_prev_tokens", None):
        raise ValueError(
            "condition_on_prev_tokens=True is not supported by blockwise decoding: each segment's decoder prompt "
            "then starts with the previous segment's tokens, left-padded per row, which blockwise decoding cannot "
            "position exactly. Generate without it (long-form audio is still decoded exactly, segment by segment), "
            "or use the base model's generate without hf_blockwise."
        )
    if getattr(generation_config, "return_token_timestamps", None):
        raise ValueError(
            "return_token_timestamps=True (word-level timestamps, e.g. the automatic-speech-recognition pipeline's "
            "return_timestamps='word') is not supported by blockwise decoding: they are read from every step's "
            "scores and cross-attention maps, which a blockwise step does not produce one token at a time. Use "
            "return_timestamps=True (segment timestamps), or the base model's generate without hf_blockwise."
        )


def decoder_prompt_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model kwargs of a `generate` call without a `decoder_attention_mask` that masks nothing.

    Greedy search extends such a mask with ones, step by step, which is what attending to every decoder position
    does. A mask with zeros (a left-padded decoder prompt) would shift each row's positions, which a blockwise
    step does not reproduce: refused.
    """
    mask = model_kwargs.get("decoder_attention_mask")
    if mask is None:
        return model_kwargs
    if not bool(mask.all()):
        raise ValueError(
            "A decoder_attention_mask with padding (decoder prompts of different lengths, left-padded) is not "
            "supported by blockwise decoding: give every row a decoder prompt of the same length, or use the base "
            "model's generate without hf_blockwise."
        )
    return {key: value for key, value in model_kwargs.items() if key != "decoder_attention_mask"}


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


@dataclass(frozen=True)
class GenerateCall:
    """What a `custom_generate` call of transformers' `generate` hands the loop, in this package's terms.

    Attributes:
        decoder_input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): decoder start (and prompt).
        stop_rules ([`StopRules`]).
        pad_token_id (`int`, *optional*): the pad id as `generate` prepared it.
        filler_token_id (`int`): what fills sequences and feeds after real tokens (the pad id, else 0).
        cache: an empty croppable `EncoderDecoderCache`.
        forward_kwargs (`dict`): what every decoder forward receives (encoder outputs, attention mask).
        encoder_input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        streamer: the `streamer=` of the `generate` call, if any.
    """

    decoder_input_ids: torch.Tensor
    stop_rules: StopRules
    pad_token_id: int | None
    filler_token_id: int
    cache: EncoderDecoderCache
    forward_kwargs: dict[str, Any]
    encoder_input_ids: torch.Tensor | None
    encoder_attention_mask: torch.Tensor | None
    streamer: BaseStreamer | None


def adapt_generate_call(
    model: nn.Module,
    input_ids: torch.Tensor,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool,
    streamer: BaseStreamer | None,
    inputs_tensor: torch.Tensor | None,
    model_kwargs: dict[str, Any],
) -> GenerateCall:
    """Validates the arguments of a `custom_generate` call and translates them into a [`GenerateCall`]."""
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by blockwise decoding")
    validate_generation_config(generation_config)
    model_kwargs = decoder_prompt_kwargs(model_kwargs)
    rules = split_stopping_criteria(stopping_criteria, generation_config)
    if rules.others and rules.eos_token_ids is None:
        raise ValueError(
            "Custom stopping criteria are supported together with an eos_token_id only: without one, greedy "
            "search keeps extending rows that have stopped, which blockwise decoding does not reproduce"
        )
    check_decoder_length(model, rules.max_length, input_ids.shape[1])
    streamer = streamer if streamer is not None else streamer_from_generate_call()
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer= supports batch size 1 only, like transformers' TextStreamer")
    pad = pad_token_tensor(generation_config)
    pad_token_id = None if pad is None else int(pad)
    return GenerateCall(
        decoder_input_ids=input_ids,
        stop_rules=rules,
        pad_token_id=pad_token_id,
        filler_token_id=0 if pad_token_id is None else pad_token_id,
        cache=loop_decoder_cache(model_kwargs),
        forward_kwargs=forward_kwargs(model_kwargs),
        # a speech or vision encoder's inputs are not token ids that a drafter could copy
        encoder_input_ids=inputs_tensor if encoder_input_name(model) == "input_ids" else None,
        encoder_attention_mask=encoder_output_mask(
            model, encoder_hidden_states(model_kwargs), model_kwargs.get("attention_mask")
        ),
        streamer=streamer,
    )


def encoder_output_mask(
    model: nn.Module, encoder_states: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The attention mask over the encoder's *output* positions, which drafters that attend to it need.

    A text encoder keeps one output per input token, so the generate call's mask serves as it is. Speech encoders
    subsample their input frames (Speech2Text 4x, wav2vec2 by its convolutions); their models map a frame mask
    onto the output positions with `_get_feature_vector_attention_mask`, used here.

    Args:
        encoder_states (`torch.Tensor` of shape `(batch_size, output_length, hidden_size)`, *optional*).
        attention_mask (`torch.LongTensor` of shape `(batch_size, input_length)`, *optional*).

    Returns:
        `torch.LongTensor` of shape `(batch_size, output_length)`, or `None` without a mask.
    """
    if attention_mask is None or encoder_states is None or attention_mask.shape[1] == encoder_states.shape[1]:
        return attention_mask
    for module in (model, model.get_encoder()):
        subsample = getattr(module, "_get_feature_vector_attention_mask", None)
        if subsample is not None:
            return subsample(encoder_states.shape[1], attention_mask).long()
    if not decoder_reads_frame_mask(model, attention_mask.shape[1], encoder_states.shape[1]):
        # Whisper: its decoder attends to every encoder position, the padded audio's included; the drafters do too
        return None
    raise ValueError(
        f"The attention mask covers {attention_mask.shape[1]} input positions but the encoder of "
        f"{model_name(model)} outputs {encoder_states.shape[1]}, its decoder's output depends on the mask, and the "
        "model has no mapping between them (_get_feature_vector_attention_mask)"
    )


_READS_FRAME_MASK: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def decoder_reads_frame_mask(model: nn.Module, input_length: int, output_length: int) -> bool:
    """Whether the model's logits depend on the `attention_mask` of its encoder *inputs* once the encoder has run.

    Checked once per model (the verdict is cached), in eval mode, on random encoder states of `output_length`
    positions and two masks of `input_length` positions, one of them masking half a row: Whisper's decoder reads no
    mask (its audio is padded to the window and attended to whole), so equal logits.
    """
    verdict = _READS_FRAME_MASK.get(model)
    if verdict is not None:
        return verdict
    parameter = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, output_length, encoder_hidden_size(model), generator=generator)
    encoder_outputs = BaseModelOutput(last_hidden_state=states.to(parameter.device, parameter.dtype))
    full = torch.ones(2, input_length, dtype=torch.long, device=parameter.device)
    half = full.clone()
    half[1, input_length // 2 :] = 0
    was_training = model.training
    model.eval()  # dropout would make two passes differ
    try:
        with torch.no_grad():
            tokens = probe_inputs(model, 2).decoder_tokens
            logits = [
                decoder_forward(
                    model, tokens, new_decoder_cache(), {"encoder_outputs": encoder_outputs, "attention_mask": mask}
                )[0]
                for mask in (full, half)
            ]
    finally:
        model.train(was_training)
    verdict = not torch.equal(logits[0], logits[1])
    _READS_FRAME_MASK[model] = verdict
    return verdict


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


def static_cache_capacity(cache: EncoderDecoderCache) -> int:
    """Positions each self-attention buffer of a [`static_decoder_cache`] holds."""
    return cache.self_attention_cache.layers[0].max_cache_len


def static_cache_mask(cache: EncoderDecoderCache, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder attention mask that goes with a static cache: every buffer position may be attended to as far as
    padding goes (causal masking from the cache's write position hides the ones not written yet).

    Without it, transformers' decoders build a padding mask as long as the valid positions only, while the
    attention reads the whole buffer, and the empty slots are attended to.

    Returns:
        `torch.LongTensor` of shape `(batch_size, capacity)`.
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


def new_decoder_cache() -> EncoderDecoderCache:
    """An empty dynamic encoder-decoder cache whose self-attention layers can all be cropped.

    Built without the model's config on purpose: with one, transformers gives sliding-window layers
    (T5Gemma) a rolling buffer that cannot be cropped back once it is full. Plain layers keep every
    position; the model's attention mask still applies the sliding window, so the logits are the same.
    """
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def loop_decoder_cache(model_kwargs: dict[str, Any]) -> EncoderDecoderCache:
    """Checks that `generate` prepared an empty cache, and returns a croppable one to decode with instead."""
    cache = model_kwargs.get("past_key_values")
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(f"Blockwise decoding needs a transformers Cache, got {type(cache).__name__}")
    if cache is not None and cache.get_seq_length() != 0:
        raise ValueError("Blockwise decoding starts from an empty cache; a pre-filled past_key_values was passed")
    return new_decoder_cache()


def select_cache_rows(cache: EncoderDecoderCache, rows: torch.Tensor) -> None:
    """Keeps only `rows` (batch indices, shape `(num_rows,)`) of the cache, in place, self- and cross-attention."""
    if not is_static_cache(cache):
        cache.batch_select_indices(rows)
        return
    for layer in cache.self_attention_cache.layers:  # transformers selects rows of dynamic caches only
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
    cache.cross_attention_cache.batch_select_indices(rows)


def select_forward_rows(kwargs: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The decoder forward's fixed inputs (encoder output, attention mask) for `rows` of the batch only."""

    def select(key: str, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            return value.index_select(0, rows)
        if isinstance(value, ModelOutput):
            return type(value)(**{name: select(key, item) for name, item in value.items()})
        if isinstance(value, tuple):
            return tuple(select(key, item) for item in value)
        raise ValueError(
            f"Blockwise decoding drops finished rows from the batch but cannot select rows of the generate "
            f"argument {key!r} ({type(value).__name__})"
        )

    return {key: select(key, value) for key, value in kwargs.items()}


def decoder_forward(
    model: nn.Module,
    decoder_input_ids: torch.Tensor,
    cache: EncoderDecoderCache,
    forward_kwargs: dict[str, Any],
    capture_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One cached decoder pass over `decoder_input_ids`, as `generate` runs it.

    Args:
        decoder_input_ids (`torch.LongTensor` of shape `(batch_size, width)`).
        capture_states (`bool`): also return what the model feeds its output projection.

    Returns:
        logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`) and, with `capture_states`,
        states (`torch.Tensor` of shape `(batch_size, width, hidden_size)`), else `None`.
    """
    if not capture_states:
        outputs = model(
            decoder_input_ids=decoder_input_ids, past_key_values=cache, use_cache=True, return_dict=True,
            **forward_kwargs,
        )  # fmt: skip
        return outputs.logits, None
    with capture_output_projection_input(model) as captured:
        outputs = model(
            decoder_input_ids=decoder_input_ids, past_key_values=cache, use_cache=True, return_dict=True,
            **forward_kwargs,
        )  # fmt: skip
    if not captured:
        raise ValueError(
            f"{type(model).__name__}'s get_output_embeddings() ({type(model.get_output_embeddings()).__name__}) "
            "was not called in its forward, so the decoder states it projects cannot be read"
        )
    return outputs.logits, captured[-1]


# Arguments that `generate` leaves in `model_kwargs` and that a decoder forward must not receive again. `labels`: a
# processor's training targets, which `generate` passes on (the image-text-to-text pipeline with DonutProcessor
# does); greedy search's forward computes an unused loss over its one-token feeds, which a wider feed breaks.
_GENERATE_ONLY_KWARGS = {"use_cache", "past_key_values", "logits_to_keep", "output_attentions",
                         "output_hidden_states", "return_dict", "decoder_input_ids", "cache_position",
                         "labels"}  # fmt: skip


def forward_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model kwargs of `generate` that every decoder forward receives unchanged (encoder outputs, mask)."""
    return {key: value for key, value in model_kwargs.items() if key not in _GENERATE_ONLY_KWARGS}


def save_shipped_model(model: PreTrainedModel, directory: str | os.PathLike) -> None:
    """Saves a model to ship in the repository: fp16 weights (half the size), a config that makes plain
    `from_pretrained` load it as float32 (fp16 is slow and erratic on CPUs), and a generation config that limits
    new tokens rather than the total length, so that `generate(max_new_tokens=...)` warns about nothing."""
    model.to(torch.float16).save_pretrained(directory)
    model.to(torch.float32)
    config_path = os.path.join(directory, "config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["dtype"] = "float32"
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        with open(generation_path, encoding="utf-8") as handle:
            generation = json.load(handle)
        if "max_length" in generation:
            generation["max_new_tokens"] = generation.pop("max_length")
        atomic_write_text(generation_path, json.dumps(generation, indent=2, sort_keys=True) + "\n")


def encoder_hidden_states(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The encoder output among a decoder forward's kwargs (computed once per `generate` call), if any."""
    outputs = kwargs.get("encoder_outputs")
    if outputs is None:
        return None
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs.last_hidden_state


def encoder_hidden_size(model: nn.Module) -> int:
    """Width of the model's encoder output, read from the encoder's config (`d_model` or `hidden_size`)."""
    encoder = model.get_encoder()
    for config in (getattr(encoder, "config", None), getattr(model.config, "encoder", None), model.config):
        for name in ("d_model", "hidden_size"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"Cannot tell the encoder output width of {type(model).__name__} from its config")


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


# ---------------------------------------------------------------------------------------------------------------
# Model quirks: where a transformers model keeps what the loop and the heads need
# ---------------------------------------------------------------------------------------------------------------


class BaseModelWrapper(nn.Module):
    """A module that wraps a transformers seq2seq model as `self.base_model` (PEFT's `PeftModel` pattern).

    [`BlockwiseHeadsModel`] and [`FeatureDrafterModel`] subclass it, so [`unwrap_base`] can tell a wrapper from a
    transformers model (which also has a `base_model` attribute: its bare backbone), and `config`, `device` and
    `generation_config` are the base's.
    """

    base_model: nn.Module

    @property
    def config(self) -> PretrainedConfig:
        """The base model's config, as for PEFT's `PeftModel`; the wrapper's own settings live beside it."""
        return self.base_model.config

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    @property
    def generation_config(self) -> GenerationConfig:
        return self.base_model.generation_config


def position_limit(stack: nn.Module | None) -> int | None:
    """How many positions an encoder or decoder stack can embed, or `None` when it has no fixed table.

    Read from the module, not the model type: a stack whose `embed_positions` is an `nn.Embedding` (learned, as in
    BART, or a fixed sinusoidal table, as in Marian and Pegasus) fails with an `IndexError` past its last row
    (BART-style tables keep `offset` rows in front); relative positions (T5) and tables that grow on demand
    (M2M100, NLLB) have no limit.
    """
    table = getattr(stack, "embed_positions", None)
    if not isinstance(table, nn.Embedding):
        return None
    return table.num_embeddings - int(getattr(table, "offset", 0))


def decoder_position_limit(model: nn.Module) -> int | None:
    """[`position_limit`] of the model's decoder stack."""
    return position_limit(_stack(model, "get_decoder"))


def _stack(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    return get() if callable(get) else None


def check_generate_inputs(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Clear errors for inputs `generate` would otherwise fail on deep inside the model: an empty batch (a reshape
    error in the encoder) and a source longer than the encoder's positions (an `IndexError`).

    Args:
        model: the transformers seq2seq model whose `generate` is about to be called.
        args, kwargs: the positional and keyword arguments of that call.
    """
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.shape[0] == 0:
        raise ValueError("generate was called with an empty batch (batch size 0)")
    limit = position_limit(_stack(unwrap_base(model), "get_encoder"))
    if limit is not None and inputs.dim() >= 2 and inputs.shape[1] > limit:
        raise ValueError(
            f"the input is {inputs.shape[1]} tokens long, but the encoder of {model_name(model)} has {limit} "
            f"positions; truncate it, e.g. tokenizer(..., truncation=True, max_length={limit})"
        )


def check_decoder_length(model: nn.Module, max_length: int, prompt_length: int) -> None:
    """A `ValueError` when decoding up to `max_length` tokens would feed the decoder positions it does not have.

    Greedy search feeds positions 0 .. max_length - 2 (the last token is never fed), and so does the loop.
    """
    limit = decoder_position_limit(model)
    if limit is not None and max_length - 1 > limit:
        raise ValueError(
            f"max_length {max_length} (decoder prompt {prompt_length} + {max_length - prompt_length} new tokens) "
            f"needs {max_length - 1} decoder positions, but the decoder of {model_name(model)} has {limit}; pass "
            f"max_new_tokens={limit + 1 - prompt_length} or less"
        )


def decoder_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config that describes the decoder: its own sub-config where the model has one (`decoder`:
    `EncoderDecoderModel`, `VisionEncoderDecoderModel`, `SpeechEncoderDecoderModel`, T5Gemma; `text_config`: the
    text decoder of Pix2Struct), else the model's config.

    Not `config.get_text_config(decoder=True)`: for configs without a decoder sub-config (Marian in 5.23) it
    returns a freshly built config with default sizes, not the model's.
    """
    for name in ("decoder", "text_config"):
        sub_config = getattr(config, name, None)
        if isinstance(sub_config, PretrainedConfig):
            return sub_config
    return config


def decoder_layer_count(model: nn.Module) -> int:
    """How many layers the model's decoder has, from the standard transformers config attributes."""
    config = decoder_config(model.config)
    for name in ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "num_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"Cannot tell how many decoder layers a {type(model.config).__name__} has from its config")


def decoder_ffn_width(config: Any) -> int:
    """The base decoder's feed-forward width, read from the standard transformers config attributes."""
    for name in ("decoder_ffn_dim", "d_ff", "ffn_dim", "intermediate_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"Cannot tell the decoder feed-forward width of a {type(config).__name__}; set "
        "BlockwiseConfig(head_hidden_size=...) explicitly"
    )


def unwrap_base(model: nn.Module) -> nn.Module:
    """The transformers model inside a [`BlockwiseHeadsModel`], or `model` itself.

    Not `getattr(model, "base_model", model)`: every transformers model has a `base_model` attribute too (its
    bare backbone, without the output layer).
    """
    return model.base_model if isinstance(model, BaseModelWrapper) else model


def shortlist_projection(base_model: nn.Module, shortlist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of the base's output projection (and its biases) for the token ids in `shortlist`.

    Returns:
        weight (`torch.Tensor` of shape `(shortlist_size, hidden_size)`) and bias (`torch.Tensor` of shape
        `(shortlist_size,)`, or `None` when the base adds none).
    """
    projection = base_model.get_output_embeddings()
    weight = projection.weight[shortlist]
    bias = None if getattr(projection, "bias", None) is None else projection.bias[shortlist]
    final_logits_bias = getattr(base_model, "final_logits_bias", None)
    if final_logits_bias is not None:
        extra = final_logits_bias.reshape(-1)[shortlist].to(weight.dtype)
        bias = extra if bias is None else bias + extra
    return weight, bias


def output_projection_logits(base_model: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Applies the base model's output projection, and the logit bias it adds after it, to `states`.

    BART, mBART, Marian and Pegasus add a `final_logits_bias` buffer after `lm_head`; the rescaling T5 applies
    happens *before* `lm_head`, so it is already part of the captured states.

    Args:
        base_model: a transformers seq2seq model.
        states (`torch.Tensor` of shape `(..., hidden_size)`).

    Returns:
        `torch.Tensor` of shape `(..., vocab_size)`.
    """
    logits = base_model.get_output_embeddings()(states)
    final_logits_bias = getattr(base_model, "final_logits_bias", None)
    if final_logits_bias is not None:
        logits = logits + final_logits_bias.reshape(-1).to(logits.dtype)
    return logits


def _input_embeddings(module: nn.Module | None) -> nn.Module | None:
    """A module's input embeddings: `get_input_embeddings()` where it has one, else its `embed_tokens` (FSMT)."""
    if module is None:
        return None
    if hasattr(module, "get_input_embeddings"):
        return module.get_input_embeddings()
    return getattr(module, "embed_tokens", None)


def decoder_input_embeddings(model: nn.Module) -> nn.Module:
    """The embedding layer of the model's decoder tokens."""
    embeddings = _input_embeddings(model.get_decoder() if hasattr(model, "get_decoder") else None)
    if embeddings is None:
        raise ValueError(f"Cannot find the decoder's token embeddings of {type(model).__name__}")
    return embeddings


def check_shared_vocabulary(model: nn.Module) -> None:
    """Raises a `ValueError` unless the model's encoder and decoder embed the same token ids the same way."""
    encoder_embeddings = _input_embeddings(model.get_encoder())
    decoder_embeddings = _input_embeddings(model.get_decoder() if hasattr(model, "get_decoder") else None)
    shared = encoder_embeddings is not None and (
        encoder_embeddings is decoder_embeddings
        or (
            decoder_embeddings is not None
            and encoder_embeddings.weight.shape == decoder_embeddings.weight.shape
            and encoder_embeddings.weight.data_ptr() == decoder_embeddings.weight.data_ptr()
        )
    )
    if not shared:
        raise ValueError(
            f"InputCopyDrafter copies source token ids into the output, but {type(model).__name__} has separate "
            "source and target vocabularies (its encoder and decoder embeddings differ), so a source id means "
            "another token in the output. Use a model with a shared vocabulary, or another drafter."
        )


def base_location(heads_name_or_path: str | os.PathLike, base_name_or_path: str) -> str:
    """A relative base path is looked up beside the heads first, so a directory holding both (e.g. with
    `base_model_name_or_path="."`) can be moved or shipped as one piece."""
    beside_heads = os.path.join(heads_name_or_path, base_name_or_path)
    if not os.path.isabs(base_name_or_path) and os.path.isfile(os.path.join(beside_heads, "config.json")):
        return beside_heads
    return base_name_or_path


def resolved_base_location(adapter_name_or_path: str | os.PathLike, base_name_or_path: str | None) -> str | None:
    """Where an adapter's (heads', drafter's) recorded base is: [`base_location`], made absolute when it is a local
    directory, so that the adapter re-saved anywhere still names a base that resolves (a bare `"."` would be
    read against the current directory)."""
    if base_name_or_path is None:
        return None
    location = base_location(adapter_name_or_path, base_name_or_path)
    return os.path.abspath(location) if os.path.isdir(location) else location


def warn_if_other_base(recorded: str | None, base_model: nn.Module, what: str) -> None:
    """Warns when an adapter trained for one named base is attached to a model loaded from another: same shapes
    are not the same model, and its drafts would rarely be accepted (decoding stays exact). Local directories are
    compared by their real paths, hub names as written."""
    actual = getattr(base_model, "name_or_path", "") or ""
    if not recorded or not actual:
        return
    if os.path.isdir(recorded) and os.path.isdir(actual):
        same = os.path.realpath(recorded) == os.path.realpath(actual)
    else:
        same = recorded.rstrip("/") == actual.rstrip("/")
    if not same:
        warnings.warn(
            f"These {what} were trained for base {recorded!r} and are attached to {actual!r}: decoding stays exact, "
            "but their drafts will rarely be accepted unless the two are the same model",
            stacklevel=4,
        )


def check_local_path(name_or_path: str | os.PathLike, what: str) -> None:
    """A `ValueError` for a location that looks like a local directory but is none, instead of the hub's "couldn't
    connect" or "not a valid model identifier" message. Local-looking: absolute, starting with `.` or `~`, with a
    backslash or more than one `/`, or whose first part is an existing local directory (`checkpoints/hedas`);
    anything else may be a hub id (`org/name`) and is left to transformers."""
    text = os.fspath(name_or_path)
    if os.path.isdir(text):
        return
    first = text.replace("\\", "/").split("/")[0]
    looks_local = (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or "\\" in text
        or text.count("/") > 1
        or (first != text and os.path.isdir(first))
    )
    if looks_local:
        where = os.path.abspath(os.path.expanduser(text))
        kind = "a file, not a directory" if os.path.isfile(where) else "no such directory"
        raise ValueError(f"{what} {text!r}: {kind} ({where}); check the path (hub ids have the form 'org/name')")


def adapter_base(
    adapter_name_or_path: str | os.PathLike,
    recorded: str | None,
    base_model: nn.Module | None,
    what: str,
    base_model_kwargs: dict[str, Any],
) -> tuple[str | None, nn.Module]:
    """The base an adapter (heads, feature drafter) attaches to, and where its config says that base is.

    With `base_model` given, that one, with a warning when the adapter was trained for another named base
    ([`warn_if_other_base`]); else the recorded base ([`resolved_base_location`]) loaded with
    [`load_encoder_decoder`]`(location, **base_model_kwargs)`.
    """
    location = resolved_base_location(adapter_name_or_path, recorded)
    if base_model is not None:
        warn_if_other_base(location, unwrap_base(base_model), what)
        return location, base_model
    if location is None:
        raise ValueError(
            f"{adapter_name_or_path} names no base checkpoint (base_model_name_or_path is null); pass base_model= "
            "explicitly"
        )
    check_local_path(location, "the recorded base model (pass base_model= to attach one)")
    return location, load_encoder_decoder(location, **base_model_kwargs)


def load_encoder_decoder(location: str | os.PathLike, **kwargs: Any) -> PreTrainedModel:
    """An encoder-decoder checkpoint through the auto class its config's `model_type` maps to: speech (Whisper,
    Speech2Text, `SpeechEncoderDecoderModel`), image-text (`VisionEncoderDecoderModel`, Pix2Struct) or, for every
    other type, `AutoModelForSeq2SeqLM` (whose error names a type it cannot load)."""
    model_type = AutoConfig.from_pretrained(location).model_type
    if model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq.from_pretrained(location, **kwargs)
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText.from_pretrained(location, **kwargs)
    return AutoModelForSeq2SeqLM.from_pretrained(location, **kwargs)


def has_file(name_or_path: str | os.PathLike, filename: str) -> bool:
    check_local_path(name_or_path, "no model")
    if os.path.isdir(name_or_path):
        return os.path.isfile(os.path.join(name_or_path, filename))
    return cached_file(str(name_or_path), filename, _raise_exceptions_for_missing_entries=False) is not None


def resolve_file(name_or_path: str | os.PathLike, filename: str) -> str:
    check_local_path(name_or_path, "no model")
    path = os.path.join(name_or_path, filename)
    if os.path.isdir(name_or_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{name_or_path} holds no {filename}; is it a directory written by save_pretrained?"
            )
        return path
    resolved = cached_file(str(name_or_path), filename)
    if resolved is None:
        raise FileNotFoundError(f"{name_or_path} holds no {filename}")
    return resolved


def model_name(model: nn.Module) -> str:
    """The checkpoint a model was loaded from, or its model type when built from a config."""
    return getattr(model, "name_or_path", "") or f"model_type={getattr(model.config, 'model_type', '?')!r}"


def _special_token_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(source, name, None) if source is not None else None
            ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [int(value)])
    return ids


def _vocabulary_size(module: nn.Module, fallback: int) -> int:
    embeddings = _input_embeddings(module)
    return int(getattr(embeddings, "num_embeddings", 0) or fallback)


@dataclass(frozen=True)
class ProbeInputs:
    """A tiny batch to probe a model's decoder with (see `generation.capability`).

    Attributes:
        forward_kwargs (`dict`): encoder outputs and attention mask of 2 sources of different lengths.
        decoder_tokens (`torch.LongTensor` of shape `(2, length)`): decoder start token, then ordinary tokens.
        pad_token_id (`int`, *optional*).
    """

    forward_kwargs: dict[str, Any]
    decoder_tokens: torch.Tensor
    pad_token_id: int | None


def encoder_input_name(model: nn.Module) -> str:
    """What the model's encoder reads: `input_ids` for text, `input_features` (Whisper, Speech2Text), `input_values`
    (wav2vec2-style speech encoders), `pixel_values` (vision encoders), `flattened_patches` (Pix2Struct)."""
    return getattr(model.get_encoder(), "main_input_name", "input_ids")


def probe_inputs(model: nn.Module, length: int) -> ProbeInputs:
    """Two short sources of different lengths and ordinary (non-special) decoder tokens.

    A text encoder encodes two random sources, the second padded. The decoder of a speech or vision model only
    sees its encoder's output, so the probe hands it random encoder states of the encoder's width instead of
    synthesizing audio or images.
    """
    special = _special_token_ids(model)
    fallback = int(getattr(decoder_config(model.config), "vocab_size", 0) or 0)
    generator = torch.Generator().manual_seed(0)

    def ordinary(vocab_size: int, count: int) -> torch.Tensor:
        candidates = torch.tensor([i for i in range(min(vocab_size, 4096)) if i not in special])
        return candidates[torch.randperm(len(candidates), generator=generator)[:count]]

    parameter = next(model.parameters())
    device = parameter.device
    pad = model.config.pad_token_id
    if encoder_input_name(model) == "input_ids":
        encoder = model.get_encoder()
        source = ordinary(_vocabulary_size(encoder, fallback), 2 * 5).reshape(2, 5).to(device)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], device=device)
        source = source.masked_fill(mask == 0, 0 if pad is None else int(pad))
        encoder_outputs = encoder(input_ids=source, attention_mask=mask, return_dict=True)
        forward_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": mask}
    else:
        states = torch.randn(2, 6, encoder_hidden_size(model), generator=generator)
        forward_kwargs = {"encoder_outputs": BaseModelOutput(last_hidden_state=states.to(device, parameter.dtype))}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    tokens = ordinary(_vocabulary_size(decoder, fallback) if decoder is not None else fallback, 2 * length)
    tokens = tokens.reshape(2, length).to(device)
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    start = getattr(model.config, "decoder_start_token_id", None) if start is None else start
    if isinstance(start, int):
        tokens[:, 0] = start
    return ProbeInputs(
        forward_kwargs=forward_kwargs,
        decoder_tokens=tokens,
        pad_token_id=None if pad is None else int(pad),
    )


def check_output_projection(model: nn.Module) -> None:
    """Raises a `ValueError` unless `get_output_embeddings()` is the layer that turns decoder states into logits.

    Proposal heads project their states with it; on a model where it is something else (FSMT returns its
    decoder's input embeddings) they would crash or draft nonsense. Checked on one probe forward: its input
    must be the decoder states, and projecting them (plus any logit bias) must give the model's own choices.
    """
    projection = model.get_output_embeddings()
    with torch.no_grad():
        inputs = probe_inputs(model, 2)
    problem = None
    if projection is None or getattr(projection, "weight", None) is None:
        problem = f"get_output_embeddings() returns {type(projection).__name__}"
    else:
        with torch.no_grad():
            try:
                logits, states = decoder_forward(
                    model, inputs.decoder_tokens, new_decoder_cache(), inputs.forward_kwargs, capture_states=True
                )
            except ValueError as error:
                problem = str(error)
        if problem is None:
            if not states.is_floating_point() or states.shape[:2] != logits.shape[:2]:
                problem = f"get_output_embeddings() ({type(projection).__name__}) is not applied to the decoder states"
            elif not torch.equal(output_projection_logits(model, states).argmax(-1), logits.argmax(-1)):
                problem = f"get_output_embeddings() ({type(projection).__name__}) does not produce the model's logits"
    if problem is not None:
        raise ValueError(
            f"Proposal heads project their states with the base's output projection, but for "
            f"{type(model).__name__} ({model_name(model)}) {problem}. Draft with another drafter (ReferenceDrafter, "
            "InputCopyDrafter, NonAutoregressiveDrafter) or use a model whose get_output_embeddings() is its "
            "output layer."
        )


def expert_capacity_limit(model: nn.Module) -> tuple[int, str] | None:
    """The most decoder tokens a row may feed in one forward before a mixture-of-experts decoder drops tokens.

    Switch Transformers routes at most `expert_capacity` tokens of a sequence to one expert per forward and
    drops the rest, so a wider verification pass is computed differently from one-token steps. NLLB-MoE in
    eval mode sizes its capacity as `moe_eval_capacity_token_fraction` of the forward's tokens: below 1,
    what is dropped depends on how many tokens a forward holds, so any multi-token feed may differ.

    Returns:
        `(limit, reason)`, or `None` when the decoder drops nothing.
    """
    config = decoder_config(model.config)
    fraction = getattr(config, "moe_eval_capacity_token_fraction", None)
    if fraction is not None:
        if float(fraction) < 1.0:
            return 1, f"its experts keep only moe_eval_capacity_token_fraction={fraction} of a forward's tokens"
        return None
    capacity = getattr(config, "expert_capacity", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        return capacity, f"its experts drop tokens beyond expert_capacity={capacity} per sequence and forward"
    return None


def processor_ignores_prefix(processor: Any) -> bool:
    """Whether a logits processor's output depends on the scores only (never on `input_ids` or its length).

    Known from transformers' own processors: `suppress_tokens`, and sequence biases / `bad_words_ids` made of
    single tokens only (a constant bias). Any other processor is taken to depend on the prefix.
    """
    if isinstance(processor, SuppressTokensLogitsProcessor):
        return True
    if isinstance(processor, SequenceBiasLogitsProcessor):  # NoBadWordsLogitsProcessor included
        return all(len(sequence) == 1 for sequence in processor.sequence_bias)
    return False


def processor_acts_at(processor: Any, length: int) -> bool:
    """Whether a logits processor may change the scores when the prefix has `length` tokens.

    `False` only where transformers' processor is known to return its input unchanged at that length (forced
    BOS/EOS, minimum length, begin-suppression); any other processor is taken to act everywhere.
    """
    if isinstance(processor, ForcedEOSTokenLogitsProcessor):
        return length == processor.max_length - 1
    if isinstance(processor, ForcedBOSTokenLogitsProcessor):
        return length == 1
    if isinstance(processor, MinLengthLogitsProcessor):
        return length < processor.min_length
    if isinstance(processor, SuppressTokensAtBeginLogitsProcessor):
        return length == processor.begin_index
    return True

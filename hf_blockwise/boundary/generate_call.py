"""The `custom_generate` calling convention: what transformers' `generate` hands the loop, and what it gets back.

[`adapt_generate_call`] validates a call ([`validate_generation_config`]: greedy search with a KV cache and no
per-step outputs; [`decoder_prompt_kwargs`]) and translates it into a [`GenerateCall`]: stopping rules, pad id, a
croppable cache, the kwargs every decoder forward receives ([`forward_kwargs`]; [`encoder_hidden_states`] reads the
encoder output among them, [`select_forward_rows`] keeps the rows still decoding), the source ids and
encoder-output mask, and the streamer `generate` does not pass on ([`streamer_from_generate_call`]; the same frame
read refuses a dropped `assistant_model=`, [`check_no_assistant_model`]). [`stop_string_kwargs`] builds the
stop-string criterion a wrapper's `tokenizer=` would otherwise lose. The loop returns a [`BlockwiseGenerateOutput`].
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateEncoderDecoderOutput
from transformers.utils import ModelOutput

from hf_blockwise.boundary.beam import validate_beam_config
from hf_blockwise.boundary.cache import CACHE_ARGUMENTS, check_cache_settings, loop_decoder_cache
from hf_blockwise.boundary.inputs import check_attention_mask, check_decoder_length, warn_unmasked_padding
from hf_blockwise.boundary.media import encoder_output_mask, validate_segment_options
from hf_blockwise.boundary.models import encoder_input_name
from hf_blockwise.boundary.processors import StopRules, split_stopping_criteria

# generate() arguments whose meaning a blockwise loop cannot keep; each maps to the reason shown.
_UNSUPPORTED_FLAGS = {
    "output_attentions": "attention maps",
    "output_hidden_states": "hidden states",
}


def is_beam_search(generation_config: GenerationConfig) -> bool:
    """Whether a `generate` call asks for beam search (`num_beams > 1`, no sampling): the blockwise beam loop's."""
    return generation_config.get_generation_mode() == GenerationMode.BEAM_SEARCH


def validate_generation_config(generation_config: GenerationConfig) -> None:
    """Raises a `ValueError` naming the first `generate` argument that blockwise decoding cannot honour.

    Blockwise decoding reproduces *greedy* search, sampling as greedy search on shared noise
    (`generation/sampling.py`), and beam search ([`validate_beam_config`]); every other mode (beam sampling, group
    beam search, contrastive search, DoLa, transformers' own assisted generation) changes what "the right output" is.
    """
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        given, neutral = _selecting_arguments(generation_config, mode)
        raise ValueError(
            f"Blockwise decoding reproduces greedy search, sampling and beam search, but {given} selects "
            f"{mode.value!r}. Use "
            f"{neutral}, or call the base model's generate without hf_blockwise."
        )
    validate_segment_options(generation_config)
    if getattr(generation_config, "dola_layers", None) is not None:
        raise ValueError("dola_layers (DoLa decoding) is not supported by blockwise decoding")
    check_cache_settings(generation_config)
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"{flag}=True is not supported by blockwise decoding: {what} are not produced one token at a "
                "time. Generate without it, or use the base model's greedy generate."
            )


def _selecting_arguments(config: GenerationConfig, mode: GenerationMode) -> tuple[str, str]:
    """The generate arguments that select `mode` (in transformers' precedence, `get_generation_mode`), and the
    values that select greedy or beam search instead: `("num_beam_groups=2", "num_beam_groups=1")`."""
    if mode == GenerationMode.CONSTRAINED_BEAM_SEARCH:
        return "constraints / force_words_ids", "neither"
    if mode == GenerationMode.GROUP_BEAM_SEARCH:
        return f"num_beam_groups={config.num_beam_groups}", "num_beam_groups=1"
    if mode in (GenerationMode.SAMPLE, GenerationMode.BEAM_SAMPLE):
        return "do_sample=True", "do_sample=False"
    if mode == GenerationMode.CONTRASTIVE_SEARCH:
        return f"penalty_alpha={config.penalty_alpha} with top_k={config.top_k}", "penalty_alpha=None"
    if mode == GenerationMode.DOLA_GENERATION:
        return f"dola_layers={config.dola_layers!r}", "dola_layers=None"
    given = [
        f"{name}={getattr(config, name)!r}"
        for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")
        if getattr(config, name, None) not in (None, False)
    ]  # assisted generation: hf_blockwise's drafters take its place (assistant=)
    return " / ".join(given) or "an assistant model", "assistant= with a drafter of hf_blockwise instead"


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
        encoder_input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): each decoded row's
            source ids ([`expanded_source`]).
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
    check_no_assistant_model()
    beams = is_beam_search(generation_config)
    if beams:
        validate_beam_config(generation_config)
    else:
        validate_generation_config(generation_config)
    model_kwargs = decoder_prompt_kwargs(model_kwargs)
    rules = split_stopping_criteria(stopping_criteria, generation_config)
    if rules.others and rules.eos_token_ids is None and not beams:  # beam search calls the criteria themselves
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
    text_encoder = encoder_input_name(model) == "input_ids"
    # a speech or vision encoder's inputs are not token ids that a drafter could copy
    source = expanded_source(inputs_tensor, input_ids.shape[0]) if text_encoder else None
    if source is not None:
        check_attention_mask(source, model_kwargs.get("attention_mask"))  # a mask of one row is broadcast silently
        warn_unmasked_padding(
            inputs_tensor, model_kwargs.get("attention_mask"), pad_token_id, generation_config._eos_token_tensor
        )
    return GenerateCall(
        decoder_input_ids=input_ids,
        stop_rules=rules,
        pad_token_id=pad_token_id,
        filler_token_id=0 if pad_token_id is None else pad_token_id,
        cache=loop_decoder_cache(model_kwargs),
        forward_kwargs=forward_kwargs(model_kwargs),
        encoder_input_ids=source,
        encoder_attention_mask=encoder_output_mask(
            model, encoder_hidden_states(model_kwargs), model_kwargs.get("attention_mask")
        ),
        streamer=streamer,
    )


def expanded_source(inputs_tensor: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """The source ids of each of the `num_rows` decoded rows. `generate` expands the decoder prompt and the model
    kwargs (encoder output, attention mask) to `num_return_sequences` (or `num_beams`) rows per source with
    `repeat_interleave`, but not `inputs_tensor`: row `i * n + j` is source `i`'s `j`-th."""
    if inputs_tensor is None or inputs_tensor.shape[0] in (0, num_rows):
        return inputs_tensor
    return inputs_tensor.repeat_interleave(num_rows // inputs_tensor.shape[0], dim=0)


# Arguments that `generate` leaves in `model_kwargs` and that a decoder forward must not receive again. `labels`: a
# processor's training targets, which `generate` passes on (the image-text-to-text pipeline with DonutProcessor
# does); greedy search's forward computes an unused loss over its one-token feeds, which a wider feed breaks.
_GENERATE_ONLY_KWARGS = {"use_cache", *CACHE_ARGUMENTS, "logits_to_keep", "output_attentions",
                         "output_hidden_states", "return_dict", "decoder_input_ids", "cache_position",
                         "labels"}  # fmt: skip


def forward_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model kwargs of `generate` that every decoder forward receives unchanged (encoder outputs, mask)."""
    return {key: value for key, value in model_kwargs.items() if key not in _GENERATE_ONLY_KWARGS}


def encoder_hidden_states(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The encoder output among a decoder forward's kwargs (computed once per `generate` call), if any."""
    outputs = kwargs.get("encoder_outputs")
    if outputs is None:
        return None
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs.last_hidden_state


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


def streamer_from_generate_call() -> BaseStreamer | None:
    """The `streamer` passed to the `GenerationMixin.generate` call that is running this loop, if any.

    transformers 5.23 passes a callable `custom_generate` only the keyword arguments that its signature adds
    to `_sample`'s; `streamer` is not one of them, so it is dropped after the prompt was already streamed.
    Without this, a `TextIteratorStreamer` consumer would wait forever for tokens and the end signal.
    """
    return generate_call_argument("streamer")


def generate_call_argument(name: str) -> Any:
    """The argument `name` of the `GenerationMixin.generate` call that is running this loop (`None` when there is
    none), read from its frame: for the arguments transformers 5.23 does not hand a callable `custom_generate`."""
    # under its decorators (`torch.no_grad`; from transformers 5.25 also `deprecate_kwarg`, twice)
    generate_code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        while caller is not None:
            if caller.f_code is generate_code:
                return caller.f_locals.get(name)
            caller = caller.f_back
        return None
    finally:
        del frame


def check_no_assistant_model() -> None:
    """A `ValueError` when `assistant_model=` was passed to the `generate` call running this loop: transformers
    selects its own assisted generation from it, then calls the `custom_generate` loop without it, so it would be
    dropped silently and the output would be plain greedy."""
    if generate_call_argument("assistant_model") is not None:
        raise ValueError(
            "assistant_model= (transformers' assisted generation with a smaller model) is not used by blockwise "
            "decoding. Pass assistant= an hf_blockwise Drafter (e.g. model.drafter(), or the default: the model's "
            "own heads), or call the base model's own generate (model.base_model.generate(..., "
            "assistant_model=...)) for transformers' assisted generation."
        )


def stop_string_kwargs(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `generate` kwargs of a wrapper's call with `tokenizer=` turned into a `StopStringCriteria`.

    transformers 5.23 drops `tokenizer` for a callable `custom_generate` before it builds the stop-string
    criterion, and then refuses `stop_strings` for want of a tokenizer. The criterion is built here as `generate`
    would build it and passed with the caller's `stopping_criteria`, and `stop_strings` is cleared.

    Args:
        model: the transformers model whose `generate` is about to be called.
        kwargs: the keyword arguments of that call.
    """
    if kwargs.get("tokenizer") is None:
        return kwargs
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer")
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if stop_strings is None:
        return kwargs
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), criterion])
    kwargs["stop_strings"] = None
    return kwargs


@dataclass
class BlockwiseGenerateOutput(GenerateEncoderDecoderOutput):
    """[`~generation.GenerateEncoderDecoderOutput`] plus the statistics of a blockwise decoding run.

    `past_key_values` is left `None`: rows end a blockwise run with caches of different valid lengths. With
    `output_scores=True`, `scores` holds greedy search's processed (and, sampling, warped) scores of every generated
    token, with `output_logits=True` `logits` their raw logits; a row's entries after its end are NaN where other
    rows decode on (greedy search scores the padding it feeds there, which a blockwise run does not feed).

    Attributes:
        decoding_stats ([`DecodingStats`]): decoder forwards, tokens accepted per step and row, mean block.
    """

    decoding_stats: Any = None

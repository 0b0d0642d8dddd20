"""Input checks that turn failures deep inside a model into clear errors.

Position limits read from the model's position tables ([`position_limit`], [`encoder_position_limit`],
[`decoder_position_limit`]), checked against the inputs of the wrappers' `generate` ([`check_generate_inputs`],
which also refuses inputs on the meta device, an empty batch or source, ids outside the vocabulary
([`check_token_ids`]), a mask of another shape ([`check_attention_mask`], which the loop checks too) and speech
features of the wrong width), against the loop's `max_length` ([`check_decoder_length`]), against a block size
([`check_block_size_fits`]) and by the corpus job against each source; and the warning for padded input ids without
an attention mask ([`warn_unmasked_padding`]).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from hf_blockwise.boundary.models import (
    check_materialized,
    encoder_input_name,
    input_embeddings,
    model_name,
    unwrap_base,
)


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


def encoder_position_limit(model: nn.Module) -> int | None:
    """[`position_limit`] of the model's encoder stack: the longest source it can read."""
    return position_limit(_stack(unwrap_base(model), "get_encoder"))


def _stack(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    return get() if callable(get) else None


def check_generate_inputs(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Clear errors, naming the argument and the fix, for inputs `generate` would otherwise fail on deep inside the
    model (or decode wrongly): inputs on the meta device, an empty batch or empty sources (a reshape error in the
    encoder), token ids that are no ids of the model's vocabulary ([`check_token_ids`], an `IndexError`), an
    `attention_mask` of another shape ([`check_attention_mask`]), a source longer than the encoder's positions (an
    `IndexError`), speech features with another number of mel bins than the model's ([`check_input_features`], a
    convolution's channel error) and weights never loaded ([`check_materialized`]).

    Args:
        model: the transformers seq2seq model whose `generate` is about to be called.
        args, kwargs: the positional and keyword arguments of that call.
    """
    check_materialized(model)
    _check_streamed_beams(model, kwargs)
    _check_not_meta({"inputs": args[0] if args else None, **kwargs})
    check_input_features(model, args[0] if args else kwargs.get("input_features"))
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.shape[0] == 0:
        raise ValueError("generate was called with an empty batch (batch size 0)")
    reads_ids = encoder_input_name(model) == "input_ids" and inputs is not kwargs.get("inputs_embeds")
    if reads_ids:
        check_token_ids(model, inputs)
        check_attention_mask(inputs, kwargs.get("attention_mask"))
    if reads_ids and inputs.dim() == 2 and inputs.shape[1] == 0:
        raise ValueError(
            f"input_ids has no tokens (shape {tuple(inputs.shape)}): every source needs at least one, e.g. the EOS "
            "token the tokenizer appends: generate(**tokenizer(texts, padding=True, return_tensors='pt'))"
        )
    limit = encoder_position_limit(model)
    if limit is not None and inputs.dim() >= 2 and inputs.shape[1] > limit:
        raise ValueError(
            f"the input is {inputs.shape[1]} tokens long, but the encoder of {model_name(model)} has {limit} "
            f"positions; truncate it, e.g. tokenizer(..., truncation=True, max_length={limit})"
        )


def _check_not_meta(inputs: dict[str, Any]) -> None:
    """A `ValueError` naming the first input tensor on the meta device: it has a shape but no values to decode."""
    name = next((name for name, value in inputs.items() if isinstance(value, torch.Tensor) and value.is_meta), None)
    if name is not None:
        raise ValueError(
            f"{name} is on the meta device: it has a shape but no values to decode. Pass real tensors on the model's "
            "device, e.g. tokenizer(texts, return_tensors='pt').to(model.device)"
        )


def check_token_ids(model: nn.Module, input_ids: torch.Tensor) -> None:
    """A `TypeError` for `input_ids` that are not integers, and a `ValueError` naming the first id (and where it is)
    that the encoder's embedding has no row for: negative, or past its vocabulary (ids of another tokenizer)."""
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(
            f"input_ids holds {input_ids.dtype} values, but token ids are integers: pass the ids the tokenizer "
            "returns (return_tensors='pt' gives torch.long), or input_ids.long()"
        )
    embeddings = input_embeddings(unwrap_base(model).get_encoder())
    if not isinstance(embeddings, nn.Embedding) or input_ids.numel() == 0:
        return
    vocab_size = embeddings.num_embeddings
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"input_ids holds the id {int(input_ids[tuple(where)])} at {tuple(where)}, but the encoder of "
            f"{model_name(model)} embeds {vocab_size} tokens (ids 0 to {vocab_size - 1}): tokenize with this "
            "model's own tokenizer (AutoTokenizer.from_pretrained of the same checkpoint)"
        )


def check_attention_mask(inputs: torch.Tensor, attention_mask: Any) -> None:
    """A `ValueError` when the encoder's `attention_mask` has another shape than its `inputs` (`(batch_size,
    source_length)`, the ids' or the embeddings' first two dimensions): the encoder would fail deep in attention, or
    broadcast a mask of one row over every row, masking each source by another's padding."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape == inputs.shape[:2]:
        return
    raise ValueError(
        f"attention_mask has shape {tuple(attention_mask.shape)}, but the encoder inputs have "
        f"{tuple(inputs.shape[:2])} (batch size, source length): give one mask value per token, as the tokenizer "
        "returns them together: generate(**tokenizer(texts, padding=True, return_tensors='pt'))"
    )


def _check_streamed_beams(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """transformers' own refusal of a streamer with beam search, before `generate` feeds the streamer its prompt of
    `num_beams` rows (which a `TextStreamer` refuses as "batch size 1 only", a misleading reason)."""
    if kwargs.get("streamer") is None:
        return
    config = kwargs.get("generation_config") or model.generation_config
    beams = kwargs.get("num_beams", config.num_beams)
    if beams is not None and beams > 1:
        raise ValueError(
            f"streamer= cannot be used with beam search (num_beams={beams}), as in transformers' generate: stream "
            "with num_beams=1"
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


def check_input_features(model: nn.Module, features: Any) -> None:
    """A `ValueError` naming the expected number when log-mel `input_features` of shape `(batch_size, num_mel_bins,
    frames)` (Whisper's layout) have another number of mel bins than the model's `config.num_mel_bins`."""
    expected = getattr(unwrap_base(model).config, "num_mel_bins", None)
    if not isinstance(features, torch.Tensor) or not isinstance(expected, int) or features.dim() != 3:
        return
    if features.shape[1] != expected:
        raise ValueError(
            f"input_features has {features.shape[1]} mel bins (shape {tuple(features.shape)}, read as (batch, mel "
            f"bins, frames)), but {model_name(model)} takes num_mel_bins={expected}: compute them with this model's "
            f"feature extractor (feature_size={expected}), e.g. AutoProcessor.from_pretrained(...)(audio, "
            "sampling_rate=..., return_tensors='pt')"
        )


def check_block_size_fits(model: nn.Module, block_size: int) -> None:
    """A `ValueError` naming the limit when one step's `block_size` tokens could not all be fed to the decoder: a
    verification pass feeds up to `block_size` positions, and a decoder with a position table has only so many."""
    limit = decoder_position_limit(unwrap_base(model))
    if limit is not None and block_size > limit:
        raise ValueError(
            f"block_size={block_size} exceeds the {limit} decoder positions of {model_name(model)}: one step feeds up "
            f"to block_size tokens; use block_size <= {limit}"
        )


def warn_unmasked_padding(input_ids: torch.Tensor, attention_mask: Any, pad_token_id: int | None, eos: Any) -> None:
    """Warns, once per call, when encoder `input_ids` look padded and no `attention_mask` was given: the encoder
    then attends to the padding, and the output is what greedy search gives for such input, rarely what was meant.

    A row looks padded when it starts with the pad id (left padding) or ends with it (right padding); where the pad
    id is also an EOS id (a row may end with it), only when it ends with two. transformers warns alike for
    decoder-only models.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`).
        eos (`torch.Tensor`, *optional*): the EOS ids of the call.
    """
    if attention_mask is not None or pad_token_id is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return
    is_pad = input_ids == pad_token_id  # (B, S)
    pad_is_eos = eos is not None and bool(torch.isin(torch.as_tensor(pad_token_id), eos.cpu()).item())
    trailing = is_pad[:, -2:].all(dim=1) if pad_is_eos and input_ids.shape[1] > 1 else is_pad[:, -1]
    if pad_is_eos and input_ids.shape[1] == 1:
        trailing = torch.zeros_like(trailing)
    if bool((is_pad[:, 0] | trailing).any()):
        warnings.warn(
            f"The input_ids hold the pad token ({pad_token_id}) at padded positions but no attention_mask was "
            "given, so the encoder attends to the padding and the output is not what the unpadded sources give. "
            "Pass the attention_mask the tokenizer returns: generate(**tokenizer(texts, padding=True, "
            "return_tensors='pt'))",
            UserWarning,
            stacklevel=2,
        )

"""Input checks that turn failures deep inside a model into clear errors.

Position limits read from the model's position tables ([`position_limit`], [`encoder_position_limit`],
[`decoder_position_limit`]), checked against the inputs of the wrappers' `generate` ([`check_generate_inputs`],
which also refuses an empty batch), against the loop's `max_length` ([`check_decoder_length`]) and by the corpus
job against each source.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_blockwise.boundary.models import model_name, unwrap_base


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
    limit = encoder_position_limit(model)
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

"""Probing a model's decoder on a tiny batch built without data.

[`probe_inputs`] gives two short sources of different lengths (random encoder states of the encoder's width for
speech and vision encoders) and ordinary, non-special decoder tokens; `generation.capability` checks the decoder
with them, and [`check_output_projection`] checks that `get_output_embeddings()` is the layer that produces the
logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from hf_blockwise.boundary.cache import new_decoder_cache
from hf_blockwise.boundary.models import (
    decoder_config,
    decoder_forward,
    encoder_hidden_size,
    encoder_input_name,
    input_embeddings,
    model_name,
    output_projection_logits,
)


def _special_token_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(source, name, None) if source is not None else None
            ids.update(value if isinstance(value, (list, tuple)) else [] if value is None else [int(value)])
    return ids


def _vocabulary_size(module: nn.Module, fallback: int) -> int:
    embeddings = input_embeddings(module)
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

"""What differs for speech and vision encoder-decoders once `generate` has run their encoder.

The mask over the encoder's output positions that drafters attend with ([`encoder_output_mask`]: a subsampling
speech encoder's frame mask mapped onto its outputs), the probe for decoders that read no encoder mask at all
([`decoder_reads_frame_mask`]: Whisper's), and the options of Whisper's segment-by-segment `generate` that
blockwise decoding refuses ([`validate_segment_options`]). The encoder's input name and width are model reads
(`boundary.models`); the probe batch hands such decoders random encoder states (`boundary.probes`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.generation import GenerationConfig
from transformers.modeling_outputs import BaseModelOutput

from hf_blockwise.boundary.cache import new_decoder_cache
from hf_blockwise.boundary.models import decoder_forward, encoder_hidden_size, model_name
from hf_blockwise.boundary.probes import probe_inputs


def validate_segment_options(generation_config: GenerationConfig) -> None:
    """Raises a `ValueError` for the options of a segment-by-segment speech `generate` (Whisper's) that blockwise
    decoding cannot keep exact; decided from the generation config each segment's search receives.

    Every segment is an ordinary greedy search or, in a temperature fallback (`temperature=(0.0, 0.2, ...)` with
    `compression_ratio_threshold` / `logprob_threshold`), a sampling call: both decoded by the loop (long-form audio,
    timestamps, language and task tokens, `prompt_ids` included; `logprob_threshold` reads the scores the loop keeps
    with `output_scores`). Refused:

    - `condition_on_prev_tokens=True`: each segment's decoder prompt starts with the previous segment's tokens,
      left-padded per row under a `decoder_attention_mask`.
    - `return_token_timestamps=True` (word-level timestamps): read from every step's scores and cross-attention.
    """
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

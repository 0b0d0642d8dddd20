"""transformers' beam search, one step at a time, for a loop that computes the scores its own way.

transformers 5.23's `GenerationMixin._beam_search` is a loop over vectorized helpers (`_get_top_k_continuations`,
`_get_running_beams_for_next_iteration`, `_update_finished_beams`, `_check_early_stop_heuristic`,
`_beam_search_has_unfinished_sequences`); its state is a handful of tensors. [`beam_search_step`] is one iteration of
that loop from the processed log-probabilities on (its steps c-g, the cache reorder left to the caller), calling the
same helpers in the same order, so a loop that hands it the scores beam search would have computed takes the same
steps: the same sequences, scores and beam indices, by construction. [`beam_search_output`] is the loop's
epilogue (best `num_return_sequences`, cropped; the output class with `sequences_scores` when `output_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.generation import GenerationConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput

from hf_blockwise.boundary.cache import check_cache_settings

# generate() arguments of a beam search that the blockwise beam loop does not produce, and what they would return
_UNSUPPORTED_BEAM_FLAGS = {
    "output_logits": "per-step raw logits",
    "output_attentions": "attention maps",
    "output_hidden_states": "hidden states",
}


@dataclass(frozen=True)
class BeamOptions:
    """What stays fixed during one beam search call (from its `generation_config`).

    Attributes:
        batch_size (`int`): the caller's rows (each holds `num_beams` beams).
        num_beams (`int`), beams_to_keep (`int`): candidates kept per step (`max(2, 1 + #eos) * num_beams`).
        prompt_length (`int`): the decoder prompt's length. max_length (`int`).
        length_penalty (`float`), early_stopping (`bool` or `"never"`), num_return_sequences (`int`).
        top_num_beam_mask (`torch.BoolTensor` of shape `(beams_to_keep,)`): the first `num_beams` candidates.
        output_scores (`bool`), return_dict (`bool`).
        fill_value (`int`): what fills sequences past their end (`_beam_search`'s: the pad id unless it is 0 or
            unset, then the first EOS id, -1 without one).
    """

    batch_size: int
    num_beams: int
    beams_to_keep: int
    prompt_length: int
    max_length: int
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int
    top_num_beam_mask: torch.Tensor
    output_scores: bool
    return_dict: bool
    fill_value: int


@dataclass(frozen=True)
class BeamSearchState:
    """transformers' beam search state between two steps.

    Attributes:
        running (`torch.LongTensor` of shape `(batch_size, num_beams, max_length)`): live beams.
        running_scores (`torch.FloatTensor` of shape `(batch_size, num_beams)`): their summed log-probabilities.
        running_indices (`torch.IntTensor` of shape `(batch_size, num_beams, max_length - prompt_length)`).
        sequences, scores, indices, is_finished: the same for finished hypotheses (scores length-penalized).
        improvable (`torch.BoolTensor` of shape `(batch_size, 1)`): the early-stop heuristic is not yet satisfied.
        cur_len (`int`): the live beams' length. unfinished (`bool`): whether beam search takes another step.
    """

    running: torch.Tensor
    running_scores: torch.Tensor
    running_indices: torch.Tensor
    sequences: torch.Tensor
    scores: torch.Tensor
    indices: torch.Tensor
    is_finished: torch.Tensor
    improvable: torch.Tensor
    cur_len: int
    unfinished: bool = True


def validate_beam_config(generation_config: GenerationConfig) -> None:
    """Raises a `ValueError` naming the first `generate` argument of a beam search that the beam loop cannot honour.

    The loop reproduces `GenerationMode.BEAM_SEARCH` (`num_beams > 1`, no sampling): sequences, `sequences_scores`,
    per-step `scores` and `beam_indices`.
    """
    mode = generation_config.get_generation_mode()
    if mode != GenerationMode.BEAM_SEARCH:
        raise ValueError(f"the blockwise beam loop reproduces beam search, not {mode.value!r}")
    if generation_config.low_memory:
        raise ValueError("low_memory=True is not supported by beam search (transformers refuses it too)")
    check_cache_settings(generation_config)
    for flag, what in _UNSUPPORTED_BEAM_FLAGS.items():
        if getattr(generation_config, flag, False):
            raise ValueError(
                f"{flag}=True is not supported by blockwise beam search ({what} of every beam at every step); "
                "generate without it, or use the base model's generate without hf_blockwise"
            )


def beam_options(generation_config: GenerationConfig, input_ids: torch.Tensor, max_length: int) -> BeamOptions:
    """The options of a beam search over `input_ids` (shape `(batch_size * num_beams, prompt_length)`, as
    `generate` expands them), stopping at `max_length`."""
    num_beams = generation_config.num_beams
    eos = generation_config._eos_token_tensor
    beams_to_keep = max(2, 1 + (eos.shape[0] if eos is not None else 0)) * num_beams
    pad = generation_config._pad_token_tensor
    # `pad_token_id or eos_token_id[0] if eos_token_id is not None else -1`, as `_beam_search` writes it
    fill_value = int(pad or eos[0]) if eos is not None else -1
    top = torch.zeros(beams_to_keep, dtype=torch.bool, device=input_ids.device)
    top[:num_beams] = True
    return BeamOptions(
        batch_size=input_ids.shape[0] // num_beams, num_beams=num_beams, beams_to_keep=beams_to_keep,
        prompt_length=input_ids.shape[1], max_length=max_length, length_penalty=generation_config.length_penalty,
        early_stopping=generation_config.early_stopping, num_return_sequences=generation_config.num_return_sequences,
        top_num_beam_mask=top, output_scores=bool(generation_config.output_scores),
        return_dict=bool(generation_config.return_dict_in_generate), fill_value=fill_value,
    )  # fmt: skip


def initial_beam_search(input_ids: torch.Tensor, options: BeamOptions) -> BeamSearchState:
    """Beam search before its first step: every beam holds the prompt, only the first of each row is live."""
    b, n, device, fill_value = options.batch_size, options.num_beams, input_ids.device, options.fill_value
    running = input_ids.new_full((b, n, options.max_length), fill_value)
    running[:, :, : options.prompt_length] = input_ids.reshape(b, n, -1)
    running_scores = torch.zeros((b, n), dtype=torch.float, device=device)
    running_scores[:, 1:] = -1e9  # only the first beam's tokens count at the first step
    indices = torch.full((b, n, options.max_length - options.prompt_length), -1, dtype=torch.int32, device=device)
    return BeamSearchState(
        running=running, running_scores=running_scores, running_indices=indices, sequences=running.clone(),
        scores=torch.full((b, n), -1e9, dtype=torch.float, device=device), indices=indices.clone(),
        is_finished=torch.zeros((b, n), dtype=torch.bool, device=device),
        improvable=torch.ones((b, 1), dtype=torch.bool, device=device), cur_len=options.prompt_length,
    )  # fmt: skip


def beam_search_step(
    model: nn.Module,
    search: BeamSearchState,
    log_probs: torch.Tensor,
    stopping_criteria: StoppingCriteriaList,
    options: BeamOptions,
    all_scores: tuple[torch.Tensor, ...] | None,
) -> tuple[BeamSearchState, torch.Tensor]:
    """One step of transformers' beam search from the processed log-probabilities of the live beams.

    Args:
        log_probs (`torch.FloatTensor` of shape `(batch_size * num_beams, vocab_size)`): `log_softmax` of each live
            beam's next-token logits, through the logits processors, as `_beam_search` computes them.
        all_scores: the per-step scores so far (what `_beam_search` hands its stopping criteria), or `None`.

    Returns:
        The state after the step, and each new live beam's parent (`torch.LongTensor` of shape
        `(batch_size * num_beams,)`, an index into the live beams before the step): its cache is the parent's.
    """
    b, n, cur_len, prompt = options.batch_size, options.num_beams, search.cur_len, options.prompt_length
    accumulated = (log_probs.reshape(b, n, -1) + search.running_scores[:, :, None]).reshape(b, -1)
    topk_log_probs, topk_sequences, topk_indices = model._get_top_k_continuations(
        accumulated_log_probs=accumulated, running_sequences=search.running,
        running_beam_indices=search.running_indices, cur_len=cur_len, decoder_prompt_len=prompt, do_sample=False,
        beams_to_keep=options.beams_to_keep, num_beams=n, batch_size=b,
    )  # fmt: skip
    hits = stopping_criteria(topk_sequences[:, :, : cur_len + 1].reshape(b * options.beams_to_keep, -1), all_scores)
    hits = hits.reshape(b, options.beams_to_keep)
    running, running_scores, running_indices = model._get_running_beams_for_next_iteration(
        topk_log_probs=topk_log_probs, topk_running_sequences=topk_sequences,
        topk_running_beam_indices=topk_indices, next_token_hits_stopping_criteria=hits, num_beams=n,
    )  # fmt: skip
    sequences, scores, indices, is_finished = model._update_finished_beams(
        sequences=search.sequences, topk_running_sequences=topk_sequences, beam_scores=search.scores,
        topk_log_probs=topk_log_probs, beam_indices=search.indices, topk_running_beam_indices=topk_indices,
        is_early_stop_heuristic_unsatisfied=search.improvable, is_sent_finished=search.is_finished,
        next_token_hits_stopping_criteria=hits, top_num_beam_mask=options.top_num_beam_mask, num_beams=n,
        cur_len=cur_len, decoder_prompt_len=prompt, length_penalty=options.length_penalty,
        early_stopping=options.early_stopping,
    )  # fmt: skip
    parents = running_indices[..., cur_len - prompt].reshape(-1).long()  # (b * n,) batch-offset beam indices
    improvable = model._check_early_stop_heuristic(
        is_early_stop_heuristic_unsatisfied=search.improvable, running_beam_scores=running_scores,
        beam_scores=scores, is_sent_finished=is_finished, cur_len=cur_len + 1, max_length=options.max_length,
        decoder_prompt_len=prompt, early_stopping=options.early_stopping, length_penalty=options.length_penalty,
    )  # fmt: skip
    unfinished = model._beam_search_has_unfinished_sequences(improvable, is_finished, hits, options.early_stopping)
    new = BeamSearchState(
        running=running, running_scores=running_scores, running_indices=running_indices, sequences=sequences,
        scores=scores, indices=indices, is_finished=is_finished, improvable=improvable, cur_len=cur_len + 1,
        unfinished=bool(unfinished),
    )  # fmt: skip
    return new, parents


def beam_search_output(
    search: BeamSearchState, options: BeamOptions, all_scores: tuple[torch.Tensor, ...] | None, **extra: Any
) -> torch.Tensor | GenerateBeamEncoderDecoderOutput:
    """What `_beam_search` returns after its loop: each row's best `num_return_sequences` hypotheses, cropped to
    the longest generated; with `return_dict_in_generate`, a [`BlockwiseBeamOutput`] (`extra` fills its fields)."""
    r = options.num_return_sequences
    sequences = search.sequences[:, :r].reshape(options.batch_size * r, -1)
    scores = search.scores[:, :r].reshape(-1)
    indices = search.indices[:, :r].reshape(options.batch_size * r, -1)
    generated = int((indices + 1).bool().sum(dim=1).max())
    sequences, indices = sequences[:, : options.prompt_length + generated], indices[:, :generated]
    if not options.return_dict:
        return sequences
    return BlockwiseBeamOutput(
        sequences=sequences, sequences_scores=scores if options.output_scores else None, scores=all_scores,
        beam_indices=indices, **extra,
    )  # fmt: skip


@dataclass
class BlockwiseBeamOutput(GenerateBeamEncoderDecoderOutput):
    """[`~generation.GenerateBeamEncoderDecoderOutput`] plus the statistics of a blockwise beam search.

    `past_key_values` is left `None`.

    Attributes:
        decoding_stats ([`DecodingStats`]): decoder forwards and beam steps taken per forward.
    """

    decoding_stats: Any = None

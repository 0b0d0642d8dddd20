"""Blockwise parallel decoding (Stern et al. 2018) as a `custom_generate` loop for transformers' `generate`.

Each iteration is one decoder forward pass that both *verifies* the tokens drafted at the previous step and,
through the decoder states it produces, lets the drafter *propose* the next block (Stern §4). The step itself
is `generation.step.decode_step`, a pure function of an explicit [`DecodingState`]; this module adapts
transformers' calling convention (through `boundary`), checks the model once, and runs the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter, NoDrafter
from hf_blockwise.engine import CompiledDecoder, CompileOptions, check_arithmetic, compiled_decoder
from hf_blockwise.generation.acceptance import AcceptanceRule, ExactAcceptance, check_rule_fits
from hf_blockwise.generation.beam import BeamSetup, beam_search, initial_beam_state
from hf_blockwise.generation.capability import check_decoder, check_tree_decoder, check_verification_width
from hf_blockwise.generation.sampling import call_seed
from hf_blockwise.generation.state import DecodingSetup, DecodingState, DecodingStats, GeneratedScores
from hf_blockwise.generation.step import decode_step


def _validate_call(
    model: nn.Module,
    input_ids: torch.Tensor,
    assistant: Drafter | None,
    acceptance: AcceptanceRule | None,
    logits_processor: LogitsProcessorList,
    beams: bool,
) -> tuple[Drafter, AcceptanceRule]:
    hf.encoder_decoder_only(model)
    hf.check_materialized(model)
    # beam search calls the processors on every live beam, as transformers does; one row has no other rows to read
    if input_ids.shape[0] > 1 and not beams:
        hf.check_row_local_processors(logits_processor or [])
    if input_ids.shape[0] == 0:
        raise ValueError("generate was called with an empty batch (batch size 0)")
    drafter = NoDrafter() if assistant is None else assistant
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"assistant= takes an hf_blockwise Drafter (e.g. HeadsDrafter), got {type(assistant).__name__}. "
            "For transformers' own assisted generation with a smaller model, pass assistant_model= to the "
            "base model's generate instead."
        )
    rule = ExactAcceptance() if acceptance is None else acceptance
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"acceptance= takes an AcceptanceRule such as ExactAcceptance(), got {type(rule).__name__}")
    if beams and not isinstance(rule, ExactAcceptance):
        raise ValueError(
            f"beam search keeps what its own steps select; acceptance={type(rule).__name__}() applies to greedy "
            "decoding only (pass num_beams=1, or no acceptance=)"
        )
    check_rule_fits(rule, max(int(drafter.block_size), 1))
    drafter.check_base(model)
    return drafter, rule


def initial_state(call: hf.GenerateCall, setup: DecodingSetup) -> DecodingState:
    """The state before the first (prefill) step: every row holds its decoder prompt, nothing is cached."""
    input_ids = call.decoder_input_ids
    batch_size, prompt_length = input_ids.shape
    buffer_length = call.stop_rules.max_length + setup.block_size + 1
    sequences = input_ids.new_full((batch_size, buffer_length), setup.filler_token_id)
    sequences[:, :prompt_length] = input_ids
    lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=input_ids.device)
    return DecodingState(
        sequences=sequences,
        lengths=lengths,
        rows=torch.arange(batch_size, device=input_ids.device),
        cache_length=0,
        max_pending=prompt_length,
        min_pending=prompt_length,
        cache=call.cache,
        forward_kwargs=call.forward_kwargs,
        encoder_input_ids=call.encoder_input_ids,
        encoder_attention_mask=call.encoder_attention_mask,
        last_states=None,
        verified_states=None,
        drafter_state=setup.drafter.prepare(call.encoder_input_ids, call.encoder_attention_mask),
        output=sequences.clone(),
        output_lengths=lengths.clone(),
    )


def finish(
    state: DecodingState, return_dict: bool, compiled_forwards: int = 0, prompt_length: int = 0
) -> torch.Tensor | hf.BlockwiseGenerateOutput:
    """Every row's tokens in the caller's order, cut to the longest row, as greedy search returns them (with the
    call's [`DecodingStats`] when `return_dict`; `compiled_forwards`: the passes the compiled engine ran; and the
    kept scores, if any, per generated position after the `prompt_length` tokens of the decoder prompt)."""
    output_ids = state.output[:, : int(state.output_lengths.max())]
    if not return_dict:
        return output_ids
    accepted = torch.stack(state.accepted).cpu()
    stats = DecodingStats(num_forwards=len(state.accepted), accepted=accepted, compiled_forwards=compiled_forwards)
    steps = output_ids.shape[1] - prompt_length
    scores, logits = (
        generated_scores(kept, output_ids.shape[0], steps, prompt_length) for kept in (state.scores, state.logits)
    )
    return hf.BlockwiseGenerateOutput(sequences=output_ids, scores=scores, logits=logits, decoding_stats=stats)


def generated_scores(
    kept: list[GeneratedScores], batch_size: int, num_steps: int, prompt_length: int
) -> tuple[torch.Tensor, ...] | None:
    """Kept scores (or logits) as greedy search returns them: one `(batch_size, vocab_size)` tensor per generated
    position, NaN for rows that had ended there (greedy search scores the padding it feeds them); `None` if none."""
    if not kept:
        return None
    vocab_size = kept[0].scores.shape[-1]
    table = kept[0].scores.new_full((num_steps, batch_size, vocab_size), float("nan"))  # (T, B, V)
    for step in kept:  # in step order: a position is decided once
        table[step.positions - prompt_length, step.rows] = step.scores
    return tuple(table.unbind(0))


def with_engine(
    model: nn.Module, call: hf.GenerateCall, feed_limit: int, blockwise_compile: bool | CompileOptions
) -> tuple[hf.GenerateCall, CompiledDecoder | None]:
    """The compiled engine a call verifies through, and the call with the engine's static cache in place of
    transformers' dynamic one.

    Args:
        feed_limit (`int`): most tokens a row feeds per step (k, or more with trees); the static cache has room for
            the last step's feed past the length limit ([`CompiledDecoder.new_cache`]).
        blockwise_compile (`bool` or [`CompileOptions`]): `generate`'s argument; `False` decodes eagerly.

    Returns:
        The call, and the [`CompiledDecoder`], or `None` (eager decoding: the call unchanged).
    """
    options = CompileOptions.coerce(blockwise_compile)
    engine = None if options is None else compiled_decoder(model, options)
    if engine is not None:
        call = dataclasses.replace(call, cache=engine.new_cache(call.stop_rules.max_length, feed_limit))
    return call, engine


def probe_engine(
    engine: CompiledDecoder | None,
    call: hf.GenerateCall,
    feed_limit: int,
    tree: bool,
    state: DecodingState | None = None,
) -> None:
    """Runs the engine's one-arithmetic probe ([`engine.check_arithmetic`]) for a decode that feeds
    several tokens per row: before it starts, and (given its `state`) when a decode of several rows is left with one,
    which moves it to the batch-1 graph. Once per engine and kind of decode; it warns where the contract fails here.
    Greedy decodes feed one token per call, the contract's reference: nothing to check."""
    if engine is None or feed_limit <= 1:
        return
    max_length = call.stop_rules.max_length
    if state is None:
        check_arithmetic(engine, call.decoder_input_ids, call.forward_kwargs, max_length, feed_limit, tree)
    elif state.num_rows == 1 and call.decoder_input_ids.shape[0] > 1:
        prompt = call.decoder_input_ids[state.rows]
        check_arithmetic(engine, prompt, state.forward_kwargs, max_length, feed_limit, tree, shrunk=True)


def decoding_setup(
    model: nn.Module,
    call: hf.GenerateCall,
    drafter: Drafter,
    rule: AcceptanceRule,
    logits_processor: LogitsProcessorList,
    block_size: int,
    engine: CompiledDecoder | None,
    generation_config: GenerationConfig,
) -> DecodingSetup:
    """What stays fixed during the call, once the model is known to verify `block_size` tokens per pass exactly
    (checked here when `block_size > 1`; an [`UnsupportedModelError`] otherwise). With `do_sample=True` the call's
    seed is drawn: decisions are greedy on scores perturbed by its shared noise (`sampling.py`). With
    `output_scores=True` / `output_logits=True` (and `return_dict_in_generate=True`), the scores / raw logits of every
    generated token are kept (chains only)."""
    kept = {flag: bool(getattr(generation_config, flag) and generation_config.return_dict_in_generate)
            for flag in ("output_scores", "output_logits")}  # fmt: skip
    if any(kept.values()) and drafter.tree_nodes is not None:
        flags = " and ".join(f"{flag}=True" for flag, on in kept.items() if on)
        raise ValueError(
            f"{flags} is not supported with a drafter of trees ({type(drafter).__name__} with tree_nodes="
            f"{drafter.tree_nodes}): a tree step keeps only its accepted path. Use a chain drafter (tree_nodes=None) "
            "or generate without it."
        )
    capability = None
    if block_size > 1:
        check_verification_width(model, block_size)
        capability = check_decoder(model)
        if drafter.tree_nodes is not None:
            check_tree_decoder(model, capability)
    return DecodingSetup(
        model=model,
        drafter=drafter,
        acceptance=rule,
        logits_processor=logits_processor,
        stop_rules=call.stop_rules,
        block_size=block_size,
        filler_token_id=call.filler_token_id,
        pad_cut_token_id=call.pad_token_id if capability is not None and capability.positions_count_non_pad else None,
        batch_size=call.decoder_input_ids.shape[0],
        streamer=call.streamer,
        engine=engine,
        position_limit=hf.decoder_position_limit(model),
        sampling_seed=call_seed() if generation_config.do_sample else None,
        sampling_temperature=float(generation_config.temperature or 1.0),
        output_scores=kept["output_scores"],
        output_logits=kept["output_logits"],
    )


def beam_generate(
    model: nn.Module,
    call: hf.GenerateCall,
    drafter: Drafter,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    blockwise_compile: bool | CompileOptions,
) -> torch.Tensor | hf.BlockwiseBeamOutput:
    """Beam search through the blockwise loop (`generation/beam.py`), for a `generate` call with `num_beams > 1`:
    the output of transformers' beam search, each forward verifying a chain or a tree of drafts per live beam."""
    block_size = max(int(drafter.block_size), 1)
    feed_limit = block_size if drafter.tree_nodes is None else 1 + drafter.tree_nodes
    call, engine = with_engine(model, call, feed_limit, blockwise_compile)
    if block_size > 1:
        check_verification_width(model, feed_limit)
        capability = check_decoder(model)
        if drafter.tree_nodes is not None:
            check_tree_decoder(model, capability)
    setup = BeamSetup(
        model=model, drafter=drafter, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        options=hf.beam_options(generation_config, call.decoder_input_ids, generation_config.max_length),
        block_size=block_size, filler_token_id=call.filler_token_id, engine=engine,
        position_limit=hf.decoder_position_limit(model),
    )  # fmt: skip
    probe_engine(engine, call, feed_limit, drafter.tree_nodes is not None)
    compiled_before = 0 if engine is None else engine.compiled_calls
    return beam_search(initial_beam_state(call, setup), setup, compiled_before)


def blockwise_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,
    assistant: Drafter | None = None,
    acceptance: AcceptanceRule | None = None,
    blockwise_compile: bool | CompileOptions = False,
    **model_kwargs: Any,
):
    """Blockwise parallel decoding, to be passed as `model.generate(..., custom_generate=blockwise_generate)`.

    transformers prepares everything (encoder pass, decoder start tokens, logits processors, stopping
    criteria) and calls this loop in place of greedy search. With the default exact acceptance the result
    equals the base model's greedy `generate`, token for token, at any batch size. A model whose decoder
    cannot verify several tokens in one cached pass exactly is refused with an [`UnsupportedModelError`]
    before anything is decoded.

    Args:
        assistant ([`Drafter`], *optional*): what proposes tokens; `None` proposes nothing (plain greedy).
        acceptance ([`AcceptanceRule`], *optional*): defaults to [`ExactAcceptance`].
        blockwise_compile (`bool` or [`CompileOptions`], defaults to `False`): run the verification forward through
            the compiled engine (`engine.py`): `torch.compile` over a static cache, weights prepacked on
            CPU, CUDA graphs on CUDA. The first call per model compiles (seconds to a minute); where compilation
            is unavailable a warning says so and decoding runs eagerly. Its output is the engine's own greedy
            output, which may differ from eager greedy only at a floating-point near-tie.

    Returns:
        `torch.LongTensor` of shape `(batch_size, sequence_length)`, or a [`BlockwiseGenerateOutput`] with
        `decoding_stats` when `return_dict_in_generate=True`.
    """
    beams = hf.is_beam_search(generation_config)
    drafter, rule = _validate_call(model, input_ids, assistant, acceptance, logits_processor, beams)
    call = hf.adapt_generate_call(
        model, input_ids, stopping_criteria, generation_config, synced_gpus, streamer, inputs_tensor, model_kwargs
    )
    if beams:
        return beam_generate(
            model, call, drafter, logits_processor, stopping_criteria, generation_config, blockwise_compile
        )
    block_size = max(int(drafter.block_size), 1)
    # a row feeds its pending tokens (at most k) and its drafts: a chain's k - 1 or a tree's nodes
    feed_limit = block_size if drafter.tree_nodes is None else block_size + drafter.tree_nodes
    call, engine = with_engine(model, call, feed_limit, blockwise_compile)
    setup = decoding_setup(model, call, drafter, rule, logits_processor, block_size, engine, generation_config)
    probe_engine(engine, call, feed_limit, drafter.tree_nodes is not None)
    compiled_before = 0 if engine is None else engine.compiled_calls
    state = initial_state(call, setup)
    while state.num_rows > 0:
        state = decode_step(state, setup)
        probe_engine(engine, call, feed_limit, drafter.tree_nodes is not None, state)
    if call.streamer is not None:
        call.streamer.end()
    compiled_forwards = 0 if engine is None else engine.compiled_calls - compiled_before
    return finish(state, generation_config.return_dict_in_generate, compiled_forwards, input_ids.shape[1])

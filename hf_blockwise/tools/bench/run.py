"""Which of the requested modes a setup can run, and the run itself: every mode at every batch size, timed batch by
batch through the measurement harness, then CTranslate2 in a pass of its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hf_blockwise import boundary as hf
from hf_blockwise.evaluation.harness import Batch, ModeResult, Runner, measure
from hf_blockwise.loading import missing_drafter
from hf_blockwise.tools.bench.ct2_pass import ct2_unavailable, measure_ct2
from hf_blockwise.tools.bench.modes import REFERENCE_MODES, Mode
from hf_blockwise.tools.bench.runners import compile_modes, mode_runner
from hf_blockwise.tools.bench.setup import BenchSetup, make_batches, usable_batch_sizes


def unavailable(mode: Mode, setup: BenchSetup) -> str | None:
    """Why `setup` cannot run `mode` (a model or package it needs is absent), or `None`."""
    if mode.drafter is not None:
        missing = missing_drafter(mode.drafter, setup.loaded)
        return None if missing is None else f"the model has {missing}"
    if mode.family == "assisted" and setup.loaded.assistant_model is None:
        return "pass --assistant-model"
    if mode.family == "ct2":
        return ct2_unavailable(setup)
    return None


def available_modes(setup: BenchSetup, requested: Sequence[str]) -> list[Mode]:
    """The requested modes this setup can run, with a reason printed for each one left out, and the reference
    modes they need; `oracle` becomes one `oracle_k{k}` mode per block size of `setup.oracle_block_sizes`.
    References come first: each batch is decoded by the modes in this order, and others are compared with them."""
    modes: list[Mode] = []
    for name in requested:
        mode = Mode.parse(name)
        reason = unavailable(mode, setup)
        if mode.family == "oracle" and mode.block_size is None:
            modes += [mode.at_block_size(block_size) for block_size in setup.oracle_block_sizes]
        elif reason:
            print(f"skipping {mode.name}: {reason}")
        else:
            modes.append(mode)
    needed = {"greedy"} | {mode.reference for mode in modes if mode.reference is not None}
    while missing := {Mode.parse(name).reference for name in needed} - needed - {None}:  # a reference's reference
        needed |= missing
    # the greedy references first, in their order, then the others (transformers' beam search, the loop's sampling)
    # each after its own reference and before its users
    others = sorted(needed - set(REFERENCE_MODES), key=lambda name: (_reference_depth(name), name))
    modes = [Mode.parse(name) for name in (*[n for n in REFERENCE_MODES if n in needed], *others)] + modes
    unique: dict[str, Mode] = {}
    for mode in modes:
        unique.setdefault(mode.name, mode)

    def order(mode: Mode) -> int:
        return REFERENCE_MODES.index(mode.name) if mode.name in REFERENCE_MODES else len(REFERENCE_MODES)

    return sorted(unique.values(), key=order)


def _reference_depth(name: str) -> int:
    """How many references stand above mode `name` (`greedy_compiled_sample` -> `loop_sample`: 1)."""
    reference = Mode.parse(name).reference
    return 0 if reference is None or reference == name else 1 + _reference_depth(reference)


def run_bench(
    setup: BenchSetup,
    sources: Sequence[str] | Sequence[Sequence[int]],
    references: Sequence[str] | None,
    modes: Sequence[str],
    batch_sizes: Sequence[int],
    progress: bool = True,
    variants: dict[str, tuple[str, BenchSetup]] | None = None,
) -> list[ModeResult]:
    """Decodes `sources` in every mode at every batch size; returns one [`ModeResult`] per pair.

    Batch sizes larger than the number of sources are skipped (with a printed note).

    Args:
        sources: sentences, or lists of source token ids when `setup.loaded.tokenizer` is `None`.
        references (`list[str]`, *optional*): one per source, for BLEU.
        variants (`dict`, *optional*): more runs by name, each a mode with its own setup (e.g. a sweep over GAD's
            block size); they are timed beside the modes, batch by batch, and compared with the same greedy run.
    """
    if not sources:
        raise ValueError("The benchmark needs at least one source sentence")
    chosen = available_modes(setup, modes)
    ct2_modes = [mode for mode in chosen if mode.family == "ct2"]
    chosen = [mode for mode in chosen if mode.family != "ct2"]
    int8_setup, int8_drafter_setup = _int8_setups(setup, chosen)
    loaded = setup.loaded
    pad_token_id = loaded.base.config.pad_token_id
    device = next(loaded.base.parameters()).device
    results = []
    for batch_size in usable_batch_sizes(batch_sizes, len(sources)):
        batches = make_batches(sources, batch_size, loaded.tokenizer, pad_token_id, device, loaded.feature_extractor)
        for batch in batches:  # an over-long source is a clear error before anything is timed
            hf.check_generate_inputs(loaded.base, (), batch)
        active = {mode.name: mode for mode in chosen if batch_size == 1 or not mode.batch_one_only}
        runs = {name: (mode, _setup_of(mode, setup, int8_setup, int8_drafter_setup)) for name, mode in active.items()}
        for name, (mode, variant_setup) in (variants or {}).items():
            if name in runs:
                raise ValueError(f"variant name {name!r} is also a mode")
            runs[name] = (Mode.parse(mode), variant_setup)
        runners = {name: mode_runner(mode, run_setup) for name, (mode, run_setup) in runs.items()}
        # the outputs of the modes CTranslate2 is compared with (greedy, beam search), kept for its pass only
        outputs: dict[str, dict[int, Any]] = {mode.reference: {} for mode in ct2_modes}
        for name, recorded in outputs.items():
            runners[name] = _recording(runners[name], recorded)
        warm_up = compile_modes(runners, batches[0], {name for name, (mode, _) in runs.items() if mode.compiled})
        by_mode = measure(
            runners, batches, pad_token_id=pad_token_id,
            reference={name: mode.reference for name, (mode, _) in runs.items() if mode.reference is not None},
            baseline="greedy",
            tokenizer=loaded.tokenizer, references=references, word_error=loaded.feature_extractor is not None,
            count_forwards_of=[loaded.base] + ([int8_setup.loaded.base] if int8_setup is not None else []),
            progress=progress, description=f"bench batch {batch_size}",
        )  # fmt: skip
        for name, seconds in warm_up.items():
            by_mode[name].compile_seconds = seconds
        results += by_mode.values()
        if ct2_modes:
            results += measure_ct2(setup, ct2_modes, batches, outputs, by_mode["greedy"], references, progress)
    return results


def _int8_setups(setup: BenchSetup, modes: Sequence[Mode]) -> tuple[BenchSetup | None, BenchSetup | None]:
    """The setups over the int8 model ([`LoadedModel.int8_copy`]) and over the float32 model with an int8 feature
    drafter ([`LoadedModel.int8_drafter_copy`]), each only where one of `modes` decodes with it."""
    int8 = any(mode.on_int8_model for mode in modes)
    int8_drafter = any(mode.on_int8_drafter for mode in modes)
    return (
        dataclasses.replace(setup, loaded=setup.loaded.int8_copy()) if int8 else None,
        dataclasses.replace(setup, loaded=setup.loaded.int8_drafter_copy()) if int8_drafter else None,
    )


def _setup_of(
    mode: Mode, setup: BenchSetup, int8_setup: BenchSetup | None, int8_drafter_setup: BenchSetup | None
) -> BenchSetup:
    """The setup `mode` decodes with: the int8 model's, the float32 model's with an int8 feature drafter, or the
    float32 model's."""
    if mode.on_int8_model:
        return int8_setup
    return int8_drafter_setup if mode.on_int8_drafter else setup


def _recording(runner: Runner, outputs: dict[int, Any]) -> Runner:
    """`runner`, keeping each batch's output by `id(batch)`."""

    def run(batch: Batch, earlier: Any) -> Any:
        outputs[id(batch)] = runner(batch, earlier)
        return outputs[id(batch)]

    return run

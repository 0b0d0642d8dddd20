"""CTranslate2, the engine a CPU user would pick instead, timed by the bench in a pass of its own
(the conversion and its runner: [`hf_blockwise.tools.ct2`])."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

from hf_blockwise.evaluation.harness import Batch, ModeResult, Runner, measure
from hf_blockwise.tools.bench.modes import Mode
from hf_blockwise.tools.bench.setup import BenchSetup

try:
    from hf_blockwise.tools import ct2
except ModuleNotFoundError as error:  # the optional extra: pip install -e .[ctranslate2]
    if error.name != "ctranslate2":
        raise
    ct2 = None


def ct2_unavailable(setup: BenchSetup) -> str | None:
    """Why the bench cannot run CTranslate2 on `setup`, or `None` when it can."""
    if ct2 is None:
        return "CTranslate2 is not installed (pip install -e .[ctranslate2])"
    if setup.loaded.tokenizer is None:
        return "CTranslate2 decodes token strings, which needs a tokenizer"
    if setup.loaded.feature_extractor is not None:
        return "the bench runs CTranslate2 on text inputs only"
    model_type = setup.loaded.base.config.model_type
    if model_type not in ct2.CONVERTED_MODEL_TYPES:
        return (
            f"the bench converts {list(ct2.CONVERTED_MODEL_TYPES)} models to CTranslate2, not {model_type!r} (its "
            "stock converters read config fields transformers 5 no longer has, e.g. BART's normalize_before)"
        )
    return None


def _replay(outputs: dict[int, Any]) -> Runner:
    """A runner that returns what a mode of the main pass output for each batch (no decoding, untimed in effect)."""
    return lambda batch, _: outputs[id(batch)]


def measure_ct2(
    setup: BenchSetup,
    modes: Sequence[Mode],
    batches: Sequence[Batch],
    reference_outputs: dict[str, dict[int, Any]],
    greedy: ModeResult,
    references: Sequence[str] | None,
    progress: bool,
) -> list[ModeResult]:
    """The CTranslate2 modes on the same batches, in a pass of their own after the other modes, with
    `setup.ct2_threads` threads (the bench's `--ct2-threads`, by default its torch threads).

    CTranslate2 brings its own OpenMP runtime, and in one process beside torch's on this 2-core CPU the two
    contend (measured): interleaved with torch's modes, a translator that has run slowed torch's calls by 30% (by
    3x with two CTranslate2 threads, which also slowed CTranslate2 itself 5x). So its translators exist only for
    this pass, after the others have finished. Outputs are compared with their reference mode's outputs of the same
    batches (greedy's, or transformers' beam search's for `ct2_b4`), and speedups are relative to the greedy mode's
    time in the main pass.

    Args:
        reference_outputs (`dict`): per reference mode, `id(batch)` -> its output for that batch.
        greedy ([`ModeResult`]): the greedy mode's result in the main pass.
    """
    base, tokenizer = setup.loaded.base, setup.loaded.tokenizer
    device = "cuda" if next(base.parameters()).device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as folder:
        model_dir = ct2.convert(base, tokenizer, folder)
        runners: dict[str, Runner] = {name: _replay(outputs) for name, outputs in reference_outputs.items()}
        for mode in modes:
            translator = ct2.load_translator(model_dir, mode.ct2_compute_type, setup.ct2_threads, device)
            runners[mode.name] = ct2.greedy_runner(translator, tokenizer, base, setup.max_new_tokens, mode.num_beams)
        by_mode = measure(
            runners, batches, pad_token_id=base.config.pad_token_id,
            reference={mode.name: mode.reference for mode in modes}, tokenizer=tokenizer,
            references=references, progress=progress, description=f"bench batch {greedy.batch_size}, CTranslate2",
        )  # fmt: skip
    results = [by_mode[mode.name] for mode in modes]
    for result in results:
        result.speedup = greedy.seconds / result.seconds if result.seconds else None
    return results

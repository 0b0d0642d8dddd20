"""`hf-blockwise bench`: every decoding mode side by side, in one run, measured against transformers' greedy.

Each mode decodes the same sentences in the same batches through one harness ([`harness.measure`]): times are
summed over batches (each batch timed once, modes interleaved per batch so that they share the machine's state).
Per mode: wall-clock ratio to greedy, target tokens/s, words/s (Devlin 2017's metric; single-threaded with
`--threads 1`), decoder forwards per output token, mean accepted block, identical-to-greedy rate (generated
tokens only: [`harness.same_output`]) and BLEU against references.

Two modes measure the decoding loop itself rather than a drafter:

- `loop`: `blockwise_generate` with no drafter (`assistant=None`, i.e. `NoDrafter`): one token per decoder call,
  like greedy, so its ratio to greedy is the loop's own overhead per step.
- `oracle` (rows `oracle_k{k}`, one per `--oracle-block-sizes` value): the drafts are greedy's own output for
  that batch (greedy runs first on each batch; a [`ReferenceDrafter`] proposes its next `k - 1` tokens), so
  every draft is accepted and each step gains k tokens. Its output must be identical to greedy's (100%), and its
  speedup is the loop's ceiling on this model and data at block size k: what a perfect drafter that costs
  nothing would reach. If a drafter's speedup is far below the oracle's at the same mean accepted block, the
  drafter (its accuracy or its own cost) limits you; if the oracle itself gains little, the loop and the
  model's cost of feeding k tokens per call ([`decoder_cost_curve`]) do, and no drafter can do better.

The bench also runs on randomly initialised models of real models' shapes and random source ids
(`--model-config`, [`hf_blockwise.tools.model_configs`]): greedy, loop and oracle need no trained drafter.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import CompileConfig

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.composite import CompositeDrafter
from hf_blockwise.drafters.input_copy import InputCopyDrafter
from hf_blockwise.drafters.nar import NonAutoregressiveDrafter
from hf_blockwise.drafters.oracle import ReferenceDrafter
from hf_blockwise.engine import CompiledDecoder, CompileOptions, compiled_decoder
from hf_blockwise.generation.acceptance import GADPlusPlusAcceptance, TopKAcceptance
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.modeling.quantization import quantize_dynamic_int8
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.tools.harness import Batch, Runner, measure, sequences_of
from hf_blockwise.tools.harness import DecoderCallCounter as DecoderCallCounter  # re-exported
from hf_blockwise.tools.harness import ModeResult as ModeResult  # re-exported

try:
    from hf_blockwise.tools import ct2
except ModuleNotFoundError as error:  # the optional extra: pip install -e .[ctranslate2]
    if error.name != "ctranslate2":
        raise
    ct2 = None

# The compiled engine (`blockwise_compile=True`): `greedy_compiled` is the loop with no drafter through it, the
# exact reference of every other `*_compiled` mode; `hf_greedy_compiled` is transformers' own greedy with a static
# cache and a compiled forward, as a user would set it up.
COMPILED_MODES = (
    "greedy_compiled", "oracle_compiled", "heads_compiled", "seq_heads_compiled", "feature_compiled", "iad_compiled",
    "composite_compiled", "gad_compiled", "hf_greedy_compiled",
)  # fmt: skip
MODE_NAMES = (
    "greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_full_vocab", "heads_top2", "seq_heads", "feature",
    "composite", "iad", "iad_realign", "gad", "gad_pp", "greedy_int8", "heads_int8", "iad_int8", "loop", "oracle",
    "ct2", "ct2_int8", *COMPILED_MODES,
)  # fmt: skip
DEFAULT_MODES = (
    "greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_top2", "seq_heads", "feature", "composite", "iad",
    "gad", "gad_pp", "loop", "oracle", "greedy_compiled", "oracle_compiled", "heads_compiled", "seq_heads_compiled",
    "feature_compiled", "iad_compiled", "composite_compiled", "hf_greedy_compiled",
)  # fmt: skip
COMPILED_SUFFIX = "_compiled"
# The CPU fast path, step by step (Devlin 2017, Table 1): blockwise heads drafting over the whole vocabulary,
# + the heads' vocabulary shortlist, + int8 matrix products (with int8 greedy as that step's exact reference).
FAST_PATH_MODES = ("greedy", "heads_full_vocab", "heads", "greedy_int8", "heads_int8")
# The loop alone, without a trained drafter: what `--model-config` runs.
LOOP_MODES = ("greedy", "loop", "oracle")
BATCH_ONE_ONLY = {"prompt_lookup", "assisted"}  # transformers' assisted generation decodes one row at a time
INT8_MODES = {"greedy_int8", "heads_int8", "iad_int8"}
# CTranslate2 greedy (float32, int8 weights), compared with transformers' float32 greedy: another engine, not exact
CT2_COMPUTE_TYPES = {"ct2": "float32", "ct2_int8": "int8"}
CT2_THREADS = 1  # see `measure_ct2`
DEFAULT_ORACLE_BLOCK_SIZES = (4,)
ORACLE_MODE = re.compile(r"oracle_k(\d+)")
# a model drafter at another block size k and (feature drafter) draft threshold: `feature_k6_t0.3`, `heads_k3`
SIZED_MODE = re.compile(r"(heads|seq_heads|feature)_k(\d+)(?:_t([0-9.]+))?|feature_t([0-9.]+)")


def reference_mode(mode: str) -> str:
    """The greedy mode whose output `mode` must reproduce: int8 modes are exact w.r.t. the int8 model, compiled
    modes w.r.t. the engine's own greedy (`greedy_compiled`, itself compared with eager greedy)."""
    if mode in INT8_MODES:
        return "greedy_int8"
    if is_compiled_mode(mode) and mode not in ("greedy_compiled", "hf_greedy_compiled"):
        return "greedy_compiled"
    return "greedy"


def is_compiled_mode(mode: str) -> bool:
    """Whether `mode` decodes through the compiled engine (or transformers' compiled forward)."""
    return mode.endswith(COMPILED_SUFFIX)


def oracle_mode(block_size: int) -> str:
    """The row name of the oracle mode at block size k: `oracle_k{k}`."""
    return f"oracle_k{block_size}"


@dataclass
class BenchSetup:
    """What the modes decode with.

    Attributes:
        base: the transformers seq2seq model (greedy reference and verifier).
        tokenizer (*optional*): turns source sentences into ids and outputs into texts; without one, sources are
            token ids and no texts, words/s or BLEU are reported.
        heads_model: a [`BlockwiseHeadsModel`] around `base`, for the heads modes.
        assistant_model: a smaller transformers model for transformers' assisted generation.
        max_new_tokens (`int`): length limit of every mode.
        iad_max_draft_length (`int`): most source tokens the IAD modes draft per step.
        nar_drafter ([`NonAutoregressiveDrafter`], *optional*): the drafter of the GAD modes.
        sequential_heads_model ([`BlockwiseHeadsModel`] with sequential heads, *optional*): mode `seq_heads`.
        feature_model ([`FeatureDrafterModel`], *optional*): the feature drafter of modes `feature` and
            `composite` (source copy where it has a draft, else the feature drafter).
        gad_block_size (`int`, *optional*): tokens per GAD step (default: the drafter's trained block size).
        gad_top_beta (`int`), gad_tolerance (`float`): GAD++'s β and τ (mode `gad_pp`).
        oracle_block_sizes (`tuple[int, ...]`): the block sizes k of the `oracle` mode, one row `oracle_k{k}` each.
        feature_extractor (*optional*): for models whose encoder reads audio (Whisper...): sources are then arrays
            of samples at its `sampling_rate`, and word error rate is reported beside BLEU.
    """

    base: nn.Module
    tokenizer: Any
    heads_model: nn.Module | None = None
    assistant_model: nn.Module | None = None
    max_new_tokens: int = 128
    iad_max_draft_length: int = 32
    nar_drafter: Any = None
    sequential_heads_model: nn.Module | None = None
    feature_model: nn.Module | None = None
    gad_block_size: int | None = None
    gad_top_beta: int = 3
    gad_tolerance: float = 1.0
    oracle_block_sizes: tuple[int, ...] = DEFAULT_ORACLE_BLOCK_SIZES
    feature_extractor: Any = None

    def int8_copy(self) -> BenchSetup:
        """The same setup with int8 dynamically quantized copies of the base (and of the heads model's base)."""
        source = self.heads_model if self.heads_model is not None else self.base
        quantized = quantize_dynamic_int8(copy.deepcopy(source))
        heads_model = quantized if self.heads_model is not None else None
        base = quantized.base_model if heads_model is not None else quantized
        return dataclasses.replace(
            self, base=base, heads_model=heads_model, assistant_model=None, sequential_heads_model=None,
            feature_model=None,
        )  # fmt: skip


def is_known_mode(mode: str) -> bool:
    """A mode name of the bench: one of `MODE_NAMES`, or an oracle or sized drafter mode, compiled or not."""
    plain = mode.removesuffix(COMPILED_SUFFIX)
    return mode in MODE_NAMES or bool(ORACLE_MODE.fullmatch(plain) or SIZED_MODE.fullmatch(plain))


def available_modes(setup: BenchSetup, requested: Sequence[str]) -> list[str]:
    """The requested modes this setup can run, with a reason printed for each one left out; `oracle` becomes one
    `oracle_k{k}` mode per block size of `setup.oracle_block_sizes`."""
    modes = []
    for mode in requested:
        if not is_known_mode(mode):
            raise ValueError(f"Unknown mode {mode!r}; choose from {MODE_NAMES}, oracle_k<k>, feature_k<k>_t<p>")
        missing = _missing_model(setup, mode.removesuffix(COMPILED_SUFFIX))
        if mode in ("oracle", "oracle_compiled"):
            suffix = mode.removeprefix("oracle")
            modes += [oracle_mode(k) + suffix for k in setup.oracle_block_sizes]
        elif missing:
            print(f"skipping {mode}: {missing}")
        elif mode == "assisted" and setup.assistant_model is None:
            print("skipping assisted: pass --assistant-model")
        elif mode.startswith("gad") and setup.nar_drafter is None:
            print(f"skipping {mode}: pass --nar-drafter")
        elif mode.startswith("iad") and not shares_vocabulary(setup.base):
            print(f"skipping {mode}: source and target vocabularies differ")
        elif mode in CT2_COMPUTE_TYPES and ct2 is None:
            print(f"skipping {mode}: CTranslate2 is not installed (pip install -e .[ctranslate2])")
        elif mode in CT2_COMPUTE_TYPES and setup.tokenizer is None:
            print(f"skipping {mode}: CTranslate2 decodes token strings, which needs a tokenizer")
        elif mode in CT2_COMPUTE_TYPES and setup.feature_extractor is not None:
            print(f"skipping {mode}: the bench runs CTranslate2 on text inputs only")
        else:
            modes.append(mode)
    if "greedy_int8" not in modes and INT8_MODES & set(modes):
        modes.insert(0, "greedy_int8")
    if "greedy_compiled" not in modes and any(reference_mode(mode) == "greedy_compiled" for mode in modes):
        modes.insert(0, "greedy_compiled")
    if "greedy" not in modes:
        modes.insert(0, "greedy")
    modes = list(dict.fromkeys(modes))
    # references first: each batch is decoded by the modes in this order, and others are compared with them
    return sorted(modes, key=lambda mode: ("greedy", "greedy_int8", "greedy_compiled").index(mode) if mode in (
        "greedy", "greedy_int8", "greedy_compiled") else 3)  # fmt: skip


def _missing_model(setup: BenchSetup, mode: str) -> str | None:
    """Why `setup` cannot run a drafter mode (the model it needs is absent), or `None`."""
    if mode.startswith("heads") and setup.heads_model is None:
        return "the model has no proposal heads"
    if mode.startswith("seq_heads") and setup.sequential_heads_model is None:
        return "no sequential heads (pass --sequential-heads)"
    if mode.startswith(("feature", "composite")) and setup.feature_model is None:
        return "no feature drafter (pass --feature-drafter)"
    if mode == "composite" and not shares_vocabulary(setup.base):
        return "source and target vocabularies differ"
    return None


def shares_vocabulary(model: nn.Module) -> bool:
    try:
        hf.check_shared_vocabulary(model)
    except ValueError:
        return False
    return True


def usable_batch_sizes(batch_sizes: Sequence[int], num_sentences: int) -> list[int]:
    """The batch sizes that fit `num_sentences`; a note is printed for each one skipped."""
    usable = []
    for batch_size in dict.fromkeys(batch_sizes):
        if batch_size < 1:
            raise ValueError(f"batch sizes must be >= 1, got {batch_size}")
        if batch_size > num_sentences:
            print(f"skipping batch size {batch_size}: larger than the {num_sentences} sentences")
        else:
            usable.append(batch_size)
    if not usable:
        raise ValueError(f"every batch size in {list(batch_sizes)} is larger than the {num_sentences} sentences")
    return usable


def make_batches(
    sources: Sequence[str] | Sequence[Sequence[int]] | Sequence[np.ndarray],
    batch_size: int,
    tokenizer: Any,
    pad_token_id: int,
    device: torch.device,
    feature_extractor: Any = None,
) -> list[Batch]:
    """`sources` in consecutive batches of `batch_size` rows, right-padded, with attention masks.

    Args:
        sources: sentences (tokenized with `tokenizer`), lists of source token ids (without a tokenizer), or audio
            samples (with a `feature_extractor`).

    Returns:
        `list[dict]` with `input_ids` and `attention_mask` of shape `(rows, longest source of the batch)`, or the
        feature extractor's outputs (e.g. Whisper's `input_features` of shape `(rows, mel bins, frames)`).
    """
    chunks = [list(sources[start : start + batch_size]) for start in range(0, len(sources), batch_size)]
    if feature_extractor is not None:
        rate = feature_extractor.sampling_rate
        return [dict(feature_extractor(chunk, sampling_rate=rate, return_tensors="pt").to(device)) for chunk in chunks]
    if tokenizer is not None:
        return [dict(tokenizer(chunk, return_tensors="pt", padding=True).to(device)) for chunk in chunks]
    batches = []
    for chunk in chunks:
        width = max(len(ids) for ids in chunk)
        input_ids = torch.tensor([list(ids) + [pad_token_id] * (width - len(ids)) for ids in chunk], device=device)
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in chunk], device=device)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


def _blockwise_runner(model: nn.Module, limit: int, **generate_kwargs: Any) -> Runner:
    """`model.generate` through this package's loop (or a [`BlockwiseHeadsModel`]'s own generate)."""
    return lambda batch, _: model.generate(
        **batch, **generate_kwargs, max_new_tokens=limit, return_dict_in_generate=True
    )


def _oracle_runner(base: nn.Module, block_size: int, limit: int, compiled: bool) -> Runner:
    """Blockwise decoding that drafts greedy's own output of the same batch (the `greedy` mode's, or with the
    engine `greedy_compiled`'s, so that every draft is accepted)."""
    reference = "greedy_compiled" if compiled else "greedy"

    def run(batch: Batch, earlier: dict[str, Any]) -> Any:
        drafter = ReferenceDrafter(sequences_of(earlier[reference]), block_size=block_size)
        return base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=limit,
            return_dict_in_generate=True, blockwise_compile=compiled,
        )  # fmt: skip

    return run


def _hf_compiled_greedy_runner(base: nn.Module, limit: int) -> Runner:
    """transformers' greedy `generate` as a user compiles it: a static cache and a compiled forward."""
    config = CompileConfig(fullgraph=False, dynamic=True)
    return lambda batch, _: base.generate(
        **batch, do_sample=False, num_beams=1, max_new_tokens=limit, cache_implementation="static",
        compile_config=config,
    )  # fmt: skip


def mode_runner(mode: str, setup: BenchSetup) -> Runner:
    """A function `runner(batch, earlier)` decoding one tokenized batch in `mode` (see [`harness.measure`]);
    returns sequences or a dict-style output.

    For the int8 modes, `setup` is the quantized one ([`BenchSetup.int8_copy`]). `oracle_k{k}` modes read the
    `greedy` mode's output of the same batch from `earlier`.
    """
    base, limit = setup.base, setup.max_new_tokens
    if mode == "hf_greedy_compiled":
        return _hf_compiled_greedy_runner(base, limit)
    compiled = is_compiled_mode(mode)
    mode = mode.removesuffix("_int8").removesuffix(COMPILED_SUFFIX)
    oracle = ORACLE_MODE.fullmatch(mode)
    if oracle:
        return _oracle_runner(base, int(oracle.group(1)), limit, compiled)
    if compiled and mode in ("greedy", "loop"):  # the engine's greedy: the loop with no drafter, compiled
        return _blockwise_runner(
            base, limit, custom_generate=blockwise_generate, assistant=None, blockwise_compile=True
        )
    if mode == "greedy":
        # a dict-style output: Whisper's keeps its decoder prompt in `sequences` (a tensor output drops it), like
        # the loop's outputs, which are compared with it and which the oracle drafts from
        return lambda batch, _: base.generate(
            **batch, do_sample=False, num_beams=1, max_new_tokens=limit, return_dict_in_generate=True
        )
    if mode == "beam4":
        return lambda batch, _: base.generate(**batch, do_sample=False, num_beams=4, max_new_tokens=limit)
    if mode == "prompt_lookup":
        return lambda batch, _: base.generate(
            **batch, do_sample=False, prompt_lookup_num_tokens=10, max_new_tokens=limit
        )
    if mode == "assisted":
        return lambda batch, _: base.generate(
            **batch, do_sample=False, assistant_model=setup.assistant_model, max_new_tokens=limit
        )
    if mode == "loop":
        return _blockwise_runner(
            base, limit, custom_generate=blockwise_generate, assistant=None, blockwise_compile=compiled
        )
    sized = SIZED_MODE.fullmatch(mode)
    if sized or mode in ("seq_heads", "feature", "composite"):
        return _model_drafter_runner(mode, sized, setup, compiled)
    if mode in ("heads", "heads_full_vocab", "heads_top2"):
        rule = TopKAcceptance(2) if mode == "heads_top2" else None
        drafter = setup.heads_model.drafter(use_shortlist=mode != "heads_full_vocab")
        return _blockwise_runner(
            setup.heads_model, limit, assistant=drafter, acceptance=rule, blockwise_compile=compiled
        )
    if mode in ("iad", "iad_realign"):  # iad_realign: drafts right after an edit too
        drafter = InputCopyDrafter(base, max_draft_length=setup.iad_max_draft_length, realign=mode == "iad_realign")
        return _blockwise_runner(
            base, limit, custom_generate=blockwise_generate, assistant=drafter, blockwise_compile=compiled
        )
    if mode in ("gad", "gad_pp"):
        nar = setup.nar_drafter
        drafter = NonAutoregressiveDrafter(nar.model, nar.config, block_size=setup.gad_block_size, verifier=base)
        rule = GADPlusPlusAcceptance(setup.gad_top_beta, setup.gad_tolerance) if mode == "gad_pp" else None
        return _blockwise_runner(
            base,
            limit,
            custom_generate=blockwise_generate,
            assistant=drafter,
            acceptance=rule,
            blockwise_compile=compiled,
        )
    raise ValueError(f"Unknown mode {mode!r}")


def _model_drafter_runner(mode: str, sized: re.Match | None, setup: BenchSetup, compiled: bool) -> Runner:
    """Runners of the trained model drafters: heads, sequential heads, feature drafter (at a block size k and
    draft threshold when the mode names them), and the composite of source copy and feature drafter."""
    name, block_size, threshold = mode, None, "config"
    if sized:
        name = sized.group(1) or "feature"
        block_size = int(sized.group(2)) if sized.group(2) else None
        raw = sized.group(3) or sized.group(4)
        threshold = float(raw) if raw else None
    limit = setup.max_new_tokens
    if name == "heads":
        return _blockwise_runner(
            setup.heads_model, limit, assistant=setup.heads_model.drafter(block_size), blockwise_compile=compiled
        )
    if name == "seq_heads":
        model = setup.sequential_heads_model
        return _blockwise_runner(model, limit, assistant=model.drafter(block_size), blockwise_compile=compiled)
    feature = setup.feature_model.drafter(block_size=block_size, threshold=threshold)
    if name == "composite":
        copy = InputCopyDrafter(setup.base, max_draft_length=setup.iad_max_draft_length)
        feature = CompositeDrafter(copy, feature)
    return _blockwise_runner(
        setup.base, limit, custom_generate=blockwise_generate, assistant=feature, blockwise_compile=compiled
    )


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
        sources: sentences, or lists of source token ids when `setup.tokenizer` is `None`.
        references (`list[str]`, *optional*): one per source, for BLEU.
        variants (`dict`, *optional*): more runs by name, each a mode with its own setup (e.g. a sweep over GAD's
            block size); they are timed beside the modes, batch by batch, and compared with the same greedy run.
    """
    if not sources:
        raise ValueError("The benchmark needs at least one source sentence")
    modes = available_modes(setup, modes)
    ct2_modes = [mode for mode in modes if mode in CT2_COMPUTE_TYPES]
    modes = [mode for mode in modes if mode not in CT2_COMPUTE_TYPES]
    int8_setup = setup.int8_copy() if INT8_MODES & set(modes) else None
    counted = [setup.base] + ([int8_setup.base] if int8_setup is not None else [])
    pad_token_id = setup.base.config.pad_token_id
    device = next(setup.base.parameters()).device
    results = []
    for batch_size in usable_batch_sizes(batch_sizes, len(sources)):
        batches = make_batches(sources, batch_size, setup.tokenizer, pad_token_id, device, setup.feature_extractor)
        for batch in batches:  # an over-long source is a clear error before anything is timed
            hf.check_generate_inputs(setup.base, (), batch)
        active = [mode for mode in modes if batch_size == 1 or mode not in BATCH_ONE_ONLY]
        runners = {mode: mode_runner(mode, int8_setup if mode in INT8_MODES else setup) for mode in active}
        greedy_outputs: dict[int, Any] = {}  # kept only for the CTranslate2 pass, which compares with them
        if ct2_modes:
            runners["greedy"] = _recording(runners["greedy"], greedy_outputs)
        for name, (mode, variant_setup) in (variants or {}).items():
            if name in runners:
                raise ValueError(f"variant name {name!r} is also a mode")
            runners[name] = mode_runner(mode, variant_setup)
        warm_up = compile_modes(runners, batches[0])
        by_mode = measure(
            runners, batches, pad_token_id=pad_token_id, reference={name: reference_mode(name) for name in runners},
            baseline="greedy", tokenizer=setup.tokenizer, references=references,
            word_error=setup.feature_extractor is not None, count_forwards_of=counted,
            progress=progress, description=f"bench batch {batch_size}",
        )  # fmt: skip
        for mode, seconds in warm_up.items():
            by_mode[mode].compile_seconds = seconds
        results += by_mode.values()
        if ct2_modes:
            results += measure_ct2(setup, ct2_modes, batches, greedy_outputs, by_mode["greedy"], references, progress)
    return results


def compile_modes(runners: dict[str, Runner], batch: Batch) -> dict[str, float]:
    """Runs every compiled mode once on `batch`, untimed, so that compilation is not timed as decoding; returns
    each one's wall time for that run (its compilation, when it was the first to need a graph). Modes run in
    order, so that an oracle finds the greedy output it drafts from."""
    earlier: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    if not any(is_compiled_mode(mode) for mode in runners):
        return seconds
    with torch.no_grad():
        for mode, runner in runners.items():
            if is_compiled_mode(mode) or mode == "greedy":
                start = time.perf_counter()
                earlier[mode] = runner(batch, earlier)
                if is_compiled_mode(mode):
                    seconds[mode] = time.perf_counter() - start
    return seconds


def measure_ct2(
    setup: BenchSetup,
    modes: Sequence[str],
    batches: Sequence[Batch],
    greedy_outputs: dict[int, Any],
    greedy: ModeResult,
    references: Sequence[str] | None,
    progress: bool,
) -> list[ModeResult]:
    """The CTranslate2 modes on the same batches, in a pass of their own after the other modes, with one thread.

    CTranslate2 brings its own OpenMP runtime, and in one process beside torch's on this 2-core CPU the two
    contend (measured): interleaved with torch's modes, a translator that has run slowed torch's calls by 30% (by
    3x with two CTranslate2 threads, which also slowed CTranslate2 itself 5x). So its translators exist only for
    this pass, after the others, and run `CT2_THREADS` (one) thread: at `--threads 1` the comparison is at equal
    threads, at `--threads 2` the CTranslate2 rows understate it. Outputs are compared with the greedy mode's
    outputs of the same batches, and speedups are relative to that mode's time in the main pass.

    Args:
        greedy_outputs (`dict`): `id(batch)` -> the greedy mode's output for that batch.
        greedy ([`ModeResult`]): the greedy mode's result in the main pass.
    """
    device = "cuda" if next(setup.base.parameters()).device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as folder:
        model_dir = ct2.convert(setup.base, setup.tokenizer, folder)
        runners: dict[str, Runner] = {"greedy": lambda batch, _: greedy_outputs[id(batch)]}  # a replay
        for mode in modes:
            translator = ct2.load_translator(model_dir, CT2_COMPUTE_TYPES[mode], CT2_THREADS, device)
            runners[mode] = ct2.greedy_runner(translator, setup.tokenizer, setup.base, setup.max_new_tokens)
        by_mode = measure(
            runners, batches, pad_token_id=setup.base.config.pad_token_id, reference="greedy",
            tokenizer=setup.tokenizer, references=references, progress=progress,
            description=f"bench batch {greedy.batch_size}, CTranslate2",
        )  # fmt: skip
    results = [by_mode[mode] for mode in modes]
    for result in results:
        result.speedup = greedy.seconds / result.seconds if result.seconds else None
    return results


def _recording(runner: Runner, outputs: dict[int, Any]) -> Runner:
    """`runner`, keeping each batch's output by `id(batch)`."""

    def run(batch: Batch, earlier: Any) -> Any:
        outputs[id(batch)] = runner(batch, earlier)
        return outputs[id(batch)]

    return run


def block_widths(setup: BenchSetup, modes: Sequence[str]) -> dict[str, int]:
    """Tokens fed per step, for the modes whose every step feeds the same number: heads (the heads' k), GAD (the
    drafter's k) and oracle (its k). IAD's width follows the source, so it has none."""
    widths = {}
    for mode in modes:
        oracle = ORACLE_MODE.fullmatch(mode)
        if oracle:
            widths[mode] = int(oracle.group(1))
        elif SIZED_MODE.fullmatch(mode) and SIZED_MODE.fullmatch(mode).group(2):
            widths[mode] = int(SIZED_MODE.fullmatch(mode).group(2))
        elif mode.startswith("heads") and setup.heads_model is not None:
            widths[mode] = setup.heads_model.blockwise_config.block_size
        elif mode.startswith("gad") and setup.nar_drafter is not None:
            widths[mode] = setup.gad_block_size or setup.nar_drafter.block_size
    return widths


def set_speedup_ceilings(results: Sequence[ModeResult], curve: Sequence[tuple[int, float]], setup: BenchSetup) -> None:
    """Sets `speedup_ceiling` ([`speedup_ceiling`]) of the batch-1 results of fixed-width modes the curve covers."""
    widths = block_widths(setup, [result.mode for result in results])
    for result in results:
        width = widths.get(result.mode)
        if width is not None and width <= len(curve) and result.batch_size == 1 and result.mean_accepted:
            result.speedup_ceiling = speedup_ceiling(curve, result.mean_accepted, width)


def _format(value: float | None, pattern: str) -> str:
    return "" if value is None else pattern.format(value)


def _table_cells(result: ModeResult) -> dict[str, str]:
    figures = result.summary()
    return {
        "batch": str(result.batch_size),
        "mode": result.mode,
        "speedup vs greedy": _format(result.speedup, "{:.2f}x"),
        "ceiling": _format(result.speedup_ceiling, "{:.2f}x"),
        "tokens/s": _format(figures["tokens_per_second"], "{:.0f}"),
        "words/s": _format(figures["words_per_second"], "{:.0f}"),
        "forwards/token": _format(figures["forwards_per_token"] if result.decoder_forwards else None, "{:.2f}"),
        "mean accepted": _format(figures["mean_accepted"], "{:.2f}"),
        "identical¹": f"{result.identical}/{result.compared}" if result.compared else "",
        "BLEU": _format(result.bleu, "{:.2f}"),
        "WER": _format(None if result.wer is None else 100 * result.wer, "{:.1f}%"),
    }


def markdown_table(results: Sequence[ModeResult], header: str) -> str:
    """The results as a Markdown table under `header`; columns empty in every row are left out."""
    rows = [_table_cells(result) for result in results]
    columns = [column for column in rows[0] if any(row[column] for row in rows)] if rows else []
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[column] for column in columns) + " |" for row in rows]
    if "identical¹" in columns:
        lines += [
            "",
            "¹ generated tokens equal, token for token, to greedy decoding of the same model (int8 modes: the int8 "
            "model; `ct2*`: transformers' float32 greedy, which another engine need not match); `oracle_k*` must be "
            "100%",
        ]
    if "ceiling" in columns:
        lines += [
            "",
            "ceiling: `mean accepted · t(1) / t(k)` from the decoder cost curve (`--cost-curve`), for modes that "
            "feed k tokens every step: what the mode would reach if drafting and the loop cost nothing (GAD's "
            "drafter calls come on top)",
        ]
    return "\n".join(lines) + "\n"


def mode_colours(modes: Sequence[str]) -> dict[str, Any]:
    """One distinct colour per mode: a qualitative colormap (tab20's ten dark colours, then its ten light ones), or
    evenly spaced hues beyond 20."""
    import matplotlib

    names = list(dict.fromkeys(modes))
    if len(names) <= 20:
        tab20 = matplotlib.colormaps["tab20"].colors
        palette = tab20[0::2] + tab20[1::2]  # the dark ones are tab10's colours
    else:
        palette = [matplotlib.colormaps["hsv"](index / len(names)) for index in range(len(names))]
    return {name: palette[index] for index, name in enumerate(names)}


def plot(results: Sequence[ModeResult], path: str) -> bool:
    """Speedup (and BLEU, given references) against mean accepted block (Stern's Figure 4 and Table 1 scatter),
    one PNG; one colour per mode, one marker per batch size. Panels without data are left out.

    Returns:
        `bool`: whether anything was plotted (no file is written otherwise).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [result for result in results if result.mean_accepted is not None and result.speedup is not None]
    panels = [("speed", "wall-clock speedup vs greedy", lambda result: result.speedup)]
    if any(result.bleu is not None for result in plotted):
        panels.append(("quality", "BLEU", lambda result: result.bleu))
    if not plotted:
        return False
    colours = mode_colours([result.mode for result in plotted])
    markers = dict(zip(dict.fromkeys(result.batch_size for result in plotted), "osD^v<>pPX*", strict=False))
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 4), squeeze=False)
    for axis, (title, label, value) in zip(axes[0], panels, strict=True):
        for result in plotted:
            if value(result) is not None:
                axis.scatter(
                    result.mean_accepted, value(result), color=colours[result.mode],
                    marker=markers.get(result.batch_size, "o"), label=f"{result.mode} (b={result.batch_size})",
                )  # fmt: skip
        axis.set(xlabel="mean accepted block", ylabel=label, title=title)
    axes[0][0].axhline(1.0, color="grey", linewidth=0.5)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    temporary = f"{path}.tmp.png"
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    os.replace(temporary, path)
    return True


def write_report(results: Sequence[ModeResult], out_dir: str, header: str, settings: dict[str, Any]) -> list[str]:
    """`bench.json`, `bench.md` and `bench.png` (when there is anything to plot) in `out_dir`, each written
    atomically; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    report = {"settings": settings, "results": [result.summary() for result in results]}
    paths = [os.path.join(out_dir, name) for name in ("bench.json", "bench.md", "bench.png")]
    atomic_write_text(paths[0], json.dumps(report, indent=2) + "\n")
    atomic_write_text(paths[1], markdown_table(results, header))
    if not plot(results, paths[2]):
        print("no plot: no mode reports a mean accepted block")
        paths.pop()
    return paths


def read_lines(path: str) -> list[str]:
    """One sentence per line, plain or gzip text."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [" ".join(line.split()) for line in handle.read().splitlines()]


@torch.no_grad()
def decoder_cost_curve(
    base: nn.Module,
    tokenizer: Any,
    sentence: str | Sequence[int],
    max_tokens: int = 32,
    prefix_length: int = 10,
    repeats: int = 20,
    compiled: bool = False,
) -> list[tuple[int, float]]:
    """Median time of one cached decoder forward that feeds n = 1..`max_tokens` new tokens.

    The cache first holds `prefix_length` tokens and the encoder output is computed once, as in decoding. Each
    round times every n once (after one warm-up round), so that the widths share the machine's state.
    The curve bounds what any drafter can gain: a step that feeds k tokens and keeps a of them is at most
    `a * t(1) / t(k)` times faster than greedy (see [`speedup_ceiling`]).

    Args:
        sentence: the source, as text (tokenized with `tokenizer`) or as a list of token ids (`tokenizer` unused).
        compiled (`bool`): time the compiled engine's forward (`blockwise_compile=True`) instead of the eager one.

    Returns:
        `list[tuple[int, float]]`: (tokens fed, seconds per call), for 1..`max_tokens`.
    """
    device = next(base.parameters()).device
    if isinstance(sentence, str):
        inputs = tokenizer([sentence], return_tensors="pt").to(device)
    else:
        input_ids = torch.tensor([list(sentence)], device=device)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    encoder_outputs = base.get_encoder()(**inputs)
    start = torch.full((1, 1), base.config.decoder_start_token_id, device=device)
    prefix = torch.cat([start, torch.full((1, prefix_length - 1), base.config.eos_token_id, device=device)], dim=1)
    engine = compiled_decoder(base, CompileOptions()) if compiled else None
    if compiled and engine is None:
        raise RuntimeError("the compiled cost curve needs torch.compile, which is unavailable here (see the warning)")
    times: dict[int, list[float]] = {num_tokens: [] for num_tokens in range(1, max_tokens + 1)}
    for repeat in range(repeats + 1):  # widths interleaved, so that a slow spell of the machine hits them all
        for num_tokens, timings in times.items():
            seconds = _time_cached_forward(base, encoder_outputs, inputs["attention_mask"], prefix, num_tokens, engine)
            if repeat > 0:  # the first round warms up
                timings.append(seconds)
    return [(num_tokens, statistics.median(timings)) for num_tokens, timings in times.items()]


def _time_cached_forward(
    base: nn.Module,
    encoder_outputs: Any,
    attention_mask: torch.Tensor,
    prefix: torch.Tensor,
    num_tokens: int,
    engine: CompiledDecoder | None = None,
) -> float:
    """Seconds of one decoder forward feeding `num_tokens` tokens (EOS ids) after `prefix` (already cached),
    eager or through `engine`."""
    forward_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": attention_mask}
    fed = torch.full((1, num_tokens), base.config.eos_token_id, device=prefix.device)
    if engine is None:
        cache = hf.new_decoder_cache()
        hf.decoder_forward(base, prefix, cache, forward_kwargs)
        begin = time.perf_counter()
        hf.decoder_forward(base, fed, cache, forward_kwargs)
        return time.perf_counter() - begin
    cache = engine.new_cache(prefix.shape[1] + num_tokens + 1)
    engine.forward(prefix, cache, forward_kwargs, cache_length=0)
    begin = time.perf_counter()
    engine.forward(fed, cache, forward_kwargs, cache_length=prefix.shape[1])
    return time.perf_counter() - begin


def speedup_ceiling(curve: Sequence[tuple[int, float]], mean_accepted: float, tokens_fed: int) -> float:
    """Best speedup over greedy for steps that feed `tokens_fed` tokens and gain `mean_accepted` on average,
    counting decoder forwards only: `mean_accepted * t(1) / t(tokens_fed)`."""
    times = dict(curve)
    return mean_accepted * times[1] / times[tokens_fed]


def plot_cost_curve(
    curve: Sequence[tuple[int, float]], path: str, compiled: Sequence[tuple[int, float]] | None = None
) -> None:
    """The decoder cost curve (eager, and compiled when given) and the speedup ceilings the eager one implies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, ceiling_axis) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [n for n, _ in curve]
    time_axis.plot(tokens, [1000 * t for _, t in curve], marker="o", label="eager")
    if compiled is not None:
        time_axis.plot([n for n, _ in compiled], [1000 * t for _, t in compiled], marker="s", label="compiled")
        time_axis.legend(fontsize=7)
    time_axis.set(xlabel="tokens fed in one decoder call", ylabel="ms per call", title="decoder cost curve")
    accepted_levels = (1.5, 2.0, 3.0, 4.0)
    colours = mode_colours([str(accepted) for accepted in accepted_levels])
    for accepted in accepted_levels:
        ceiling = [speedup_ceiling(curve, min(accepted, n), n) for n in tokens]
        ceiling_axis.plot(tokens, ceiling, label=f"mean accepted {accepted:g}", color=colours[str(accepted)])
    ceiling_axis.set(xlabel="block size k (tokens fed)", ylabel="speedup ceiling", title="a · t(1) / t(k)")
    ceiling_axis.axhline(1.0, color="grey", linewidth=0.5)
    ceiling_axis.legend(fontsize=7)
    figure.tight_layout()
    temporary = f"{path}.tmp.png"
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    os.replace(temporary, path)

"""A corpus job: the settings checked, the model and drafter loaded, each chunk decoded in sorted batches through
the loop, written in input order, and (under `accelerate launch`) the shards merged."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import PartialState
from torch import nn
from tqdm.auto import tqdm

from hf_blockwise.corpus.decoding import DecodedRow, decode_chunk, output_text
from hf_blockwise.corpus.models import load_for_corpus
from hf_blockwise.corpus.output import (
    CorpusSettings,
    OutputProgress,
    append_chunk,
    check_output,
    claim_output,
    first_bad_line,
    locked_output,
    merge_shards,
    progress_path,
    read_progress,
    shard_path,
    warn_repaired,
    whole_output_settings,
    write_progress,
)
from hf_blockwise.corpus.paths import (
    check_output_is_not_a_source,
    check_output_location,
    input_identity,
)
from hf_blockwise.corpus.planning import chunks_of_shard
from hf_blockwise.corpus.sources import read_sources, texts_sha256
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.loading import DRAFTERS as REGISTERED_DRAFTERS
from hf_blockwise.loading import (
    LoadedModel,
    build_drafter,
    default_max_new_tokens,
    missing_drafter,
    shares_vocabulary,
)

# the job's drafter names: `auto` (the fastest exact choice, [`choose_drafter`]), `none`, and the registry's drafters
# offered for corpora ([`hf_blockwise.loading.DRAFTERS`])
DRAFTERS = ("auto", "none", *(name for name, kind in REGISTERED_DRAFTERS.items() if kind.corpus))
OUTPUT_FORMATS = ("text", "jsonl")
# generate arguments the job sets itself: given again in `generate_kwargs`, they would clash
JOB_GENERATE_ARGUMENTS = ("custom_generate", "assistant", "blockwise_compile", "return_dict_in_generate")


@dataclass
class CorpusReport:
    """What a run did, for this process's share (the whole corpus with one process).

    Attributes:
        output (`str`): the output file. lines (`int`): lines decoded in this run (resumed lines excluded).
        skipped (`int`): sources skipped as too long. new_tokens (`int`): generated tokens.
        row_calls (`int`): decoder calls summed over rows (a call serving 8 rows counts 8); `new_tokens / row_calls` is
            the mean tokens per decoder call a row gained. seconds (`float`): wall time of decoding.
        drafter (`str`): the drafter used. resumed_lines (`int`): lines already in the output when the run began
            (those it verifiably held). repaired_from (`int`, *optional*): the first line (from 1) that no longer
            held what the job wrote (deleted, edited or appended since), from which on it was written again.
    """

    output: str
    drafter: str
    lines: int = 0
    skipped: int = 0
    new_tokens: int = 0
    row_calls: int = 0
    seconds: float = 0.0
    resumed_lines: int = 0
    repaired_from: int | None = None

    @property
    def sentences_per_second(self) -> float:
        return self.lines / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / self.row_calls if self.row_calls else 0.0


def choose_drafter(name: str, loaded: LoadedModel, batch_size: int) -> str:
    """The drafter a run uses: `name` (one of `DRAFTERS`, checked by `CorpusOptions.checked`) if the model has it, or
    for `"auto"` the fastest exact choice measured here (`docs/results.md`, "Generating a corpus": Europarl through
    the Multi30k model, W&I through gec-en):

    - batch size 1: the composite of source copy and feature drafter when the model ships a feature drafter and
      shares its vocabulary (within 10% of the best on both tasks: 1.61x vs the feature drafter's 1.74x on
      translation, 3.95x vs source copy's 4.31x on error correction), else the feature drafter, the heads, source
      copy (shared vocabulary) or none;
    - larger batches: none (the loop alone, one token per call): drafting at 16 or 64 rows costs more than it saves
      on translation (the feature drafter 1.37x against the loop's 1.87x at 16), and on error correction the loop is
      within 10% of source copy at 16 (2.38x vs 2.64x) and the fastest at 64.
    """
    if name == "auto" and batch_size > 1:
        return "none"
    if name == "auto":
        shares = shares_vocabulary(loaded.base)
        if loaded.feature_model is not None:
            return "composite" if shares else "feature"
        if loaded.heads_model is not None:
            return "heads"
        return "input_copy" if shares else "none"
    missing = missing_drafter(name, loaded)
    if missing:
        raise ValueError(f"--drafter {name}: the model has {missing}")
    return name


def format_line(index: int, row: DecodedRow, settings: CorpusSettings) -> str:
    """The output line of source `index` (with its newline): the text alone ([`output_text`]), or a JSON object."""
    if settings.output_format == "text":
        return output_text(row) + "\n"
    record: dict[str, Any] = {"index": index, "output": None if row.skipped else row.text}
    if row.skipped:
        record["skipped"] = row.skipped
    elif settings.stats:
        record.update(new_tokens=row.new_tokens, decoder_calls=row.decoder_calls)
    return json.dumps(record, ensure_ascii=False) + "\n"


@dataclass
class CorpusJob:
    """A prepared run: the loaded models and drafter, the sources, and this process's settings and output file."""

    loaded: LoadedModel
    drafter: Drafter | None
    texts: list[str]
    settings: CorpusSettings
    generate_kwargs: dict[str, Any]
    output: Path
    shard_output: Path
    state: Any = field(repr=False, default=None)


def generate_corpus(
    model: str | os.PathLike | nn.Module | LoadedModel,
    inputs: str | Sequence[str] | datasets.Dataset,
    output: str | os.PathLike,
    *,
    tokenizer: Any = None,
    column: str | None = None,
    split: str | None = None,
    drafter: str = "auto",
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    max_new_tokens: int | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    compile: bool = False,
    int8: bool = False,
    output_format: str | None = None,
    stats: bool = False,
    on_long: str = "fail",
    chunk_size: int = 1024,
    overwrite: bool = False,
    progress: bool = True,
) -> CorpusReport:
    """Generates an output for every source of a corpus, exactly as greedy `generate` would, in input order.

    Sources are decoded in sorted batches (by length, within chunks of `chunk_size` lines) through blockwise
    decoding with `drafter`; an interrupted run resumes where it stopped when called again with the same arguments;
    under `accelerate launch` each process decodes its share of the chunks and process 0 merges them. A blank
    source gives a blank output.

    Args:
        model: a model directory (with its drafters), a hub id, or a model loaded in eval mode (a transformers seq2seq
            model, a [`BlockwiseHeadsModel`], [`FeatureDrafterModel`] or [`LoadedModel`]) with its `tokenizer`.
        inputs: a text file, a JSONL file, a data file or saved/hub dataset (`column`, `split`), a list of strings or
            a `datasets.Dataset` (see [`read_sources`]).
        output (`str` or `os.PathLike`): the output file; `OUTPUT.progress.json` beside it records progress. Never
            the input or one of the model directory's files.
        tokenizer (*optional*): the tokenizer of a loaded `model` (a model directory loads its own).
        drafter (`str`): one of `DRAFTERS`; `"auto"` picks the fastest exact one the model has ([`choose_drafter`]).
        batch_size (`int`): most rows per batch. max_batch_tokens (`int`, *optional*): most padded source tokens.
        max_new_tokens (`int`, *optional*): the length limit, as in `generate`; by default the checkpoint's
            `generation_config`, as `model.generate()` without arguments (`generate_kwargs` may set more arguments).
        compile (`bool`): verify through the compiled engine, on CPU with `CompileOptions(compiled_prefill=True)`.
        int8 (`bool`): the base in int8 (CPU); with `compile`, each row encoded alone ([`batch_invariant`]).
        output_format (`str`, *optional*): `"text"` or `"jsonl"`; by default from the file name (`.jsonl` -> JSONL).
        stats (`bool`): JSONL records also carry `new_tokens` and `decoder_calls`.
        on_long (`str`): `"fail"` (default) or `"skip"` (with a warning, an empty output) for too long sources.
        chunk_size (`int`): lines sorted together and written together; the unit of resuming and of sharding.
        overwrite (`bool`): replace an existing output instead of resuming or refusing it.
        progress (`bool`): a progress bar with tokens/s and tokens per decoder call.

    Returns:
        [`CorpusReport`] of this process's work.
    """
    options = CorpusOptions(
        drafter=drafter, batch_size=batch_size, max_batch_tokens=max_batch_tokens, compile=compile, int8=int8,
        generate_kwargs=merged_generate_kwargs(max_new_tokens, generate_kwargs), output_format=output_format,
        stats=stats, on_long=on_long, chunk_size=chunk_size,
    )  # fmt: skip
    job = prepare_job(model, inputs, output, column=column, split=split, options=options, tokenizer=tokenizer)
    return run_job(job, overwrite=overwrite, progress=progress)


def merged_generate_kwargs(
    max_new_tokens: int | None, generate_kwargs: Any, num_beams: int | None = None
) -> dict[str, Any]:
    """`generate_kwargs` with `max_new_tokens` and `num_beams` when they are given (else the checkpoint's
    `generation_config` sets them, as in `model.generate()`); a `ValueError` for arguments that are no dict, or a
    value given twice."""
    if generate_kwargs is not None and not isinstance(generate_kwargs, dict):
        raise ValueError(
            f"generate_kwargs / --generate-kwargs must be a dict (a JSON object) of generate arguments, got "
            f'{type(generate_kwargs).__name__}: e.g. {{"no_repeat_ngram_size": 3}}'
        )
    merged = dict(generate_kwargs or {})
    for name, value in (("max_new_tokens", max_new_tokens), ("num_beams", num_beams)):
        if value is None:
            continue
        if name in merged and merged[name] != value:
            raise ValueError(f"{name} is given twice, in generate_kwargs and as {name}: give it once")
        merged[name] = value
    return merged


@dataclass(frozen=True)
class CorpusOptions:
    """How a corpus is decoded and written (the arguments of [`generate_corpus`] of the same names; no length in
    `generate_kwargs` means the checkpoint's `generation_config` sets it)."""

    drafter: str = "auto"
    batch_size: int = 16
    max_batch_tokens: int | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    compile: bool = False
    int8: bool = False
    output_format: str | None = None
    stats: bool = False
    on_long: str = "fail"
    chunk_size: int = 1024

    def checked(self, output: Path) -> CorpusOptions:
        """These options with the output format resolved from the file name; a `ValueError` names a bad one."""
        fmt = self.output_format or ("jsonl" if output.name.removesuffix(".gz").endswith(".jsonl") else "text")
        if fmt not in OUTPUT_FORMATS:
            raise ValueError(f"unknown output_format {fmt!r}; choose one of {OUTPUT_FORMATS}")
        if self.stats and fmt != "jsonl":
            raise ValueError("stats=True / --stats writes per-line stats into JSONL records: use a .jsonl output")
        self.check_decoding()
        return dataclasses.replace(self, output_format=fmt)

    def check_decoding(self) -> None:
        """A `ValueError` naming a bad option of how sources are decoded (all but the output's format)."""
        for what, value, allowed in (("on_long", self.on_long, ("fail", "skip")), ("drafter", self.drafter, DRAFTERS)):
            if value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; choose one of {allowed}")
        sizes = {what: getattr(self, what) for what in ("batch_size", "chunk_size", "max_batch_tokens")}
        sizes["max_new_tokens"] = self.generate_kwargs.get("max_new_tokens")
        for what, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        _check_generate_kwargs(self.generate_kwargs)


def _check_generate_kwargs(generate_kwargs: Any) -> None:
    if not isinstance(generate_kwargs, dict):
        raise ValueError(f"generate_kwargs must be a dict of generate arguments, got {type(generate_kwargs).__name__}")
    clashing = sorted(set(generate_kwargs) & set(JOB_GENERATE_ARGUMENTS))
    if clashing:
        raise ValueError(
            f"generate_kwargs sets {clashing}, which the corpus job sets itself: use drafter= / --drafter and "
            "compile= / --compile instead"
        )
    try:
        json.dumps(generate_kwargs)
    except TypeError as error:
        raise ValueError(f"generate arguments must be JSON values (they are recorded for resuming): {error}") from error


def prepare_job(
    model: str | os.PathLike | nn.Module | LoadedModel,
    inputs: str | Sequence[str] | datasets.Dataset,
    output: str | os.PathLike,
    *,
    column: str | None,
    split: str | None,
    options: CorpusOptions,
    tokenizer: Any = None,
) -> CorpusJob:
    """Checks the options and where the output goes, reads the sources, loads the model and its drafters (the
    checks come first, so that a bad call fails in a second, not after loading) and makes the job."""
    output = Path(output)
    options = options.checked(output)
    check_output_location(output)
    check_output_is_not_a_source(output, inputs, model)
    texts = read_sources(inputs, column, split)
    loaded, name = load_for_corpus(model, tokenizer, int8=options.int8)
    loaded.check_reads_text(name)
    return make_job(loaded, name, texts, input_identity(inputs, column, split), output, options)


def make_job(
    loaded: LoadedModel, model: str, texts: list[str], description: str, output: Path, options: CorpusOptions
) -> CorpusJob:
    """A job over loaded models (moved to this process's device) for `texts`, written to `output` (or, under
    `accelerate launch` with several processes, to this process's shard of it)."""
    options = options.checked(output)
    check_not_sampling(loaded, options.generate_kwargs)
    state = PartialState()
    check_int8_device(options.int8, state.device)
    loaded.to(state.device)
    chosen = choose_drafter(options.drafter, loaded, options.batch_size)
    settings = CorpusSettings(
        model=model, drafter=chosen, input=description, input_sha256=texts_sha256(texts), num_lines=len(texts),
        generate_kwargs=dict(options.generate_kwargs), generation_config=generation_defaults(loaded.base),
        batch_size=options.batch_size, max_batch_tokens=options.max_batch_tokens, chunk_size=options.chunk_size,
        output_format=options.output_format, stats=options.stats, on_long=options.on_long, compile=options.compile,
        int8=options.int8, num_shards=state.num_processes, shard=state.process_index if state.num_processes > 1 else -1,
    )  # fmt: skip
    shard_output = output if state.num_processes == 1 else shard_path(output, state.process_index, state.num_processes)
    return CorpusJob(
        loaded=loaded, drafter=build_drafter(chosen, loaded), texts=texts, settings=settings,
        generate_kwargs=dict(options.generate_kwargs), output=output, shard_output=shard_output, state=state,
    )  # fmt: skip


def check_int8_device(int8: bool, device: torch.device) -> None:
    """A `ValueError` for int8 on a device other than the CPU (int8 layers run on the CPU only)."""
    if int8 and device.type != "cpu":
        raise ValueError(f"int8 / --int8 quantizes for the CPU; this process decodes on {device}: drop int8 there")


def check_not_sampling(loaded: LoadedModel, generate_kwargs: dict[str, Any]) -> None:
    """A `ValueError` where the call or the checkpoint's `generation_config` samples: a corpus is decoded greedily or
    by beam search, so that a row's output does not depend on when or where it is decoded (sampling draws its seed
    per call)."""
    if generate_kwargs.get("do_sample", loaded.base.generation_config.do_sample):
        raise ValueError(
            "do_sample=True: the corpus job decodes greedy or beam search, so that a resumed or repaired run writes "
            "what an uninterrupted one writes (sampling draws its seed per call); pass --generate-kwargs "
            '\'{"do_sample": false}\' / generate_kwargs={"do_sample": False} for a checkpoint that samples'
        )


def generation_defaults(model: nn.Module) -> dict[str, Any]:
    """The checkpoint's `generation_config` as it differs from transformers' defaults (JSON values, without the
    transformers version): what `generate` applies where the call is silent, recorded so that a resumed run with
    another generation config is refused."""
    defaults = json.loads(model.generation_config.to_json_string(use_diff=True))
    defaults.pop("transformers_version", None)
    return defaults


def length_limit(job: CorpusJob) -> str:
    """The length limit of the job's outputs, and where it comes from, in words (`"max_new_tokens 128 (the
    checkpoint's generation_config)"`), in the precedence `generate` applies."""
    given, config = job.generate_kwargs, job.loaded.base.generation_config
    if "max_new_tokens" in given:
        return f"max_new_tokens {given['max_new_tokens']} (given)"
    if "max_length" in given and config.max_new_tokens is None:
        return f"max_length {given['max_length']} (given)"
    limit, source = default_max_new_tokens(job.loaded.base)
    return f"max_new_tokens {limit} ({source})"


def run_job(job: CorpusJob, overwrite: bool = False, progress: bool = True) -> CorpusReport:
    """Decodes this process's chunks that the output does not verifiably hold yet, then (process 0, with several)
    merges. Every run first checks the output against its progress file, finished or not ([`check_output`]): lines
    deleted, edited or appended since are decoded again from the first damaged chunk on, with a
    [`CorpusRepairWarning`] naming the first bad line, so that the output ends byte-identical to an uninterrupted
    run's.

    The files this process writes are locked for the whole run ([`locked_output`]): its shard, and for process 0 the
    output itself, which it alone replaces and merges into. A second run on the same output is refused at once,
    naming the first run's process id."""
    with ExitStack() as locks:
        for path in _written_by_this_process(job):
            locks.enter_context(locked_output(path))
        return _run_locked(job, overwrite, progress)


def _written_by_this_process(job: CorpusJob) -> list[Path]:
    """The files this process of the run writes: its shard (the output itself with one process), and the output for
    process 0 of several. Each process locks its own files only: the run's processes never wait on each other."""
    main = job.state is None or job.state.is_main_process
    return list(dict.fromkeys([job.shard_output, *([job.output] if main else [])]))


def _run_locked(job: CorpusJob, overwrite: bool, progress: bool) -> CorpusReport:
    """[`run_job`], once this process holds the locks of the files it writes."""
    settings, state = job.settings, job.state
    report = CorpusReport(output=os.fspath(job.output), drafter=settings.drafter)
    if settings.num_shards > 1 and _merged_output_is_done(job, overwrite):
        report.resumed_lines = settings.num_lines
        return report
    if overwrite and state.is_main_process and state.num_processes > 1:
        job.output.unlink(missing_ok=True)
        progress_path(job.output).unlink(missing_ok=True)
    written, damage = claim_output(job.shard_output, settings, overwrite)
    report.resumed_lines = written.lines
    if written.complete:  # nothing to decode: at most lines appended after the end were cut
        if damage is not None:
            report.repaired_from = damage.line
            warn_repaired(job.shard_output, damage.line, damage.line, damage.line - 1)
            damage = None
        if settings.num_shards == 1:
            return report
    chunks = chunks_of_shard(settings.num_lines, settings.chunk_size, settings.num_shards, max(settings.shard, 0))
    done = written.lines  # whole chunks only: a complete shard holds all of its lines
    todo = _chunks_after(chunks, done)
    bar = tqdm(
        total=sum(len(chunk) for chunk in chunks), initial=done, unit="line", disable=not progress, dynamic_ncols=True,
        desc="generate" if settings.num_shards == 1 else f"generate {settings.shard + 1}/{settings.num_shards}",
    )  # fmt: skip
    started = time.perf_counter()
    with torch.inference_mode(), bar:
        for chunk in todo:
            rows = decode_chunk(
                job.loaded, job.drafter, job.texts[chunk.start : chunk.stop], settings, job.generate_kwargs,
                first_line=chunk.start + 1,
            )  # fmt: skip
            lines = [format_line(chunk.start + offset, row, settings) for offset, row in enumerate(rows)]
            if damage is not None and report.repaired_from is None:  # the damaged chunk, decoded again
                report.repaired_from = first_bad_line(damage, lines)
            written = append_chunk(job.shard_output, written, lines)
            _account(report, rows)
            report.seconds = time.perf_counter() - started
            bar.update(len(rows))
            bar.set_postfix(
                tok_s=f"{report.tokens_per_second:.0f}", tok_call=f"{report.tokens_per_call:.2f}", refresh=False
            )
    if damage is not None:
        warn_repaired(job.shard_output, report.repaired_from or damage.line, damage.line, written.lines)
    write_progress(job.shard_output, OutputProgress(**(asdict(written) | {"complete": True})))
    if report.skipped:
        warnings.warn(f"{report.skipped} sources were longer than the model's positions and skipped", stacklevel=2)
    if settings.num_shards > 1:
        state.wait_for_everyone()
        if state.is_main_process:
            merge_shards(job.output, settings, settings.chunk_size)
        state.wait_for_everyone()
    return report


def _merged_output_is_done(job: CorpusJob, overwrite: bool) -> bool:
    """Whether the whole output of a run of several processes is merged and still holds what was merged. One that
    no longer does is refused: its lines are spread over the processes' chunks, which one process of several
    cannot decode again alone."""
    final = read_progress(job.output)
    if overwrite or final is None or not final.complete or final.settings != whole_output_settings(job.settings):
        return False
    _, damage = check_output(job.output, final, repair=False)
    if damage is not None:
        raise ValueError(
            f"{job.output} no longer holds what was written, from the chunk at line {damage.line} on (lines deleted, "
            "edited or appended since): rerun in one process, which decodes it again from there, or pass "
            "--overwrite / overwrite=True to decode everything again"
        )
    return True


def _chunks_after(chunks: Sequence[range], done: int) -> Iterator[range]:
    """The chunks after the first `done` lines of `chunks` (which end on a chunk boundary: whole chunks are written)."""
    seen = 0
    for chunk in chunks:
        if seen >= done:
            yield chunk
        seen += len(chunk)
    if done > seen:
        raise ValueError(f"the output holds {done} lines but this shard has only {seen}")


def _account(report: CorpusReport, rows: Sequence[DecodedRow]) -> None:
    for row in rows:
        if row.skipped:
            report.skipped += 1
        report.lines += 1
        report.new_tokens += row.new_tokens
        report.row_calls += row.decoder_calls

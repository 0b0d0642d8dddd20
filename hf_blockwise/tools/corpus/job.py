"""A corpus job: the settings checked, the model and drafter loaded, each chunk decoded in sorted batches through
the loop, written in input order, and (under `accelerate launch`) the shards merged."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import PartialState
from tqdm.auto import tqdm

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.drafters.composite import CompositeDrafter
from hf_blockwise.drafters.input_copy import InputCopyDrafter
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.tools.bench import BenchSetup, shares_vocabulary
from hf_blockwise.tools.corpus.output import (
    CorpusSettings,
    OutputProgress,
    append_chunk,
    claim_output,
    merge_shards,
    progress_path,
    read_progress,
    shard_path,
    whole_output_settings,
    write_progress,
)
from hf_blockwise.tools.corpus.planning import chunks_of_shard, plan_batches
from hf_blockwise.tools.corpus.sources import fingerprint, read_sources
from hf_blockwise.tools.loading import load_for_bench

DRAFTERS = ("auto", "none", "heads", "feature", "input_copy", "composite")
OUTPUT_FORMATS = ("text", "jsonl")


@dataclass
class CorpusReport:
    """What a run did, for this process's share (the whole corpus with one process).

    Attributes:
        output (`str`): the output file. lines (`int`): lines decoded in this run (resumed lines excluded).
        skipped (`int`): sources skipped as too long. new_tokens (`int`): generated tokens.
        row_calls (`int`): decoder calls summed over rows (a call serving 8 rows counts 8); `new_tokens / row_calls` is
            the mean tokens per decoder call a row gained. seconds (`float`): wall time of decoding.
        drafter (`str`): the drafter used. resumed_lines (`int`): lines already in the output when the run began.
    """

    output: str
    drafter: str
    lines: int = 0
    skipped: int = 0
    new_tokens: int = 0
    row_calls: int = 0
    seconds: float = 0.0
    resumed_lines: int = 0

    @property
    def sentences_per_second(self) -> float:
        return self.lines / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.new_tokens / self.row_calls if self.row_calls else 0.0


def choose_drafter(name: str, setup: BenchSetup, batch_size: int) -> str:
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
    shares = shares_vocabulary(setup.base)
    if name == "auto" and batch_size > 1:
        return "none"
    if name == "auto":
        if setup.feature_model is not None:
            return "composite" if shares else "feature"
        if setup.heads_model is not None:
            return "heads"
        return "input_copy" if shares else "none"
    missing = {
        "heads": setup.heads_model is None and "no proposal heads (blockwise_config.json)",
        "feature": setup.feature_model is None and "no feature-drafter/ folder",
        "composite": (setup.feature_model is None and "no feature-drafter/ folder")
        or (not shares and "different source and target vocabularies (source copy needs one)"),
        "input_copy": not shares and "different source and target vocabularies (source copy needs one)",
    }.get(name)
    if missing:
        raise ValueError(f"--drafter {name}: the model has {missing}")
    return name


def build_drafter(name: str, setup: BenchSetup) -> Drafter | None:
    """The drafter called `name` (not `"auto"`) over `setup`'s models; `None` for `"none"` (one token a call)."""
    if name == "none":
        return None
    if name == "heads":
        return setup.heads_model.drafter()
    if name == "input_copy":
        return InputCopyDrafter(setup.base, max_draft_length=setup.iad_max_draft_length)
    feature = setup.feature_model.drafter()
    if name == "feature":
        return feature
    return CompositeDrafter(InputCopyDrafter(setup.base, max_draft_length=setup.iad_max_draft_length), feature)


@dataclass(frozen=True)
class DecodedRow:
    """One source's output: `text`, and what it cost (`new_tokens`, `decoder_calls`); `skipped` names why a source
    was not decoded (then `text` is empty)."""

    text: str
    new_tokens: int = 0
    decoder_calls: int = 0
    skipped: str | None = None


def decode_batch(
    setup: BenchSetup, drafter: Drafter | None, ids: Sequence[list[int]], generate_kwargs: dict[str, Any], compile: bool
) -> list[DecodedRow]:
    """Decodes one batch of tokenized sources through the loop.

    Args:
        ids: each source's token ids (special tokens included), unpadded.

    Returns:
        `list[DecodedRow]`, one per source, in the order of `ids`.
    """
    batch = setup.tokenizer.pad({"input_ids": list(ids)}, return_tensors="pt").to(setup.base.device)
    output = setup.base.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, blockwise_compile=compile,
        return_dict_in_generate=True, **generate_kwargs,
    )  # fmt: skip
    texts = setup.tokenizer.batch_decode(output.sequences, skip_special_tokens=True)
    accepted = output.decoding_stats.accepted  # (iterations, rows): tokens each row gained at each decoder call
    new_tokens, calls = accepted.sum(dim=0).tolist(), (accepted > 0).sum(dim=0).tolist()
    return [
        DecodedRow(text=text, new_tokens=int(tokens), decoder_calls=int(count))
        for text, tokens, count in zip(texts, new_tokens, calls, strict=True)
    ]


def decode_chunk(
    setup: BenchSetup,
    drafter: Drafter | None,
    texts: Sequence[str],
    settings: CorpusSettings,
    generate_kwargs: dict[str, Any],
) -> list[DecodedRow]:
    """One chunk of sources, decoded in sorted batches and put back in input order; too long sources are skipped
    or refused (`settings.on_long`)."""
    encoded = setup.tokenizer(list(texts))["input_ids"]
    limit = hf.encoder_position_limit(setup.base)  # None: relative or growing positions (T5, NLLB)
    rows: list[DecodedRow | None] = [None] * len(texts)
    decodable = []
    for index, ids in enumerate(encoded):
        if limit is not None and len(ids) > limit:
            reason = f"the source has {len(ids)} tokens; the model has positions for {limit}"
            if settings.on_long == "fail":
                raise ValueError(f"{reason} (a chunk's line {index}): pass --on-long skip to skip such lines")
            rows[index] = DecodedRow(text="", skipped=reason)
        else:
            decodable.append(index)
    lengths = [len(encoded[index]) for index in decodable]
    for planned in plan_batches(lengths, settings.batch_size, settings.max_batch_tokens):
        members = [decodable[position] for position in planned]
        decoded = decode_batch(setup, drafter, [encoded[i] for i in members], generate_kwargs, settings.compile)
        for index, row in zip(members, decoded, strict=True):
            rows[index] = row
    return rows  # type: ignore[return-value]  # every index is filled above


def format_line(index: int, row: DecodedRow, settings: CorpusSettings) -> str:
    """The output line of source `index` (with its newline): the text alone (line breaks inside become spaces, so
    that line n stays source n), or a JSON object."""
    if settings.output_format == "text":
        return " ".join(row.text.splitlines()) + "\n"
    record: dict[str, Any] = {"index": index, "output": None if row.skipped else row.text}
    if row.skipped:
        record["skipped"] = row.skipped
    elif settings.stats:
        record.update(new_tokens=row.new_tokens, decoder_calls=row.decoder_calls)
    return json.dumps(record, ensure_ascii=False) + "\n"


@dataclass
class CorpusJob:
    """A prepared run: the loaded models and drafter, the sources, and this process's settings and output file."""

    setup: BenchSetup
    drafter: Drafter | None
    texts: list[str]
    settings: CorpusSettings
    generate_kwargs: dict[str, Any]
    output: Path
    shard_output: Path
    state: Any = field(repr=False, default=None)


def generate_corpus(
    model: str,
    inputs: str | Sequence[str] | datasets.Dataset,
    output: str | os.PathLike,
    *,
    column: str | None = None,
    split: str | None = None,
    drafter: str = "auto",
    batch_size: int = 16,
    max_batch_tokens: int | None = None,
    max_new_tokens: int = 256,
    generate_kwargs: dict[str, Any] | None = None,
    compile: bool = False,
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
    under `accelerate launch` each process decodes its share of the chunks and process 0 merges them.

    Args:
        model (`str`): a model directory (with its drafters: proposal heads, `feature-drafter/`) or a hub id.
        inputs: a text file, a JSONL file, a data file or saved/hub dataset (`column`, `split`), a list of strings or
            a `datasets.Dataset` (see [`read_sources`]).
        output (`str` or `os.PathLike`): the output file; `OUTPUT.progress.json` beside it records progress.
        drafter (`str`): one of `DRAFTERS`; `"auto"` picks the fastest exact one the model has ([`choose_drafter`]).
        batch_size (`int`): most rows per batch. max_batch_tokens (`int`, *optional*): most padded source tokens.
        max_new_tokens (`int`): the length limit, as in `generate` (`generate_kwargs` may set more arguments).
        compile (`bool`): verify through the compiled engine (`blockwise_compile=True`; pays off on long runs).
        output_format (`str`, *optional*): `"text"` or `"jsonl"`; by default from the file name (`.jsonl` -> JSONL).
        stats (`bool`): JSONL records also carry `new_tokens` and `decoder_calls`.
        on_long (`str`): `"fail"` (default) or `"skip"` (with a warning; the line's output is empty) for sources
            longer than the model's positions.
        chunk_size (`int`): lines sorted together and written together; the unit of resuming and of sharding.
        overwrite (`bool`): replace an existing output instead of resuming or refusing it.
        progress (`bool`): show a progress bar with tokens/s and tokens per decoder call.

    Returns:
        [`CorpusReport`] of this process's work.
    """
    options = CorpusOptions(
        drafter=drafter, batch_size=batch_size, max_batch_tokens=max_batch_tokens, compile=compile,
        generate_kwargs={"max_new_tokens": max_new_tokens, **(generate_kwargs or {})}, output_format=output_format,
        stats=stats, on_long=on_long, chunk_size=chunk_size,
    )  # fmt: skip
    job = prepare_job(model, inputs, output, column=column, split=split, options=options)
    return run_job(job, overwrite=overwrite, progress=progress)


@dataclass(frozen=True)
class CorpusOptions:
    """How a corpus is decoded and written (the arguments of [`generate_corpus`] of the same names)."""

    drafter: str = "auto"
    batch_size: int = 16
    max_batch_tokens: int | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 256})
    compile: bool = False
    output_format: str | None = None
    stats: bool = False
    on_long: str = "fail"
    chunk_size: int = 1024

    def checked(self, output: Path) -> CorpusOptions:
        """These options with the output format resolved from the file name; a `ValueError` names a bad one."""
        fmt = self.output_format or ("jsonl" if output.name.removesuffix(".gz").endswith(".jsonl") else "text")
        for what, value, allowed in (
            ("output_format", fmt, OUTPUT_FORMATS), ("on_long", self.on_long, ("fail", "skip")),
            ("drafter", self.drafter, DRAFTERS),
        ):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; choose one of {allowed}")
        for what in ("batch_size", "chunk_size", "max_batch_tokens"):
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        if self.stats and fmt != "jsonl":
            raise ValueError("stats=True / --stats writes per-line stats into JSONL records: use a .jsonl output")
        try:
            json.dumps(self.generate_kwargs)
        except TypeError as error:
            raise ValueError(
                f"generate arguments must be JSON values (they are recorded for resuming): {error}"
            ) from error
        return dataclasses.replace(self, output_format=fmt)


def prepare_job(
    model: str,
    inputs: str | Sequence[str] | datasets.Dataset,
    output: str | os.PathLike,
    *,
    column: str | None,
    split: str | None,
    options: CorpusOptions,
) -> CorpusJob:
    """Checks the options, reads the sources, loads the model and its drafters (options are checked first, so that
    a bad call fails in a second, not after loading) and makes the job."""
    options = options.checked(Path(output))
    texts = read_sources(inputs, column, split)
    setup = load_for_bench(model, None, int(options.generate_kwargs.get("max_new_tokens", 256)))
    if setup.tokenizer is None or setup.feature_extractor is not None:
        raise ValueError(f"{model}: its encoder reads {hf.encoder_input_name(setup.base)}, not text")
    return make_job(setup, os.fspath(model), texts, _describe(inputs, column, split), Path(output), options)


def make_job(
    setup: BenchSetup, model: str, texts: list[str], description: str, output: Path, options: CorpusOptions
) -> CorpusJob:
    """A job over loaded models (moved to this process's device) for `texts`, written to `output` (or, under
    `accelerate launch` with several processes, to this process's shard of it)."""
    options = options.checked(output)
    state = PartialState()
    _to_device(setup, state.device)
    chosen = choose_drafter(options.drafter, setup, options.batch_size)
    settings = CorpusSettings(
        model=model, drafter=chosen, input=description, input_sha256=fingerprint(texts), num_lines=len(texts),
        generate_kwargs=dict(options.generate_kwargs), batch_size=options.batch_size,
        max_batch_tokens=options.max_batch_tokens, chunk_size=options.chunk_size, output_format=options.output_format,
        stats=options.stats, on_long=options.on_long, compile=options.compile, num_shards=state.num_processes,
        shard=state.process_index if state.num_processes > 1 else -1,
    )  # fmt: skip
    shard_output = output if state.num_processes == 1 else shard_path(output, state.process_index, state.num_processes)
    return CorpusJob(
        setup=setup, drafter=build_drafter(chosen, setup), texts=texts, settings=settings,
        generate_kwargs=dict(options.generate_kwargs), output=output, shard_output=shard_output, state=state,
    )  # fmt: skip


def _to_device(setup: BenchSetup, device: torch.device) -> None:
    for model in (setup.base, setup.heads_model, setup.feature_model):
        if model is not None:
            model.to(device)


def _describe(inputs: Any, column: str | None, split: str | None) -> str:
    where = os.fspath(inputs) if isinstance(inputs, str | os.PathLike) else f"<{type(inputs).__name__}>"
    return where + (f" [{split}]" if split else "") + (f" column {column}" if column else "")


def run_job(job: CorpusJob, overwrite: bool = False, progress: bool = True) -> CorpusReport:
    """Decodes this process's chunks that the output does not hold yet, then (process 0, with several) merges."""
    settings, state = job.settings, job.state
    report = CorpusReport(output=os.fspath(job.output), drafter=settings.drafter)
    final = read_progress(job.output)
    if final is not None and final.complete and final.settings == whole_output_settings(settings) and not overwrite:
        report.resumed_lines = final.lines
        return report  # already done
    if overwrite and state.is_main_process and state.num_processes > 1:
        job.output.unlink(missing_ok=True)
        progress_path(job.output).unlink(missing_ok=True)
    written = claim_output(job.shard_output, settings, overwrite)
    chunks = chunks_of_shard(settings.num_lines, settings.chunk_size, settings.num_shards, max(settings.shard, 0))
    done = written.lines  # whole chunks only: a complete shard holds all of its lines
    report.resumed_lines = done
    todo = _chunks_after(chunks, done)
    bar = tqdm(
        total=sum(len(chunk) for chunk in chunks), initial=done, unit="line", disable=not progress, dynamic_ncols=True,
        desc="generate" if settings.num_shards == 1 else f"generate {settings.shard + 1}/{settings.num_shards}",
    )  # fmt: skip
    started = time.perf_counter()
    with torch.inference_mode(), bar:
        for chunk in todo:
            rows = decode_chunk(
                job.setup, job.drafter, job.texts[chunk.start : chunk.stop], settings, job.generate_kwargs
            )
            lines = [format_line(chunk.start + offset, row, settings) for offset, row in enumerate(rows)]
            written = append_chunk(job.shard_output, written, lines)
            _account(report, rows)
            report.seconds = time.perf_counter() - started
            bar.update(len(rows))
            bar.set_postfix(
                tok_s=f"{report.tokens_per_second:.0f}", tok_call=f"{report.tokens_per_call:.2f}", refresh=False
            )
    write_progress(job.shard_output, OutputProgress(**(asdict(written) | {"complete": True})))
    if report.skipped:
        warnings.warn(f"{report.skipped} sources were longer than the model's positions and skipped", stacklevel=2)
    if settings.num_shards > 1:
        state.wait_for_everyone()
        if state.is_main_process:
            merge_shards(job.output, settings, settings.chunk_size)
        state.wait_for_everyone()
    return report


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

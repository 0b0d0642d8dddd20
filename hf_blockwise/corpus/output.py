"""The output file and its progress file: claiming an output for a run (or refusing one that belongs to another),
appending a chunk durably, and merging the shards of several processes in input order."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_blockwise.serialization import atomic_write_text

PROGRESS_SUFFIX = ".progress.json"


@dataclass(frozen=True)
class CorpusSettings:
    """Everything that decides the output file; recorded in its progress file, so that a restart with other
    settings is refused instead of mixing two runs in one file.

    Attributes:
        model (`str`): model directory or hub id.
        drafter (`str`): the drafter actually used (never `"auto"`).
        input (`str`): where the sources came from; `input_sha256` and `num_lines` identify their content.
        generate_kwargs (`dict`): the JSON-able `generate` arguments given (`max_new_tokens` when given).
        generation_config (`dict`): the checkpoint's `generation_config` where it differs from transformers'
            defaults: what `generate` applies where `generate_kwargs` is silent (the length limit by default).
        batch_size (`int`), max_batch_tokens (`int`, *optional*), chunk_size (`int`): the batching.
        output_format (`str`): `"text"` (one output per line) or `"jsonl"`; stats (`bool`): per-line stats in JSONL.
        on_long (`str`): `"fail"` or `"skip"` for sources longer than the model's positions.
        compile (`bool`): the compiled engine verifies.
        num_shards (`int`), shard (`int`): for a shard file, the run's processes and this one's index; a whole
            output (one process, or the shards merged) has 1 and -1, whatever the number of processes that wrote it,
            since that number does not change a byte of it.
    """

    model: str
    drafter: str
    input: str
    input_sha256: str
    num_lines: int
    generate_kwargs: dict[str, Any]
    generation_config: dict[str, Any]
    batch_size: int
    max_batch_tokens: int | None
    chunk_size: int
    output_format: str
    stats: bool
    on_long: str
    compile: bool
    num_shards: int = 1
    shard: int = -1


def progress_path(output: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(output)}{PROGRESS_SUFFIX}")


def shard_path(output: str | os.PathLike, shard: int, num_shards: int) -> Path:
    return Path(f"{os.fspath(output)}.shard{shard:03d}-of-{num_shards:03d}")


@dataclass
class OutputProgress:
    """The content of a progress file: the run's settings, the complete lines and bytes, and whether it is done."""

    settings: dict[str, Any]
    lines: int = 0
    bytes: int = 0
    complete: bool = False


def read_progress(output: str | os.PathLike) -> OutputProgress | None:
    path = progress_path(output)
    if not path.is_file():
        return None
    try:
        return OutputProgress(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"{path} is not a progress file of hf-blockwise generate ({error})") from error


def write_progress(output: str | os.PathLike, progress: OutputProgress) -> None:
    atomic_write_text(progress_path(output), json.dumps(asdict(progress), indent=1, sort_keys=True) + "\n")


def claim_output(output: Path, settings: CorpusSettings, overwrite: bool) -> OutputProgress:
    """The progress of `output` for a run with `settings`: a fresh one for a new file, the recorded one (with the file
    cut back to its complete chunks) to resume. An existing file written by another run, or by something else, is
    refused unless `overwrite`."""
    recorded = read_progress(output)
    if overwrite:
        output.unlink(missing_ok=True)
        progress_path(output).unlink(missing_ok=True)
        recorded = None
    mine = asdict(settings)
    if recorded is None:
        if output.exists() and output.stat().st_size > 0:
            raise ValueError(
                f"{output} exists and was not written by hf-blockwise generate (no {progress_path(output).name}): "
                "choose another output, or pass --overwrite / overwrite=True to replace it"
            )
        progress = OutputProgress(settings=mine)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(b"")
        write_progress(output, progress)
        return progress
    differing = sorted(key for key in set(mine) | set(recorded.settings) if mine.get(key) != recorded.settings.get(key))
    if differing:
        details = ", ".join(f"{key} {recorded.settings.get(key)!r} (now {mine.get(key)!r})" for key in differing)
        raise ValueError(
            f"{output} belongs to another run: it was written with {details}. Rerun with the same settings to "
            "resume, choose another output, or pass --overwrite / overwrite=True to start over"
        )
    size = output.stat().st_size if output.exists() else 0
    if size < recorded.bytes:
        raise ValueError(f"{output} is shorter ({size} bytes) than its progress file records ({recorded.bytes})")
    if size > recorded.bytes:  # an interrupted append: drop the chunk it did not finish
        with open(output, "r+b") as handle:
            handle.truncate(recorded.bytes)
    return recorded


def append_chunk(output: Path, progress: OutputProgress, lines: Sequence[str]) -> OutputProgress:
    """Appends one chunk's lines, makes them durable, then records them in the progress file (so a crash between the
    two leaves bytes that the next run cuts away)."""
    data = "".join(lines).encode("utf-8")
    with open(output, "ab") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    updated = OutputProgress(
        settings=progress.settings, lines=progress.lines + len(lines), bytes=progress.bytes + len(data)
    )
    write_progress(output, updated)
    return updated


def whole_output_settings(settings: CorpusSettings) -> dict[str, Any]:
    """The settings recorded for a whole output: those of a one-process run, however many processes wrote it."""
    return asdict(settings) | {"num_shards": 1, "shard": -1}


def merge_shards(output: Path, settings: CorpusSettings, chunk_size: int) -> None:
    """Interleaves the shards' chunks back into input order, into `output` (atomically), then removes the shards."""
    num_shards, num_lines = settings.num_shards, settings.num_lines
    handles = [open(shard_path(output, shard, num_shards), encoding="utf-8") for shard in range(num_shards)]  # noqa: SIM115
    try:
        lines = []
        for start in range(0, num_lines, chunk_size):
            handle = handles[(start // chunk_size) % num_shards]
            for _ in range(min(chunk_size, num_lines - start)):
                line = handle.readline()
                if not line.endswith("\n"):
                    raise ValueError(f"shard {handle.name} ends early: it is incomplete, rerun to finish it")
                lines.append(line)
    finally:
        for handle in handles:
            handle.close()
    text = "".join(lines)
    atomic_write_text(output, text)
    merged = whole_output_settings(settings)
    write_progress(output, OutputProgress(merged, lines=num_lines, bytes=len(text.encode("utf-8")), complete=True))
    for shard in range(num_shards):
        shard_path(output, shard, num_shards).unlink()
        progress_path(shard_path(output, shard, num_shards)).unlink()

"""The output file and its progress file: locking an output for the run writing it ([`locked_output`]), claiming
it (or refusing one that belongs to another run), checking that it still holds what was written (each chunk's lines,
bytes and SHA-256), appending a chunk durably, and merging the shards of several processes in input order."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from hf_blockwise.serialization import atomic_write_text

try:
    import fcntl  # the output's lock (Linux, macOS)
except ImportError:  # Windows
    fcntl = None

PROGRESS_SUFFIX = ".progress.json"
LOCK_SUFFIX = ".lock"


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
        compile (`bool`): the compiled engine verifies. int8 (`bool`): the base was quantized to int8 first.
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
    int8: bool = False


# the settings with defaults: what a progress file written before a setting existed means by its absence
_SETTING_DEFAULTS = {item.name: item.default for item in fields(CorpusSettings) if item.default is not MISSING}


def progress_path(output: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(output)}{PROGRESS_SUFFIX}")


def shard_path(output: str | os.PathLike, shard: int, num_shards: int) -> Path:
    return Path(f"{os.fspath(output)}.shard{shard:03d}-of-{num_shards:03d}")


def lock_path(output: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(output)}{LOCK_SUFFIX}")


@contextlib.contextmanager
def locked_output(output: Path) -> Iterator[None]:
    """Holds an exclusive lock on writing `output` for as long as the context lasts: a second run on the same output
    (whose appends and progress file would interleave with this one's) is refused at once with a `ValueError` naming
    the output and this process's id, which the lock file `OUTPUT.lock` holds.

    The lock is an `flock` on that file, which the OS releases when the process ends however it ends: a run killed
    leaves the file behind, but no lock, and the next run takes it over. The file is removed when the context ends.
    """
    path = lock_path(output)
    handle = _acquire_lock(path, output)
    try:
        yield
    finally:
        # removed while still held: a run that opened this file meanwhile sees it gone once it gets the lock, and
        # locks a fresh one ([`_acquire_lock`]) instead of sharing one with a third run
        path.unlink(missing_ok=True)
        handle.close()


def _acquire_lock(path: Path, output: Path) -> IO[str]:
    """The lock file `path` of `output`, open and exclusively locked, holding this process's id."""
    if fcntl is None:  # no flock: say so rather than leave two runs to corrupt an output unnoticed
        warnings.warn(
            f"{output}: this platform has no fcntl.flock, so a second run writing the same output at the same time "
            "is not detected: start one run per output",
            stacklevel=4,
        )
        return open(os.devnull, "w", encoding="utf-8")  # closed by `locked_output`
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115  # closed by `locked_output`, or below
        except OSError as error:
            raise ValueError(f"--output / output {output}: cannot create {path} ({error.strerror or error})") from error
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise ValueError(
                f"{output} is being written by another run (pid {holder}, which holds {path}): wait for it to "
                "finish, or choose another output. Two runs writing one output would corrupt it"
            ) from None
        except OSError as error:
            handle.close()
            raise ValueError(
                f"{output}: cannot lock {path} ({error}); write the output to a local filesystem that supports "
                "file locks"
            ) from error
        if _is_the_file_at(handle, path):
            break
        handle.close()  # removed by the run that held it, which has just ended: lock the file now there
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _is_the_file_at(handle: IO[str], path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


@dataclass
class OutputProgress:
    """The content of a progress file: the run's settings, the complete lines and bytes, whether it is done, and
    what each chunk wrote (`{"lines", "bytes", "sha256"}`, in file order), against which the output is checked."""

    settings: dict[str, Any]
    lines: int = 0
    bytes: int = 0
    complete: bool = False
    chunks: list[dict[str, Any]] = field(default_factory=list)


class CorpusRepairWarning(UserWarning):
    """An output no longer held what its job wrote (lines deleted, edited or appended since): the job decoded the
    lines from the first damaged chunk on again."""


@dataclass(frozen=True)
class Damage:
    """Where an output stopped holding what its progress file records.

    Attributes:
        line (`int`): the first line (from 1) of the first chunk that does not match; for lines appended to a
            finished output, the line after its last.
        found (`bytes`): what the file held from that chunk's start, up to the chunk's recorded length: decoded
            again, the chunk's lines name the first bad line ([`first_bad_line`]).
    """

    line: int
    found: bytes = b""


def read_progress(output: str | os.PathLike) -> OutputProgress | None:
    path = progress_path(output)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        progress = OutputProgress(**data)
        # settings added since the file was written (`int8`) read as their defaults: that run did not set them
        progress.settings = {**_SETTING_DEFAULTS, **progress.settings}
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(f"{path} is not a progress file of hf-blockwise generate ({error})") from error
    if "chunks" not in data and progress.lines > 0:
        raise ValueError(
            f"{path} was written by an older hf-blockwise that recorded no digests of the output, so the output "
            "cannot be checked: pass --overwrite / overwrite=True to decode it again"
        )
    return progress


def _chunk_record(data: bytes, lines: int) -> dict[str, Any]:
    return {"lines": lines, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_output(output: Path, progress: OutputProgress, repair: bool) -> tuple[OutputProgress, Damage | None]:
    """Checks `output` against the chunks its progress file records, and cuts it back to the verified ones.

    Bytes past the last chunk of an unfinished output are what an interrupted append leaves: cut, no damage. Any
    other difference (lines deleted, edited or appended since, a shorter or missing file) is a [`Damage`]: the
    output is cut back to the chunks before it, which are then all that is recorded, to be decoded again from there.

    Args:
        repair (`bool`): cut the file and return the cut progress; `False` (a finished output merged from several
            processes, which one process cannot decode again) only looks.

    Returns:
        The progress of what the file verifiably holds (unchanged when nothing is wrong), and the damage if any.
    """
    size = output.stat().st_size if output.exists() else 0
    offset, lines, damage, kept = 0, 0, None, 0
    with open(output, "rb") if output.exists() else io.BytesIO() as handle:  # a missing output holds no bytes
        for record in progress.chunks:
            data = handle.read(record["bytes"])
            if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
                damage = Damage(line=lines + 1, found=data)
                break
            offset, lines, kept = offset + record["bytes"], lines + record["lines"], kept + 1
    if damage is None and size > offset and progress.complete:
        damage = Damage(line=lines + 1)  # lines appended to a finished output
    if damage is None and size == offset:
        return progress, None
    if not repair:
        return progress, damage
    if output.exists():
        with open(output, "r+b") as handle:
            handle.truncate(offset)
    else:
        output.write_bytes(b"")
    complete = progress.complete and kept == len(progress.chunks)  # only junk after the last chunk was cut
    verified = OutputProgress(progress.settings, lines, offset, complete, progress.chunks[:kept])
    write_progress(output, verified)
    return verified, damage


def first_bad_line(damage: Damage, decoded: Sequence[str]) -> int:
    """The first line (from 1) of a damaged chunk whose bytes differ from what the chunk decoded again holds."""
    pieces = damage.found.split(b"\n")  # lines as written: JSON strings may hold U+2028, which splitlines splits at
    found = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    for offset, line in enumerate(decoded):
        if offset >= len(found) or found[offset] != line.encode("utf-8"):
            return damage.line + offset
    return damage.line


def warn_repaired(output: Path, first_bad: int, decoded_from: int, decoded_to: int) -> None:
    """The [`CorpusRepairWarning`] of a repaired output: the file, its first bad line, what was decoded again."""
    what = "lines appended after the last line written were removed" if decoded_to < decoded_from else (
        f"lines {decoded_from}-{decoded_to} were decoded again"
    )  # fmt: skip
    warnings.warn(
        f"{output} did not hold what this job wrote from line {first_bad} on (lines deleted, edited or appended "
        f"since): {what}; the output is now what an uninterrupted run writes",
        CorpusRepairWarning,
        stacklevel=3,
    )


def write_progress(output: str | os.PathLike, progress: OutputProgress) -> None:
    atomic_write_text(progress_path(output), json.dumps(asdict(progress), indent=1, sort_keys=True) + "\n")


def claim_output(output: Path, settings: CorpusSettings, overwrite: bool) -> tuple[OutputProgress, Damage | None]:
    """The progress of `output` for a run with `settings`: a fresh one for a new file, the recorded one to resume,
    with the file checked and cut back to the chunks it verifiably holds ([`check_output`]). An existing file
    written by another run, or by something else, is refused unless `overwrite`.

    Returns:
        The progress to resume from, and the damage found (the lines from there on are to be decoded again).
    """
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
        return progress, None
    check_same_settings(output, recorded, mine)
    return check_output(output, recorded, repair=True)


def check_same_settings(output: Path, recorded: OutputProgress, mine: dict[str, Any]) -> None:
    """A `ValueError` naming each setting of `recorded` that differs from this run's (`mine`)."""
    differing = sorted(key for key in set(mine) | set(recorded.settings) if mine.get(key) != recorded.settings.get(key))
    if differing:
        details = ", ".join(f"{key} {recorded.settings.get(key)!r} (now {mine.get(key)!r})" for key in differing)
        raise ValueError(
            f"{output} belongs to another run: it was written with {details}. Rerun with the same settings to "
            "resume, choose another output, or pass --overwrite / overwrite=True to start over"
        )


def append_chunk(output: Path, progress: OutputProgress, lines: Sequence[str]) -> OutputProgress:
    """Appends one chunk's lines, makes them durable, then records them in the progress file (so a crash between the
    two leaves bytes that the next run cuts away)."""
    data = "".join(lines).encode("utf-8")
    with open(output, "ab") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    updated = OutputProgress(
        settings=progress.settings, lines=progress.lines + len(lines), bytes=progress.bytes + len(data),
        chunks=[*progress.chunks, _chunk_record(data, len(lines))],
    )  # fmt: skip
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
    chunks = [
        _chunk_record(
            "".join(lines[start : start + chunk_size]).encode("utf-8"), len(lines[start : start + chunk_size])
        )
        for start in range(0, num_lines, chunk_size)
    ]  # the merged file's chunks, in input order: a later run checks it as a one-process output
    text = "".join(lines)
    atomic_write_text(output, text)
    merged = whole_output_settings(settings)
    size = sum(chunk["bytes"] for chunk in chunks)
    write_progress(output, OutputProgress(merged, lines=num_lines, bytes=size, complete=True, chunks=chunks))
    for shard in range(num_shards):
        shard_path(output, shard, num_shards).unlink()
        progress_path(shard_path(output, shard, num_shards)).unlink()

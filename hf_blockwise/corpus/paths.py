"""Where a corpus job reads and writes: paths compared resolved (a model or input given once relatively and once
absolutely is the same run), an output that could never be written refused before a model is loaded, and nothing a
user gave (the input, the model's files) ever taken as the output."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hf_blockwise.corpus.output import lock_path, progress_path

# a saved tokenizer writes at least one of these (slow ones: their vocabulary file, matched by the patterns below)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
TOKENIZER_PATTERNS = ("vocab.*", "*.model", "*.spm", "merges.txt")


def local_path(name_or_path: Any) -> Path | None:
    """The resolved path of `name_or_path` when it names something on this machine, else `None` (a hub id, a list
    of strings, a dataset)."""
    if not isinstance(name_or_path, str | os.PathLike):
        return None
    path = Path(os.path.expanduser(os.fspath(name_or_path)))
    return path.resolve() if path.exists() else None


def model_identity(model: str | os.PathLike) -> str:
    """How a model is recorded in the progress file: a local directory by its resolved path, a hub id as given."""
    path = local_path(model)
    return os.fspath(model) if path is None else os.fspath(path)


def input_identity(inputs: Any, column: str | None, split: str | None) -> str:
    """How the sources are recorded in the progress file: a local file or folder by its resolved path, a hub
    dataset by its name, an in-memory list or dataset by its type; then the split and column."""
    path = local_path(inputs)
    if path is not None:
        where = os.fspath(path)
    elif isinstance(inputs, str | os.PathLike):
        where = os.fspath(inputs)
    else:
        where = f"<{type(inputs).__name__}>"
    return where + (f" [{split}]" if split else "") + (f" column {column}" if column else "")


def check_output_location(output: Path) -> None:
    """A `ValueError` when `output` could never be written: it is a folder, a folder on its way is a file, or the
    nearest existing folder is not writable (by its permissions, or where no file can be made in it at all: `/proc`,
    `/sys`, a read-only mount, which permissions do not tell root). Checked before the model loads, so a bad path
    fails in a second."""
    if output.is_dir():
        raise ValueError(f"--output / output {output} is a directory: name a file in it, e.g. {output / 'out.txt'}")
    existing = output.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"--output / output {output}: {existing} is a file, not a directory; choose an output in a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK) or (output.exists() and not os.access(output, os.W_OK)):
        where = output if output.exists() else existing
        raise ValueError(
            f"--output / output {output}: {where} is not writable; choose an output in a directory you can write to"
        )
    try:  # a file made and removed at once: what the run itself does beside the output (its lock and progress)
        with tempfile.TemporaryFile(dir=existing, prefix=".hf-blockwise-probe-"):
            pass
    except OSError as error:
        raise ValueError(
            f"--output / output {output}: no file can be created in {existing} ({error.strerror or error}); choose "
            "an output in a directory you can write to"
        ) from error


def check_output_is_not_a_source(output: Path, inputs: Any, model: Any) -> None:
    """A `ValueError` when the output (or its progress or lock file) is the input, lies inside an input folder (a saved
    dataset), or is one of a local model directory's own files: `--overwrite` replaces outputs, never what the user
    gave. Paths are compared resolved, and by identity of the file when both exist (links)."""
    written = [output, progress_path(output), lock_path(output)]
    source = local_path(inputs)
    if source is not None and any(_is_or_is_inside(path, source) for path in written):
        raise ValueError(f"--output / output {output} would overwrite the input {inputs}: choose another output file")
    folder = local_path(model)
    if folder is not None and folder.is_dir() and not _is_corpus_output(output):
        for path in written:
            if path.exists() and _is_or_is_inside(path, folder):
                raise ValueError(
                    f"--output / output {output} is a file of the model directory {model}: choose another output file"
                )


def _is_or_is_inside(path: Path, other: Path) -> bool:
    resolved = path.resolve()
    if resolved == other or other in resolved.parents:
        return True
    return path.exists() and other.exists() and os.path.samefile(path, other)


def _is_corpus_output(output: Path) -> bool:
    """Whether `output` was written by an earlier corpus job (its progress file is beside it)."""
    return progress_path(output).is_file()


def check_tokenizer(model: Any) -> None:
    """A `ValueError` when a local model directory holds no tokenizer (transformers would fail with an unrelated
    `TypeError`); hub ids are left to transformers."""
    folder = local_path(model)
    if folder is None or not folder.is_dir():
        return
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or _any_match(folder, TOKENIZER_PATTERNS):
        return
    raise ValueError(
        f"--model / model {model} holds no tokenizer (no {' or '.join(TOKENIZER_FILES)}): save the tokenizer into it "
        "with tokenizer.save_pretrained(DIR)"
    )


def _any_match(folder: Path, patterns: Iterable[str]) -> bool:
    return any(next(folder.glob(pattern), None) is not None for pattern in patterns)

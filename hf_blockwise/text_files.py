"""Reading text files, plain or gzip (`.gz`): the one reader of the package, its tools, recipes and scripts."""

from __future__ import annotations

import gzip
import io
import os
import zlib
from typing import BinaryIO, TextIO


def _open_bytes(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading bytes, through gzip when its name ends in `.gz`: the one place that decides."""
    return gzip.open(path, "rb") if os.fspath(path).endswith(".gz") else open(path, "rb")


def open_text(path: str | os.PathLike) -> TextIO:
    """`path` opened for reading as UTF-8 text (a stream, for files too large to read at once)."""
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8")


def read_text(path: str | os.PathLike) -> str:
    """The whole of a UTF-8 text file, plain or gzip.

    Raises:
        `ValueError` for bytes that are not UTF-8, naming the file, the line and the byte, and saying whether the
        file looks binary or written in another encoding (with the `iconv` command that converts it); and for a
        `.gz` file that is cut short or no gzip at all, naming the file.
    """
    try:
        with _open_bytes(path) as handle:
            data = handle.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:  # only gzip's reader raises these
        raise ValueError(
            f"{os.fspath(path)} is not a whole gzip file ({error}): it was cut short (an interrupted download or "
            f"copy) or is no gzip at all; fetch it again, or check it with gzip -t {os.fspath(path)}"
        ) from error
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(_not_utf8(os.fspath(path), data, error)) from None


def _not_utf8(path: str, data: bytes, error: UnicodeDecodeError) -> str:
    line = data.count(b"\n", 0, error.start) + 1
    column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
    where = f"{path}, line {line}, byte {column}: 0x{data[error.start]:02x} is not UTF-8"
    if b"\x00" in data[:8192]:
        return f"{where}, and the file holds NUL bytes: it looks binary, not a text file of one source per line"
    return (
        f"{where}. Text files are read as UTF-8; this one looks written in another encoding (Latin-1 or "
        f"Windows-1252, say). Convert it first, e.g. iconv -f WINDOWS-1252 -t UTF-8 {path} > {path}.utf8"
    )


def read_lines(path: str | os.PathLike) -> list[str]:
    """Every line of a text file (plain or gzip), its runs of whitespace collapsed and its ends stripped; empty
    lines are kept, so that the lines of the two files of a parallel set stay aligned."""
    return [" ".join(line.split()) for line in read_text(path).splitlines()]

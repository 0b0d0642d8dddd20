"""Reading text files, plain or gzip (`.gz`): the one reader of the package, its tools, recipes and scripts."""

from __future__ import annotations

import gzip
import os
from typing import TextIO


def open_text(path: str | os.PathLike) -> TextIO:
    """`path` opened for reading as UTF-8 text, through gzip when its name ends in `.gz`."""
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_lines(path: str | os.PathLike) -> list[str]:
    """Every line of a text file (plain or gzip), its runs of whitespace collapsed and its ends stripped; empty
    lines are kept, so that the lines of the two files of a parallel set stay aligned."""
    with open_text(path) as handle:
        return [" ".join(line.split()) for line in handle.read().splitlines()]

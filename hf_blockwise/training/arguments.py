"""Command-line parsing for the recipes and scripts: transformers' `HfArgumentParser` over one dataclass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from transformers import HfArgumentParser

T = TypeVar("T")


def parse_dataclass_args(arguments_class: type[T], argv: Sequence[str] | None, description: str | None) -> T:
    """Parses `argv` (`sys.argv[1:]` when `None`) into an `arguments_class` instance.

    Unknown flags are a usage error (exit code 2), as with argparse; no `<script>.args` file is read, so the
    flags are exactly the command line (a recipe that calls another's `parse_args` gets only what it passes).
    """
    parser = HfArgumentParser(arguments_class, description=description)
    args, unknown = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True, look_for_args_file=False
    )
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args

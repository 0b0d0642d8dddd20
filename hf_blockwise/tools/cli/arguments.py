"""What the `hf-blockwise` subcommands share: argument types, the length-limit help and words, the tokenizer check."""

from __future__ import annotations

import argparse
import json
import os

import torch

from hf_blockwise.corpus.paths import check_tokenizer
from hf_blockwise.loading import PRETRAINED, default_max_new_tokens

MAX_NEW_TOKENS_HELP = (
    "length limit of each output; default: the checkpoint's generation_config, as model.generate() without "
    "arguments (its max_new_tokens: 128 for the shipped model; printed at the start of the run)"
)


def check_shipped_model(parser: argparse.ArgumentParser, model: str, flag: str = "--model") -> None:
    """A usage error when `model`, a default of the command, is a shipped model that is not here: the wheel carries
    the library only, the models live in a checkout (`hf_blockwise/pretrained/`, with `pip install -e .`)."""
    if os.path.normpath(os.path.dirname(model)) == os.path.normpath(PRETRAINED) and not os.path.isdir(model):
        parser.error(
            f"the shipped model {os.path.basename(model)} is not installed here: the shipped models live in a checkout "
            f"of hf_blockwise (hf_blockwise/pretrained/, installed with `pip install -e .`), not in the wheel. Pass "
            f"{flag} DIR (a checkout's hf_blockwise/pretrained/{os.path.basename(model)}, or your own model directory)"
        )


def positive_int(text: str) -> int:
    """An argparse type: an int of at least 1 (0 or a negative count would be ignored or mean nothing)."""
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from error
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from error


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (a temperature)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def unit_interval(text: str) -> float:
    """An argparse type: a number in (0, 1] (a top-p)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (generate's keyword arguments by name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}); e.g. '{{\"no_repeat_ngram_size\": 3}}'") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object of generate arguments by name, got a {type(value).__name__}: "
            "e.g. '{\"no_repeat_ngram_size\": 3}'"
        )
    return value


def require_tokenizer(model_path: str) -> None:
    """Exits with the reason when a local model directory holds no tokenizer (transformers' own error names none)."""
    try:
        check_tokenizer(model_path)
    except ValueError as error:
        raise SystemExit(str(error)) from error


def limit_words(base: torch.nn.Module, max_new_tokens: int | None) -> str:
    """The length limit of a run in words: given, or the checkpoint's default and where it comes from."""
    if max_new_tokens is not None:
        return f"max_new_tokens {max_new_tokens} (--max-new-tokens)"
    limit, source = default_max_new_tokens(base)
    return f"max_new_tokens {limit} ({source})"

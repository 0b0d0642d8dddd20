"""`hf-blockwise train feature-drafter|heads`: a drafter for your own checkpoint, trained on your own text
([`train_own_drafter`]): self-distillation, training, evaluation on held-out lines, the adapter saved; resumable."""

from __future__ import annotations

import argparse

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise.corpus.sources import read_sources
from hf_blockwise.tools.cli.arguments import positive_float, positive_int
from hf_blockwise.training.own_text import KINDS, OwnDrafterOptions, train_own_drafter

# a drafter worth using within an hour on 2 CPU cores: ~10 minutes of distillation, 40 of training, then evaluation
DEFAULT_MAX_LINES = 10_000
DEFAULT_MAX_MINUTES = 40.0


def add_train_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("kind", choices=KINDS, help="feature-drafter: the most tokens per call; heads: the cheapest")
    command.add_argument("--model", required=True, help="model directory or hub id (a text encoder-decoder)")
    command.add_argument(
        "--source-file", required=True, nargs="+",
        help="source-language text the model will decode: text files (one source per line, .gz allowed), .jsonl "
        "(with --column), .csv/.tsv/.parquet/.json data files or saved datasets, as hf-blockwise generate reads them",
    )  # fmt: skip
    command.add_argument("--column", default=None, help="the column / JSON field holding the sources")
    command.add_argument("--out", required=True, help="output folder: the adapter, its checkpoints and summary")
    defaults = OwnDrafterOptions()
    command.add_argument("--block-size", type=positive_int, default=defaults.block_size, help="k: drafts + 1")
    command.add_argument("--epochs", type=positive_float, default=defaults.epochs, help="passes over the text")
    command.add_argument("--max-steps", type=positive_int, default=None, help="stop after N training steps")
    command.add_argument(
        "--max-minutes", type=positive_float, default=DEFAULT_MAX_MINUTES,
        help="stop training after N minutes (saving first); with the default --max-lines a run takes under an hour "
        "on 2 CPU cores for a model of ~50M parameters",
    )  # fmt: skip
    command.add_argument(
        "--max-lines",
        type=positive_int,
        default=DEFAULT_MAX_LINES,
        help="distil and train on at most N lines (distilling takes ~1,000 lines a minute there)",
    )
    command.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="training batch size")
    command.add_argument("--lr", type=positive_float, default=defaults.learning_rate, help="peak learning rate")
    command.add_argument(
        "--eval-lines", type=positive_int, default=defaults.eval_lines, help="lines held out for the evaluation"
    )
    command.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the generation_config's")
    command.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    command.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_train_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise train`: reads the sources, trains, prints the summary (how to load the drafter with it)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    if args.no_progress:
        transformers_logging.disable_progress_bar()
    options = OwnDrafterOptions(
        kind=args.kind, block_size=args.block_size, epochs=args.epochs, max_steps=args.max_steps or -1,
        max_minutes=args.max_minutes, max_lines=args.max_lines, batch_size=args.batch_size, learning_rate=args.lr,
        eval_lines=args.eval_lines,
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    try:
        texts = [text for source in args.source_file for text in read_sources(source, args.column, None)]
        report = train_own_drafter(args.model, texts, args.out, options, progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"hf-blockwise train: {error}") from error
    model_class = "FeatureDrafterModel" if args.kind == "feature-drafter" else "BlockwiseHeadsModel"
    print(report.summary())
    print(f"load it: {model_class}.from_pretrained({args.out!r}, base_model=model)")
    return 0

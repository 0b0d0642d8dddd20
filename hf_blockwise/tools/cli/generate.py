"""`hf-blockwise generate`: a whole corpus, in sorted batches, resumable, sharded over `accelerate launch`
processes ([`generate_corpus`])."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise.corpus import DRAFTERS as CORPUS_DRAFTERS
from hf_blockwise.corpus.job import CorpusJob, CorpusOptions, length_limit, merged_generate_kwargs, prepare_job, run_job
from hf_blockwise.corpus.paths import check_output_is_not_a_source, check_output_location, check_tokenizer
from hf_blockwise.tools.cli.arguments import MAX_NEW_TOKENS_HELP, json_object, positive_int


def add_generate_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", required=True, help="model directory (with its drafters) or hub id")
    command.add_argument(
        "--input", required=True,
        help="text file (one source per line, .gz allowed), .jsonl (with --column), .csv/.tsv/.parquet/.json data "
        "file, a dataset saved with save_to_disk, or a hub dataset name (with --column, --split)",
    )  # fmt: skip
    command.add_argument("--output", required=True, help="output file: text, or JSONL when it ends in .jsonl")
    command.add_argument("--column", default=None, help="the column / JSON field holding the sources")
    command.add_argument("--split", default=None, help="the dataset split (datasets with several)")
    command.add_argument(
        "--drafter", choices=CORPUS_DRAFTERS, default="auto",
        help="auto: the fastest exact choice measured here: at batch 1 composite (else feature, heads, input_copy, "
        "none, by what the model has), above batch 1 none (the loop alone)",
    )  # fmt: skip
    command.add_argument("--batch-size", type=positive_int, default=16, help="most rows per batch")
    command.add_argument(
        "--max-batch-tokens", type=positive_int, default=None, help="most padded source tokens per batch"
    )
    command.add_argument("--max-new-tokens", type=positive_int, default=None, help=MAX_NEW_TOKENS_HELP)
    command.add_argument(
        "--generate-kwargs", type=json_object, default=None,
        help='more generate arguments, as a JSON object: \'{"no_repeat_ngram_size": 3}\'',
    )  # fmt: skip
    command.add_argument(
        "--num-beams", type=positive_int, default=None, help="beam search of N beams (1: greedy); default: the "
        "checkpoint's generation_config"
    )  # fmt: skip
    command.add_argument("--compile", action="store_true", help="verify through the compiled engine")
    command.add_argument(
        "--int8", action="store_true", help="the base in int8 (CPU): exact against its int8 greedy; with --compile, "
        "each row is encoded alone, so that a line's output does not depend on the rows batched with it"
    )  # fmt: skip
    command.add_argument("--format", choices=("text", "jsonl"), default=None, help="default: from the file name")
    command.add_argument("--stats", action="store_true", help="JSONL records carry new_tokens and decoder_calls")
    command.add_argument(
        "--on-long", choices=("fail", "skip"), default="fail",
        help="sources longer than the model's positions: fail, or skip with a warning (empty output line)",
    )  # fmt: skip
    command.add_argument(
        "--chunk-size", type=positive_int, default=1024,
        help="lines sorted, written and resumed together; the unit of sharding",
    )  # fmt: skip
    command.add_argument(
        "--overwrite", action="store_true", help="replace an earlier output instead of resuming it (never the input)"
    )
    command.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (per process)")
    command.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_generate_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise generate`: [`generate_corpus`] with the command's flags; prints the settings it runs with
    (the length limit and where it comes from) and, at the end, the run's figures."""
    _check_generate_paths(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # loading bars would interleave with the job's own
    try:
        options = CorpusOptions(
            drafter=args.drafter, batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
            generate_kwargs=merged_generate_kwargs(args.max_new_tokens, args.generate_kwargs, args.num_beams),
            compile=args.compile, int8=args.int8,
            output_format=args.format, stats=args.stats, on_long=args.on_long, chunk_size=args.chunk_size,
        )  # fmt: skip
        job = prepare_job(args.model, args.input, args.output, column=args.column, split=args.split, options=options)
        if job.state.is_main_process:
            print(_job_summary(job), flush=True)
        report = run_job(job, overwrite=args.overwrite, progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"hf-blockwise generate: {error}") from error
    repaired = "" if report.repaired_from is None else f", decoded again from line {report.repaired_from}"
    print(
        f"{report.output}: {report.lines} lines decoded ({report.resumed_lines} already there{repaired}, "
        f"{report.skipped} skipped) with drafter {report.drafter} in {report.seconds:.1f}s: "
        f"{report.sentences_per_second:.1f} sentences/s, {report.tokens_per_second:.0f} tokens/s, "
        f"{report.tokens_per_call:.2f} tokens per decoder call"
    )
    return 0


def _check_generate_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) before anything loads: an output that cannot be written or that is the input or
    a model file, and a model directory without a tokenizer."""
    output = Path(args.output)
    try:
        check_output_location(output)
        check_output_is_not_a_source(output, args.input, args.model)
        check_tokenizer(args.model)
    except ValueError as error:
        parser.error(str(error))


def _job_summary(job: CorpusJob) -> str:
    settings = job.settings
    budget = f", {settings.max_batch_tokens} source tokens" if settings.max_batch_tokens else ""
    return (
        f"generate: {settings.num_lines} sources from {settings.input} with {settings.model}, drafter "
        f"{settings.drafter}, {length_limit(job)}, at most {settings.batch_size} rows{budget} per batch"
        + (f", generate arguments {others}" if (others := _other_arguments(settings.generate_kwargs)) else "")
    )


def _other_arguments(generate_kwargs: dict) -> dict:
    return {key: value for key, value in generate_kwargs.items() if key != "max_new_tokens"}

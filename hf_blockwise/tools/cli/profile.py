"""`hf-blockwise profile calls|step|divergences|acceptance`: where decoding's time goes on a model, and how often
sampling keeps a draft (`tools/profile.py`)."""

from __future__ import annotations

import argparse
import copy
import os

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise import quantize_dynamic_int8
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.engine import CompileOptions
from hf_blockwise.loading import DRAFTER_NAMES, REALISTIC_MODEL, DrafterOptions, LoadedModel, build_drafter, load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.tools import profile
from hf_blockwise.tools.cli.arguments import (
    check_shipped_model,
    positive_float,
    positive_int,
    require_tokenizer,
    unit_interval,
)
from hf_blockwise.tools.cli.demo import DEMO_SENTENCES


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `hf-blockwise profile` and of its four questions (calls, step, divergences, acceptance)."""
    questions = parser.add_subparsers(dest="question", required=True)
    calls = questions.add_parser("calls", help="one decoder call of 1..N tokens against its weights' bytes' time")
    steps = questions.add_parser("step", help="a blockwise decode's time: verification, drafting, bookkeeping")
    differ = questions.add_parser(
        "divergences", help="where blockwise output departs from greedy, and the gap to greedy's best"
    )
    accept = questions.add_parser(
        "acceptance", help="how often sampling keeps a first draft: speculative sampling against shared noise"
    )
    for question in (calls, steps, differ, accept):
        question.add_argument("--model", default=None, help="model directory (default: the shipped marian-base-en-de)")
        question.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    calls.add_argument("--max-tokens", type=positive_int, default=8, help="time calls of 1..N tokens")
    calls.add_argument("--repeats", type=positive_int, default=20, help="timed rounds over the widths (median)")
    calls.add_argument(
        "--kinds", nargs="+", choices=profile.CALL_KINDS, default=["float32 compiled", "int8 eager", "int8 compiled"],
        help="which calls to time",
    )  # fmt: skip
    calls.add_argument("--torch-profile", action="store_true", help="with torch.profiler's table")
    calls.add_argument(
        "--guards", action="store_true", help="what dynamo's guards cost a compiled float32 call of 1 and 5 tokens"
    )
    for question in (steps, differ, accept):
        question.add_argument("--source-file", default=None, help="one source per line (default: the demo's sentences)")
        question.add_argument("--sentences", type=positive_int, default=100, help="the first N sources")
        question.add_argument("--drafter", choices=[n for n in DRAFTER_NAMES if n != "none"], default="feature")
        question.add_argument("--block-size", type=positive_int, default=None, help="the drafter's k")
        question.add_argument("--max-new-tokens", type=positive_int, default=128, help="length limit")
    accept.add_argument("--temperature", type=positive_float, default=0.7, help="sampling temperature")
    accept.add_argument("--top-p", type=unit_interval, default=0.9, help="sampling top-p")
    accept.add_argument("--draws", type=positive_int, default=256, help="noise draws per position")
    for question in (steps, differ):
        question.add_argument("--tree-nodes", type=positive_int, default=None, help="draft trees of this many nodes")
        question.add_argument("--tree-branching", type=positive_int, default=2, help="candidates per node of a tree")
        precision = question.add_mutually_exclusive_group()
        precision.add_argument(
            "--int8",
            action="store_true",
            help="the base in int8 (and the feature drafter's layer where the int8 kernel runs)",
        )
        precision.add_argument(
            "--int8-drafter", action="store_true", help="the float32 base with its feature drafter's layer in int8"
        )
        question.add_argument(
            "--feature-drafter", default=None, help="feature drafter directory (default: <model>/feature-drafter)"
        )
        question.add_argument("--compiled", action="store_true", help="verify through the compiled engine")
        question.add_argument(
            "--compiled-prefill",
            action="store_true",
            help="with --compiled: each generate's first decoder call compiled too (CompileOptions.compiled_prefill)",
        )


def run_profile_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise profile`: prints one Markdown table (or report) for the question asked."""
    model = args.model or REALISTIC_MODEL
    check_shipped_model(parser, model)
    if not os.path.isdir(model):
        parser.error(f"--model {model}: no such directory (a saved seq2seq model with its tokenizer)")
    require_tokenizer(model)  # as the demo and the bench: transformers' own error names no tokenizer
    transformers_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    source_file = getattr(args, "source_file", None)
    if source_file is not None and not os.path.isfile(source_file):  # before anything loads
        parser.error(f"--source-file {source_file}: no such file (one source sentence per line, plain or gzip)")
    if args.question == "calls":
        loaded = load_model(model)
        _print_calls(loaded, args, threads)
        return 0
    if args.question == "acceptance":
        return _print_acceptance(parser, args, model, threads)
    if args.feature_drafter is not None and not os.path.isdir(args.feature_drafter):
        parser.error(f"--feature-drafter {args.feature_drafter}: no such directory (a saved feature drafter)")
    loaded = load_model(model, int8=args.int8, feature_drafter_path=args.feature_drafter)
    if args.int8_drafter:
        loaded = loaded.int8_drafter_copy()
    options = DrafterOptions(block_size=args.block_size, tree_nodes=args.tree_nodes, tree_branching=args.tree_branching)
    try:
        drafter = build_drafter(args.drafter, loaded, options)
    except ValueError as error:
        parser.error(str(error))
    try:
        sources = (read_lines(source_file) if source_file else DEMO_SENTENCES)[: args.sentences]
    except ValueError as error:  # not UTF-8: the file, line and byte, and the iconv command
        parser.error(str(error))
    if args.compiled_prefill and not args.compiled:
        parser.error("--compiled-prefill chooses how the engine compiles: it needs --compiled")
    compiled = args.compiled and CompileOptions(compiled_prefill=args.compiled_prefill)
    weights = "int8" if args.int8 else "float32 base, int8 drafter" if args.int8_drafter else "float32"
    print(f"{model}, {len(sources)} sentences, batch 1, {threads} threads, {weights}, drafter {args.drafter}, "
          f"k = {drafter.block_size}" + (", compiled engine" if args.compiled else ", eager")
          + (" (first call compiled too)" if args.compiled_prefill else ""))  # fmt: skip
    if args.question == "step":
        _print_step_phases(loaded, sources, drafter, compiled, args)
        return 0
    report = profile.divergences(loaded.base, loaded.tokenizer, sources, drafter, compiled, args.max_new_tokens)
    for source, found in report.differing:
        print(source, found)
    reference = "the engine's greedy" if args.compiled else "transformers' greedy"
    print(f"identical to {reference}: {report.sentences - len(report.differing)}/{report.sentences}")
    print("gaps to greedy's best score where the output departs from transformers' greedy (float spacings): "
          + (", ".join(f"{gap:.1f}" for gap in report.gaps) or "none"))  # fmt: skip
    return 0


_STEP_COLUMNS = ("verification", "drafting", "bookkeeping", "generate (fixed)", "total", "verification per call",
                 "drafting per call")  # fmt: skip
_FIXED_COLUMNS = ("encoder", "engine check", "setup", "block check")


def _print_step_phases(
    loaded: LoadedModel, sources: list[str], drafter: Drafter, compiled: bool | CompileOptions, args: argparse.Namespace
) -> None:
    modes = (("greedy (the loop, no drafts)", None), (args.drafter, drafter))
    phases = {
        name: profile.step_phases(loaded.base, loaded.tokenizer, sources, assistant, compiled, args.max_new_tokens)
        for name, assistant in modes
    }
    print("| mode | verification | drafting | bookkeeping | generate (fixed) | total | one verification | one "
          "drafter call |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, values in phases.items():
        print(f"| {name} | " + " | ".join(f"{values[column]:.1f}" for column in _STEP_COLUMNS) + " |")
    print("(ms per sentence; the last two columns: ms per call)\n")
    print("| mode | generate (fixed): encoder | engine's stale check | setup | drafting: block's stale check |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for name, values in phases.items():
        print(f"| {name} | " + " | ".join(f"{values[column]:.1f}" for column in _FIXED_COLUMNS) + " |")
    print(
        "(ms per sentence: the encoder with an int8 base's refresh of its copies before it; the stale checks of "
        "the compiled engine and of a drafting block, once per generate; the rest of generate's fixed cost)"
    )


def _print_calls(loaded: LoadedModel, args: argparse.Namespace, threads: int) -> None:
    from_memory, from_cache = profile.bandwidth_gb_s(400), profile.bandwidth_gb_s(4, repeats=50)
    print(f"{args.model or REALISTIC_MODEL}, batch 1, {threads} threads; streaming bandwidth measured here: "
          f"{from_memory:.1f} GB/s from memory (400 MB), {from_cache:.1f} GB/s from cache (4 MB)")  # fmt: skip
    needs_int8 = args.torch_profile or any(kind.startswith("int8") for kind in args.kinds)
    int8 = quantize_dynamic_int8(copy.deepcopy(loaded.base)) if needs_int8 else None  # one copy for both
    rows = profile.call_cost_rows(loaded.base, loaded.tokenizer, args.kinds, args.max_tokens, args.repeats, int8=int8)
    print(profile.call_cost_table(rows, from_memory, from_cache))
    if args.guards:
        print("\n| compiled float32 call | ms | dynamo's guards (ms) |\n|---|---|---|")
        for width, (ms, guards) in profile.guard_cost(loaded.base, loaded.tokenizer).items():
            print(f"| {width} tok | {ms:.2f} | {guards:.3f} |")
    if args.torch_profile:  # int8 made above
        print("\nWhere a compiled int8 call of 3 tokens spends its time (20 calls; divide by 20 for one):\n")
        table, parts = profile.profile_compiled_call(int8, loaded.tokenizer)
        print("```\n" + table + "\n```\n\n| part of one call | ms |\n|---|---|")
        for part, milliseconds in parts.items():
            print(f"| {part} | {milliseconds:.3f} |")


def _print_acceptance(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str, threads: int) -> int:
    loaded = load_model(model)
    try:
        drafter = build_drafter(args.drafter, loaded, DrafterOptions(block_size=args.block_size))
        sources = (read_lines(args.source_file) if args.source_file else DEMO_SENTENCES)[: args.sentences]
    except ValueError as error:  # a drafter the model lacks; a file that is not UTF-8
        parser.error(str(error))
    result = profile.sampling_acceptance(
        loaded.base, loaded.tokenizer, sources, drafter, args.temperature, args.top_p, args.max_new_tokens, args.draws
    )
    print(f"{model}, {len(sources)} sentences, batch 1, {threads} threads, drafter {args.drafter}, "
          f"k = {drafter.block_size}, temperature {args.temperature}, top-p {args.top_p}")  # fmt: skip
    print("| construction | a first draft kept |\n|---|---|")
    print(f"| speculative sampling, min(1, p/q) (expected) | {result.speculative:.3f} |")
    print(f"| shared noise, the loop's (expected over {args.draws} draws) | {result.shared_noise:.3f} |")
    print(f"| shared noise, these decodes | {result.kept:.3f} |")
    print(f"({result.drafts} first drafts; {result.tokens_per_call:.2f} tokens per verification call)")
    return 0

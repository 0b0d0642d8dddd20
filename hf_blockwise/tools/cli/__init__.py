"""`hf-blockwise` console script: `demo` (greedy and blockwise side by side), `bench` (every mode, or the loop alone
on random models of real shapes with `--model-config`), `generate` (a whole corpus, resumable, sharded over
`accelerate launch` processes), `profile` (where the time goes: a call against its bytes, a step's phases, the
divergences from greedy) and `train` (a drafter for your own model on your own text), one module per subcommand."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

from hf_blockwise.tools.cli.bench import add_bench_arguments, run_bench_command
from hf_blockwise.tools.cli.demo import add_demo_arguments, run_demo_command
from hf_blockwise.tools.cli.generate import add_generate_arguments, run_generate_command
from hf_blockwise.tools.cli.profile import add_profile_arguments, run_profile_command
from hf_blockwise.tools.cli.train import add_train_arguments, run_train_command


def build_parser() -> argparse.ArgumentParser:
    """The `hf-blockwise` parser: one subcommand per module; each sets the function that runs it (`args.run`)."""
    parser = argparse.ArgumentParser(prog="hf-blockwise", description="Exact blockwise parallel decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="translate a few sentences, greedy and blockwise side by side")
    add_demo_arguments(demo)
    demo.set_defaults(run=functools.partial(run_demo_command, demo))
    bench = commands.add_parser("bench", help="every decoding mode side by side, measured against greedy")
    add_bench_arguments(bench)
    bench.set_defaults(run=functools.partial(run_bench_command, bench))
    generate = commands.add_parser(
        "generate", help="a whole corpus, in sorted batches, resumable; data parallel under accelerate launch"
    )
    add_generate_arguments(generate)
    generate.set_defaults(run=functools.partial(run_generate_command, generate))
    profile = commands.add_parser(
        "profile", help="where decoding's time goes: calls, a step's phases, divergences, sampling's acceptance"
    )
    add_profile_arguments(profile)
    profile.set_defaults(run=functools.partial(run_profile_command, profile))
    train = commands.add_parser(
        "train", help="a drafter for your own model, trained on your own text: distilled, trained, evaluated, saved"
    )
    add_train_arguments(train)
    train.set_defaults(run=functools.partial(run_train_command, train))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `hf-blockwise` console script: `demo`, `bench`, `generate`, `profile` and `train`."""
    args = build_parser().parse_args(argv)
    return args.run(args)

"""What the measurement scripts share (they run as `python scripts/NAME.py`, so this folder is on their path): a
caption to decode and one compiled decoder call over a prefilled cache (`hf_blockwise.evaluation.cost_curve`'s,
which `hf-blockwise profile` uses too), and the bench run through its command line (scripts drive the bench as a
user does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from hf_blockwise.evaluation.cost_curve import CAPTION as SENTENCE
from hf_blockwise.evaluation.cost_curve import compiled_call

__all__ = ["SENTENCE", "bench_command", "compiled_call", "run_bench"]


def bench_command(arguments: Sequence[str], out: str | os.PathLike) -> list[str]:
    """The command line of `hf-blockwise bench ARGUMENTS --out OUT`, with this interpreter."""
    return [sys.executable, "-m", "hf_blockwise.tools.cli", "bench", *arguments, "--out", os.fspath(out)]


def run_bench(arguments: Sequence[str], out: str | os.PathLike) -> dict[str, Any]:
    """Runs `hf-blockwise bench ARGUMENTS --out OUT` in a process of its own (its progress on stderr, its table
    left in `OUT/bench.md`) and returns its `bench.json`: `settings`, and `results` (one dict per mode and batch
    size, [`hf_blockwise.evaluation.ModeResult.summary`]); a failed run ends the script, naming the command."""
    command = bench_command(arguments, out)
    if subprocess.run(command, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        raise SystemExit(f"the bench failed: {' '.join(command)}")
    with open(os.path.join(out, "bench.json"), encoding="utf-8") as report:
        return json.load(report)

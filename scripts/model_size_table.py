"""What the decoding loop costs and can gain on models of real sizes: `docs/model_sizes.md`.

For each shape of `hf_blockwise.evaluation.model_configs` (opus-mt-en-de, t5-base, bart-large, nllb-200-distilled-600M;
randomly initialised, fp32, EOS suppressed so every sentence generates `--max-new-tokens` tokens), runs
``hf-blockwise bench --model-config NAME`` at batch 1 (modes greedy, loop, oracle at each block size, and the
decoder cost curve) and tabulates: greedy ms/token, the loop's time with no drafter over greedy's, the oracle's
speedup at each k, and the cost-curve ratios t(k)/t(1). The bench reports land in ``--out-dir/NAME``.

Command behind ``docs/model_sizes.md`` (from the repository root, a few minutes on 2 CPU threads)::

    python scripts/model_size_table.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
from script_common import run_bench

from hf_blockwise.evaluation.model_configs import MODEL_CONFIGS, build_model
from hf_blockwise.serialization import atomic_write_text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", nargs="+", default=list(MODEL_CONFIGS), choices=list(MODEL_CONFIGS))
    parser.add_argument("--sentences", type=int, default=8, help="random sources of 20 tokens per model")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--oracle-block-sizes", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="bench/model-sizes", help="one bench report per model")
    parser.add_argument("--table", default="docs/model_sizes.md")
    parser.add_argument("--tiny-model-config", action="store_true", help=argparse.SUPPRESS)  # tests: tiny shapes
    return parser.parse_args(argv)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs the bench on one shape; its results by mode, its cost curve (ms by tokens fed) and its wall time."""
    out = os.path.join(args.out_dir, name)
    command = ["--model-config", name, "--sentences", str(args.sentences), "--batch-sizes", "1"]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    command += ["--oracle-block-sizes", *map(str, args.oracle_block_sizes)]
    command += ["--tiny-model-config"] if args.tiny_model_config else []
    start = time.perf_counter()
    rows = {row["mode"]: row for row in run_bench(command, out)["results"]}
    seconds = time.perf_counter() - start
    with open(os.path.join(out, "cost_curve.json"), encoding="utf-8") as handle:
        curve = {int(n): ms for n, ms in json.load(handle)["ms_per_call"].items()}
    meta = build_model(name, tiny=args.tiny_model_config, device="meta")
    parameters = sum(parameter.numel() for parameter in meta.parameters())
    return {"rows": rows, "curve": curve, "seconds": seconds, "parameters": parameters}


def _oracle(measured: dict[str, Any], k: int) -> dict[str, Any]:
    return measured["rows"][f"oracle_k{k}"]


def speed_table(results: dict[str, dict[str, Any]], ks: Sequence[int]) -> list[str]:
    """Per model: size, greedy ms/token, loop/greedy time, oracle speedup at each k, identical outputs."""
    lines = [
        "| model | parameters | greedy ms/token | loop / greedy (time) | "
        + " | ".join(f"oracle k={k}" for k in ks)
        + " | identical to greedy |",
        "|---|---|---|---|" + "---|" * len(ks) + "---|",
    ]
    for name, measured in results.items():
        rows = measured["rows"]
        greedy = rows["greedy"]
        ms_per_token = 1000 * greedy["seconds"] / greedy["target_tokens"]
        loop_ratio = rows["loop"]["seconds"] / greedy["seconds"]
        oracles = " | ".join(
            f"{_oracle(measured, k)['speedup']:.2f}x (a={_oracle(measured, k)['mean_accepted']:.2f})" for k in ks
        )
        identical = sum(row["identical"] for row in rows.values())
        compared = sum(row["compared"] for row in rows.values())
        lines.append(
            f"| {name} | {measured['parameters'] / 1e6:.1f}M | {ms_per_token:.2f} | {loop_ratio:.2f} | {oracles} | "
            f"{identical}/{compared} |"
        )
    return lines


def cost_table(results: dict[str, dict[str, Any]], ks: Sequence[int]) -> list[str]:
    """Per model: the decoder cost curve's t(k)/t(1), and t(1) in ms."""
    lines = [
        "| model | t(1) ms | " + " | ".join(f"t({k})/t(1)" for k in ks) + " |",
        "|---|---|" + "---|" * len(ks),
    ]
    for name, measured in results.items():
        curve = measured["curve"]
        ratios = " | ".join(f"{curve[k] / curve[1]:.2f}" for k in ks)
        lines.append(f"| {name} | {curve[1]:.2f} | {ratios} |")
    return lines


def worked_example(results: dict[str, dict[str, Any]], k: int, accepted: float) -> str:
    """The rule of the guide applied to the first model's measured numbers."""
    name, measured = next(iter(results.items()))
    oracle = _oracle(measured, k)
    estimate = oracle["speedup"] * accepted / oracle["mean_accepted"]
    ceiling = accepted * measured["curve"][1] / measured["curve"][k]
    return (
        f"For example, on {name} a drafter at k={k} that averages a={accepted:g}: the oracle reached "
        f"{oracle['speedup']:.2f}x at a={oracle['mean_accepted']:.2f}, so expect about "
        f"{oracle['speedup']:.2f} × {accepted:g} / {oracle['mean_accepted']:.2f} = {estimate:.2f}x before the "
        f"drafter's own time; the cost-curve ceiling is {accepted:g} × t(1)/t({k}) = {ceiling:.2f}x."
    )


GUIDE = """## From a drafter's acceptance to an expected speedup

Blockwise decoding with block size k spends one decoder call per step, and a step costs about the same whatever
its drafts are, so its time is (number of steps) × (cost of a step at width k), and the number of steps is the
number of tokens divided by the mean accepted block a. The oracle column measures exactly that cost with the
best possible drafts (a ≈ k). So, for a drafter at block size k whose mean accepted block you have measured (the
bench's "mean accepted", or `output.decoding_stats.mean_accepted`), on a model of about this size:

    expected speedup ≈ oracle speedup at k × a / a_oracle(k)      (then subtract the drafter's own time per step)

- If that is below 1, no drafter with that acceptance pays off at this k: take a smaller k, or a better drafter.
- `a × t(1)/t(k)` (the cost-curve columns) is the ceiling counting decoder calls only; the gap between it and the
  estimate above is the loop's own overhead, which the "loop / greedy" column shows at k = 1.
- A drafter that runs a model of its own (GAD's non-autoregressive drafter, an assistant model) adds its time per
  step: divide the estimate by (1 + drafter time per step / loop time per step).
"""


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    ks = args.oracle_block_sizes
    example_k = 4 if 4 in ks else max(ks)
    header = [
        "# Decoding cost by model size",
        "",
        "Randomly initialised models with the shapes of real ones (`hf_blockwise/evaluation/model_configs.py`), fp32, "
        f"batch 1, {args.sentences} random sources of 20 tokens, {args.max_new_tokens} new tokens each (EOS "
        f"suppressed, so every mode generates the same tokens); CPU threads: {args.threads} ({platform.machine()}, "
        f"torch {torch.__version__}). Whole run: {seconds:.0f} s. Regenerate: `python scripts/model_size_table.py "
        f"--threads {args.threads}`; per-model bench reports in `{args.out_dir}/`.",
        "",
        "`loop / greedy`: time of `blockwise_generate` with no drafter (one token per call, like greedy) over "
        "greedy's: the loop's own overhead. `oracle k=…`: speedup over greedy when the drafts are greedy's own "
        "output (every draft accepted; a = mean accepted block): the most this loop can gain on this model at "
        "block size k.",
        "",
        "## Speed",
        "",
    ]
    body = [*speed_table(results, ks), "", "## Decoder cost curve", "", *cost_table(results, ks), ""]
    guide = [GUIDE, worked_example(results, example_k, accepted=example_k / 2 + 0.5), ""]
    return "\n".join(header + body + guide)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    results = {}
    for name in args.models:
        results[name] = bench_model(name, args)
        print(f"{name}: {results[name]['seconds']:.0f} s")
    seconds = time.perf_counter() - start
    atomic_write_text(args.table, report(results, args, seconds))
    print(f"wrote {os.path.abspath(args.table)} in {seconds:.0f} s")


if __name__ == "__main__":
    main()

"""Where a blockwise step's time goes: verification, drafting, bookkeeping and `generate`'s fixed cost per sentence.

Wall-clock time is summed per phase over a run of sentences at batch size 1 (after an untimed warm-up run over the
same sentences, which also compiles): `verification` is the decoder forward (`step.run_decoder`), `drafting` the
drafter's `get_candidates`, `bookkeeping` the rest of each step (feed, scores, acceptance, stopping, advance), and
`generate (fixed)` what a call spends outside its steps (encoder, transformers' setup, the loop's own setup).

    python scripts/step_profile.py --model hf_blockwise/pretrained/multi30k-en-de \
        --source-file ../shared/data/multi30k/test_2016_flickr.en.gz --sentences 100 --threads 2
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from hf_blockwise import blockwise_generate
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.generation import loop, step
from hf_blockwise.loading import load_model
from hf_blockwise.text_files import read_lines

MODES = ("greedy", "greedy_compiled", "feature", "feature_compiled")


def _timed(totals: dict[str, float], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = function(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        totals[f"{name} calls"] += 1
        return result

    return run


def profile_mode(base, tokenizer, drafter: FeatureDrafter, sources: list[str], mode: str) -> dict[str, float]:
    """Milliseconds per sentence of each phase for one mode."""
    totals: dict[str, float] = collections.defaultdict(float)
    originals = (loop.decode_step, step.run_decoder, FeatureDrafter.get_candidates)
    loop.decode_step = _timed(totals, "step", loop.decode_step)
    step.run_decoder = _timed(totals, "verification", step.run_decoder)
    FeatureDrafter.get_candidates = _timed(totals, "drafting", FeatureDrafter.get_candidates)
    assistant = drafter if mode.startswith("feature") else None
    try:
        with torch.inference_mode():
            for _run in ("warm-up", "timed"):
                totals.clear()
                start = time.perf_counter()
                for source in sources:
                    base.generate(
                        **tokenizer(source, return_tensors="pt"), custom_generate=blockwise_generate,
                        assistant=assistant, blockwise_compile=mode.endswith("compiled"), max_new_tokens=128,
                    )  # fmt: skip
                total = time.perf_counter() - start
    finally:
        loop.decode_step, step.run_decoder, FeatureDrafter.get_candidates = originals
    phases = {
        "verification": totals["verification"],
        "drafting": totals["drafting"],
        "bookkeeping": totals["step"] - totals["verification"] - totals["drafting"],
        "generate (fixed)": total - totals["step"],
        "total": total,
    }
    per_sentence = {name: 1000 * seconds / len(sources) for name, seconds in phases.items()}
    # one verification call, one draft (a drafter call proposes a whole chain)
    per_call = {
        name: 1000 * totals[name] / totals[f"{name} calls"] if totals[f"{name} calls"] else float("nan")
        for name in ("verification", "drafting")
    }
    return {**per_sentence, **{f"{name} per call": value for name, value in per_call.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model directory with a feature-drafter/ folder")
    parser.add_argument("--source-file", required=True)
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=None, help="the feature drafter's k (default: its config's)")
    parser.add_argument("--tree-nodes", type=int, default=None, help="draft trees of this many nodes (default: chains)")
    parser.add_argument("--tree-branching", type=int, default=2, help="candidates per node of a tree")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--int8", action="store_true", help="the int8 model (base and drafter quantized)")
    precision.add_argument(
        "--int8-drafter", action="store_true", help="the float32 base with its feature drafter's layer in int8"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, int8=args.int8)
    if args.int8_drafter:
        loaded = loaded.int8_drafter_copy()
    if loaded.feature_model is None:
        raise SystemExit(f"{args.model} ships no feature-drafter/ folder")
    base, tokenizer = loaded.base, loaded.tokenizer
    drafter = loaded.feature_model.drafter(
        block_size=args.block_size, tree_nodes=args.tree_nodes, tree_branching=args.tree_branching
    )
    sources = read_lines(args.source_file)[: args.sentences]
    weights = "int8" if args.int8 else "float32 base, int8 drafter" if args.int8_drafter else "float32"
    print(
        f"ms per sentence, {len(sources)} sentences, batch 1, {args.threads} threads, "
        f"k = {drafter.block_size}, {weights}"
        + ("" if args.tree_nodes is None else f", trees of {args.tree_nodes} nodes, {args.tree_branching} per node")
    )
    print(
        "| mode | verification | drafting | bookkeeping | generate (fixed) | total "
        "| one verification call | one draft |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        phases = profile_mode(base, tokenizer, drafter, sources, mode)
        print(f"| {mode} | " + " | ".join(f"{value:.1f}" for value in phases.values()) + " |")


if __name__ == "__main__":
    main()

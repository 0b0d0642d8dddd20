"""Stern et al.'s Table 1, for this package's drafters: accepted tokens per decoder call at k = 2..10, with speedups.

Rows: Stern's heads, sequential (Hydra-style) heads and the feature drafter of a shipped model, each at every
block size k it supports (heads: up to their trained k; the feature drafter drafts autoregressively, so any k),
plus the oracle (greedy's own output as drafts: the loop's ceiling). Every cell comes from one bench run
(`hf-blockwise bench`: same sentences, batch 1, modes interleaved per sentence, each timed against transformers'
greedy in the same run; its own report lands beside `--out`, in `<out>-bench/`).

    python scripts/acceptance_table.py --model hf_blockwise/pretrained/multi30k-en-de --sentences 300 \
        --out docs/acceptance_table.md
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from script_common import run_bench

from hf_blockwise.loading import load_model
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.training.arguments import parse_dataclass_args

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass
class AcceptanceTableArguments:
    model: str = field(default="hf_blockwise/pretrained/multi30k-en-de", metadata={"help": "shipped model dir"})
    sources: str = field(default=str(DATA_DIR / "multi30k" / "test_2016_flickr.en.gz"))
    sentences: int = field(default=300, metadata={"help": "first N sources"})
    block_sizes: list[int] = field(default_factory=lambda: list(range(2, 11)), metadata={"help": "k values"})
    threads: int = field(default=2)
    max_new_tokens: int = field(default=128)
    out: str = field(default="docs/acceptance_table.md")


ROW_NAMES = {
    "oracle": "oracle (ceiling)",
    "heads": "Stern heads",
    "seq_heads": "sequential heads",
    "feature": "feature drafter",
}


def table_lines(rows: dict[str, list[int]], by_mode: dict, block_sizes: Sequence[int]) -> list[str]:
    """The markdown table: one row per drafter, one column per k; each cell the mean accepted tokens per call and
    the speedup (and the identical count where not every output is identical)."""
    lines = ["| drafter | " + " | ".join(f"k={k}" for k in block_sizes) + " |", "|---|" + "---|" * len(block_sizes)]
    for row, sizes in rows.items():
        cells = []
        for k in block_sizes:
            result = by_mode.get(f"oracle_k{k}" if row == "oracle" else f"{row}_k{k}")
            if k not in sizes or result is None:
                cells.append("")
            else:
                identical = "" if result["identical"] == result["compared"] else f" ({result['identical']} identical)"
                cells.append(f"{result['mean_accepted']:.2f} ({result['speedup']:.2f}x){identical}")
        lines.append(f"| {ROW_NAMES[row]} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(AcceptanceTableArguments, argv, __doc__.split("\n", 1)[0])
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    rows: dict[str, list[int]] = {"oracle": list(args.block_sizes)}
    if loaded.heads_model is not None:
        rows["heads"] = [k for k in args.block_sizes if k <= loaded.heads_model.blockwise_config.block_size]
    if loaded.sequential_heads_model is not None:
        trained = loaded.sequential_heads_model.blockwise_config.block_size
        rows["seq_heads"] = [k for k in args.block_sizes if k <= trained]
    if loaded.feature_model is not None:
        rows["feature"] = list(args.block_sizes)
    modes = ["greedy"] + [f"{row}_k{k}" for row, sizes in rows.items() if row != "oracle" for k in sizes]
    modes += ["oracle"]
    arguments = ["--model", args.model, "--source-file", args.sources, "--sentences", str(args.sentences)]
    arguments += ["--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), "--batch-sizes", "1"]
    arguments += ["--oracle-block-sizes", *map(str, rows["oracle"]), "--modes", *modes]
    started = time.time()
    report = run_bench(arguments, os.path.splitext(args.out)[0] + "-bench")
    by_mode = {result["mode"]: result for result in report["results"]}
    lines = table_lines(rows, by_mode, args.block_sizes)
    text = f"""# Accepted tokens per decoder call at k = 2..10 (Stern et al., Table 1 shape)

Each cell: mean accepted tokens per decoder call (the base's own token included), and in brackets the wall-clock
speedup over transformers' greedy `generate` in the same run. Exact decoding: every output identical to greedy
unless a cell says otherwise. Empty: the drafter has fewer heads than k - 1.

- Model: `{args.model}`; first {args.sentences} sentences of `{os.path.basename(args.sources)}`; batch 1;
  {torch.get_num_threads()} CPU threads; max {args.max_new_tokens} new tokens; run took {time.time() - started:.0f} s.
- Regenerate: `python scripts/acceptance_table.py --model {args.model} --sentences {args.sentences} --out {args.out}`

{chr(10).join(lines)}
"""
    atomic_write_text(args.out, text)
    atomic_write_text(
        os.path.splitext(args.out)[0] + ".json",
        json.dumps(by_mode, indent=2) + "\n",
    )
    print(text)


if __name__ == "__main__":
    main()

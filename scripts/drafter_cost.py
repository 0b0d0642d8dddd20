"""How much of a blockwise decode the feature drafter itself costs, at several k and draft thresholds.

For each setting, decodes the same sentences greedy and blockwise (batch 1, interleaved per sentence) and times
`FeatureDrafter.get_candidates` separately: its share is what drafting costs, and greedy time over (blockwise time
minus drafting time) is what the same decode would reach with free drafts.

    python scripts/drafter_cost.py --model hf_blockwise/pretrained/multi30k-en-de --sentences 60
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from hf_blockwise import FeatureDrafterModel, blockwise_generate
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass
class DrafterCostArguments:
    model: str = field(default="hf_blockwise/pretrained/multi30k-en-de", metadata={"help": "shipped model dir"})
    sources: str = field(default=str(DATA_DIR / "multi30k" / "test_2016_flickr.en.gz"))
    sentences: int = field(default=60)
    settings: list[str] = field(
        default_factory=lambda: ["5", "4", "3", "5:0.3", "6:0.3"], metadata={"help": "k or k:threshold"}
    )
    threads: int = field(default=2)
    max_new_tokens: int = field(default=128)


def time_drafting(drafter: Any) -> list[float]:
    """Wraps `drafter.get_candidates` to time it; returns the accumulator `[seconds, calls]`, which the caller
    may reset (after a warm-up)."""
    draft, spent = drafter.get_candidates, [0.0, 0]

    def timed(request):
        started = time.perf_counter()
        drafts = draft(request)
        spent[0] += time.perf_counter() - started
        spent[1] += 1
        return drafts

    drafter.get_candidates = timed
    return spent


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(DrafterCostArguments, argv, __doc__.split("\n", 1)[0])
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
    feature = FeatureDrafterModel.from_pretrained(f"{args.model}/feature-drafter", base_model=base).eval()
    sources = read_lines(args.sources)[: args.sentences]
    batches = [tokenizer([source], return_tensors="pt") for source in sources]
    for setting in args.settings:
        k, _, threshold = setting.partition(":")
        drafter = feature.drafter(block_size=int(k), threshold=float(threshold) if threshold else None)
        spent = time_drafting(drafter)
        for batch in batches[:5]:  # warm-up
            base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=8)
        spent[0], spent[1] = 0.0, 0
        greedy_seconds = blockwise_seconds = 0.0
        accepted = []
        for batch in batches:
            started = time.perf_counter()
            base.generate(**batch, max_new_tokens=args.max_new_tokens)
            greedy_seconds += time.perf_counter() - started
            started = time.perf_counter()
            out = base.generate(
                **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=args.max_new_tokens,
                return_dict_in_generate=True,
            )  # fmt: skip
            blockwise_seconds += time.perf_counter() - started
            accepted.append(out.decoding_stats.mean_accepted)
        print(
            f"k={k} threshold={threshold or None}: greedy {greedy_seconds:.2f} s, blockwise {blockwise_seconds:.2f} s "
            f"({greedy_seconds / blockwise_seconds:.2f}x), drafting {spent[0]:.2f} s over {spent[1]} steps "
            f"({1000 * spent[0] / spent[1]:.2f} ms per step), {sum(accepted) / len(accepted):.2f} tokens per call; "
            f"with free drafts {greedy_seconds / (blockwise_seconds - spent[0]):.2f}x"
        )


if __name__ == "__main__":
    main()

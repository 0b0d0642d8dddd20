"""What a feature drafter's width costs per draft, against a verification call of its base (eager, batch 1).

For each feed-forward width, a feature drafter with random weights (its cost does not depend on them) drafts k - 1
tokens per step on the base's own decoding; `get_candidates` is timed apart from the rest of each step.

    python scripts/drafter_width.py --model hf_blockwise/pretrained/marian-base-en-de --threads 2

Prints, per width: ms per `get_candidates` call, ms per draft, and ms per step outside drafting (verification and
bookkeeping), whose ratio is the issue-26 budget (a draft ≤ 1/8 of a verification call).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.utils import logging

from hf_blockwise import blockwise_generate
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.text_files import read_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_cost import time_drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--source-file", default="../shared/data/multi30k/test_2016_flickr.en.gz")
    parser.add_argument("--sentences", type=int, default=12)
    parser.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
    batches = [tokenizer([source], return_tensors="pt") for source in read_lines(args.source_file)[: args.sentences]]
    for width in args.widths:
        torch.manual_seed(0)
        model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=args.block_size, ffn_size=width)).eval()
        model.set_shortlist(torch.arange(2000))
        drafter = model.drafter()
        spent = time_drafting(drafter)
        kwargs = {"custom_generate": blockwise_generate, "assistant": drafter, "max_new_tokens": 24}
        for batch in batches[:3]:  # warm-up
            base.generate(**batch, **kwargs)
        spent[0], spent[1], total = 0.0, 0, 0.0
        for batch in batches:
            started = time.perf_counter()
            base.generate(**batch, **kwargs)
            total += time.perf_counter() - started
        per_call = 1000 * spent[0] / spent[1]
        print(
            f"FFN {width}: {per_call:.2f} ms per get_candidates ({args.block_size - 1} drafts), "
            f"{per_call / (args.block_size - 1):.2f} ms per draft; {1000 * (total - spent[0]) / spent[1]:.2f} ms per "
            "step outside drafting"
        )


if __name__ == "__main__":
    main()

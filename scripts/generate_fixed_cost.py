"""How much of a short greedy decode is `generate`'s fixed cost per call (docs/results.md, "The loop and its ceiling").

Times transformers' greedy `generate` with `max_new_tokens=1` (config merging, processors, encoder pass, one
decoder step) against a full greedy decode, per sentence, on the shipped Multi30k model::

    python scripts/generate_fixed_cost.py --sentences 100 --threads 2
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from hf_blockwise.loading import SHIPPED_MODEL
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class FixedCostArguments:
    model: str = field(default=SHIPPED_MODEL, metadata={"help": "seq2seq model directory"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz", metadata={"help": "one source per line"}
    )
    sentences: int = field(default=100, metadata={"help": "first N sources"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})


def main() -> None:
    args = parse_dataclass_args(FixedCostArguments, None, __doc__.split("\n", 1)[0])
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=torch.float32).eval()
    sources = read_lines(args.source_file)[: args.sentences]
    one_token, full, lengths = [], [], []
    for source in sources:
        batch = tokenizer([source], return_tensors="pt")
        start = time.perf_counter()
        model.generate(**batch, max_new_tokens=1)
        one_token.append(time.perf_counter() - start)
        start = time.perf_counter()
        output = model.generate(**batch, max_new_tokens=128)
        full.append(time.perf_counter() - start)
        lengths.append(output.shape[1] - 1)
    print(
        f"{len(sources)} sentences, {args.threads} threads: generate with 1 new token "
        f"{1000 * statistics.mean(one_token):.1f} ms; full greedy {1000 * statistics.mean(full):.1f} ms for "
        f"{statistics.mean(lengths):.1f} tokens on average"
    )


if __name__ == "__main__":
    main()

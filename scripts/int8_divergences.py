"""Where int8 blockwise decoding of the shipped model departs from int8 greedy decoding, and how close the call was.

    python scripts/int8_divergences.py --sentences 100

Prints each differing sentence with `first_divergence` (position, the two tokens, top-2 logit gap) and a count.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer
from transformers.utils import logging

from hf_blockwise import BlockwiseHeadsModel, first_divergence, quantize_dynamic_int8
from hf_blockwise.tools.arguments import parse_dataclass_args
from hf_blockwise.tools.cli import SHIPPED_MODEL


@dataclass
class Int8DivergencesArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=SHIPPED_MODEL, metadata={"help": "shipped model folder (base and heads)"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz",
        metadata={"help": "gzip source sentences, one per line"},
    )
    sentences: int = field(default=100, metadata={"help": "decode the first N sentences"})
    threads: int = field(default=1, metadata={"help": "torch.set_num_threads"})


def parse_args(argv: Sequence[str] | None = None) -> Int8DivergencesArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `Int8DivergencesArguments`."""
    return parse_dataclass_args(Int8DivergencesArguments, argv, __doc__.split("\n", 1)[0])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = quantize_dynamic_int8(BlockwiseHeadsModel.from_pretrained(args.model, dtype=torch.float32).eval())
    base = model.base_model
    with gzip.open(args.source_file, "rt", encoding="utf-8") as handle:
        sources = [line.strip() for line in handle][: args.sentences]
    differing = 0
    for source in sources:
        inputs = tokenizer([source], return_tensors="pt")
        greedy = base.generate(**inputs, max_new_tokens=128)
        blockwise = model.generate(**inputs, max_new_tokens=128)
        if not torch.equal(greedy, blockwise):
            differing += 1
            divergences = first_divergence(
                base, inputs["input_ids"], greedy, blockwise, inputs["attention_mask"], base.config.pad_token_id
            )
            print(source, divergences)
    print(f"identical to int8 greedy: {len(sources) - differing}/{len(sources)}")


if __name__ == "__main__":
    main()

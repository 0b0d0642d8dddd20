"""Where int8 blockwise decoding departs from int8 greedy decoding, and how close the call was.

    python scripts/int8_divergences.py --sentences 100
    python scripts/int8_divergences.py --model hf_blockwise/pretrained/marian-base-en-de --drafter feature \
        --source-file ../shared/data/europarl_de_en/validation.en --sentences 40 --threads 2

Loads the model with its drafters and quantizes the base (and the feature drafter's layer) to int8, decodes each
sentence with int8 greedy and with the drafter (eager, batch 1), and prints each differing sentence with
`first_divergence` (position, the two tokens, top-2 logit gap), a count, and the sorted top-2 gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.utils import logging

from hf_blockwise import blockwise_generate, first_divergence
from hf_blockwise.loading import SHIPPED_MODEL, build_drafter, load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class Int8DivergencesArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=SHIPPED_MODEL, metadata={"help": "shipped model folder (base and its drafters)"})
    drafter: Literal["heads", "feature"] = field(default="heads", metadata={"help": "which shipped drafter drafts"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz",
        metadata={"help": "source sentences, one per line (plain or gzip)"},
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
    loaded = load_model(args.model, int8=True)
    base, tokenizer = loaded.base, loaded.tokenizer
    drafter = build_drafter(args.drafter, loaded)
    sources = read_lines(args.source_file)[: args.sentences]
    gaps = []
    for source in sources:
        inputs = tokenizer([source], return_tensors="pt")
        greedy = base.generate(**inputs, max_new_tokens=128, do_sample=False)
        blockwise = base.generate(**inputs, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=128)
        if not torch.equal(greedy, blockwise):
            divergences = first_divergence(
                base, inputs["input_ids"], greedy, blockwise, inputs["attention_mask"], base.config.pad_token_id
            )
            print(source, divergences)
            gaps += [divergence.top2_gap for divergence in divergences]
    print(f"identical to int8 greedy: {len(sources) - len(gaps)}/{len(sources)}")
    print("top-2 logit gaps at the divergences: " + ", ".join(f"{gap:.4f}" for gap in sorted(gaps)))


if __name__ == "__main__":
    main()

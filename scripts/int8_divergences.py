"""Where int8 blockwise decoding of the shipped model departs from int8 greedy decoding, and how close the call was.

    python scripts/int8_divergences.py --sentences 100

Prints each differing sentence with `first_divergence` (position, the two tokens, top-2 logit gap) and a count.
"""

from __future__ import annotations

import argparse
import gzip

import torch
from transformers import AutoTokenizer
from transformers.utils import logging

from hf_blockwise import BlockwiseHeadsModel, first_divergence, quantize_dynamic_int8
from hf_blockwise.cli import SHIPPED_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default=SHIPPED_MODEL)
    parser.add_argument("--source-file", default="../shared/data/multi30k/test_2016_flickr.en.gz")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
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

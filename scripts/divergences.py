"""Where blockwise decoding departs from greedy decoding of the same weights, and how close the call was.

    python scripts/divergences.py --sentences 100
    python scripts/divergences.py --model hf_blockwise/pretrained/marian-base-en-de --drafter feature \
        --source-file ../shared/data/europarl_de_en/validation.en --sentences 40 --threads 2
    python scripts/divergences.py --drafter feature --no-int8 --block-size 6 --tree-nodes 16 --tree-branching 4

Loads the model with its drafters (with `--int8`, the default, the base and the feature drafter's layer quantized to
int8), decodes each sentence with greedy and with the drafter (batch 1; eager, or with `--compiled` through the
compiled engine against its own greedy; chains, or trees with `--tree-nodes`), and prints each differing sentence with
`first_divergence` (position, the two tokens, top-2 logit gap), a count, and the sorted top-2 gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.utils import logging

from hf_blockwise import blockwise_generate, first_divergence
from hf_blockwise.loading import SHIPPED_MODEL, DrafterOptions, build_drafter, load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class DivergencesArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=SHIPPED_MODEL, metadata={"help": "shipped model folder (base and its drafters)"})
    drafter: Literal["heads", "feature"] = field(default="heads", metadata={"help": "which shipped drafter drafts"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz",
        metadata={"help": "source sentences, one per line (plain or gzip)"},
    )
    sentences: int = field(default=100, metadata={"help": "decode the first N sentences"})
    threads: int = field(default=1, metadata={"help": "torch.set_num_threads"})
    int8: bool = field(default=True, metadata={"help": "quantize the base and the feature drafter to int8"})
    block_size: int | None = field(default=None, metadata={"help": "drafted tokens per step (default: trained)"})
    tree_nodes: int | None = field(default=None, metadata={"help": "draft trees of this many nodes (default: chains)"})
    tree_branching: int = field(default=2, metadata={"help": "candidates per drafted state in trees"})
    compiled: bool = field(
        default=False, metadata={"help": "through the compiled engine, against the engine's own greedy (no drafter)"}
    )


def parse_args(argv: Sequence[str] | None = None) -> DivergencesArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `DivergencesArguments`."""
    return parse_dataclass_args(DivergencesArguments, argv, __doc__.split("\n", 1)[0])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, int8=args.int8)
    base, tokenizer = loaded.base, loaded.tokenizer
    options = DrafterOptions(block_size=args.block_size, tree_nodes=args.tree_nodes, tree_branching=args.tree_branching)
    drafter = build_drafter(args.drafter, loaded, options)
    sources = read_lines(args.source_file)[: args.sentences]
    engine = {"custom_generate": blockwise_generate, "blockwise_compile": args.compiled}
    gaps = []
    for source in sources:
        inputs = tokenizer([source], return_tensors="pt")
        if args.compiled:
            greedy = base.generate(**inputs, **engine, max_new_tokens=128)
        else:
            greedy = base.generate(**inputs, max_new_tokens=128, do_sample=False)
        blockwise = base.generate(**inputs, **engine, assistant=drafter, max_new_tokens=128)
        if not torch.equal(greedy, blockwise):
            divergences = first_divergence(
                base, inputs["input_ids"], greedy, blockwise, inputs["attention_mask"], base.config.pad_token_id
            )
            print(source, divergences)
            gaps += [divergence.top2_gap for divergence in divergences]
    print(f"identical to {'int8 ' if args.int8 else ''}greedy: {len(sources) - len(gaps)}/{len(sources)}")
    print("top-2 logit gaps at the divergences: " + ", ".join(f"{gap:.4f}" for gap in sorted(gaps)))


if __name__ == "__main__":
    main()

"""Beam steps per verification call with perfect chain drafts: the ceiling of drafting under beam search.

    python scripts/beam_ceiling.py --model hf_blockwise/pretrained/marian-base-en-de \
        --source-file ../shared/data/multi30k/test_2016_flickr.en.gz --sentences 100 --num-beams 4

Runs the beam loop without drafts (transformers' beam search, one step per forward) and records every step: each new
live beam's parent, and the rank of its token among its parent's scores. A call replays beam search's steps while
every live beam extends its row by that row's drafts, so with perfect drafts a call goes on past a step when
- `greedy chains` (each beam drafts its own best continuation, what a greedy drafter can at best do): every new beam is
  its parent's best-scoring child;
- `any chains` (each beam drafts the one child beam search will keep, if any): no two new beams share a parent;
- `trees of top-m` (each beam drafts its m best children at every depth: m + m^2 + ... nodes): every new beam is
  among its parent's m best children.
Prints the steps per call each gives for blocks of k = 2, 4, 8 (at most k steps per call), and how often a step
allows the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from hf_blockwise import blockwise_generate
from hf_blockwise import boundary as hf
from hf_blockwise.loading import SHIPPED_MODEL, load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class BeamCeilingArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=SHIPPED_MODEL, metadata={"help": "model folder"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz", metadata={"help": "sources, one per line"}
    )
    sentences: int = field(default=100, metadata={"help": "decode the first N sentences"})
    num_beams: int = field(default=4, metadata={"help": "beams"})
    max_new_tokens: int = field(default=128, metadata={"help": "length limit"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})


def recorded_steps(model, inputs: dict, num_beams: int, max_new_tokens: int) -> list[tuple[int, bool]]:
    """Per beam step of one sentence: (the worst rank of a new beam's token among its parent's scores, 0 = every new
    beam is its parent's best child; whether no two new beams share a parent)."""
    steps: list[tuple[int, bool]] = []
    step = hf.beam_search_step

    def recording(model_, search, log_probs, criteria, options, all_scores):
        new, parents = step(model_, search, log_probs, criteria, options, all_scores)
        tokens = new.running[:, :, new.cur_len - 1].reshape(-1)  # (b * n,)
        scores = log_probs[parents]  # (b * n, vocab): each new beam's parent's scores
        ranks = (scores > scores.gather(1, tokens[:, None])).sum(dim=1)  # (b * n,)
        steps.append((int(ranks.max()), len(set(parents.tolist())) == parents.numel()))
        return new, parents

    hf.beam_search_step = recording
    try:
        model.generate(**inputs, num_beams=num_beams, max_new_tokens=max_new_tokens, custom_generate=blockwise_generate)
    finally:
        hf.beam_search_step = step
    return steps


def steps_per_call(allows_next: Sequence[bool], block_size: int) -> float:
    """Steps per call over one sentence's steps: a call takes its first step, then the next while the step just
    taken allows it, up to `block_size` steps."""
    calls, taken = 0, 0
    while taken < len(allows_next):
        calls += 1
        run = 1
        while run < block_size and taken + run < len(allows_next) and allows_next[taken + run - 1]:
            run += 1
        taken += run
    return len(allows_next) / calls if calls else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(BeamCeilingArguments, argv, __doc__.split("\n", 1)[0])
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    sources = read_lines(args.source_file)[: args.sentences]
    inputs = [loaded.tokenizer([source], return_tensors="pt") for source in sources]
    per_sentence = [recorded_steps(loaded.base, batch, args.num_beams, args.max_new_tokens) for batch in inputs]
    print(f"{args.sentences} sentences of {args.source_file}, {args.num_beams} beams, batch 1")
    print("| perfect drafts | steps allowing the next | k = 2 | k = 4 | k = 8 |\n|---|---|---|---|---|")
    criteria = {
        "greedy chains": lambda step: step[0] == 0,
        "any chains": lambda step: step[1],
        **{f"trees of top-{m}": (lambda step, m=m: step[0] < m) for m in (2, 3, 4)},
    }
    for name, allows in criteria.items():
        flags = [[allows(step) for step in steps] for steps in per_sentence]
        allowed = sum(map(sum, flags)) / sum(map(len, flags))
        total = sum(map(len, flags))
        ratios = [total / sum(len(f) / steps_per_call(f, k) for f in flags if f) for k in (2, 4, 8)]
        print(f"| {name} | {allowed:.2f} | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()

"""Sampling through the loop against transformers' own sampling (CHANGELOG, "Sampling through the loop").

Per batch (`--batch-size`, 1 by default), the median of `--repeats` runs of: transformers' sampling
(`do_sample=True`), the loop's sampling without drafts, and with the model's feature drafter (eager, or `--compiled`
through the compiled engine, compiled before the timed runs), all with the same temperature and top-p; prints the
summed times, the ratios to transformers' sampling, tokens per row and decoder call, and on how many sentences the
drafted output equals the undrafted one under the same seed::

    python scripts/sampling_speed.py --sentences 30 --threads 2 [--compiled] [--batch-size 16]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise import blockwise_generate
from hf_blockwise.loading import REALISTIC_MODEL, build_drafter, load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class SamplingSpeedArguments:
    model: str = field(default=REALISTIC_MODEL, metadata={"help": "model directory with a feature-drafter/"})
    source_file: str = field(
        default="../shared/data/multi30k/test_2016_flickr.en.gz", metadata={"help": "one source per line"}
    )
    sentences: int = field(default=30, metadata={"help": "first N sources"})
    repeats: int = field(default=3, metadata={"help": "runs per sentence and mode (the median is kept)"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature"})
    top_p: float = field(default=0.9, metadata={"help": "nucleus sampling's top-p"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})
    compiled: bool = field(default=False, metadata={"help": "the loop's modes through the compiled engine"})
    batch_size: int = field(default=1, metadata={"help": "sentences per generate call (padded)"})


def main() -> None:
    args = parse_dataclass_args(SamplingSpeedArguments, None, __doc__.split("\n", 1)[0])
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    base, drafter = loaded.base, build_drafter("feature", loaded)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    loop = {"custom_generate": blockwise_generate, "blockwise_compile": args.compiled}
    modes = {"transformers": {}, "loop": loop, "loop + feature drafter": {**loop, "assistant": drafter}}
    warm_up = loaded.tokenizer(["A warm-up."] * args.batch_size, return_tensors="pt")  # the batch's graphs
    for extra in modes.values():  # compiled once, before the timed runs
        with torch.inference_mode():
            base.generate(**warm_up, **sampling, **extra)
    seconds = dict.fromkeys(modes, 0.0)
    tokens, calls, same = 0, 0, 0
    sources = read_lines(args.source_file)[: args.sentences]
    batches = [sources[start : start + args.batch_size] for start in range(0, len(sources), args.batch_size)]
    for index, rows in enumerate(batches):
        batch = dict(loaded.tokenizer(rows, return_tensors="pt", padding=True))
        outputs = {}
        for name, extra in modes.items():
            times = []
            for _ in range(args.repeats):
                torch.manual_seed(index)
                started = time.perf_counter()
                with torch.inference_mode():
                    outputs[name] = base.generate(**batch, **sampling, **extra, return_dict_in_generate=True)
                times.append(time.perf_counter() - started)
            seconds[name] += statistics.median(times)
        undrafted, drafted = outputs["loop"].sequences, outputs["loop + feature drafter"].sequences
        same += int((undrafted == drafted).all(dim=1).sum())
        accepted = outputs["loop + feature drafter"].decoding_stats.accepted
        tokens, calls = tokens + int(accepted.sum()), calls + int((accepted > 0).sum())
    engine = "the compiled engine" if args.compiled else "eager"
    print(f"{args.model}, {len(sources)} sentences, batch {args.batch_size}, {args.threads} threads, {sampling}, "
          f"loop {engine}")  # fmt: skip
    for name, total in seconds.items():
        print(f"{name:24} {total:7.2f} s  {seconds['transformers'] / total:5.2f}x transformers' sampling")
    print(f"feature drafter: {tokens / calls:.2f} tokens per row and decoder call; drafted = undrafted on "
          f"{same}/{len(sources)}")  # fmt: skip


if __name__ == "__main__":
    main()

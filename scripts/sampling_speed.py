"""Sampling through the loop against transformers' own sampling (CHANGELOG, "Sampling through the loop").

Per sentence at batch 1, the median of `--repeats` runs of: transformers' sampling (`do_sample=True`), the loop's
sampling without drafts, and with the model's feature drafter (eager, or `--compiled` through the compiled engine,
compiled before the timed runs), all with the same temperature and top-p;
prints the summed times, the ratios to transformers' sampling, tokens per decoder call, and whether the drafted
output equals the undrafted one under the same seed on every sentence::

    python scripts/sampling_speed.py --sentences 30 --threads 2 [--compiled]
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


def main() -> None:
    args = parse_dataclass_args(SamplingSpeedArguments, None, __doc__.split("\n", 1)[0])
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    base, drafter = loaded.base, build_drafter("feature", loaded)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    loop = {"custom_generate": blockwise_generate, "blockwise_compile": args.compiled}
    modes = {"transformers": {}, "loop": loop, "loop + feature drafter": {**loop, "assistant": drafter}}
    for extra in modes.values():  # compiled once, before the timed runs
        with torch.inference_mode():
            base.generate(**loaded.tokenizer(["A warm-up."], return_tensors="pt"), **sampling, **extra)
    seconds = dict.fromkeys(modes, 0.0)
    tokens, calls, same = 0, 0, 0
    for index, source in enumerate(read_lines(args.source_file)[: args.sentences]):
        batch = dict(loaded.tokenizer([source], return_tensors="pt"))
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
        same += torch.equal(outputs["loop"].sequences, outputs["loop + feature drafter"].sequences)
        accepted = outputs["loop + feature drafter"].decoding_stats.accepted
        tokens, calls = tokens + int(accepted.sum()), calls + int((accepted > 0).sum())
    engine = "the compiled engine" if args.compiled else "eager"
    print(f"{args.model}, {args.sentences} sentences, batch 1, {args.threads} threads, {sampling}, loop {engine}")
    for name, total in seconds.items():
        print(f"{name:24} {total:7.2f} s  {seconds['transformers'] / total:5.2f}x transformers' sampling")
    print(f"feature drafter: {tokens / calls:.2f} tokens per decoder call; drafted = undrafted on {same}/{index + 1}")


if __name__ == "__main__":
    main()

"""Peak resident memory of each bench mode, each in a fresh process: the model loaded, the mode compiled (compiled
graphs hold their own copy of the frozen weights) and a few sentences decoded.

    python scripts/peak_memory.py --model hf_blockwise/pretrained/marian-base-en-de \
        --source-file ../shared/data/multi30k/test_2016_flickr.en.gz --modes greedy greedy_compiled \
        greedy_int8_compiled feature_compiled feature_int8_compiled ct2 ct2_int8

Prints a markdown table: mode, peak resident set size (MiB) of the whole process. `greedy` is the float model
alone; the int8 modes hold the float model and its int8 copy (the bench quantizes a copy); `ct2*` also hold the
float model, greedy's run and the converted CTranslate2 model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# the child: one bench run of one mode over a few sentences, then its own peak RSS (KiB on Linux); each child
# reports its own (RUSAGE_CHILDREN in the parent would keep the largest so far)
_CHILD = """
import resource, sys, torch
from transformers.utils import logging
from hf_blockwise.loading import load_model
from hf_blockwise.text_files import read_lines
from hf_blockwise.tools.bench import BenchSetup, run_bench
logging.set_verbosity_error()
model, source_file, mode, sentences, threads = sys.argv[1:6]
torch.set_num_threads(int(threads))
loaded = load_model(model)
sources = read_lines(source_file)[: int(sentences)]
run_bench(BenchSetup(loaded, 128, ct2_threads=int(threads)), sources, None, [mode], [1], progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_mib(model: str, source_file: str, mode: str, sentences: int, threads: int) -> float:
    """Peak RSS in MiB of a fresh process that runs `mode` (and the greedy reference it needs)."""
    command = [sys.executable, "-c", _CHILD, model, source_file, mode, str(sentences), str(threads)]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{finished.stderr[-2000:]}")
    return int(finished.stdout.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--source-file", required=True)
    parser.add_argument("--modes", nargs="+", required=True)
    parser.add_argument("--sentences", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"peak resident memory per mode (fresh process each; {args.sentences} sentences, batch 1)")
    print("| mode | peak RSS (MiB) |")
    print("|---|---|")
    for mode in args.modes:
        print(f"| {mode} | {peak_mib(args.model, args.source_file, mode, args.sentences, args.threads):.0f} |")


if __name__ == "__main__":
    main()

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
import os
import subprocess
import tempfile

from script_common import bench_command


def peak_mib(model: str, source_file: str, mode: str, sentences: int, threads: int) -> float:
    """Peak RSS in MiB of a fresh `hf-blockwise bench` process that runs `mode` (and the greedy reference it needs)
    over the first `sentences` sources at batch 1. The child's own peak (`os.wait4`): `RUSAGE_CHILDREN` would
    keep the largest of all children so far."""
    arguments = ["--model", model, "--source-file", source_file, "--sentences", str(sentences), "--modes", mode]
    arguments += ["--batch-sizes", "1", "--threads", str(threads), "--max-new-tokens", "128"]
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryFile() as errors:  # a file: a pipe could fill up
        child = subprocess.Popen(bench_command(arguments, out), stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            errors.seek(0)
            raise SystemExit(f"mode {mode} failed:\n{errors.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024  # KiB on Linux


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

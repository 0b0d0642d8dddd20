"""A Ray Data run against `hf-blockwise generate` on the same lines: byte for byte, and the wall time of each.

For each `--batch-sizes` value B: `generate_corpus` (what `hf-blockwise generate --batch-size B` runs, `--threads`
torch threads) writes a text output; then `ray.data.read_text(input).limit(lines).map_batches(CorpusPredictor, ...)`
over a local Ray cluster of `--actors` actors (one CPU and one torch thread each, Ray batches of `--ray-batch-size`
rows) gives the rows, joined as that output's lines. Reports whether the two are equal byte for byte, how many lines
are equal, and the seconds each took (Ray's with its start and the actors' loading). From the repository root:

    python scripts/ray_corpus_check.py --model hf_blockwise/pretrained/marian-base-en-de \\
        --input ../shared/data/multi30k/test_2016_flickr.en.gz --lines 1000 --batch-sizes 1 16 \\
        --out docs/bench/ray-corpus-multi30k
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import ray
import ray.data
import torch

from hf_blockwise import CorpusPredictor, generate_corpus
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.text_files import read_lines


def cpu_description() -> str:
    """The CPU's name, family and model from /proc/cpuinfo (Linux), else what `platform` says."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def ray_outputs(args: argparse.Namespace, sources: list[str], batch_size: int) -> tuple[list[str | None], float]:
    """The `output` column of a Ray Data run over `sources` in input order, and its wall time."""
    started = time.perf_counter()
    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False)
    try:
        dataset = ray.data.from_items([{"index": i, "text": text} for i, text in enumerate(sources)])
        settings = {"model": args.model, "batch_size": batch_size, "compile": args.compile, "threads": 1}
        rows = dataset.map_batches(
            CorpusPredictor, fn_constructor_kwargs=settings, batch_size=args.ray_batch_size,
            compute=ray.data.ActorPoolStrategy(size=args.actors), num_cpus=1,
        ).take_all()  # fmt: skip
    finally:
        ray.shutdown()
    rows.sort(key=lambda row: row["index"])
    return [row["output"] for row in rows], time.perf_counter() - started


def check(args: argparse.Namespace, sources: list[str], batch_size: int, work: Path) -> dict:
    output = work / f"generate-b{batch_size}.txt"
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    report = generate_corpus(args.model, sources, output, batch_size=batch_size, compile=args.compile, progress=False)
    generate_seconds = time.perf_counter() - started
    outputs, ray_seconds = ray_outputs(args, sources, batch_size)
    written = output.read_bytes()
    lines = written.decode("utf-8").splitlines()
    return {
        "batch_size": batch_size,
        "drafter": report.drafter,
        "lines": len(sources),
        "equal_bytes": "".join(f"{text or ''}\n" for text in outputs).encode("utf-8") == written,
        "equal_lines": sum(a == (b or "") for a, b in zip(lines, outputs, strict=True)),
        "generate_seconds": round(generate_seconds, 1),
        "ray_seconds": round(ray_seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--ray-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the generate_corpus run")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sources = read_lines(args.input)[: args.lines]
    with tempfile.TemporaryDirectory() as work:
        rows = [check(args, sources, batch_size, Path(work)) for batch_size in args.batch_sizes]
    header = (
        f"{args.model}, the first {len(sources)} lines of {args.input}; generate_corpus with {args.threads} threads, "
        f"Ray Data with {args.actors} actors of 1 CPU and 1 thread, Ray batches of {args.ray_batch_size} rows"
        f"{', compiled engine' if args.compile else ''}; {cpu_description()}"
    )
    table = [
        "| batch size | drafter | lines | equal byte for byte | equal lines | generate (s) | Ray Data (s) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {row['batch_size']} | {row['drafter']} | {row['lines']} | {'yes' if row['equal_bytes'] else 'no'} "
            f"| {row['equal_lines']} | {row['generate_seconds']} | {row['ray_seconds']} |"
            for row in rows
        ),
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", header + "\n\n" + "\n".join(table) + "\n")
    atomic_write_text(out / "report.json", json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")
    print(header, *table, sep="\n")


if __name__ == "__main__":
    main()

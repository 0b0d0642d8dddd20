"""Corpus throughput: `hf-blockwise generate` (sorted batches, a drafter) against a naive unsorted greedy loop.

For each batch size B, in one process on the same sentences: transformers' greedy `generate` over consecutive
batches of B (the loop a user writes: no sorting, finished rows stay in the batch), then `generate_corpus` with each
`--drafters` value over sorted batches of B, and with `--max-batch-tokens` (rows up to the largest batch size). Reports
sentences/s and tokens/s (output tokens by the tokenizer, the same count for every configuration), the ratio to the
naive loop at the same B, tokens per decoder call, and how many lines equal the naive loop's. One timed run per
configuration; with `--compile` every engine and drafter block is compiled on a few lines before timing.

    python scripts/corpus_bench.py --model hf_blockwise/pretrained/multi30k-en-de \\
        --input ../shared/data/europarl_de_en/validation.en --lines 400 --out docs/bench/corpus-europarl
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise.corpus.job import CorpusOptions, make_job, run_job
from hf_blockwise.loading import load_model
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.text_files import read_lines


def naive_loop(setup, texts: list[str], batch_size: int, max_new_tokens: int) -> list[str]:
    """Greedy `generate` over consecutive, unsorted batches: what a user writes around transformers."""
    outputs = []
    for start in range(0, len(texts), batch_size):
        batch = setup.tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
        sequences = setup.base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
        outputs += setup.tokenizer.batch_decode(sequences, skip_special_tokens=True)
    return outputs


def corpus_job(setup, model: str, texts: list[str], options: CorpusOptions, folder: Path):
    """`generate_corpus`'s job over the loaded models; returns (seconds, output lines, report)."""
    output = folder / "out.txt"
    job = make_job(setup, model, texts, "bench", output, options)
    started = time.perf_counter()
    report = run_job(job, overwrite=True, progress=False)
    seconds = time.perf_counter() - started
    return seconds, output.read_text(encoding="utf-8").splitlines(), report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True, help="one source per line")
    parser.add_argument("--lines", type=int, default=400, help="the first N lines")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--drafters", nargs="+", default=["none", "auto"])
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="also a token-budget run (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="verify through the compiled engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def measure_rows(args: argparse.Namespace, setup, texts: list[str], folder: Path) -> list[dict]:
    """One row per configuration: the naive loop at each batch size, then each drafter's corpus job beside it."""
    count = lambda lines: sum(len(setup.tokenizer(line, add_special_tokens=False).input_ids) for line in lines)  # noqa: E731
    generate_kwargs = {"max_new_tokens": args.max_new_tokens}
    if args.compile:  # compile the engine (batch classes 1 and > 1) and the drafters' blocks before timing
        for drafter in args.drafters:
            for batch_size in (1, 4):
                options = CorpusOptions(drafter, batch_size, generate_kwargs=generate_kwargs, compile=True)
                corpus_job(setup, args.model, texts[:8], options, folder)
    runs = [(batch_size, None) for batch_size in args.batch_sizes]
    if args.max_batch_tokens:
        runs.append((max(args.batch_sizes), args.max_batch_tokens))
    rows, naive = [], {}
    for batch_size, budget in runs:
        if batch_size not in naive:
            started = time.perf_counter()
            lines = naive_loop(setup, texts, batch_size, args.max_new_tokens)
            naive[batch_size] = (time.perf_counter() - started, lines)
            rows.append({
                "configuration": "naive greedy generate, unsorted", "batch": batch_size, "budget": None,
                "seconds": naive[batch_size][0], "sentences_per_s": len(texts) / naive[batch_size][0],
                "tokens_per_s": count(lines) / naive[batch_size][0], "ratio": 1.0, "tokens_per_call": 1.0,
                "identical": len(texts),
            })  # fmt: skip
            print(rows[-1], flush=True)
        base_seconds, base_lines = naive[batch_size]
        for drafter in args.drafters:
            options = CorpusOptions(drafter, batch_size, budget, generate_kwargs=generate_kwargs, compile=args.compile)
            seconds, lines, report = corpus_job(setup, args.model, texts, options, folder)
            rows.append({
                "configuration": f"generate --drafter {drafter} ({report.drafter}), sorted"
                + (", compiled" if args.compile else ""),
                "batch": batch_size, "budget": budget, "seconds": seconds,
                "sentences_per_s": len(texts) / seconds, "tokens_per_s": count(lines) / seconds,
                "ratio": base_seconds / seconds, "tokens_per_call": report.tokens_per_call,
                "identical": sum(a == b for a, b in zip(lines, base_lines, strict=True)),
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def write_reports(args: argparse.Namespace, texts: list[str], rows: list[dict]) -> None:
    """`corpus.json` and the markdown table `corpus.md` in `--out`."""
    out = Path(args.out)
    settings = {
        "model": args.model, "input": args.input, "lines": len(texts), "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(), "compile": args.compile, "torch": torch.__version__,
    }  # fmt: skip
    atomic_write_text(out / "corpus.json", json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    table = [
        f"Corpus throughput: {len(texts)} lines of `{args.input}`, model `{args.model}`, "
        f"{settings['threads']} threads, max_new_tokens {args.max_new_tokens}, one run per row "
        "(`scripts/corpus_bench.py`).",
        "",
        "| configuration | batch | token budget | sentences/s | tokens/s | vs naive at same batch | tokens per call | "
        "identical to naive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        table.append(
            f"| {row['configuration']} | {row['batch']} | {row['budget'] or '-'} | {row['sentences_per_s']:.2f} | "
            f"{row['tokens_per_s']:.0f} | {row['ratio']:.2f}x | {row['tokens_per_call']:.2f} | "
            f"{row['identical']}/{len(texts)} |"
        )
    atomic_write_text(out / "corpus.md", "\n".join(table) + "\n")
    print("\n".join(table))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    texts = read_lines(args.input)[: args.lines]
    setup = load_model(args.model)
    folder = Path(tempfile.mkdtemp(prefix="corpus-bench-"))
    try:
        rows = measure_rows(args, setup, texts, folder)
    finally:
        shutil.rmtree(folder)
    write_reports(args, texts, rows)


if __name__ == "__main__":
    main()

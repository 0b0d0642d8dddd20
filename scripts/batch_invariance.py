"""Whether a line's output depends on the batch it is decoded in: `marian-base-en-de` in int8 through the compiled
engine (each generate's first call compiled too, as the corpus job runs it), greedy, the first `--lines` sources
decoded one at a time against consecutive batches of `--batch-size`, with the encoder run on the padded batch (as
`generate` runs it) and with each row encoded alone (`encoder_outputs_by_row`, what `hf-blockwise generate --int8
--compile` does); then `generate_corpus` itself at batch size 1 and `--batch-size`, and what encoding the rows alone
costs: the encoder's time per batch both ways (medians of 5) against the time `generate_corpus` took per batch. From
the repository root:

    python scripts/batch_invariance.py --input ../shared/data/europarl_de_en/validation.en --lines 96 \\
        --out docs/bench/batch-invariance-int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_blockwise import CompileOptions, blockwise_generate, generate_corpus
from hf_blockwise.corpus.decoding import encoder_outputs_by_row
from hf_blockwise.loading import load_model
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.text_files import read_lines

MODEL = "hf_blockwise/pretrained/marian-base-en-de"


def decoded(loaded, texts: list[str], by_row: bool) -> list[list[int]]:
    """Greedy token ids of `texts` decoded as one batch (pad tokens dropped)."""
    batch = loaded.tokenizer(texts, return_tensors="pt", padding=True)
    extra = {}
    if by_row and len(texts) > 1:
        extra["encoder_outputs"] = encoder_outputs_by_row(loaded.base, batch["input_ids"], batch["attention_mask"])
    sequences = loaded.base.generate(
        **batch, **extra, custom_generate=blockwise_generate, num_beams=1,
        blockwise_compile=CompileOptions(compiled_prefill=True),
    )  # fmt: skip
    pad = loaded.tokenizer.pad_token_id
    return [row[row != pad].tolist() for row in sequences]


def encoder_ms(loaded, batches: list[list[str]], by_row: bool) -> float:
    """Milliseconds per batch the encoder takes over `batches`, padded or row by row (median of 5 passes)."""
    encoder, passes = loaded.base.get_encoder(), []
    for _ in range(5):
        started = time.perf_counter()
        for texts in batches:
            batch = loaded.tokenizer(texts, return_tensors="pt", padding=True)
            if by_row:
                encoder_outputs_by_row(loaded.base, batch["input_ids"], batch["attention_mask"])
            else:
                encoder(**batch)
        passes.append((time.perf_counter() - started) / len(batches))
    return 1000 * statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--lines", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources = read_lines(args.input)[: args.lines]
    loaded = load_model(MODEL, int8=True)
    size = args.batch_size
    with torch.inference_mode():
        alone = [decoded(loaded, [text], by_row=False)[0] for text in sources]
        rows = {}
        for by_row in (False, True):
            batched = [
                ids for i in range(0, len(sources), size) for ids in decoded(loaded, sources[i : i + size], by_row)
            ]
            rows["each row encoded alone" if by_row else "the padded batch encoded"] = sum(
                a == b for a, b in zip(alone, batched, strict=True)
            )
        batches = [sources[i : i + size] for i in range(0, len(sources), size)]
        padded_ms, by_row_ms = encoder_ms(loaded, batches, by_row=False), encoder_ms(loaded, batches, by_row=True)
    with tempfile.TemporaryDirectory() as work:
        outputs, seconds = {}, {}
        for run, batch_size in enumerate((1, size, size)):  # the loaded model's engine: the last run compiles nothing
            output = Path(work) / f"run{run}.txt"
            started = time.perf_counter()
            generate_corpus(loaded, sources, output, batch_size=batch_size, int8=True, compile=True, progress=False)
            seconds[batch_size] = time.perf_counter() - started
            outputs[batch_size] = output.read_text(encoding="utf-8").splitlines()
    rows[f"generate_corpus(int8=True, compile=True), batch {size} against 1"] = sum(
        a == b for a, b in zip(outputs[1], outputs[size], strict=True)
    )
    lines = [
        f"{MODEL} in int8, compiled engine (first call compiled too), greedy, {args.threads} threads; the first "
        f"{len(sources)} lines of {args.input}: lines decoded at batch {size} as at batch 1",
        "",
        "| encoder | identical lines |",
        "|---|---|",
        *(f"| {name} | {count} / {len(sources)} |" for name, count in rows.items()),
        "",
        f"The encoder per batch of {size}: {padded_ms:.1f} ms on the padded batch, {by_row_ms:.1f} ms row by row; "
        f"generate_corpus at batch {size} took {1000 * seconds[size] / len(batches):.0f} ms per batch (compiled).",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    timing = {"encoder_ms_padded": padded_ms, "encoder_ms_by_row": by_row_ms, "generate_corpus_seconds": seconds}
    report = {"settings": vars(args), "identical": rows, **timing}
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    print(*lines, sep="\n")


if __name__ == "__main__":
    main()

"""Stern et al.'s Table 1 on Multi30k: BLEU / mean accepted block per block size k and training setting.

Settings (Stern §6–7.1):

- ``regular``: heads trained on the gold references, base frozen (lossless);
- ``distilled``: heads trained on the base's own greedy outputs (sequence-level distillation), base frozen;
- ``fine-tuned``: heads and base trained together on the references (the base changes: output = *its* greedy);
- ``both``: heads and base trained together on the distilled outputs.

To fit a 2-core CPU, each setting trains **one** model with k = 10 (nine heads) and every smaller k decodes
with the first k − 1 of those heads (``HeadsDrafter(model, block_size=k)``), instead of Stern's separate
model per k. Heads get ``--head-hidden-size`` (192) units each (k = 10 then fits the 25 MB package limit).
For each setting and k, on the first
``--eval-sentences`` sentences of test_2016_flickr at batch 1, greedy and blockwise decoding run back to back
(``hf_blockwise.evaluation.compare_to_greedy``): BLEU, mean accepted block, identical outputs and the
wall-clock ratio to that setting's own greedy ``generate``.

Exact command (from the repository root, after ``training/train_base.py`` and ``training/train_heads.py``,
whose distillation cache it reuses)::

    python training/sweep_table1.py --base checkpoints/base-multi30k --out checkpoints/table1 \\
        --distilled-cache checkpoints/heads-k4/distilled-beam1.jsonl --docs docs/table1.md

Wall time on a 2-core CPU (2 threads): see ``docs/table1.md`` (each setting's training time is recorded in
``<out>/<setting>/sweep_result.json``). Re-running resumes: finished settings are read back from their
``sweep_result.json``, interrupted trainings restart from their last checkpoint. ``--reevaluate`` decodes and
times every setting again from its saved model, without training: timings are only meaningful on an otherwise
idle machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from hf_blockwise import BlockwiseHeadsModel
from hf_blockwise.evaluation import compare_to_greedy
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.training.arguments import parse_dataclass_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_heads
from data import MULTI30K_DIR, load_multi30k
from recipe_common import atomic_write_json

SETTINGS = {
    "regular": ("gold", "frozen"),
    "distilled": ("distilled", "frozen"),
    "fine-tuned": ("gold", "full"),
    "both": ("distilled", "full"),
}
BLOCK_SIZES = (2, 4, 6, 8, 10)


@dataclass
class SweepTable1Arguments:
    """Command-line flags of the sweep; each field is ``--field-name`` (or ``--field_name``)."""

    base: str = field(default="checkpoints/base-multi30k", metadata={"help": "base checkpoint directory"})
    dataset: str = field(default=str(MULTI30K_DIR), metadata={"help": "Multi30k folder or hub name"})
    out: str = field(default="checkpoints/table1", metadata={"help": "output directory, one folder per setting"})
    distilled_cache: str = field(
        default="checkpoints/heads-k4/distilled-beam1.jsonl",
        metadata={"help": "JSON-lines cache of the base's greedy outputs (written by train_heads.py)"},
    )
    settings: list[str] = field(
        default_factory=lambda: list(SETTINGS),
        metadata={"choices": list(SETTINGS), "help": "training settings to run, in this order"},
    )
    block_sizes: list[int] = field(
        default_factory=lambda: list(BLOCK_SIZES),
        metadata={"help": "block sizes k to decode with; one model with the largest k is trained per setting"},
    )
    head_hidden_size: int = field(default=192, metadata={"help": "hidden width per head"})
    train_sentences: int | None = field(default=None, metadata={"help": "use only the first N (smoke tests)"})
    epochs: float = field(default=1.0, metadata={"help": "training epochs per setting"})
    eval_sentences: int = field(default=300, metadata={"help": "test_2016_flickr sentences decoded per setting and k"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    docs: str = field(default="docs/table1.md", metadata={"help": "Markdown table to (re)write"})
    reevaluate: bool = field(
        default=False,
        metadata={
            "help": "decode and time again with each setting's saved final model (e.g. on a quiet machine); no training"
        },
    )


def parse_args(argv: Sequence[str] | None = None) -> SweepTable1Arguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `SweepTable1Arguments`."""
    return parse_dataclass_args(SweepTable1Arguments, argv, __doc__.split("\n", 1)[0])


def train_setting(args: SweepTable1Arguments, setting: str) -> tuple[BlockwiseHeadsModel, object, dict, float]:
    targets, base_training = SETTINGS[setting]
    out = os.path.join(args.out, setting)
    heads_args = train_heads.parse_args(
        [
            "--base", args.base, "--dataset", args.dataset, "--out", out,
            "--block-size", str(max(args.block_sizes)), "--head-hidden-size", str(args.head_hidden_size),
            "--targets", targets, "--base-training", base_training, "--distilled-cache", args.distilled_cache,
            *(["--train-sentences", str(args.train_sentences)] if args.train_sentences else []),
            "--epochs", str(args.epochs),
            "--threads", str(args.threads), "--warmup-steps", "30",
            "--lr", "1e-3" if base_training == "frozen" else "5e-4",
        ]
    )  # fmt: skip
    started = time.time()
    model, tokenizer, data = train_heads.train(heads_args)
    return model, tokenizer, data, time.time() - started


def evaluate_setting(args: SweepTable1Arguments, model: BlockwiseHeadsModel, tokenizer, data) -> dict[int, dict]:
    sources, references = (split[: args.eval_sentences] for split in data["test"])
    results = {}
    for block_size in args.block_sizes:
        comparison = compare_to_greedy(
            model, tokenizer, sources, references, assistant=model.drafter(block_size), batch_size=1
        )
        results[block_size] = comparison.summary()
        print(f"  k={block_size}: {json.dumps(results[block_size])}", flush=True)
    return results


def markdown_table(results: dict[str, dict], base_bleu: float, args: SweepTable1Arguments) -> str:
    block_sizes = sorted({int(k) for result in results.values() for k in result["by_block_size"]})
    header = "| setting | " + " | ".join(f"k={k}" for k in block_sizes) + " |"
    lines = [header, "|---" * (len(block_sizes) + 1) + "|"]
    for setting, result in results.items():
        cells = []
        for k in block_sizes:
            row = result["by_block_size"].get(str(k)) or result["by_block_size"].get(k)
            cells.append(f"{row['blockwise_bleu']:.2f} / {row['mean_accepted']:.2f} / {row['speedup']:.2f}x")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    identical = {
        setting: min(row["identical"] for row in result["by_block_size"].values())
        for setting, result in results.items()
    }
    train_minutes = {setting: result["train_seconds"] / 60 for setting, result in results.items()}
    return "\n".join(
        [
            "# Table 1 on Multi30k en→de (Stern et al. 2018, §7.1 shape)",
            "",
            "Each cell: **BLEU / mean accepted block / wall-clock speedup** over the same model's own greedy",
            f"`generate`, measured in the same run on the first {args.eval_sentences} sentences of",
            f"test_2016_flickr, batch 1, CPU, {args.threads} threads (sacreBLEU, cased, detokenized).",
            f"Greedy BLEU of the base model (frozen settings): **{base_bleu:.2f}**.",
            "",
            *lines,
            "",
            "Identical to the setting's own greedy output (worst k): "
            + ", ".join(f"{setting} {count}/{args.eval_sentences}" for setting, count in identical.items())
            + ".",
            "Training time per setting (minutes, 2-core CPU): "
            + ", ".join(f"{setting} {minutes:.1f}" for setting, minutes in train_minutes.items())
            + ".",
            "",
            "How it was made: one model with k = 10 per setting (smaller k use its first k − 1 heads), heads of "
            f"{args.head_hidden_size} hidden units each, {args.epochs:g} epoch(s) on "
            f"{'the first ' + str(args.train_sentences) if args.train_sentences else 'all 29,000'} "
            "training pairs; distilled targets are the base's greedy outputs. In the fine-tuned settings the base "
            "itself is trained too, so their BLEU is that of the changed model (exact with respect to it).",
            "",
            "Regenerate:",
            "",
            "```",
            f"python training/sweep_table1.py --base {args.base} --out {args.out} \\",
            f"    --distilled-cache {args.distilled_cache} --settings {' '.join(args.settings)} \\",
            f"    --epochs {args.epochs:g} --eval-sentences {args.eval_sentences} "
            + (f"--train-sentences {args.train_sentences} " if args.train_sentences else "")
            + f"--docs {args.docs}",
            "```",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()  # one length warning per generate call would drown the log
    results: dict[str, dict] = {}
    for setting in args.settings:
        result_path = os.path.join(args.out, setting, "sweep_result.json")
        previous = None
        if os.path.isfile(result_path):
            with open(result_path) as file:
                previous = json.load(file)
            if not args.reevaluate:
                results[setting] = previous
                continue
        print(f"== {setting}", flush=True)
        if args.reevaluate and previous is not None:
            model = BlockwiseHeadsModel.from_pretrained(os.path.join(args.out, setting, "final")).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.base)
            data, seconds = load_multi30k(args.dataset), previous["train_seconds"]
        else:
            model, tokenizer, data, seconds = train_setting(args, setting)
        by_block_size = evaluate_setting(args, model, tokenizer, data)
        results[setting] = {"train_seconds": seconds, "by_block_size": by_block_size}
        atomic_write_json(result_path, results[setting])
    frozen = [r for s, r in results.items() if SETTINGS[s][1] == "frozen"]
    base_bleu = next(iter(frozen[0]["by_block_size"].values()))["greedy_bleu"] if frozen else float("nan")
    atomic_write_text(args.docs, markdown_table(results, base_bleu, args))
    print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()

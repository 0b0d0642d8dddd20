"""Self-distillation data for drafters: a frozen base's own greedy outputs over every source-language text here.

A drafter of an exact decoder must predict the *base's* greedy continuation, on the prefixes that greedy decoding
actually produces. So its training targets are the base's own greedy outputs (Medusa-2, EAGLE), and its
inputs are not limited to the task's training pairs: every English text in ``../shared/data`` is a source
(for an English-input base), capped per corpus so that the whole run fits in minutes.

Writes into ``--out``:

- ``sources.txt``: the selected sources, one per line, in a fixed order (the cache is keyed by line number);
- ``distilled.jsonl``: the base's greedy output per source (``hf_blockwise.training.distill``: appended after
  every batch, resumable; an interrupted run continues where it stopped).

Exact commands (from the repository root) and wall times on the 2-core CPU, 2 threads::

    python training/distill_sources.py --base hf_blockwise/pretrained/multi30k-en-de \
        --out checkpoints/distill-multi30k-en-de
    python training/distill_sources.py --base hf_blockwise/pretrained/gec-en --out checkpoints/distill-gec-en-v2 \
        --corpora gec_wi_src:12000 gec_fce_src:4000 multi30k_en:4000 europarl_en:4000 bible_en:2000 \
        dialogsum_summary:2000
    python training/distill_sources.py --base hf_blockwise/pretrained/marian-base-en-de \
        --out checkpoints/distill-marian-base --corpora multi30k_en:16000 europarl_en:8000

Wall times are in ``training/README.md``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.training.arguments import parse_dataclass_args
from hf_blockwise.training.distill import distill_texts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import CORPORA, DATA_ROOT, DISTILLED_NAME, SOURCES_NAME, read_texts


@dataclass
class DistillSourcesArguments:
    """Command-line flags; each field is ``--field-name`` (or ``--field_name``)."""

    base: str = field(metadata={"help": "the frozen base whose greedy outputs are the targets"})
    out: str = field(metadata={"help": "folder for sources.txt and distilled.jsonl (resumable)"})
    data_dir: str = field(default=str(DATA_ROOT), metadata={"help": "the shared data folder"})
    corpora: list[str] = field(
        default_factory=lambda: ["multi30k_en:all", "europarl_en", "gec_wi_tgt", "bible_en", "dialogsum_summary"],
        metadata={
            "help": "which texts, in this order, each optionally NAME:CAP (a number or 'all'); known: "
            f"{sorted(CORPORA)}"
        },
    )
    max_per_corpus: int = field(default=6000, metadata={"help": "cap of corpora named without one"})
    max_words: int = field(default=40, metadata={"help": "skip longer texts (paragraphs)"})
    batch_size: int = field(default=64, metadata={"help": "greedy decoding batch size"})
    max_new_tokens: int = field(default=96, metadata={"help": "length limit of the greedy outputs"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})

    def __post_init__(self) -> None:
        unknown = [entry for entry in self.corpora if entry.split(":")[0] not in CORPORA]
        if unknown:
            raise ValueError(f"unknown corpora {unknown}; known: {sorted(CORPORA)}")
        for entry in self.corpora:
            cap = entry.partition(":")[2]
            if cap and cap != "all" and not cap.isdigit():
                raise ValueError(f"corpus cap must be a number or 'all', got {entry!r}")

    def caps(self) -> list[tuple[str, int | None]]:
        """(corpus, most texts taken from it or `None` for all) in order."""
        result = []
        for entry in self.corpora:
            name, _, cap = entry.partition(":")
            result.append((name, None if cap == "all" else int(cap) if cap else self.max_per_corpus))
        return result


def select_sources(args: DistillSourcesArguments) -> list[str]:
    """The sources, deduplicated, in corpus order, each corpus capped as `args.caps()` says."""
    seen: set[str] = set()
    sources: list[str] = []
    for name, cap in args.caps():
        relative, kind = CORPORA[name]
        taken = 0
        for text in read_texts(Path(args.data_dir) / relative, kind):
            if cap is not None and taken >= cap:
                break
            if len(text.split()) > args.max_words or text in seen:
                continue
            seen.add(text)
            sources.append(text)
            taken += 1
        print(f"{name}: {taken} texts")
    return sources


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(DistillSourcesArguments, argv, __doc__.split("\n", 1)[0])
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    sources_path = Path(args.out) / SOURCES_NAME
    sources = select_sources(args)
    if sources_path.is_file() and sources_path.read_text(encoding="utf-8") != "\n".join(sources) + "\n":
        raise ValueError(f"{sources_path} holds other sources (other flags?); use another --out")
    atomic_write_text(sources_path, "\n".join(sources) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.base, dtype=torch.float32)
    start = time.perf_counter()
    distill_texts(
        base, tokenizer, sources, str(Path(args.out) / DISTILLED_NAME), batch_size=args.batch_size, num_beams=1,
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    print(f"{len(sources)} sources distilled into {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

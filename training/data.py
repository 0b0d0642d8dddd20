"""The recipes' data: where they are and how they are read.

- the shared data folder (``../shared/data`` beside the repository, never copied into it) and its corpora of
  English text (`CORPORA`, `read_texts`);
- the parallel sets: Multi30k en→de (`load_multi30k`) and learner English → corrected English (`load_gec`,
  `gec_dev_sets`), with synthetic learner errors added on clean English (`add_synthetic_errors`);
- the self-distillation data written by ``distill_sources.py`` (`load_distilled`);
- sentence pairs tokenized into a `datasets.Dataset` for the `Trainer`-based recipes (`encode_dataset`).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from datasets import Dataset, load_dataset
from transformers import PreTrainedTokenizerBase

from hf_blockwise.text_files import open_text, read_lines

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_errors import synthetic_pairs

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO_ROOT.parent / "shared" / "data"
MULTI30K_DIR = DATA_ROOT / "multi30k"
EUROPARL_DIR = DATA_ROOT / "europarl_de_en"
GEC_MAX_WORDS = 60  # FCE lines are paragraphs; longer pairs would be truncated on both sides out of alignment

# corpus name -> (file under the data folder, how to read one line into an English text)
CORPORA = {
    "multi30k_en": ("multi30k/train.en.gz", "text"),
    "europarl_en": ("europarl_de_en/train.en.gz", "text"),
    "gec_wi_tgt": ("gec_wi_locness/train.tgt.gz", "text"),
    "gec_wi_src": ("gec_wi_locness/train.src.gz", "text"),
    "gec_fce_tgt": ("gec_fce/train.tgt.gz", "text"),
    "gec_fce_src": ("gec_fce/train.src.gz", "text"),
    "bible_en": ("bible_kjv_asv/train.src.gz", "bible"),
    "dialogsum_summary": ("dialogsum/dialogsum.train.jsonl.gz", "summary"),
}
# what distill_sources.py writes into its --out folder
SOURCES_NAME = "sources.txt"
DISTILLED_NAME = "distilled.jsonl"

# (sources, targets): two aligned lists of sentences
Pairs = tuple[list[str], list[str]]


# ----------------------------------------------------------------------------------------------------------
# Reading lines
# ----------------------------------------------------------------------------------------------------------


def clean_text(line: str) -> str:
    """Collapse runs of whitespace and strip the ends."""
    return " ".join(line.split())


def read_texts(path: Path, kind: str) -> Iterator[str]:
    """One English text per non-empty line of `path` (plain or gzip), as `kind` (see `CORPORA`) says how to read
    it: ``text`` as it is, ``bible`` without its ``<ASV>`` tag, ``summary`` the field of a JSON line."""
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}; see ../shared/data/README.md")
    with open_text(path) as handle:
        for line in handle:
            if kind == "summary":
                text = json.loads(line)["summary"]
            elif kind == "bible":
                text = line.removeprefix("<ASV> ")
            else:
                text = line
            text = clean_text(text)
            if text:
                yield text


# ----------------------------------------------------------------------------------------------------------
# Parallel sets
# ----------------------------------------------------------------------------------------------------------


def _read_local_split(data_dir: Path, prefix: str) -> Pairs:
    """Read one parallel split ``{prefix}.en.gz`` / ``{prefix}.de.gz`` from a local folder."""
    en = read_lines(data_dir / f"{prefix}.en.gz")
    de = read_lines(data_dir / f"{prefix}.de.gz")
    if len(en) != len(de):
        raise ValueError(f"{prefix}: {len(en)} English vs {len(de)} German lines")
    return en, de


def load_multi30k(dataset: str) -> dict[str, Pairs]:
    """Load train / val / test (2016 flickr) as (English, German) sentence lists, from a local folder
    (``train.en.gz``, ``val.de.gz``, ...) or, when `dataset` is no folder, a Hub dataset id such as
    ``bentrevett/multi30k``."""
    data_dir = Path(dataset)
    if data_dir.is_dir():
        return {
            "train": _read_local_split(data_dir, "train"),
            "val": _read_local_split(data_dir, "val"),
            "test": _read_local_split(data_dir, "test_2016_flickr"),
        }
    if data_dir.is_absolute() or dataset.startswith("."):
        raise FileNotFoundError(f"no Multi30k folder at {dataset}; pass --dataset bentrevett/multi30k for the Hub")
    ds = load_dataset(dataset)
    names = {"train": "train", "val": "validation", "test": "test"}
    return {
        key: ([clean_text(s) for s in ds[split]["en"]], [clean_text(s) for s in ds[split]["de"]])
        for key, split in names.items()
    }


def load_europarl_multi30k(data_root: str | Path) -> dict[str, Pairs]:
    """English → German from two domains: Multi30k train plus Europarl train as training pairs (pairs with an
    empty side dropped), Multi30k val as validation, Multi30k test_2016_flickr as test, and Europarl validation
    as ``europarl_val`` (reported beside the test)."""
    root = Path(data_root)
    multi30k = load_multi30k(str(root / "multi30k"))
    europarl_en = read_lines(root / "europarl_de_en" / "train.en.gz")
    europarl_de = read_lines(root / "europarl_de_en" / "train.de.gz")
    if len(europarl_en) != len(europarl_de):
        raise ValueError(f"europarl train: {len(europarl_en)} English vs {len(europarl_de)} German lines")
    kept = [(en, de) for en, de in zip(europarl_en, europarl_de, strict=True) if en and de]
    train_en = multi30k["train"][0] + [en for en, _ in kept]
    train_de = multi30k["train"][1] + [de for _, de in kept]
    europarl_val = (
        read_lines(root / "europarl_de_en" / "validation.en"),
        read_lines(root / "europarl_de_en" / "validation.de"),
    )
    return {
        "train": (train_en, train_de),
        "val": multi30k["val"],
        "test": multi30k["test"],
        "europarl_val": europarl_val,
    }


def load_gec(data_root: str | Path) -> dict[str, Pairs]:
    """Learner English → corrected English: W&I+LOCNESS train + FCE train (pairs of at most
    ``GEC_MAX_WORDS`` words), W&I+LOCNESS dev as validation, JFLEG dev (first reference) as test."""
    root = Path(data_root)
    if not (root / "gec_wi_locness").is_dir():
        raise FileNotFoundError(f"no gec_wi_locness/ under {root}; pass --dataset pointing at ../shared/data")
    sources, targets = [], []
    for folder, suffix in (("gec_wi_locness", ".gz"), ("gec_fce", ".gz")):
        for source, target in zip(
            read_lines(root / folder / f"train.src{suffix}"), read_lines(root / folder / f"train.tgt{suffix}"),
            strict=True,
        ):  # fmt: skip
            if source and target and max(len(source.split()), len(target.split())) <= GEC_MAX_WORDS:
                sources.append(source)
                targets.append(target)
    return {
        "train": (sources, targets),
        "val": (
            read_lines(root / "gec_wi_locness" / "dev.src.gz"),
            read_lines(root / "gec_wi_locness" / "dev.tgt.gz"),
        ),
        "test": (read_lines(root / "jfleg" / "dev.src"), read_lines(root / "jfleg" / "dev.ref0")),
    }


def gec_dev_sets(data_root: str | Path) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The error-correction dev sets whole, each as (sources, references per annotator): JFLEG dev (754
    sentences, four references) and W&I+LOCNESS dev (one reference)."""
    root = Path(data_root)
    return {
        "jfleg_dev_4refs": (
            read_lines(root / "jfleg" / "dev.src"), [read_lines(root / "jfleg" / f"dev.ref{i}") for i in range(4)]
        ),
        "wi_locness_dev": (
            read_lines(root / "gec_wi_locness" / "dev.src.gz"), [read_lines(root / "gec_wi_locness" / "dev.tgt.gz")]
        ),
    }  # fmt: skip


def add_synthetic_errors(data: dict[str, Pairs], data_root: str | Path, corpora: Sequence[str], seed: int) -> None:
    """Append to ``data["train"]`` corrupted → clean pairs made from clean English corpora (``NAME:CAP`` each,
    the first CAP texts of `CORPORA[NAME]`), with the learner-like errors of ``synthetic_errors.py``."""
    sources, targets = data["train"]
    for entry in corpora:
        name, _, cap = entry.partition(":")
        if name not in CORPORA or not cap.isdigit():
            raise ValueError(f"--synthetic entries are NAME:CAP with NAME in {sorted(CORPORA)}, got {entry!r}")
        relative, kind = CORPORA[name]
        texts = list(itertools.islice(read_texts(Path(data_root) / relative, kind), int(cap)))
        noisy, clean = synthetic_pairs(texts, seed=seed)
        changed = sum(a != b for a, b in zip(noisy, clean, strict=True))
        print(f"synthetic errors on {name}: {len(noisy)} pairs, {changed} changed")
        sources, targets = sources + noisy, targets + clean
    data["train"] = (sources, targets)


# ----------------------------------------------------------------------------------------------------------
# Self-distillation data and tokenized pairs
# ----------------------------------------------------------------------------------------------------------


def load_distilled(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(sources, greedy outputs) written by ``distill_sources.py``; raises if that run has not finished."""
    sources_path, cache_path = Path(folder) / SOURCES_NAME, Path(folder) / DISTILLED_NAME
    if not sources_path.is_file():
        raise FileNotFoundError(f"no {SOURCES_NAME} in {folder}: run training/distill_sources.py --out {folder}")
    sources = sources_path.read_text(encoding="utf-8").split("\n")[:-1]
    outputs: dict[int, str] = {}
    if cache_path.is_file():
        with open(cache_path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                outputs[int(record["index"])] = record["text"]
    missing = len(sources) - len(outputs)
    if missing:
        raise ValueError(f"{folder}: {missing} of {len(sources)} sources not distilled yet; re-run distill_sources.py")
    return sources, [outputs[index] for index in range(len(sources))]


def encode_dataset(tokenizer: PreTrainedTokenizerBase, sources: Sequence[str], targets: Sequence[str]) -> Dataset:
    """Tokenize sentence pairs (each side truncated to 128 tokens) into a `Dataset` with the columns
    ``input_ids``, ``attention_mask`` and ``labels`` (lists of token ids, unpadded: the collator pads)."""
    inputs = tokenizer(list(sources), truncation=True, max_length=128)
    labels = tokenizer(text_target=list(targets), truncation=True, max_length=128)
    return Dataset.from_dict(
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels["input_ids"]}
    )

"""Reading a corpus's sources: text files, JSONL fields, data files and 🤗 datasets, with errors naming what is
wrong (a missing column, an empty input, a non-string entry)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import datasets

from hf_blockwise import boundary as hf
from hf_blockwise.text_files import read_text

DATASET_FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".json": "json", ".arrow": "arrow"}


def read_sources(source: str | Sequence[str] | datasets.Dataset, column: str | None, split: str | None) -> list[str]:
    """The source texts, in order.

    Args:
        source: a text file (one source per line, `.gz` allowed), a JSONL file (`.jsonl`, `.jsonl.gz`; needs
            `column`), a data file `datasets` reads (`.csv`, `.tsv`, `.parquet`, `.json`, `.arrow`), a dataset saved
            with `save_to_disk`, a dataset name on the hub, a list of strings, or a `datasets.Dataset`.
        column (`str`, *optional*): the column holding the sources (JSONL and datasets).
        split (`str`, *optional*): the split of a dataset with several.
    """
    if isinstance(source, datasets.Dataset):
        return _dataset_column(source, column, "the dataset")
    if not isinstance(source, str | os.PathLike):
        texts = list(source)
        if column is not None:
            raise ValueError("column= applies to JSONL files and datasets, not to a list of strings")
        return _checked_texts(texts, "the list of sources")
    path = os.fspath(source)
    name = path.removesuffix(".gz")
    if os.path.isfile(path) and name.endswith(".jsonl"):
        return _jsonl_column(path, column)
    if os.path.isfile(path) and os.path.splitext(name)[1] in DATASET_FILE_BUILDERS:
        builder = DATASET_FILE_BUILDERS[os.path.splitext(name)[1]]
        options = {"delimiter": "\t"} if name.endswith(".tsv") else {}
        dataset = datasets.load_dataset(builder, data_files=path, split="train", **options)
        return _dataset_column(dataset, column, path)
    if os.path.isfile(path):
        if column is not None:
            raise ValueError(f"{path} is a text file (one source per line): it has no column {column!r}")
        return _checked_texts(read_text(path).splitlines(), path)
    if os.path.isdir(path) and _is_saved_dataset(path):
        return _dataset_column(_pick_split(datasets.load_from_disk(path), split, path), column, path)
    if os.path.isdir(path):
        raise ValueError(
            f"--input {path} is a directory, but no dataset saved with save_to_disk (it holds no dataset_info.json "
            "or dataset_dict.json): pass one of its files, e.g. --input DIR/sources.txt (for a folder of data "
            "files, pass generate_corpus the dataset that datasets.load_dataset(DIR) reads)"
        )
    if os.path.splitext(name)[1]:  # a file name, not a dataset id
        raise ValueError(f"--input {path}: no such file")
    hf.check_local_path(path, "--input")  # a missing local folder gets a clear error, not the hub's
    if not _HUB_DATASET_ID.fullmatch(path):  # a sentence passed where a file belongs, say: not worth a hub request
        raise ValueError(
            f"--input {path!r} is no file, saved dataset or hub dataset id ('org/name'); to decode a few sources, "
            "pass a list of strings, e.g. generate_corpus(model, ['A dog runs.'], output)"
        )
    return _dataset_column(_pick_split(datasets.load_dataset(path, split=split), split, path), column, path)


# what a dataset id on the hub can be: a name, or an owner and a name (letters, digits, '-', '_', '.')
_HUB_DATASET_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_info.json", "dataset_dict.json"))


def _pick_split(dataset: Any, split: str | None, where: str) -> datasets.Dataset:
    if not isinstance(dataset, datasets.DatasetDict):
        return dataset
    if split is None:
        raise ValueError(f"{where} has splits {sorted(dataset)}: choose one with --split / split=")
    if split not in dataset:
        raise ValueError(f"{where} has no split {split!r}; its splits are {sorted(dataset)}")
    return dataset[split]


def _dataset_column(dataset: datasets.Dataset, column: str | None, where: str) -> list[str]:
    if column is None:
        raise ValueError(
            f"{where} is a table: name the column of sources with --column / column= ({dataset.column_names})"
        )
    if column not in dataset.column_names:
        raise ValueError(f"{where} has no column {column!r}; its columns are {dataset.column_names}")
    return _checked_texts(dataset[column], f"column {column!r} of {where}")


def _jsonl_column(path: str, column: str | None) -> list[str]:
    if column is None:
        raise ValueError(f"{path} is JSONL: name the field holding the sources with --column / column=")
    texts = []
    for number, line in enumerate(read_text(path).split("\n"), start=1):  # not splitlines: JSON strings hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}: not JSON ({error})") from error
        if not isinstance(record, dict) or column not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}, line {number}: no field {column!r} (it has {keys})")
        texts.append(record[column])
    return _checked_texts(texts, f"field {column!r} of {path}")


def _checked_texts(texts: Sequence[Any], where: str) -> list[str]:
    if not texts:
        raise ValueError(f"{where} is empty: there is nothing to generate from")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"{where}: entry {index} is {type(text).__name__}, not a string")
    return list(texts)


def texts_sha256(texts: Sequence[str]) -> str:
    """SHA-256 of the sources, one per line: identifies the input a progress file belongs to."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\n")
    return digest.hexdigest()

"""Sequence-level knowledge distillation (Kim & Rush 2016; Stern §6.2): replace targets by a teacher's outputs.

Decoding a whole training set takes a while on a CPU, so outputs are appended to a JSON-lines cache after
every batch; an interrupted run resumes where it stopped, and a torn last line is simply decoded again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from datasets import Dataset
from tqdm.auto import tqdm


def _read_cache(cache_file: str) -> dict[int, str]:
    done: dict[int, str] = {}
    if not os.path.exists(cache_file):
        return done
    with open(cache_file, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line torn by an interruption: it and anything after it are decoded again
            done[int(record["index"])] = record["text"]
    return done


@torch.no_grad()
def distill_texts(
    model,
    tokenizer,
    sources: Sequence[str],
    cache_file: str,
    batch_size: int = 32,
    num_beams: int = 4,
    max_new_tokens: int = 128,
    progress: bool = True,
) -> list[str]:
    """Teacher outputs for `sources` by beam search (greedy with `num_beams=1`), cached and resumable.

    Sources are decoded in order of length, so batches carry little padding.
    """
    if not sources:
        raise ValueError("distill_texts got no sources")
    done = _read_cache(cache_file)
    todo = sorted((index for index in range(len(sources)) if index not in done), key=lambda i: len(sources[i]))
    os.makedirs(os.path.dirname(os.path.abspath(cache_file)), exist_ok=True)
    model.eval()
    with open(cache_file, "a", encoding="utf-8") as handle:
        batches = range(0, len(todo), batch_size)
        for start in tqdm(batches, desc="distilling", disable=not progress, initial=0):
            indices = todo[start : start + batch_size]
            inputs = tokenizer([sources[i] for i in indices], return_tensors="pt", padding=True).to(model.device)
            outputs = model.generate(**inputs, num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens)
            for index, text in zip(indices, tokenizer.batch_decode(outputs, skip_special_tokens=True), strict=True):
                handle.write(json.dumps({"index": index, "text": text}, ensure_ascii=False) + "\n")
                done[index] = text
            handle.flush()
    return [done[index] for index in range(len(sources))]


def distill_dataset(
    dataset: Dataset,
    model,
    tokenizer,
    source_column: str,
    cache_file: str,
    target_column: str = "distilled",
    **kwargs,
) -> Dataset:
    """Adds `target_column` holding the teacher's output for each example's `source_column`."""
    if source_column not in dataset.column_names:
        raise ValueError(f"Column {source_column!r} not in the dataset; it has {dataset.column_names}")
    outputs = distill_texts(model, tokenizer, dataset[source_column], cache_file, **kwargs)
    return dataset.add_column(target_column, outputs)

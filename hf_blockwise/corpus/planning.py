"""Which lines a process decodes, and in which batches: fixed chunks of consecutive lines, dealt out to the
processes in turn, and within a chunk sorted batches under a row count and a token budget."""

from __future__ import annotations

from collections.abc import Sequence


def chunks_of_shard(num_lines: int, chunk_size: int, num_shards: int, shard: int) -> list[range]:
    """The line ranges shard `shard` decodes: chunk c (lines `c * chunk_size` on) goes to shard `c % num_shards`."""
    starts = range(shard * chunk_size, num_lines, num_shards * chunk_size)
    return [range(start, min(start + chunk_size, num_lines)) for start in starts]


def plan_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int | None = None) -> list[list[int]]:
    """Indices of `lengths` in batches: longest first (ties in input order), at most `batch_size` rows, and at most
    `max_batch_tokens` padded source tokens (rows × the batch's longest source) when given; a source longer than the
    budget goes alone. Sorted batches waste no padding and rows of a batch end at similar steps (Devlin 2017).
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else None
        fits = current is not None and len(current) < batch_size
        if fits and max_batch_tokens is not None:
            fits = lengths[current[0]] * (len(current) + 1) <= max_batch_tokens
        if fits:
            current.append(index)
        else:
            batches.append([index])
    return batches

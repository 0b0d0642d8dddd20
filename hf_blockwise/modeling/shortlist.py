"""Vocabulary shortlists for the heads' proposals (Devlin 2017, §3: decode over a small candidate list)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids in `sequences` (e.g. the heads' training targets), plus `always`.

    Args:
        sequences: token id lists; ids < 0 (label padding) are ignored.
        size (`int`): how many ids to keep, `always` included.
        always: ids kept whatever their frequency (end of sentence, for instance).

    Returns:
        `torch.LongTensor` of shape `(min(size, distinct ids),)`, most frequent first, `always` in front.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    counts = Counter(token for sequence in sequences for token in sequence if token >= 0)
    chosen = dict.fromkeys(int(token) for token in always)  # an ordered set
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    return torch.tensor(list(chosen)[:size], dtype=torch.long)


def shortlist_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`token_ids` as a shortlist of a `vocab_size`-token vocabulary: a flat `torch.LongTensor`, checked to be
    non-empty, within the vocabulary and free of repeats (a `ValueError` says which rule is broken)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("A shortlist needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"Shortlist ids must lie in [0, {vocab_size}) (the base's vocabulary)")
    if ids.unique().numel() != ids.numel():
        raise ValueError("Shortlist ids must be unique")
    return ids

"""Scores of decoded outputs against references that the harness reports beside BLEU: word error rate (speech)."""

from __future__ import annotations

from collections.abc import Sequence


def _edit_distance(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """Levenshtein distance between two word lists (one row of the table at a time)."""
    previous = list(range(len(hypothesis) + 1))
    for i, word in enumerate(reference, start=1):
        current = [i]
        for j, other in enumerate(hypothesis, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != other)))
        previous = current
    return previous[-1]


def normalize_words(text: str) -> list[str]:
    """Lower-cased words with punctuation other than apostrophes removed: what WER compares."""
    kept = "".join(character if character.isalnum() or character in " '" else " " for character in text.lower())
    return kept.split()


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER: word edits over reference words, after `normalize_words`."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    pairs = zip(references, hypotheses, strict=True)
    edits = sum(_edit_distance(normalize_words(ref), normalize_words(hyp)) for ref, hyp in pairs)
    words = sum(len(normalize_words(reference)) for reference in references)
    if words == 0:
        raise ValueError("the references have no words")
    return edits / words

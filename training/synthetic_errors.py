"""Synthetic grammatical errors on clean English, for training an error-correction model that copies.

A model trained only on learner pairs (W&I+LOCNESS, FCE) sees few sentences and learns to rewrite; pairs made
by corrupting clean text teach the two things a corrector needs most: copy what is right, and undo the errors
learners make. The errors follow the common learner error types (articles, prepositions, agreement, verb and
noun forms, spelling, missing or doubled words, word order, punctuation and case), at a rate of about one edit
per eight words, and a share of sentences is left clean so that copying unchanged text is learned as well.

Texts are first split the way BEA-2019 and JFLEG text is (punctuation and clitics as separate words), so that
the synthetic pairs look like the real ones.

Everything here is deterministic given the seed: `corrupt(words, random.Random(seed))`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

ARTICLES = ("a", "an", "the")
PREPOSITIONS = ("in", "on", "at", "to", "for", "of", "with", "from", "by", "about", "into")
# agreement / tense confusions learners make, both ways
SWAPS = {
    "is": "are", "are": "is", "was": "were", "were": "was", "has": "have", "have": "has", "does": "do",
    "do": "does", "am": "is", "this": "these", "these": "this", "that": "those", "much": "many",
    "many": "much", "its": "it 's", "their": "there", "there": "their", "than": "then", "then": "than",
    "your": "you", "who": "which", "which": "who", "could": "can", "would": "will", "will": "would",
}  # fmt: skip
DROPPABLE = ("the", "a", "to", "of", "is", "are", "it", "that", "and", "be", ",", "have", "for")
INSERTABLE = ("the", "a", "to", "of", "is", "that", "for", "in")
VOWELS = "aeiou"

_PUNCTUATION = re.compile(r"""([.,!?;:"()\[\]]|'(?!(?:s|t|re|ve|ll|d|m)\b))""")
_CLITIC = re.compile(r"(?i)\b(\w+)(n't|'s|'re|'ve|'ll|'d|'m)\b")
_ABBREVIATION = re.compile(r"\b(Mr|Mrs|Ms|Dr|St|etc|e\.g|i\.e) \.")


def bea_tokenize(text: str) -> list[str]:
    """Split `text` into words the way BEA-2019 / JFLEG text is written.

    Example: ``"It's fine, isn't it?"`` -> ``["It", "'s", "fine", ",", "is", "n't", "it", "?"]``.
    """
    text = _CLITIC.sub(r"\1 \2", text)
    text = _PUNCTUATION.sub(r" \1 ", text)
    return _ABBREVIATION.sub(r"\1.", " ".join(text.split())).split()


def _misspell(word: str, rng: random.Random) -> str:
    """One character edit inside `word` (length > 3): delete, swap neighbours, double, or change a vowel."""
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(4)
    if kind == 0:
        return word[:i] + word[i + 1 :]
    if kind == 1:
        return word[: i - 1] + word[i] + word[i - 1] + word[i + 1 :]
    if kind == 2:
        return word[:i] + word[i] + word[i:]
    vowels = [j for j, ch in enumerate(word) if ch in VOWELS]
    if not vowels:
        return word[:i] + word[i + 1 :]
    j = rng.choice(vowels)
    return word[:j] + rng.choice([v for v in VOWELS if v != word[j]]) + word[j + 1 :]


def _wrong_form(word: str, rng: random.Random) -> str | None:
    """A wrong inflection of `word` (plural/3rd person s, past -ed, -ing), or None when it has none."""
    lower = word.lower()
    if len(word) <= 3 or not word.isalpha():
        return None
    if lower.endswith("ies"):
        return word[:-3] + "y"
    if lower.endswith("ing") and len(word) > 5:
        return word[:-3] + rng.choice(("", "e", "ed"))
    if lower.endswith("ed"):
        return word[:-2] + rng.choice(("", "e", "s"))
    if lower.endswith("s") and not lower.endswith("ss"):
        return word[:-1]
    return word + rng.choice(("s", "ed"))


def _edit(words: list[str], i: int, rng: random.Random) -> list[str]:
    """The words replacing ``words[i]`` after one learner-like error there (may be empty or two words)."""
    word = words[i]
    lower = word.lower()
    roll = rng.random()
    if lower in ARTICLES:
        return [] if roll < 0.5 else [rng.choice([a for a in ARTICLES if a != lower])]
    if lower in PREPOSITIONS:
        return [] if roll < 0.25 else [rng.choice([p for p in PREPOSITIONS if p != lower])]
    if lower in SWAPS and roll < 0.7:
        return SWAPS[lower].split()
    if lower in DROPPABLE and roll < 0.5:
        return []
    if roll < 0.35:
        form = _wrong_form(word, rng)
        if form is not None:
            return [form]
    if roll < 0.7 and len(word) > 3 and word.isalpha():
        return [_misspell(word, rng)]
    if roll < 0.8:
        return [rng.choice(INSERTABLE), word]
    if roll < 0.85 and word.isalpha():
        return [word, word]  # doubled word
    if roll < 0.95 and word.isalpha() and word[0].isupper() and i > 0:
        return [word.lower()]
    return [word]


def corrupt(words: Sequence[str], rng: random.Random, rate: float = 0.12, clean_share: float = 0.15) -> list[str]:
    """A learner-like version of the correct sentence `words`.

    Args:
        words: the correct sentence, BEA-tokenized (`bea_tokenize`).
        rng: the random source (seed it for reproducible data).
        rate: chance that each word gets an error.
        clean_share: chance that the sentence is returned unchanged (so that copying is learned too).

    Returns:
        The corrupted words; at least one edit unless the sentence is kept clean or too short to edit.
    """
    if rng.random() < clean_share:
        return list(words)
    out: list[str] = []
    for i, word in enumerate(words):
        out.extend(_edit(list(words), i, rng) if rng.random() < rate else [word])
    if len(out) > 3 and rng.random() < 0.08:  # word order: swap two neighbours
        j = rng.randrange(len(out) - 2)
        out[j], out[j + 1] = out[j + 1], out[j]
    if out and out[-1] in ".!?" and rng.random() < 0.05:  # missing final punctuation
        out.pop()
    return out


def synthetic_pairs(texts: Sequence[str], seed: int, max_words: int = 40) -> tuple[list[str], list[str]]:
    """(corrupted sources, clean targets) for every text of at most `max_words` words.

    Each text gets its own `random.Random(seed, index)` stream, so adding texts never changes earlier pairs.
    """
    sources, targets = [], []
    for index, text in enumerate(texts):
        words = bea_tokenize(text)
        if not words or "#" in text or len(words) > max_words:
            continue
        noisy = corrupt(words, random.Random(f"{seed}:{index}"))
        if noisy:
            sources.append(" ".join(noisy))
            targets.append(" ".join(words))
    return sources, targets

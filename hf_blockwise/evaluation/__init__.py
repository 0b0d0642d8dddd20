"""Measuring decoding: one harness that times modes on the same batches and compares them with a reference
([`measure`]), greedy against blockwise decoding in one call ([`compare_to_greedy`]), and the scores it reports.

The bench, the demo, the training recipes (`compare_to_greedy`) and the trainers' evaluation decode all measure
through this package; it imports nothing from `hf_blockwise.tools`.
"""

from hf_blockwise.evaluation.compare import Comparison, compare_to_greedy
from hf_blockwise.evaluation.harness import (
    Batch,
    DecoderCallCounter,
    ModeResult,
    Runner,
    generated_tokens,
    measure,
    same_output,
    sequences_of,
)
from hf_blockwise.evaluation.scores import normalize_words, word_error_rate

__all__ = [
    "Batch",
    "Comparison",
    "DecoderCallCounter",
    "ModeResult",
    "Runner",
    "compare_to_greedy",
    "generated_tokens",
    "measure",
    "normalize_words",
    "same_output",
    "sequences_of",
    "word_error_rate",
]

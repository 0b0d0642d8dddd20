"""hf_blockwise: exact blockwise parallel decoding for Hugging Face seq2seq models.

The corpus job (`generate_corpus`, `CorpusReport`) is loaded on first use: it needs datasets and accelerate, which
decoding does not, and which would add a second or more to every `import hf_blockwise`.
"""

from typing import Any

from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts, NoDrafter, VerifiedStates
from hf_blockwise.drafters.composite import CompositeDrafter
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.drafters.heads import HeadsDrafter
from hf_blockwise.drafters.input_copy import InputCopyDrafter
from hf_blockwise.drafters.nar import NonAutoregressiveDrafter
from hf_blockwise.drafters.oracle import ReferenceDrafter
from hf_blockwise.evaluation import Comparison, compare_to_greedy
from hf_blockwise.generation.acceptance import (
    AcceptanceRule,
    DistanceAcceptance,
    ExactAcceptance,
    GADPlusPlusAcceptance,
    MinimumBlockAcceptance,
    TopKAcceptance,
    accepted_lengths,
)
from hf_blockwise.generation.capability import UnsupportedModelError, check_decoder, clear_verdicts
from hf_blockwise.generation.diagnostics import Divergence, first_divergence
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.generation.state import DecodingStats
from hf_blockwise.modeling.config import BlockwiseConfig, FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.heads import BlockwiseHeads, SequentialHeads
from hf_blockwise.modeling.model import BlockwiseHeadsModel, BlockwiseHeadsOutput
from hf_blockwise.modeling.nar_model import NARDrafterConfig, NARDrafterModel
from hf_blockwise.modeling.quantization import quantize_dynamic_int8
from hf_blockwise.modeling.shortlist import frequent_tokens

__version__ = "0.1.0"

# names served by the corpus package, imported when first asked for (PEP 562)
_CORPUS_NAMES = ("CorpusReport", "generate_corpus")


def __getattr__(name: str) -> Any:
    if name in _CORPUS_NAMES:
        import hf_blockwise.corpus as corpus  # datasets and accelerate: only when the corpus job is used

        return getattr(corpus, name)
    raise AttributeError(f"module 'hf_blockwise' has no attribute {name!r}")


__all__ = [
    "AcceptanceRule",
    "BlockwiseConfig",
    "BlockwiseHeads",
    "BlockwiseHeadsModel",
    "BlockwiseHeadsOutput",
    "Comparison",
    "CompositeDrafter",
    "CorpusReport",
    "DecodingStats",
    "DistanceAcceptance",
    "Divergence",
    "DraftRequest",
    "Drafter",
    "Drafts",
    "ExactAcceptance",
    "FeatureDrafter",
    "FeatureDrafterConfig",
    "FeatureDrafterModel",
    "GADPlusPlusAcceptance",
    "HeadsDrafter",
    "InputCopyDrafter",
    "MinimumBlockAcceptance",
    "NARDrafterConfig",
    "NARDrafterModel",
    "NoDrafter",
    "NonAutoregressiveDrafter",
    "ReferenceDrafter",
    "SequentialHeads",
    "TopKAcceptance",
    "UnsupportedModelError",
    "VerifiedStates",
    "accepted_lengths",
    "blockwise_generate",
    "check_decoder",
    "clear_verdicts",
    "compare_to_greedy",
    "first_divergence",
    "frequent_tokens",
    "generate_corpus",
    "quantize_dynamic_int8",
]

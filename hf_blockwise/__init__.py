"""hf_blockwise: exact blockwise parallel decoding for Hugging Face seq2seq models.

Every public name is imported from its module on first use (PEP 562, as transformers' own `__init__` does), so
`import hf_blockwise` costs almost nothing and a program pays only for what it uses: decoding never loads the
corpus job's datasets and accelerate, nor the training code's Trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_SOURCES = {
    "AcceptanceRule": "hf_blockwise.generation.acceptance",
    "BlockwiseHeadsConfig": "hf_blockwise.modeling.config",
    "BlockwiseHeads": "hf_blockwise.modeling.heads",
    "BlockwiseHeadsModel": "hf_blockwise.modeling.model",
    "BlockwiseHeadsOutput": "hf_blockwise.modeling.model",
    "Comparison": "hf_blockwise.evaluation",
    "CompositeDrafter": "hf_blockwise.drafters.composite",
    "CorpusPredictor": "hf_blockwise.corpus",
    "CorpusReport": "hf_blockwise.corpus",
    "DecodingStats": "hf_blockwise.generation.state",
    "DistanceAcceptance": "hf_blockwise.generation.acceptance",
    "Divergence": "hf_blockwise.generation.diagnostics",
    "DraftRequest": "hf_blockwise.drafters.base",
    "DraftNoise": "hf_blockwise.drafters.base",
    "Drafter": "hf_blockwise.drafters.base",
    "Drafts": "hf_blockwise.drafters.base",
    "ExactAcceptance": "hf_blockwise.generation.acceptance",
    "FeatureDrafter": "hf_blockwise.drafters.feature",
    "FeatureDrafterConfig": "hf_blockwise.modeling.config",
    "FeatureDrafterModel": "hf_blockwise.modeling.feature_model",
    "GADPlusPlusAcceptance": "hf_blockwise.generation.acceptance",
    "HeadsDrafter": "hf_blockwise.drafters.heads",
    "InputCopyDrafter": "hf_blockwise.drafters.input_copy",
    "MinimumBlockAcceptance": "hf_blockwise.generation.acceptance",
    "NARDrafterConfig": "hf_blockwise.modeling.nar_model",
    "NARDrafterModel": "hf_blockwise.modeling.nar_model",
    "NoDrafter": "hf_blockwise.drafters.base",
    "NonAutoregressiveDrafter": "hf_blockwise.drafters.nar",
    "ReferenceDrafter": "hf_blockwise.drafters.oracle",
    "SequentialHeads": "hf_blockwise.modeling.heads",
    "TopKAcceptance": "hf_blockwise.generation.acceptance",
    "UnsupportedModelError": "hf_blockwise.generation.capability",
    "VerifiedStates": "hf_blockwise.drafters.base",
    "accepted_lengths": "hf_blockwise.generation.acceptance",
    "blockwise_generate": "hf_blockwise.generation.loop",
    "check_decoder": "hf_blockwise.generation.capability",
    "clear_verdicts": "hf_blockwise.generation.capability",
    "compare_to_greedy": "hf_blockwise.evaluation",
    "greedy_divergences": "hf_blockwise.generation.diagnostics",
    "frequent_tokens": "hf_blockwise.modeling.shortlist",
    "generate_corpus": "hf_blockwise.corpus",
    "quantize_dynamic_int8": "hf_blockwise.quantization",
    "restore": "hf_blockwise.fast_generate",
    "speed_up": "hf_blockwise.fast_generate",
    "CompileOptions": "hf_blockwise.compile_options",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from hf_blockwise.compile_options import CompileOptions
    from hf_blockwise.corpus import CorpusPredictor, CorpusReport, generate_corpus
    from hf_blockwise.drafters.base import Drafter, DraftNoise, DraftRequest, Drafts, NoDrafter, VerifiedStates
    from hf_blockwise.drafters.composite import CompositeDrafter
    from hf_blockwise.drafters.feature import FeatureDrafter
    from hf_blockwise.drafters.heads import HeadsDrafter
    from hf_blockwise.drafters.input_copy import InputCopyDrafter
    from hf_blockwise.drafters.nar import NonAutoregressiveDrafter
    from hf_blockwise.drafters.oracle import ReferenceDrafter
    from hf_blockwise.evaluation import Comparison, compare_to_greedy
    from hf_blockwise.fast_generate import restore, speed_up
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
    from hf_blockwise.generation.diagnostics import Divergence, greedy_divergences
    from hf_blockwise.generation.loop import blockwise_generate
    from hf_blockwise.generation.state import DecodingStats
    from hf_blockwise.modeling.config import BlockwiseHeadsConfig, FeatureDrafterConfig
    from hf_blockwise.modeling.feature_model import FeatureDrafterModel
    from hf_blockwise.modeling.heads import BlockwiseHeads, SequentialHeads
    from hf_blockwise.modeling.model import BlockwiseHeadsModel, BlockwiseHeadsOutput
    from hf_blockwise.modeling.nar_model import NARDrafterConfig, NARDrafterModel
    from hf_blockwise.modeling.shortlist import frequent_tokens
    from hf_blockwise.quantization import quantize_dynamic_int8


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'hf_blockwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


# the same names as `_SOURCES` (tests/test_layering.py checks it), spelled out for linters and readers
__all__ = [
    "AcceptanceRule",
    "BlockwiseHeads",
    "BlockwiseHeadsConfig",
    "BlockwiseHeadsModel",
    "BlockwiseHeadsOutput",
    "Comparison",
    "CompileOptions",
    "CompositeDrafter",
    "CorpusPredictor",
    "CorpusReport",
    "DecodingStats",
    "DistanceAcceptance",
    "Divergence",
    "DraftNoise",
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
    "frequent_tokens",
    "generate_corpus",
    "greedy_divergences",
    "quantize_dynamic_int8",
    "restore",
    "speed_up",
]

"""hf_blockwise: exact blockwise parallel decoding for Hugging Face seq2seq models."""

from .acceptance import (
    AcceptanceRule,
    DistanceAcceptance,
    ExactAcceptance,
    GADPlusPlusAcceptance,
    MinimumBlockAcceptance,
    TopKAcceptance,
    accepted_lengths,
)
from .config import BlockwiseConfig
from .decoding import DecodingStats, blockwise_generate
from .diagnostics import Divergence, first_divergence
from .drafters import Drafter, DraftRequest, Drafts, HeadsDrafter, NoDrafter
from .evaluation import Comparison, compare_to_greedy
from .heads import BlockwiseHeads
from .input_copy import InputCopyDrafter
from .modeling import BlockwiseHeadsModel, BlockwiseHeadsOutput
from .nar_drafter import NARDrafterConfig, NonAutoregressiveDrafter
from .quantization import quantize_dynamic_int8
from .shortlist import frequent_tokens

__version__ = "0.1.0"

__all__ = [
    "AcceptanceRule",
    "BlockwiseConfig",
    "BlockwiseHeads",
    "BlockwiseHeadsModel",
    "BlockwiseHeadsOutput",
    "Comparison",
    "DecodingStats",
    "DistanceAcceptance",
    "Divergence",
    "DraftRequest",
    "Drafter",
    "Drafts",
    "ExactAcceptance",
    "GADPlusPlusAcceptance",
    "HeadsDrafter",
    "InputCopyDrafter",
    "MinimumBlockAcceptance",
    "NARDrafterConfig",
    "NoDrafter",
    "NonAutoregressiveDrafter",
    "TopKAcceptance",
    "accepted_lengths",
    "blockwise_generate",
    "compare_to_greedy",
    "first_divergence",
    "frequent_tokens",
    "quantize_dynamic_int8",
]

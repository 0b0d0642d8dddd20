"""hf_blockwise: exact blockwise parallel decoding for Hugging Face seq2seq models."""

from .acceptance import AcceptanceRule, ExactAcceptance, accepted_lengths
from .config import BlockwiseConfig
from .decoding import DecodingStats, blockwise_generate
from .diagnostics import Divergence, first_divergence
from .drafters import Drafter, DraftRequest, Drafts, HeadsDrafter, NoDrafter
from .heads import BlockwiseHeads
from .modeling import BlockwiseHeadsModel, BlockwiseHeadsOutput

__version__ = "0.1.0"

__all__ = [
    "AcceptanceRule",
    "BlockwiseConfig",
    "BlockwiseHeads",
    "BlockwiseHeadsModel",
    "BlockwiseHeadsOutput",
    "DecodingStats",
    "Divergence",
    "DraftRequest",
    "Drafter",
    "Drafts",
    "ExactAcceptance",
    "HeadsDrafter",
    "NoDrafter",
    "accepted_lengths",
    "blockwise_generate",
    "first_divergence",
]

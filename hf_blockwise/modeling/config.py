"""`BlockwiseHeadsConfig`: the validated, JSON-serialisable description of a set of proposal heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_blockwise.drafters.feature import check_draft_threshold
from hf_blockwise.serialization import JsonConfigMixin

CONFIG_NAME = "blockwise_config.json"

# Most tokens one step may produce. Stern et al. train k <= 10 and acceptance falls off long before; the heads'
# output layer grows with k ** 2 (block_size=1000 on a 256-wide base would be a 1 TB matrix), so a larger value is
# a typo, refused before anything is allocated.
MAX_BLOCK_SIZE = 64


def check_block_size(block_size: object) -> None:
    """A `ValueError` naming the limits unless `block_size` is an int in [2, `MAX_BLOCK_SIZE`]."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size must be an int from 2 to {MAX_BLOCK_SIZE} (k tokens per step, the base model's own "
            f"included), got {block_size!r}"
        )


def check_fingerprint(fingerprint: object) -> None:
    """A `ValueError` unless `fingerprint` is `None` or a list of numbers (see `boundary.base_weights_fingerprint`)."""
    if fingerprint is None:
        return
    if not isinstance(fingerprint, list) or not all(
        isinstance(value, (int, float)) and not isinstance(value, bool) for value in fingerprint
    ):
        raise ValueError(f"base_fingerprint must be a list of numbers or None, got {fingerprint!r}")


@dataclass
class BlockwiseHeadsConfig(JsonConfigMixin):
    """Configuration of the proposal heads of a [`BlockwiseHeadsModel`].

    Args:
        block_size (`int`, defaults to 4):
            k in Stern et al. (2018): the number of tokens proposed per decoding step *including* the base
            model's own next token, so the model carries `block_size - 1` proposal heads.
        head_hidden_size (`int`, *optional*):
            Hidden width of *one* head's feed-forward layer; the shared layer is `(block_size - 1) *
            head_hidden_size` wide (Stern §6, Figure 3). `None` means "the base decoder's own feed-forward
            width", resolved when the heads are attached.
        base_model_name_or_path (`str`, *optional*):
            Hub name or local path of the base checkpoint, used by `from_pretrained` to load the base.
        base_model_type (`str`, *optional*):
            `config.model_type` of the base (e.g. `"marian"`); checked when heads are attached.
        hidden_size (`int`, *optional*):
            Width of the decoder states fed to the output projection; checked when heads are attached.
        vocab_size (`int`, *optional*):
            Number of rows of the base's output projection; checked when heads are attached.
        base_fingerprint (`list[float]`, *optional*):
            A few weights of the base's output projection, filled in when the heads are attached; `from_pretrained`
            compares them with the base it attaches to and warns when they differ (configs without it: the
            recorded base name is compared instead).
        shortlist_size (`int`, *optional*):
            When set, the heads propose only among this many token ids (stored with the head weights, see
            [`BlockwiseHeadsModel.set_shortlist`]): drafting projects onto the shortlist instead of the whole
            vocabulary (Devlin 2017). Verification keeps the full vocabulary, so the output does not change.
        condition_on_token (`bool`, defaults to `False`):
            Heads also read the embedding of the token the base model chose from the same decoder state (when
            drafting: the last verified token). Stern's heads see the state only and must infer that choice
            from it; being told it, as Hydra-style heads are, makes the longer-range guesses easier.
        sequential (`bool`, defaults to `False`):
            Hydra-style sequential heads ([`SequentialHeads`]): head i also reads the drafts of heads 1..i-1, so
            drafting runs the heads one after another. Implies reading the chosen token.
    """

    block_size: int = 4
    head_hidden_size: int | None = None
    base_model_name_or_path: str | None = None
    base_model_type: str | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    shortlist_size: int | None = None
    condition_on_token: bool = False
    sequential: bool = False
    base_fingerprint: list[float] | None = None

    file_name: ClassVar[str] = CONFIG_NAME

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_fingerprint(self.base_fingerprint)
        for name in ("head_hidden_size", "hidden_size", "vocab_size", "shortlist_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in ("condition_on_token", "sequential"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("base_model_name_or_path", "base_model_type"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {value!r}")

    @property
    def num_heads(self) -> int:
        """Number of proposal heads, `block_size - 1`."""
        return self.block_size - 1


FEATURE_DRAFTER_CONFIG_NAME = "feature_drafter_config.json"


@dataclass
class FeatureDrafterConfig(JsonConfigMixin):
    """Configuration of a [`FeatureDrafterModel`]: one decoder layer that drafts the base's next decoder states.

    Args:
        block_size (`int`, defaults to 5): most tokens one step may produce, the base's own included (k); the
            drafter proposes up to `block_size - 1` tokens per step.
        draft_threshold (`float`, *optional*): default per-row stopping threshold of drafting: a row stops when
            the drafter's probability of its next token falls below it (`None`: always draft `block_size - 1`).
        cross_attention (`bool`, defaults to `True`): the layer also attends to the base's encoder output.
        num_attention_heads (`int`, *optional*): heads of the layer's attentions; `None`: `hidden_size // 64`.
        ffn_size (`int`, *optional*): feed-forward width; `None`: the base decoder's.
        training_depth (`int`, defaults to 3): how many drafting steps training unrolls ("training-time test":
            step i reads the drafter's own predicted states of steps < i).
        base_model_name_or_path, base_model_type, hidden_size, embedding_size, encoder_hidden_size, vocab_size:
            what the drafter was built for, filled in from the base and checked when it is attached.
        shortlist_size (`int`, *optional*): drafts are drawn from this many token ids only (stored with the weights).
        base_fingerprint (`list[float]`, *optional*): a few weights of the base's output projection, filled in when
            the drafter is attached and compared by `from_pretrained` with the base it attaches to.
    """

    block_size: int = 5
    draft_threshold: float | None = None
    cross_attention: bool = True
    num_attention_heads: int | None = None
    ffn_size: int | None = None
    training_depth: int = 3
    base_model_name_or_path: str | None = None
    base_model_type: str | None = None
    hidden_size: int | None = None
    embedding_size: int | None = None
    encoder_hidden_size: int | None = None
    vocab_size: int | None = None
    shortlist_size: int | None = None
    base_fingerprint: list[float] | None = None

    file_name: ClassVar[str] = FEATURE_DRAFTER_CONFIG_NAME

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_fingerprint(self.base_fingerprint)
        check_draft_threshold(self.draft_threshold, "draft_threshold")
        if not isinstance(self.cross_attention, bool):
            raise ValueError(f"cross_attention must be a bool, got {self.cross_attention!r}")
        if isinstance(self.training_depth, bool) or not isinstance(self.training_depth, int) or self.training_depth < 1:
            raise ValueError(f"training_depth must be an int >= 1, got {self.training_depth!r}")
        for name in (
            "num_attention_heads", "ffn_size", "hidden_size", "embedding_size", "encoder_hidden_size", "vocab_size",
            "shortlist_size",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in ("base_model_name_or_path", "base_model_type"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {value!r}")


# names before 0.2, kept for one release (with a FutureWarning)

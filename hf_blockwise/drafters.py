"""Drafters: what proposes the next tokens that a verification pass then checks.

The contract follows transformers' `CandidateGenerator` (`get_candidates`, `update_candidate_strategy`),
adapted to batches whose rows advance at different speeds: a drafter receives a [`DraftRequest`] describing
every row and returns a [`Drafts`] with a token count per row. Drafters keep no state on themselves between
steps or calls: what one `generate` call needs throughout (a drafter model's encoder output) is returned by
[`Drafter.prepare`] once, and the loop hands it back in every request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .heads import output_projection_logits, shortlist_projection

if TYPE_CHECKING:
    from .modeling import BlockwiseHeadsModel


@dataclass
class DraftRequest:
    """What a drafter sees before a verification step.

    Attributes:
        sequences (`torch.LongTensor` of shape `(batch_size, max_length)`):
            each row's verified decoder tokens (decoder start and prompt included), right-padded.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): number of verified tokens per row.
        max_drafts (`torch.LongTensor` of shape `(batch_size,)`): most drafts each row can use this step
            (0 for finished rows); proposing more is allowed and the surplus is ignored.
        last_states (`torch.Tensor` of shape `(batch_size, hidden_size)`, *optional*):
            the decoder state, at the output projection, that predicted each row's last token; `None` before
            the first forward pass.
        encoder_input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): the source.
        encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        drafter_state (*optional*): what the drafter's [`Drafter.prepare`] returned for this `generate` call.
    """

    sequences: torch.Tensor
    lengths: torch.Tensor
    max_drafts: torch.Tensor
    last_states: torch.Tensor | None = None
    encoder_input_ids: torch.Tensor | None = None
    encoder_attention_mask: torch.Tensor | None = None
    drafter_state: Any = None


@dataclass
class Drafts:
    """Proposed continuations.

    Attributes:
        tokens (`torch.LongTensor` of shape `(batch_size, num_drafts)`): drafts, left-aligned per row.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): how many leading entries of each row are drafts.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> Drafts:
        return cls(
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )


class Drafter(ABC):
    """Base class of everything that can be passed as `assistant=` to blockwise decoding.

    Attributes:
        block_size (`int`): most tokens one step may produce per row, the base model's own token included
            (k in Stern et al.); a step feeds at most this many tokens per row to the decoder.
    """

    block_size: int

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        """Called once per `generate` call, before the first step; the result comes back as
        `DraftRequest.drafter_state` at every step. The default needs nothing and returns `None`.

        Args:
            encoder_input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
            encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        """
        return None

    @abstractmethod
    def get_candidates(self, request: DraftRequest) -> Drafts:
        """Proposes up to `block_size - 1` tokens that continue each row."""

    def update_candidate_strategy(self, request: DraftRequest, num_accepted: torch.Tensor) -> None:  # noqa: B027
        """Called after each verification with the drafts accepted per row, shape `(batch_size,)`.

        A hook for adaptive drafters; the drafters of this package are stateless and ignore it.
        """


class NoDrafter(Drafter):
    """Proposes nothing: the loop then decodes one greedy token per forward pass."""

    block_size = 1

    def get_candidates(self, request: DraftRequest) -> Drafts:
        return Drafts.empty(request.lengths.shape[0], request.lengths.device)


class HeadsDrafter(Drafter):
    """Drafts with the proposal heads of a [`BlockwiseHeadsModel`] (Stern et al. §3–4).

    The heads read the decoder state that predicted each row's last token, a by-product of the previous
    verification pass, so drafting costs no extra decoder call. Before the first pass there is no state,
    and the first step drafts nothing.

    Args:
        model ([`BlockwiseHeadsModel`]): the model whose heads draft.
        block_size (`int`, *optional*): use only the first `block_size - 1` heads (2 <= block_size <= the
            model's block size). Fewer heads cost less per step when long blocks are rarely accepted.
        use_shortlist (`bool`, defaults to `True`): propose only among the model's vocabulary shortlist, if it
            has one (see [`BlockwiseHeadsModel.set_shortlist`]); `False` drafts over the whole vocabulary.
    """

    def __init__(self, model: BlockwiseHeadsModel, block_size: int | None = None, use_shortlist: bool = True) -> None:
        trained = model.blockwise_config.block_size
        block_size = trained if block_size is None else block_size
        if not 2 <= block_size <= trained:
            raise ValueError(f"block_size must be between 2 and the model's block size {trained}, got {block_size}")
        self.model = model
        self.block_size = block_size
        shortlist = model.heads.shortlist if use_shortlist else None
        self._shortlist = shortlist
        # derived once per generate call: slicing the projection every step would cost as much as using it
        self._shortlist_projection = None if shortlist is None else shortlist_projection(model.base_model, shortlist)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        batch_size = request.lengths.shape[0]
        if request.last_states is None:
            return Drafts.empty(batch_size, request.lengths.device)
        states = request.last_states.to(self.model.heads.up.weight.dtype)
        # the last verified token is the base model's own choice from `last_states`
        last_tokens = request.sequences.gather(1, (request.lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
        chosen = self.model.chosen_token_embeddings(last_tokens)  # (B, e) or None
        head_states = self.model.heads(states, num_heads=self.block_size - 1, token_embeddings=chosen)  # (B, k-1, d)
        if self._shortlist_projection is None:
            tokens = output_projection_logits(self.model.base_model, head_states).argmax(dim=-1)  # (B, k-1)
        else:
            weight, bias = self._shortlist_projection
            best = torch.nn.functional.linear(head_states.to(weight.dtype), weight, bias).argmax(dim=-1)  # (B, k-1)
            tokens = self._shortlist[best]
        lengths = torch.full((batch_size,), tokens.shape[1], dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens, lengths=lengths)

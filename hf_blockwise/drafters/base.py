"""Drafters: what proposes the next tokens that a verification pass then checks.

The contract follows transformers' `CandidateGenerator` (`get_candidates`),
adapted to batches whose rows advance at different speeds: a drafter receives a [`DraftRequest`] describing
every row and returns a [`Drafts`] with a token count per row.

Rows leave the batch as they finish, so row i of a request is not row i of the caller's batch for long.
[`DraftRequest.rows`] names, for each row of the request, its index in the caller's batch: per-row data kept
anywhere (a reference continuation given to the drafter's constructor, a dict keyed by row) must be looked up
through it. What one `generate` call needs throughout (a drafter model's encoder output) is best returned by
[`Drafter.prepare`] once: the loop hands it back in every request, row-selected by [`Drafter.select_rows`] as
rows leave.

One rule for that per-call state, as for the loop's own decoder cache: it belongs to the call and is mutable.
[`Drafter.get_candidates`] and [`Drafter.observe`] update it in place (a feature drafter's key/value cache grows,
a NAR drafter's cache is cropped); [`Drafter.select_rows`] narrows it to the rows that keep decoding and returns
what the loop continues with: a mutable state narrowed in place and returned itself, a value (a tensor, a tuple
of tensors, a frozen projection) as a new value. The state handed to `select_rows` is not used again, and nothing
of it is kept on the drafter (`self`) between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_blockwise.compile_options import CompileOptions
from hf_blockwise.shared_noise import position_keys, shared_gumbel_noise


@dataclass(frozen=True)
class VerifiedStates:
    """The decoder states of the last verification pass, for drafters that continue from all of them.

    Attributes:
        states (`torch.Tensor` of shape `(batch_size, width, hidden_size)`): the states at the output projection,
            column c holding decoder position `start + c`; the state at position p predicted token p + 1.
        start (`int`): decoder position of column 0 (the same for every row).
        num_valid (`torch.LongTensor` of shape `(batch_size,)`): leading columns per row whose input token was
            verified and whose next token is now verified too (at least 1).
    """

    states: torch.Tensor
    start: int
    num_valid: torch.Tensor


# a sampling call's chain drafts are drawn among the drafter's most likely tokens only (`draw_among_likely`)
SAMPLED_CANDIDATES = 32


@dataclass(frozen=True)
class DraftNoise:
    """How a sampling call (`do_sample=True`) draws its tokens, for drafters that draft what it would draw.

    Sampling here is greedy search on scores plus noise fixed by the call's seed, the row, the position and the
    token (`generation/sampling.py`). A drafter that drafts `argmax(log q / temperature + noise)` from its own
    distribution q proposes the token sampling draws wherever q's warped argmax under that noise agrees with the
    model's; greedy drafts would match only where the draw is the most likely token. Drafts only propose: the
    output is the undrafted sample's either way.

    Attributes:
        seed (`int`): the call's seed.
        rows (`torch.LongTensor` of shape `(b,)`): each request row's index in the caller's batch.
        temperature (`float`): the call's temperature (1.0 without one); the other warpers are not applied.
    """

    seed: int
    rows: torch.Tensor
    temperature: float

    def keys(self, positions: torch.Tensor) -> torch.Tensor:
        """The key of each draft's noise ([`shared_noise.position_keys`]): positions `(b,)` or `(b, n)` (each the
        length of the prefix the draft follows, decoder start included) -> int64 keys of the same shape, which
        [`drafted_candidates`] (`drafters/trees.py`) draws with."""
        return position_keys(self.seed, self.rows, positions)

    def noise(self, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The noise of `token_ids` (`(S,)`, or per position `(b, n, S)`) at positions `(b, n)`: `(b, n, S)`, what the
        verification adds to the model's scores there."""
        return shared_gumbel_noise(self.seed, self.rows, positions, 0, token_ids)


def likely_candidates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `SAMPLED_CANDIDATES` largest of `logits` (float32 values, indices into the last dimension, `(..., K)`):
    the tokens a sampling call's chain draft is drawn among ([`draw_among_likely`])."""
    likely = logits.float().topk(min(SAMPLED_CANDIDATES, logits.shape[-1]), dim=-1)
    return likely.values, likely.indices


def draw_among_likely(
    logits: torch.Tensor, temperature: float, noise_of: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """A sampling call's chain draft: `argmax(logits / temperature + noise)` over the `SAMPLED_CANDIDATES` most
    likely tokens, the token sampling would draw from the drafter's distribution unless it falls outside them (a
    draft only proposes). The eager drafters and the compiled drafting block draw through this one function.

    Args:
        logits (`torch.Tensor` of shape `(..., S)`): the drafter's logits.
        temperature (`float`): the call's temperature.
        noise_of (`Callable[[torch.Tensor], torch.Tensor]`): indices into `logits`' last dimension, `(..., K)` ->
            the call's noise of those tokens at these logits' positions.

    Returns:
        `torch.LongTensor` of shape `(..., 1)`: indices into `logits`' last dimension.
    """
    values, indices = likely_candidates(logits)  # (..., K)
    pick = (values / temperature + noise_of(indices)).argmax(dim=-1, keepdim=True)
    return indices.gather(-1, pick)


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
        encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): its mask.
        drafter_state (*optional*): what the drafter's [`Drafter.prepare`] returned for this `generate` call.
        verified_states ([`VerifiedStates`], *optional*): every state of the last verification pass, for drafters
            with `reads_decoder_states`; `None` before the first forward pass.
        encoder_hidden_states (`torch.Tensor` of shape `(batch_size, source_length, hidden_size)`, *optional*):
            the base's encoder output, computed once per call.
        compile ([`CompileOptions`], *optional*): set when the loop verifies through the compiled engine
            (`blockwise_compile=`); a drafter that has a compiled drafting block uses it with these options.
        rows (`torch.LongTensor` of shape `(batch_size,)`, *optional*): each row's index in the caller's batch
            (`generate`'s input), increasing; rows that finished are gone. The loop always sets it; `None` only in
            requests built by hand.
        sampling ([`DraftNoise`], *optional*): set when the call samples; chain drafters that rank tokens by a
            distribution of their own (heads, the feature drafter) draft with it. `None` for greedy search.
    """

    sequences: torch.Tensor
    lengths: torch.Tensor
    max_drafts: torch.Tensor
    last_states: torch.Tensor | None = None
    encoder_input_ids: torch.Tensor | None = None
    encoder_attention_mask: torch.Tensor | None = None
    drafter_state: Any = None
    verified_states: VerifiedStates | None = None
    encoder_hidden_states: torch.Tensor | None = None
    compile: CompileOptions | None = None
    rows: torch.Tensor | None = None
    sampling: DraftNoise | None = None


@dataclass
class Drafts:
    """Proposed continuations.

    A chain by default: draft i follows draft i - 1. With `parents`, a tree of candidates that one verification
    checks together (`generation/tree.py`): each draft follows its parent, and the longest path greedy decoding
    would take is kept.

    Attributes:
        tokens (`torch.LongTensor` of shape `(batch_size, num_drafts)`): drafts, left-aligned per row.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): how many leading entries of each row are drafts.
        parents (`torch.LongTensor` of shape `(batch_size, num_drafts)`, *optional*): a tree: the index of each
            draft's parent among the row's drafts, `-1` for a draft that follows the last verified token. Parents
            come before their children, and the most likely chain comes first (drafts `0..c-1` with parents
            `-1..c-2`): a step that cannot verify a tree verifies that chain ([`main_chain`]).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    parents: torch.Tensor | None = None

    def main_chain(self) -> Drafts:
        """The leading drafts that form a chain (all of them when this is a chain already)."""
        if self.parents is None:
            return self
        chained = self.parents == torch.arange(-1, self.parents.shape[1] - 1, device=self.parents.device)
        lengths = torch.minimum(self.lengths, chained.long().cumprod(dim=1).sum(dim=1))
        return Drafts(tokens=self.tokens, lengths=lengths)

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
        reads_decoder_states (`bool`): whether `DraftRequest.last_states` and `verified_states` are needed; the
            loop captures the decoder states at the output projection only for drafters that read them.
        tree_nodes (`int`, *optional*): most drafts per row of the trees this drafter proposes ([`Drafts.parents`]);
            `None` for a drafter of chains. The loop sizes its cache by it and checks that the model can verify trees.
    """

    block_size: int
    reads_decoder_states: bool = False
    tree_nodes: int | None = None

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        """Called once per `generate` call, before the first step; the result comes back as
        `DraftRequest.drafter_state` at every step, updated in place by the drafter (see the module's rule). The
        default needs nothing and returns `None`.

        Args:
            encoder_input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): the source.
            encoder_attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): its mask.
        """
        return None

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        """The per-call state for `rows` of the batch only, called when finished rows leave the batch.

        A mutable state is narrowed in place and returned itself; a value is returned as a new value. Either way
        the loop continues with the result and never uses `drafter_state` again. A drafter whose [`prepare`]
        returns per-row data must override this; the default handles `None`.

        Args:
            rows (`torch.LongTensor` of shape `(num_rows,)`): indices of the rows that keep decoding.
        """
        if drafter_state is None:
            return None
        raise NotImplementedError(
            f"{type(self).__name__}.prepare returned per-call state ({type(drafter_state).__name__}); it must also "
            "implement select_rows(drafter_state, rows), which the loop calls when finished rows leave the batch"
        )

    @abstractmethod
    def get_candidates(self, request: DraftRequest) -> Drafts:
        """Proposes up to `block_size - 1` tokens that continue each row.

        `tokens` may be narrower than `block_size - 1`: the verification pass is only as wide as the widest
        row needs, so a drafter that knows most rows have few drafts should return only that many columns. What the
        drafter keeps for later steps it writes into `request.drafter_state`, in place.
        """

    def observe(self, request: DraftRequest) -> None:  # noqa: B027
        """Called instead of [`get_candidates`] on a step where none of this drafter's drafts are wanted (a
        [`CompositeDrafter`] serving every row from its other drafter). A drafter that keeps a cache of what each
        verification established records the request's states in its per-call state here; the default does
        nothing."""

    def check_base(self, model: nn.Module) -> None:  # noqa: B027
        """Called once per `generate` call with the model it runs on; raises a `ValueError` naming both shapes when
        this drafter was made for a base of other shapes (its hidden size or vocabulary). The default accepts any
        model."""


class NoDrafter(Drafter):
    """Proposes nothing: the loop then decodes one greedy token per forward pass."""

    block_size = 1

    def get_candidates(self, request: DraftRequest) -> Drafts:
        return Drafts.empty(request.lengths.shape[0], request.lengths.device)

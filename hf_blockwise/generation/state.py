"""The explicit state of one blockwise `generate` call, and what a run reports.

[`DecodingState`] is everything that changes from one decoding step to the next; [`DecodingSetup`] is what
does not (model, drafter, rules, limits). A step is `decode_step(state, setup) -> state`
(`generation/step.py`); the loop is a few lines around it (`generation/loop.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessorList

from hf_blockwise.boundary import StopRules
from hf_blockwise.drafters.base import Drafter, VerifiedStates
from hf_blockwise.engine import CompiledDecoder
from hf_blockwise.generation.acceptance import AcceptanceRule


@dataclass
class DecodingStats:
    """What a blockwise decoding run cost.

    Attributes:
        num_forwards (`int`): decoder forward passes, the first (prefill) one included.
        accepted (`torch.LongTensor` of shape `(num_iterations, batch_size)`): tokens each row gained at each
            iteration (accepted drafts plus the base model's own token); 0 once a row has finished.
        compiled_forwards (`int`): how many of the forward passes ran through the compiled engine's graph
            (`blockwise_compile=`; its first pass of a call runs eagerly unless `compiled_prefill`); 0 without the
            engine. Compiled graphs run no module hooks, so a caller counting decoder calls with a hook adds these.
    """

    num_forwards: int
    accepted: torch.Tensor
    compiled_forwards: int = 0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted block size: tokens gained per iteration, averaged over rows still decoding."""
        active = self.accepted > 0
        return float(self.accepted[active].float().mean()) if active.any() else 0.0

    def __getitem__(self, row: int) -> DecodingStats:
        """The statistics of one row of the batch: the forwards it took part in and its column of `accepted`.

        Callers that split a `generate` output into rows index every field (Whisper's `generate` does, with
        `value[row].cpu()`, for each segment it decodes), so the statistics split along with the sequences. Every
        row takes part in the eager passes, which come first, so a row's compiled passes are the rest of its own.
        """
        accepted = self.accepted[:, [row]]  # (num_iterations, 1)
        num_forwards = int((accepted > 0).sum())
        eager_forwards = self.num_forwards - self.compiled_forwards
        return DecodingStats(
            num_forwards=num_forwards, accepted=accepted, compiled_forwards=max(num_forwards - eager_forwards, 0)
        )

    def cpu(self) -> DecodingStats:
        return DecodingStats(
            num_forwards=self.num_forwards, accepted=self.accepted.cpu(), compiled_forwards=self.compiled_forwards
        )


@dataclass(frozen=True)
class DecodingSetup:
    """What stays fixed during one `generate` call.

    Attributes:
        model: the transformers seq2seq model that verifies.
        drafter ([`Drafter`]): what proposes tokens.
        acceptance ([`AcceptanceRule`]): which drafts a verification keeps.
        logits_processor (`LogitsProcessorList`): generate's processors, applied as greedy search applies them.
        stop_rules ([`StopRules`]): max length, EOS ids and any other stopping criteria.
        block_size (`int`): most tokens one row feeds per step (k).
        filler_token_id (`int`): what fills the feed after a row's real tokens (the pad id, else 0).
        pad_cut_token_id (`int`, *optional*): for models that number decoder positions by counting non-pad
            tokens, the pad id after which a row's feed must end (greedy search feeds a pad alone); else `None`.
        batch_size (`int`): rows of the caller's batch (rows leave the state as they finish).
        streamer: transformers streamer fed with row 0's new tokens, if any.
        sampling_seed (`int`, *optional*): with `do_sample=True`, the seed of the call's shared Gumbel noise
            ([`sampling.perturbed_scores`]): the scores every decision reads are perturbed by it; `None`: greedy.
        sampling_temperature (`float`): with `sampling_seed`, the call's temperature, for drafters that draft on
            the same noise ([`DraftNoise`]).
        output_scores (`bool`): keep the scores of every generated token (`output_scores=True` with
            `return_dict_in_generate=True`), in [`DecodingState.scores`].
        output_logits (`bool`): keep the raw logits of every generated token (`output_logits=True`), in
            [`DecodingState.logits`].
        engine ([`CompiledDecoder`], *optional*): the compiled verification forward (`blockwise_compile=`); `None`
            runs transformers' forward eagerly.
        position_limit (`int`, *optional*): positions the decoder has (a learned table ends), `None` when unbounded:
            a tree feed's columns are numbered by the model up to there before they are placed by depth.
    """

    model: nn.Module
    drafter: Drafter
    acceptance: AcceptanceRule
    logits_processor: LogitsProcessorList
    stop_rules: StopRules
    block_size: int
    filler_token_id: int
    pad_cut_token_id: int | None
    batch_size: int
    streamer: Any = None
    engine: CompiledDecoder | None = None
    position_limit: int | None = None
    sampling_seed: int | None = None
    sampling_temperature: float = 1.0
    output_scores: bool = False
    output_logits: bool = False


@dataclass(frozen=True)
class DecodingState:
    """Everything one step reads and the next step receives; only rows still decoding are in it.

    Attributes:
        sequences (`torch.LongTensor` of shape `(num_rows, buffer_length)`): verified tokens (decoder start
            and prompt included), filler after each row's length.
        lengths (`torch.LongTensor` of shape `(num_rows,)`): verified tokens per row.
        rows (`torch.LongTensor` of shape `(num_rows,)`): each row's index in the caller's batch.
        cache_length (`int`): tokens of every row held in the decoder KV cache (one length for the batch).
        max_pending (`int`), min_pending (`int`): most and fewest verified tokens not yet in the cache, over
            rows; host copies read together with `cache_length` once per step.
        cache: the decoder's `EncoderDecoderCache` (transformers updates it in place in each forward).
        forward_kwargs (`dict`): what every decoder forward receives (encoder output, attention mask).
        encoder_input_ids (`torch.LongTensor` of shape `(num_rows, source_length)`, *optional*).
        encoder_attention_mask (`torch.LongTensor` of shape `(num_rows, source_length)`, *optional*).
        last_states (`torch.Tensor` of shape `(num_rows, hidden_size)`, *optional*): the decoder state at the
            output projection that predicted each row's last token; `None` before the first forward.
        verified_states ([`VerifiedStates`], *optional*): all states of the last verification pass, with how
            many leading columns of each row were verified; `None` when the drafter reads no states.
        drafter_state: what the drafter's `prepare` returned, row-selected as rows finish.
        output (`torch.LongTensor` of shape `(batch_size, buffer_length)`): finished rows, at their caller index.
        output_lengths (`torch.LongTensor` of shape `(batch_size,)`).
        accepted (`list[torch.LongTensor]`): per step, tokens gained per caller row, shape `(batch_size,)`.
        scores (`list[GeneratedScores]`): with `DecodingSetup.output_scores`, per step, the scores that decided the
            step's new tokens.
        logits (`list[GeneratedScores]`): with `DecodingSetup.output_logits`, per step, their raw logits.
    """

    sequences: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor
    cache_length: int
    max_pending: int
    min_pending: int
    cache: Any
    forward_kwargs: dict[str, Any]
    encoder_input_ids: torch.Tensor | None
    encoder_attention_mask: torch.Tensor | None
    last_states: torch.Tensor | None
    verified_states: VerifiedStates | None
    drafter_state: Any
    output: torch.Tensor
    output_lengths: torch.Tensor
    accepted: list[torch.Tensor] = field(default_factory=list)
    scores: list[GeneratedScores] = field(default_factory=list)
    logits: list[GeneratedScores] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.lengths.shape[0]


@dataclass(frozen=True)
class GeneratedScores:
    """The processed scores (`output_scores=True`) or raw logits (`output_logits=True`) that decided some generated
    tokens, one vector per token.

    Attributes:
        rows (`torch.LongTensor` of shape `(n,)`): each token's row in the caller's batch.
        positions (`torch.LongTensor` of shape `(n,)`): each token's position in its row (decoder prompt included).
        scores (`torch.FloatTensor` of shape `(n, vocab_size)`).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor


@dataclass(frozen=True)
class StepFeed:
    """The decoder input of one step.

    Attributes:
        tokens (`torch.LongTensor` of shape `(num_rows, width)`): per row, pending tokens, then drafts, then
            filler.
        num_pending (`torch.LongTensor` of shape `(num_rows,)`): verified tokens not yet in the cache.
        num_pending_fed (`torch.LongTensor` of shape `(num_rows,)`): how many of them are fed this step.
        num_drafts_fed (`torch.LongTensor` of shape `(num_rows,)`).
        deciding (`torch.BoolTensor` of shape `(num_rows,)`): rows whose pending tokens are all fed, so the
            step yields their next token.
    """

    tokens: torch.Tensor
    num_pending: torch.Tensor
    num_pending_fed: torch.Tensor
    num_drafts_fed: torch.Tensor
    deciding: torch.Tensor


@dataclass(frozen=True)
class Verdict:
    """What a verification pass decided.

    Attributes:
        new_tokens (`torch.LongTensor` of shape `(num_rows, num_decisions)`): accepted drafts, then the base
            model's own choice at the first position not accepted.
        num_new (`torch.LongTensor` of shape `(num_rows,)`): new tokens kept per row (after stopping rules).
        num_accepted (`torch.LongTensor` of shape `(num_rows,)`): drafts accepted per row.
        stopped (`torch.BoolTensor` of shape `(num_rows,)`): rows that are now finished.
    """

    new_tokens: torch.Tensor
    num_new: torch.Tensor
    num_accepted: torch.Tensor
    stopped: torch.Tensor

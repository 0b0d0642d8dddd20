"""Blockwise parallel decoding (Stern et al. 2018) as a `custom_generate` loop for transformers' `generate`.

Each iteration is one decoder forward pass that both *verifies* the tokens drafted at the previous step and,
through the decoder states it produces, lets the drafter *propose* the next block (Stern §4):

    draft  -> feed [pending verified tokens | drafts]  -> one forward  -> accept longest valid prefix
           -> append accepted drafts + the base model's own next token -> crop the KV cache.

Batching. transformers' seq2seq decoders take positions from the cache length, one per batch, so every row
must keep its cached tokens at their true positions 0..L-1 with the *same* L. After a step we crop the cache
to L = the shortest verified prefix among unfinished rows; a row that is further ahead keeps its verified
but uncached tokens as "pending" and feeds them first in the next step, before its drafts. A step feeds at
most `block_size` tokens per row, so a row that is `p` tokens ahead drafts `block_size - p` tokens: rows
ahead slow down, the gap between rows stays below `block_size`, and every row gains at least one token per
step. The price is that a row ahead recomputes its pending tokens (at most `block_size - 1`) instead of
drafting with those slots. Padding columns sit after each row's real tokens, where causal attention hides
them, so no decoder attention mask is needed and each row's output equals its greedy output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from . import _hf_generation as hf
from .acceptance import AcceptanceRule, ExactAcceptance, accepted_lengths
from .drafters import Drafter, DraftRequest, Drafts, NoDrafter


@dataclass
class DecodingStats:
    """What a blockwise decoding run cost.

    Attributes:
        num_forwards (`int`): decoder forward passes, the first (prefill) one included.
        accepted (`torch.LongTensor` of shape `(num_iterations, batch_size)`): tokens each row gained at each
            iteration (accepted drafts plus the base model's own token); 0 once a row has finished.
    """

    num_forwards: int
    accepted: torch.Tensor

    @property
    def mean_accepted(self) -> float:
        """Mean accepted block size: tokens gained per iteration, averaged over rows still decoding."""
        active = self.accepted > 0
        return float(self.accepted[active].float().mean()) if active.any() else 0.0


@dataclass
class StepFeed:
    """The decoder input of one step.

    Attributes:
        tokens (`torch.LongTensor` of shape `(batch_size, width)`): per row, pending tokens, then drafts,
            then filler.
        num_pending (`torch.LongTensor` of shape `(batch_size,)`): verified tokens not yet in the cache.
        num_pending_fed (`torch.LongTensor` of shape `(batch_size,)`): how many of them are fed this step.
        num_drafts_fed (`torch.LongTensor` of shape `(batch_size,)`).
        deciding (`torch.BoolTensor` of shape `(batch_size,)`): rows whose pending tokens are all fed, so the
            step yields their next token.
    """

    tokens: torch.Tensor
    num_pending: torch.Tensor
    num_pending_fed: torch.Tensor
    num_drafts_fed: torch.Tensor
    deciding: torch.Tensor


def build_feed(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    cache_length: int,
    drafts: Drafts,
    active: torch.Tensor,
    pad_token_id: int | None,
    filler_token_id: int,
) -> StepFeed:
    """Lays out one step's decoder input: each row's pending tokens, then its drafts, then filler.

    A row's feed is cut right after its first `pad_token_id`: models that number decoder positions by
    counting non-pad tokens (M2M100, NLLB) would otherwise shift every position after it, while greedy
    decoding feeds a pad alone. Greedy decoding essentially never emits pad mid-sentence, so this costs
    nothing in practice.

    Args:
        sequences (`torch.LongTensor` of shape `(batch_size, buffer_length)`): verified tokens per row.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): verified tokens per row.
        cache_length (`int`): tokens of each row already in the KV cache.
        drafts ([`Drafts`]): proposals, already limited to what each row may use.
        active (`torch.BoolTensor` of shape `(batch_size,)`): unfinished rows.
    """
    num_pending = (lengths - cache_length).clamp(min=0) * active
    num_drafts = drafts.lengths * active
    width = max(int((num_pending + num_drafts).max()), 1)
    columns = torch.arange(width, device=lengths.device)  # (W,)
    from_sequences = sequences[:, (cache_length + columns).clamp(max=sequences.shape[1] - 1)]  # (B, W)
    tokens = torch.where(columns < num_pending[:, None], from_sequences, filler_token_id)
    if drafts.tokens.shape[1] > 0:
        draft_index = (columns - num_pending[:, None]).clamp(0, drafts.tokens.shape[1] - 1)  # (B, W)
        is_draft = (columns >= num_pending[:, None]) & (columns < (num_pending + num_drafts)[:, None])
        tokens = torch.where(is_draft, drafts.tokens.gather(1, draft_index), tokens)
    num_fed = num_pending + num_drafts
    if pad_token_id is not None:
        is_pad = (tokens == pad_token_id) & (columns < num_fed[:, None])
        first_pad = torch.where(is_pad.any(dim=1), is_pad.long().argmax(dim=1), width)
        num_fed = torch.minimum(num_fed, first_pad + 1)
    num_pending_fed = torch.minimum(num_pending, num_fed)
    width = max(int(num_fed.max()), 1)
    tokens = torch.where(columns[:width] < num_fed[:, None], tokens[:, :width], filler_token_id)
    return StepFeed(
        tokens=tokens,
        num_pending=num_pending,
        num_pending_fed=num_pending_fed,
        num_drafts_fed=num_fed - num_pending_fed,
        deciding=active & (num_pending_fed == num_pending) & (num_pending > 0),
    )


def process_scores(
    logits_processor: LogitsProcessorList,
    cached_tokens: torch.Tensor,
    fed_tokens: torch.Tensor,
    logits: torch.Tensor,
    first_column: int,
) -> torch.Tensor:
    """Applies generate's logits processors column by column, each with the prefix that column sees.

    All rows feed from the same cache length, so column j's prefix has the same length in every row and one
    processor call per column serves the whole batch, exactly as in greedy decoding.

    Args:
        cached_tokens (`torch.LongTensor` of shape `(batch_size, cache_length)`): tokens already in the cache.
        fed_tokens (`torch.LongTensor` of shape `(batch_size, width)`): this step's feed.
        logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`).
        first_column (`int`): columns before it decide nothing in any row and are left as they are.

    Returns:
        `torch.FloatTensor` of shape `(batch_size, width, vocab_size)`.
    """
    if len(logits_processor) == 0:
        return logits
    context = torch.cat([cached_tokens, fed_tokens], dim=1)  # (B, cache_length + W)
    width = logits.shape[1]
    prefix_length = cached_tokens.shape[1]
    scores = logits.clone()
    for column in range(first_column, width):
        scores[:, column] = logits_processor(context[:, : prefix_length + column + 1], logits[:, column])
    return scores


def decision_columns(feed: StepFeed, num_decisions: int) -> torch.Tensor:
    """Column of the feed whose output decides each row's i-th new token, shape `(batch_size, num_decisions)`."""
    offsets = torch.arange(num_decisions, device=feed.tokens.device)
    return (feed.num_pending[:, None] - 1 + offsets).clamp(0, feed.tokens.shape[1] - 1)


def accept(
    scores: torch.Tensor, feed: StepFeed, acceptance: AcceptanceRule, filler_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verifies each row's drafts and forms its new tokens.

    Args:
        scores (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`): processed scores of the feed.

    Returns:
        new_tokens (`torch.LongTensor` of shape `(batch_size, num_drafts + 1)`): accepted drafts, then the
            base model's own choice at the first position not accepted.
        num_new (`torch.LongTensor` of shape `(batch_size,)`): new tokens per row (0 for rows not deciding).
        num_accepted (`torch.LongTensor` of shape `(batch_size,)`): drafts accepted per row.
    """
    num_drafts = int(feed.num_drafts_fed.max())
    columns = decision_columns(feed, num_drafts + 1)  # (B, D+1)
    decision_scores = scores.gather(1, columns[..., None].expand(-1, -1, scores.shape[-1]))  # (B, D+1, V)
    greedy_tokens = decision_scores.argmax(dim=-1)  # (B, D+1)
    # the draft judged at decision i sits in the feed right after decision column i
    draft_tokens = feed.tokens.gather(1, (columns + 1).clamp(max=feed.tokens.shape[1] - 1))  # (B, D+1)
    offsets = torch.arange(num_drafts + 1, device=scores.device)
    if num_drafts > 0:
        is_draft = offsets[:num_drafts] < feed.num_drafts_fed[:, None]
        match = acceptance(decision_scores[:, :num_drafts], draft_tokens[:, :num_drafts]) & is_draft
        num_accepted = accepted_lengths(match) * feed.deciding
    else:
        num_accepted = torch.zeros_like(feed.num_pending)
    new_tokens = torch.where(offsets < num_accepted[:, None], draft_tokens, greedy_tokens)
    new_tokens = torch.where(feed.deciding[:, None], new_tokens, filler_token_id)
    num_new = (num_accepted + 1) * feed.deciding
    return new_tokens, num_new, num_accepted


def boundary_states(
    states: torch.Tensor, feed: StepFeed, num_accepted: torch.Tensor, previous: torch.Tensor | None
) -> torch.Tensor:
    """The decoder state that predicted each deciding row's last new token; other rows keep `previous`.

    Args:
        states (`torch.Tensor` of shape `(batch_size, width, hidden_size)`): this step's states at the output
            projection.
        num_accepted (`torch.LongTensor` of shape `(batch_size,)`).

    Returns:
        `torch.Tensor` of shape `(batch_size, hidden_size)`.
    """
    column = (feed.num_pending - 1 + num_accepted).clamp(0, states.shape[1] - 1)  # (B,)
    step_states = states[torch.arange(states.shape[0], device=states.device), column]  # (B, d)
    previous = torch.zeros_like(step_states) if previous is None else previous
    return torch.where(feed.deciding[:, None], step_states, previous)


def truncate_at_stops(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    new_tokens: torch.Tensor,
    num_new: torch.Tensor,
    rules: hf.StopRules,
    filler_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuts each row's new tokens where greedy decoding would have stopped it.

    Returns:
        num_new (`torch.LongTensor` of shape `(batch_size,)`): new tokens kept per row.
        stopped (`torch.BoolTensor` of shape `(batch_size,)`): rows that are now finished.
    """
    offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    num_new = torch.minimum(num_new, rules.max_length - lengths)
    stopped = (lengths + num_new >= rules.max_length) & (num_new > 0)
    if rules.eos_token_ids is not None:
        is_stop = torch.isin(new_tokens, rules.eos_token_ids) & (offsets < num_new[:, None])
        has_stop = is_stop.any(dim=1)
        num_new = torch.where(has_stop, is_stop.long().argmax(dim=1) + 1, num_new)
        stopped = stopped | has_stop
    if rules.others:
        num_new, stopped = _apply_other_criteria(
            sequences, lengths, new_tokens, num_new, stopped, rules, filler_token_id
        )
    return num_new, stopped


def _apply_other_criteria(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    new_tokens: torch.Tensor,
    num_new: torch.Tensor,
    stopped: torch.Tensor,
    rules: hf.StopRules,
    filler_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs user stopping criteria after each new token, on each row's prefix right-aligned in the batch."""
    candidate = sequences.clone()
    append_tokens(candidate, lengths, new_tokens, num_new, filler_token_id)
    undecided = num_new > 0
    for offset in range(int(num_new.max())):
        prefix_lengths = lengths + offset + 1  # (B,)
        width = int(prefix_lengths.max())
        index = prefix_lengths[:, None] - width + torch.arange(width, device=lengths.device)  # (B, W)
        prefix = torch.where(index >= 0, candidate.gather(1, index.clamp(min=0)), filler_token_id)
        fired = torch.zeros_like(undecided)
        for criterion in rules.others:
            fired = fired | criterion(prefix, None).to(fired.device)
        fired = fired & undecided & (offset < num_new)
        num_new = torch.where(fired, offset + 1, num_new)
        stopped = stopped | fired
        undecided = undecided & ~fired
    return num_new, stopped


def append_tokens(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    new_tokens: torch.Tensor,
    num_new: torch.Tensor,
    filler: int,
) -> None:
    """Writes the first `num_new[b]` of `new_tokens[b]` after row b's verified tokens, in place.

    `sequences` holds filler after each row's length and has room for `new_tokens.shape[1]` more tokens.
    """
    offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    values = torch.where(offsets < num_new[:, None], new_tokens, filler)
    sequences.scatter_(1, lengths[:, None] + offsets, values)


def limit_drafts(drafts: Drafts, max_drafts: torch.Tensor) -> Drafts:
    """Clips each row's draft count to what the row may use this step."""
    return Drafts(tokens=drafts.tokens, lengths=torch.minimum(drafts.lengths.to(max_drafts), max_drafts))


def check_drafts(drafts: Drafts, batch_size: int) -> None:
    if drafts.tokens.dim() != 2 or drafts.tokens.shape[0] != batch_size or drafts.lengths.shape != (batch_size,):
        raise ValueError(
            f"A drafter must return tokens of shape (batch_size={batch_size}, num_drafts) and lengths of shape "
            f"({batch_size},); got {tuple(drafts.tokens.shape)} and {tuple(drafts.lengths.shape)}"
        )


def _validate_call(
    model: nn.Module,
    input_ids: torch.Tensor,
    assistant: Drafter | None,
    acceptance: AcceptanceRule | None,
    synced_gpus: bool,
) -> tuple[Drafter, AcceptanceRule]:
    hf.encoder_decoder_only(model)
    if input_ids.shape[0] == 0:
        raise ValueError("generate was called with an empty batch (batch size 0)")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by blockwise decoding")
    drafter = NoDrafter() if assistant is None else assistant
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"assistant= takes an hf_blockwise Drafter (e.g. HeadsDrafter), got {type(assistant).__name__}. "
            "For transformers' own assisted generation with a smaller model, pass assistant_model= to the "
            "base model's generate instead."
        )
    rule = ExactAcceptance() if acceptance is None else acceptance
    if not isinstance(rule, AcceptanceRule):
        raise TypeError(f"acceptance= takes an AcceptanceRule such as ExactAcceptance(), got {type(rule).__name__}")
    return drafter, rule


def blockwise_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,
    assistant: Drafter | None = None,
    acceptance: AcceptanceRule | None = None,
    **model_kwargs,
):
    """Blockwise parallel decoding, to be passed as `model.generate(..., custom_generate=blockwise_generate)`.

    transformers prepares everything (encoder pass, decoder start tokens, logits processors, stopping
    criteria, cache) and calls this loop in place of greedy search. With the default exact acceptance the
    result equals the base model's greedy `generate`, token for token, at any batch size.

    Args:
        assistant ([`Drafter`], *optional*): what proposes tokens; `None` proposes nothing (plain greedy).
        acceptance ([`AcceptanceRule`], *optional*): defaults to [`ExactAcceptance`].

    Returns:
        `torch.LongTensor` of shape `(batch_size, sequence_length)`, or a [`BlockwiseGenerateOutput`] with
        `decoding_stats` when `return_dict_in_generate=True`.
    """
    drafter, rule = _validate_call(model, input_ids, assistant, acceptance, synced_gpus)
    hf.validate_generation_config(generation_config)
    rules = hf.split_stopping_criteria(stopping_criteria, generation_config)
    if rules.others and rules.eos_token_ids is None:
        raise ValueError(
            "Custom stopping criteria are supported together with an eos_token_id only: without one, greedy "
            "search keeps extending rows that have stopped, which blockwise decoding does not reproduce"
        )
    streamer = streamer if streamer is not None else hf.streamer_from_generate_call()
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer= supports batch size 1 only, like transformers' TextStreamer")

    pad = hf.pad_token_tensor(generation_config)
    pad_token_id = None if pad is None else int(pad)
    filler = 0 if pad_token_id is None else pad_token_id
    cache = hf.decoder_cache(model_kwargs)
    forward_kwargs = hf.forward_kwargs(model_kwargs)

    batch_size, prompt_length = input_ids.shape
    device = input_ids.device
    block_size = max(int(drafter.block_size), 1)
    sequences = torch.full((batch_size, rules.max_length + block_size + 1), filler, dtype=torch.long, device=device)
    sequences[:, :prompt_length] = input_ids
    lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=device)
    active = lengths < rules.max_length
    cache_length = 0
    last_states: torch.Tensor | None = None
    accepted_per_step: list[torch.Tensor] = []
    encoder_attention_mask = model_kwargs.get("attention_mask")
    drafter_state = drafter.prepare(inputs_tensor, encoder_attention_mask)

    # one hook for the whole loop: it records the decoder states that the heads of the next step read
    with hf.capture_output_projection_input(model) as captured:
        while bool(active.any()):
            request = DraftRequest(
                sequences=sequences,
                lengths=lengths,
                max_drafts=((block_size - (lengths - cache_length)).clamp(min=0)) * active,
                last_states=last_states,
                encoder_input_ids=inputs_tensor,
                encoder_attention_mask=encoder_attention_mask,
                drafter_state=drafter_state,
            )
            drafts = drafter.get_candidates(request)
            check_drafts(drafts, batch_size)
            feed = build_feed(
                sequences, lengths, cache_length, limit_drafts(drafts, request.max_drafts), active, pad_token_id, filler
            )

            captured.clear()
            outputs = model(
                decoder_input_ids=feed.tokens, past_key_values=cache, use_cache=True, return_dict=True,
                **forward_kwargs,
            )  # fmt: skip
            logits = outputs.logits.to(dtype=torch.float32)  # (B, W, V)
            first_column = int((feed.num_pending[active] - 1).clamp(min=0).min())
            scores = process_scores(logits_processor, sequences[:, :cache_length], feed.tokens, logits, first_column)

            new_tokens, num_new, num_accepted = accept(scores, feed, rule, filler)
            drafter.update_candidate_strategy(request, num_accepted)
            num_new, stopped = truncate_at_stops(sequences, lengths, new_tokens, num_new, rules, filler)
            append_tokens(sequences, lengths, new_tokens, num_new, filler)
            if streamer is not None and int(num_new[0]) > 0:
                streamer.put(new_tokens[0, : int(num_new[0])].cpu())

            last_states = boundary_states(captured[-1], feed, num_accepted, last_states)
            cached_valid = cache_length + feed.num_pending_fed + num_accepted  # (B,)
            lengths = lengths + num_new
            active = active & ~stopped
            accepted_per_step.append(num_new)
            if bool(active.any()):
                cache_length = int(cached_valid[active].min())
                hf.crop_cache(cache, cache_length)

    if streamer is not None:
        streamer.end()
    output_ids = sequences[:, : int(lengths.max())]
    if not generation_config.return_dict_in_generate:
        return output_ids
    stats = DecodingStats(num_forwards=len(accepted_per_step), accepted=torch.stack(accepted_per_step).cpu())
    return hf.BlockwiseGenerateOutput(sequences=output_ids, decoding_stats=stats)

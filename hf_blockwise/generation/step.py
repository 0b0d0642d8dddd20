"""One blockwise decoding step as short pure functions over an explicit state (gpt-fast's `generate.py` style).

    draft  -> feed [pending verified tokens | drafts | filler]  -> one decoder forward
           -> scores at the columns that decide a token -> accept the longest valid prefix (a cumprod)
           -> stopping rules -> append -> one device-to-host read -> crop the cache -> drop finished rows

Batching. transformers' seq2seq decoders take positions from the cache length, one per batch, so every row
keeps its cached tokens at their true positions 0..L-1 with the *same* L. After a step the cache is cropped
to L = the shortest verified prefix among rows; a row that is further ahead keeps its verified but uncached
tokens as "pending" and feeds them first in the next step, before its drafts. A row feeds its pending
tokens and then at most `block_size - pending` drafts, so rows ahead draft less, the gap between rows stays
bounded and every row gains at least one token per step. Filler sits after each row's real tokens, where
causal attention hides it, so no decoder attention mask is needed. Rows that finish leave the state (and
the cache) at the end of the step, so they cost nothing afterwards.

Host syncs. The feed's width is known on the host from the previous step's read (`max_pending`) and the
drafts' shape, so a step reads the device once, at its end: the new cache length, the pending range and the
number of rows still decoding, together. A step where rows finish reads once more to select the survivors.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import DraftRequest, Drafts, VerifiedStates
from hf_blockwise.generation.acceptance import ExactAcceptance, accepted_lengths
from hf_blockwise.generation.sampling import draft_noise, perturbed_scores
from hf_blockwise.generation.state import DecodingSetup, DecodingState, GeneratedScores, StepFeed, Verdict
from hf_blockwise.generation.tree import build_tree_feed, tree_scores, tree_step_allowed, verify_tree

# larger than any sequence length: neutral element of the min/max reductions over rows
_FAR = 1 << 40


def draft_request(state: DecodingState, setup: DecodingSetup) -> DraftRequest:
    """What the drafter sees: every row's verified tokens and how many drafts it may use this step."""
    pending = state.lengths - state.cache_length  # (b,)
    # no draft past the last position greedy search feeds (max_length - 2): its token would be cut anyway, and a
    # model with learned positions may have none there
    room = setup.stop_rules.max_length - 1 - state.lengths  # (b,)
    return DraftRequest(
        sequences=state.sequences,
        lengths=state.lengths,
        max_drafts=torch.minimum(setup.block_size - pending, room).clamp(min=0),
        last_states=state.last_states,
        encoder_input_ids=state.encoder_input_ids,
        encoder_attention_mask=state.encoder_attention_mask,
        drafter_state=state.drafter_state,
        verified_states=state.verified_states,
        encoder_hidden_states=hf.encoder_hidden_states(state.forward_kwargs),
        compile=None if setup.engine is None else setup.engine.options,
        rows=state.rows,
        sampling=None
        if setup.sampling_seed is None
        else draft_noise(setup.sampling_seed, state.rows, setup.sampling_temperature),
    )


def check_drafts(drafts: Drafts, num_rows: int, tree_nodes: int | None) -> None:
    if drafts.tokens.dim() != 2 or drafts.tokens.shape[0] != num_rows or drafts.lengths.shape != (num_rows,):
        raise ValueError(
            f"A drafter must return tokens of shape (batch_size={num_rows}, num_drafts) and lengths of shape "
            f"({num_rows},); got {tuple(drafts.tokens.shape)} and {tuple(drafts.lengths.shape)}"
        )
    if drafts.parents is None:
        return
    if drafts.parents.shape != drafts.tokens.shape:
        raise ValueError(
            f"A drafter's tree parents must have the shape of its tokens {tuple(drafts.tokens.shape)}; got "
            f"{tuple(drafts.parents.shape)}"
        )
    if tree_nodes is None or drafts.tokens.shape[1] > tree_nodes:
        raise ValueError(
            f"A drafter returned a tree of {drafts.tokens.shape[1]} drafts per row but declares tree_nodes="
            f"{tree_nodes}; set its tree_nodes to the most drafts its trees hold"
        )


def feed_width(state: DecodingState, setup: DecodingSetup, drafts: Drafts) -> int:
    """Columns of the feed, from host-known numbers only: a row feeds its pending tokens, then at most
    `block_size - pending` drafts, never more drafts than the drafter's tokens hold, and no column past the last
    position greedy search would feed (`max_length - 2`)."""
    with_drafts = min(max(setup.block_size, state.max_pending), state.max_pending + drafts.tokens.shape[1])
    # filler columns sit at the same positions as other rows' drafts: none past greedy's last fed position either
    with_drafts = min(with_drafts, setup.stop_rules.max_length - 1 - state.cache_length)
    return max(with_drafts, state.max_pending, 1)


def build_feed(state: DecodingState, setup: DecodingSetup, drafts: Drafts, max_drafts: torch.Tensor) -> StepFeed:
    """Lays out one step's decoder input: each row's pending tokens, then its drafts, then filler.

    For models that number decoder positions by counting non-pad tokens (`setup.pad_cut_token_id`), a row's
    feed ends right after its first pad: greedy search feeds a pad alone, and a pad inside a multi-token feed
    would shift every later position.

    Args:
        drafts ([`Drafts`]): proposals; tokens of shape `(num_rows, num_drafts)`.
        max_drafts (`torch.LongTensor` of shape `(num_rows,)`): most drafts each row may feed.
    """
    width = feed_width(state, setup, drafts)
    sequences, filler = state.sequences, setup.filler_token_id
    num_pending = state.lengths - state.cache_length  # (b,)
    num_drafts = torch.minimum(drafts.lengths.to(max_drafts), max_drafts)  # (b,)
    columns = torch.arange(width, device=sequences.device)  # (W,)
    from_sequences = sequences[:, (state.cache_length + columns).clamp(max=sequences.shape[1] - 1)]  # (b, W)
    tokens = torch.where(columns < num_pending[:, None], from_sequences, filler)
    if drafts.tokens.shape[1] > 0:
        draft_index = (columns - num_pending[:, None]).clamp(0, drafts.tokens.shape[1] - 1)  # (b, W)
        is_draft = (columns >= num_pending[:, None]) & (columns < (num_pending + num_drafts)[:, None])
        tokens = torch.where(is_draft, drafts.tokens.gather(1, draft_index), tokens)
    num_fed = (num_pending + num_drafts).clamp(max=width)
    if setup.pad_cut_token_id is not None:
        is_pad = (tokens == setup.pad_cut_token_id) & (columns < num_fed[:, None])
        first_pad = torch.where(is_pad.any(dim=1), is_pad.long().argmax(dim=1), width)
        num_fed = torch.minimum(num_fed, first_pad + 1)
        tokens = torch.where(columns < num_fed[:, None], tokens, filler)
    num_pending_fed = torch.minimum(num_pending, num_fed)
    return StepFeed(
        tokens=tokens,
        num_pending=num_pending,
        num_pending_fed=num_pending_fed,
        num_drafts_fed=num_fed - num_pending_fed,
        deciding=num_pending_fed == num_pending,
    )


def decision_columns(state: DecodingState, feed: StepFeed) -> torch.Tensor:
    """Column of the feed whose output decides each row's i-th new token, shape `(num_rows, num_decisions)`.

    `num_decisions = width - min_pending + 1`: the most drafts any row fed, plus its own token. Computed once
    per step, for the scores ([`decision_scores`]) and the verification ([`verify`]).
    """
    width = feed.tokens.shape[1]
    first = state.min_pending - 1  # earliest deciding column over rows
    offsets = torch.arange(width - first, device=feed.num_pending.device)
    return (feed.num_pending[:, None] - 1 + offsets).clamp(0, width - 1)


def apply_processors(state: DecodingState, setup: DecodingSetup, input_ids: torch.Tensor, scores: torch.Tensor):
    """generate's logits processors on one column, in the caller's whole batch as greedy search calls them.

    Some processors keep per-row data of the caller's batch (the encoder ids of `encoder_repetition_penalty`,
    `encoder_no_repeat_ngram_size`); once rows have left the state, the remaining ones are put back at their
    caller index for the call, finished rows holding filler.

    Args:
        input_ids (`torch.LongTensor` of shape `(num_rows, prefix_length)`): the prefix this column sees.
        scores (`torch.FloatTensor` of shape `(num_rows, vocab_size)`).
    """
    if state.num_rows == setup.batch_size:
        return setup.logits_processor(input_ids, scores)
    full_ids = input_ids.new_full((setup.batch_size, input_ids.shape[1]), setup.filler_token_id)
    full_scores = scores.new_zeros((setup.batch_size, scores.shape[1]))
    full_ids[state.rows], full_scores[state.rows] = input_ids, scores
    return setup.logits_processor(full_ids, full_scores)[state.rows]


def decision_scores(
    state: DecodingState, setup: DecodingSetup, feed: StepFeed, logits: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """Processed scores at the columns that decide a token, per row and decision.

    Rows share the cache length, so column j's prefix has the same length in every row and one processor call
    per column serves the batch, as in greedy search. Columns before the earliest decision are skipped, and so
    are per-column calls where every processor that reads the prefix is known to be inactive at that length
    (a forced EOS acts at one length only): those columns get the prefix-free processors (a `bad_words_ids`
    mask of single tokens) in one call for all of them, which is the same composition.

    Args:
        logits (`torch.FloatTensor` of shape `(num_rows, width, vocab_size)`).
        columns (`torch.LongTensor` of shape `(num_rows, num_decisions)`): from [`decision_columns`].

    Returns:
        `torch.FloatTensor` of shape `(num_rows, num_decisions, vocab_size)`.
    """
    width, vocab_size = logits.shape[1], logits.shape[2]
    first = state.min_pending - 1  # earliest deciding column over rows
    processors = setup.logits_processor
    if len(processors) == 0:
        return logits.gather(1, columns[..., None].expand(-1, -1, vocab_size))
    block = hf.apply_prefix_free_processors(processors, logits[:, first:])  # (b, C, V)
    needs_prefix = [
        any(
            hf.processor_acts_at(p, state.cache_length + column + 1)
            for p in processors
            if not hf.processor_ignores_prefix(p)
        )
        for column in range(first, width)
    ]
    if any(needs_prefix):
        context = torch.cat([state.sequences[:, : state.cache_length], feed.tokens], dim=1)  # (b, L + W)
        processed = [
            apply_processors(state, setup, context[:, : state.cache_length + column + 1], logits[:, column])
            if needed
            else block[:, column - first]
            for column, needed in zip(range(first, width), needs_prefix, strict=True)
        ]
        block = torch.stack(processed, dim=1)  # (b, C, V)
    return block.gather(1, (columns - first)[..., None].expand(-1, -1, vocab_size))


def verify(
    scores: torch.Tensor, feed: StepFeed, setup: DecodingSetup, columns: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps each row's longest acceptable draft prefix and appends the base model's own next token.

    Args:
        scores (`torch.FloatTensor` of shape `(num_rows, num_decisions, vocab_size)`): from [`decision_scores`].
        columns (`torch.LongTensor` of shape `(num_rows, num_decisions)`): from [`decision_columns`].

    Returns:
        new_tokens (`torch.LongTensor` of shape `(num_rows, num_decisions)`): accepted drafts, then the base
            model's choice at the first position not accepted; filler for rows not deciding.
        num_accepted (`torch.LongTensor` of shape `(num_rows,)`).
    """
    num_decisions, width = scores.shape[1], feed.tokens.shape[1]
    num_drafts = num_decisions - 1
    greedy_tokens = scores.argmax(dim=-1)  # (b, N)
    # the draft judged at decision i sits in the feed right after decision column i
    draft_tokens = feed.tokens.gather(1, (columns + 1).clamp(max=width - 1))  # (b, N)
    offsets = torch.arange(num_decisions, device=scores.device)
    num_accepted = torch.zeros_like(feed.num_pending)
    if num_drafts > 0:
        if isinstance(setup.acceptance, ExactAcceptance):  # reuse the argmax rather than recompute it
            match = greedy_tokens[:, :num_drafts] == draft_tokens[:, :num_drafts]
        else:
            match = setup.acceptance(scores[:, :num_drafts], draft_tokens[:, :num_drafts])
        match = match & (offsets[:num_drafts] < feed.num_drafts_fed[:, None])
        num_accepted = accepted_lengths(match) * feed.deciding
    new_tokens = torch.where(offsets < num_accepted[:, None], draft_tokens, greedy_tokens)
    new_tokens = torch.where(feed.deciding[:, None], new_tokens, setup.filler_token_id)
    return new_tokens, num_accepted


def keep_token_outputs(
    state: DecodingState, setup: DecodingSetup, scores: torch.Tensor, logits: torch.Tensor | None, num_new: torch.Tensor
) -> DecodingState:
    """`state` with the scores (`output_scores`) and the raw logits (`output_logits`) that decided each row's
    `num_new` new tokens appended (decision i decides the token at `lengths + i`).

    Args:
        scores (`torch.FloatTensor` of shape `(num_rows, num_decisions, vocab_size)`): processed, unperturbed.
        logits (`torch.FloatTensor` of shape `(num_rows, num_decisions, vocab_size)`, *optional*): before the
            processors; `None` unless the call keeps them.
        num_new (`torch.LongTensor` of shape `(num_rows,)`).
    """
    offsets = torch.arange(scores.shape[1], device=scores.device)
    row, decision = (offsets < num_new[:, None]).nonzero(as_tuple=True)  # (n,), (n,): a read, only when kept

    def kept(values: torch.Tensor) -> GeneratedScores:
        return GeneratedScores(
            rows=state.rows[row], positions=state.lengths[row] + decision, scores=values[row, decision]
        )

    return dataclasses.replace(
        state,
        scores=[*state.scores, kept(scores)] if setup.output_scores else state.scores,
        logits=[*state.logits, kept(logits)] if logits is not None else state.logits,
    )


def truncate_at_stops(
    state: DecodingState, setup: DecodingSetup, new_tokens: torch.Tensor, num_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuts each row's new tokens where greedy decoding would have stopped it.

    Returns:
        num_new (`torch.LongTensor` of shape `(num_rows,)`): new tokens kept per row.
        stopped (`torch.BoolTensor` of shape `(num_rows,)`): rows that are now finished.
    """
    rules, lengths = setup.stop_rules, state.lengths
    offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    num_new = torch.minimum(num_new, rules.max_length - lengths)
    stopped = (lengths + num_new >= rules.max_length) & (num_new > 0)
    if rules.eos_token_ids is not None:
        is_stop = torch.isin(new_tokens, rules.eos_token_ids) & (offsets < num_new[:, None])
        has_stop = is_stop.any(dim=1)
        num_new = torch.where(has_stop, is_stop.long().argmax(dim=1) + 1, num_new)
        stopped = stopped | has_stop
    if rules.others:
        num_new, stopped = _apply_other_criteria(state, setup, new_tokens, num_new, stopped)
    return num_new, stopped


def _apply_other_criteria(
    state: DecodingState, setup: DecodingSetup, new_tokens: torch.Tensor, num_new: torch.Tensor, stopped: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs user stopping criteria after each new token, on each row's prefix right-aligned, in the caller's
    batch layout (a criterion may keep per-row data)."""
    lengths, filler = state.lengths, setup.filler_token_id
    candidate = append_tokens(state.sequences, lengths, new_tokens, num_new, filler)
    undecided = num_new > 0
    for offset in range(int(num_new.max())):
        prefix_lengths = lengths + offset + 1  # (b,)
        width = int(prefix_lengths.max())
        index = prefix_lengths[:, None] - width + torch.arange(width, device=lengths.device)  # (b, W)
        prefix = torch.where(index >= 0, candidate.gather(1, index.clamp(min=0)), filler)
        full_prefix = prefix.new_full((setup.batch_size, width), filler)
        full_prefix[state.rows] = prefix
        fired = torch.zeros_like(undecided)
        for criterion in setup.stop_rules.others:
            fired = fired | criterion(full_prefix, None).to(fired.device)[state.rows]
        fired = fired & undecided & (offset < num_new)
        num_new = torch.where(fired, offset + 1, num_new)
        stopped = stopped | fired
        undecided = undecided & ~fired
    return num_new, stopped


def append_tokens(
    sequences: torch.Tensor, lengths: torch.Tensor, new_tokens: torch.Tensor, num_new: torch.Tensor, filler: int
) -> torch.Tensor:
    """`sequences` with the first `num_new[b]` of `new_tokens[b]` written after row b's verified tokens.

    `sequences` holds filler after each row's length and has room for `new_tokens.shape[1]` more tokens.
    """
    offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
    values = torch.where(offsets < num_new[:, None], new_tokens, filler)
    return sequences.scatter(1, lengths[:, None] + offsets, values)


def boundary_states(
    states: torch.Tensor | None, feed: StepFeed, num_accepted: torch.Tensor, previous: torch.Tensor | None
) -> torch.Tensor | None:
    """The decoder state that predicted each deciding row's last new token; other rows keep `previous`.

    Args:
        states (`torch.Tensor` of shape `(num_rows, width, hidden_size)`, *optional*): this step's states at
            the output projection; `None` when the drafter reads none.

    Returns:
        `torch.Tensor` of shape `(num_rows, hidden_size)`, or `None`.
    """
    if states is None:
        return None
    column = (feed.num_pending - 1 + num_accepted).clamp(0, states.shape[1] - 1)  # (b,)
    step_states = states[torch.arange(states.shape[0], device=states.device), column]  # (b, d)
    previous = torch.zeros_like(step_states) if previous is None else previous
    return torch.where(feed.deciding[:, None], step_states, previous)


def advance(
    state: DecodingState,
    setup: DecodingSetup,
    feed: StepFeed,
    verdict: Verdict,
    states: torch.Tensor | None,
) -> DecodingState:
    """Appends the verified tokens, reads the device once, crops the cache, and lets finished rows go."""
    lengths = state.lengths + verdict.num_new
    active = ~verdict.stopped
    cached_valid = state.cache_length + feed.num_pending_fed + verdict.num_accepted  # (b,)
    cache_length = torch.where(active, cached_valid, _FAR).min()
    pending = lengths - cache_length
    # the step's one device-to-host read
    cache_length, max_pending, min_pending, num_active = torch.stack(
        [
            cache_length,
            torch.where(active, pending, -_FAR).max(),
            torch.where(active, pending, _FAR).min(),
            active.sum(),
        ]
    ).tolist()
    accepted = torch.zeros(setup.batch_size, dtype=torch.long, device=lengths.device)
    state = dataclasses.replace(
        state,
        sequences=append_tokens(
            state.sequences, state.lengths, verdict.new_tokens, verdict.num_new, setup.filler_token_id
        ),
        lengths=lengths,
        max_pending=max_pending,
        min_pending=min_pending,
        last_states=boundary_states(states, feed, verdict.num_accepted, state.last_states),
        verified_states=None
        if states is None
        else VerifiedStates(states, state.cache_length, feed.num_pending_fed + verdict.num_accepted),
        accepted=[*state.accepted, accepted.index_copy(0, state.rows, verdict.num_new)],
    )
    if num_active == state.num_rows:
        hf.crop_cache(state.cache, cache_length)
        return dataclasses.replace(state, cache_length=cache_length)
    return drop_finished(state, setup, active, cache_length if num_active else 0)


def drop_finished(state: DecodingState, setup: DecodingSetup, active: torch.Tensor, cache_length: int) -> DecodingState:
    """Writes every row to the output at its caller index and keeps only the rows still decoding."""
    output = state.output.index_copy(0, state.rows, state.sequences)
    output_lengths = state.output_lengths.index_copy(0, state.rows, state.lengths)
    keep = active.nonzero().squeeze(1)  # (num_active,)
    hf.crop_cache(state.cache, cache_length)
    hf.select_cache_rows(state.cache, keep)

    def rows_of(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.index_select(0, keep)

    return dataclasses.replace(
        state,
        sequences=state.sequences.index_select(0, keep),
        lengths=state.lengths.index_select(0, keep),
        rows=state.rows.index_select(0, keep),
        cache_length=cache_length,
        forward_kwargs=hf.select_forward_rows(state.forward_kwargs, keep),
        encoder_input_ids=rows_of(state.encoder_input_ids),
        encoder_attention_mask=rows_of(state.encoder_attention_mask),
        last_states=rows_of(state.last_states),
        verified_states=None
        if state.verified_states is None
        else dataclasses.replace(
            state.verified_states,
            states=state.verified_states.states.index_select(0, keep),
            num_valid=state.verified_states.num_valid.index_select(0, keep),
        ),
        drafter_state=setup.drafter.select_rows(state.drafter_state, keep),
        output=output,
        output_lengths=output_lengths,
    )


def run_decoder(
    state: DecodingState, setup: DecodingSetup, tokens: torch.Tensor, tree: hf.TreeInputs | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The verification forward over `tokens` (shape `(b, W)`), a chain or with `tree` a tree: compiled when the
    setup has an engine, else transformers' eager forward. Returns logits `(b, W, V)` and, for drafters that read
    them, states `(b, W, d)`."""
    capture = setup.drafter.reads_decoder_states
    if setup.engine is None:
        return hf.decoder_forward(
            setup.model, tokens, state.cache, state.forward_kwargs, capture_states=capture, tree=tree
        )
    logits, states = setup.engine.forward(tokens, state.cache, state.forward_kwargs, state.cache_length, tree)
    return logits, states if capture else None


def decode_step(state: DecodingState, setup: DecodingSetup) -> DecodingState:
    """One draft-verify-accept step for every row still decoding: a tree step when the drafts are a tree that the
    step can verify as one (`generation/tree.py`), else a chain step (a tree's main chain)."""
    request = draft_request(state, setup)
    drafts = setup.drafter.get_candidates(request)
    check_drafts(drafts, state.num_rows, setup.drafter.tree_nodes)
    if tree_step_allowed(state, setup, drafts):
        return tree_step(state, setup, request, drafts)
    return chain_step(state, setup, request, drafts.main_chain())


def chain_step(state: DecodingState, setup: DecodingSetup, request: DraftRequest, drafts: Drafts) -> DecodingState:
    """Verifies each row's chain of drafts in one forward."""
    feed = build_feed(state, setup, drafts, request.max_drafts)
    logits, states = run_decoder(state, setup, feed.tokens)  # (b, W, V), (b, W, d) or None
    logits = logits.float()
    columns = decision_columns(state, feed)  # (b, N)
    scores = decision_scores(state, setup, feed, logits, columns)  # (b, N, V)
    decided = scores
    if setup.sampling_seed is not None:  # decision at column c decides position cache_length + c + 1
        decided = perturbed_scores(scores, setup.sampling_seed, state.rows, state.cache_length + columns + 1)
    new_tokens, num_accepted = verify(decided, feed, setup, columns)
    raw = logits.gather(1, columns[..., None].expand(-1, -1, logits.shape[-1])) if setup.output_logits else None
    return conclude(state, setup, feed, new_tokens, num_accepted, states, (scores, raw))


def tree_step(state: DecodingState, setup: DecodingSetup, request: DraftRequest, drafts: Drafts) -> DecodingState:
    """Verifies each row's tree of drafts in one forward, then keeps only the accepted path in the cache and the
    states, so that the rest of the step is a chain's."""
    feed, tree, parent_column = build_tree_feed(state, setup, drafts, request.max_drafts)
    logits, states = run_decoder(state, setup, feed.tokens, tree)  # (b, W, V), (b, W, d) or None
    scores = tree_scores(setup, logits.float())  # (b, W, V)
    if setup.sampling_seed is not None:  # a node at depth d decides position cache_length + d + 1, on any branch
        scores = perturbed_scores(scores, setup.sampling_seed, state.rows, state.cache_length + tree.depth + 1)
    new_tokens, num_accepted, path = verify_tree(scores, feed, tree, parent_column, setup)
    hf.compact_cache(state.cache, state.cache_length, path)
    if states is not None:
        states = states.gather(1, path[..., None].expand(-1, -1, states.shape[2]))  # (b, W, d), along the path
    return conclude(state, setup, feed, new_tokens[:, : setup.block_size], num_accepted, states)


def conclude(
    state: DecodingState,
    setup: DecodingSetup,
    feed: StepFeed,
    new_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    states: torch.Tensor | None,
    decisions: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> DecodingState:
    """The end of a step: stopping rules on the new tokens (accepted drafts, then the base's own), the streamer,
    the new tokens' scores and logits where the call keeps them ([`keep_token_outputs`]; `decisions`: a chain step's
    unperturbed scores and, with `output_logits`, raw logits, each `(b, N, V)`), and [`advance`]."""
    num_new, stopped = truncate_at_stops(state, setup, new_tokens, (num_accepted + 1) * feed.deciding)
    if setup.streamer is not None and int(num_new[0]) > 0:  # batch size 1 only
        setup.streamer.put(new_tokens[0, : int(num_new[0])].cpu())
    if setup.output_scores or setup.output_logits:
        if decisions is None:  # refused before decoding (`loop.decoding_setup`)
            raise ValueError("output_scores / output_logits: a tree step keeps no per-token scores")
        state = keep_token_outputs(state, setup, *decisions, num_new)
    verdict = Verdict(new_tokens=new_tokens, num_new=num_new, num_accepted=num_accepted, stopped=stopped)
    return advance(state, setup, feed, verdict, states)

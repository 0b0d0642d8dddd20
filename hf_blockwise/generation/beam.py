"""Beam search through the blockwise loop: transformers' beam search, replayed over verified drafts.

    draft a chain (or a tree) per live beam -> feed [last token | drafts | filler] for every beam -> one forward
    -> replay beam search's steps on the verified scores: each live beam is scored at the column of its row that
       holds its last token (a draft), which exists while every live beam extends its row by drafts
    -> the first step whose beams leave the drafts stops the replay -> reorder the cache rows to the live beams'
       rows, compact each one's path (trees), crop to the replayed steps

Every step is `boundary.beam_search_step`, transformers' own beam search step, fed the scores it would have computed
(`log_softmax` of the logits, then the logits processors over the live beams), so the output is beam search's
output by construction, as far as the logits are: the compiled engine computes one arithmetic at every width;
eager verification computes a multi-token feed with other vectorized sums than a one-token one, which can flip a
near-tie (as for greedy), and so can a tree's side branches, which attend to their ancestors in other slots than a
chain's (through the engine they get their chain's bits: `fixed_order.py`). Without drafts, every forward takes one
step: beam search itself, in this loop.

Why trees: a chain holds one child per beam, but beam search often keeps two children of one beam (its best and its
runner-up), and then the replay stops. `scripts/beam_ceiling.py` measures it: with perfect chains a call replays ~1.3
steps, with trees of each beam's 2 or 3 best children per depth 2.3-2.9 (4 beams, k = 4).

All beams of a call have the same length, so the cache has one length and no row feeds pending tokens. A step that
ends beam search (`unfinished` false) ends the replay and the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from transformers import LogitsProcessorList, StoppingCriteriaList

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts, VerifiedStates
from hf_blockwise.engine import CompiledDecoder
from hf_blockwise.generation.state import DecodingStats
from hf_blockwise.generation.tree import ancestry, path_to


@dataclass(frozen=True)
class BeamSetup:
    """What stays fixed during one beam search call.

    Attributes:
        model: the seq2seq model. drafter ([`Drafter`]). logits_processor, stopping_criteria: `generate`'s.
        options ([`hf.BeamOptions`]). block_size (`int`): most beam steps one forward can take (1 + drafts).
        filler_token_id (`int`): what fills a feed after a beam's drafts. engine ([`CompiledDecoder`], *optional*).
        position_limit (`int`, *optional*): positions the decoder has (a tree's columns are numbered up to there
            before they are placed by depth); `None` when unbounded.
    """

    model: nn.Module
    drafter: Drafter
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    options: hf.BeamOptions
    block_size: int
    filler_token_id: int
    engine: CompiledDecoder | None = None
    position_limit: int | None = None


@dataclass(frozen=True)
class BeamState:
    """Everything one beam step reads and the next receives.

    Attributes:
        search ([`hf.BeamSearchState`]): transformers' beam search state.
        cache: the decoder cache of the `batch_size * num_beams` live beams, `cache_length` positions valid (every
            beam's tokens but its last).
        forward_kwargs (`dict`): what every decoder forward receives (encoder output, attention mask).
        encoder_input_ids, encoder_attention_mask (`torch.Tensor` of shape `(batch_size * num_beams, source_length)`,
            *optional*): the source, per beam.
        last_states (`torch.Tensor` of shape `(batch_size * num_beams, hidden_size)`, *optional*): the state that
            predicted each beam's last token. verified_states ([`VerifiedStates`], *optional*).
        drafter_state: the drafter's per-call state, its rows the live beams.
        all_scores (`tuple`, *optional*): per step, the processed scores (`output_scores`).
        steps (`list[int]`): beam steps taken by each forward.
    """

    search: hf.BeamSearchState
    cache: Any
    cache_length: int
    forward_kwargs: dict[str, Any]
    encoder_input_ids: torch.Tensor | None
    encoder_attention_mask: torch.Tensor | None
    last_states: torch.Tensor | None
    verified_states: VerifiedStates | None
    drafter_state: Any
    all_scores: tuple[torch.Tensor, ...] | None
    steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class BeamFeed:
    """One forward's input, as a tree (a chain is a tree whose column j follows column j - 1).

    Attributes:
        tokens (`torch.LongTensor` of shape `(rows, width)`): the prompt (first forward), else each beam's last token,
            its drafts, filler.
        parent (`torch.LongTensor` of shape `(rows, width)`): the column each column follows (`-1`: none).
        drafted (`torch.BoolTensor` of shape `(rows, width)`): the drafts a live beam may reach.
        depth (`torch.LongTensor` of shape `(rows, width)`): each column's position after the cache.
        tree ([`hf.TreeInputs`], *optional*): a tree feed's positions and ancestry; `None` for a chain.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    drafted: torch.Tensor
    depth: torch.Tensor
    tree: hf.TreeInputs | None = None


@dataclass(frozen=True)
class Replay:
    """Where a replay of beam steps over one forward stands: the search; each live beam's row of the forward
    (`origin`) and the column of that row whose output scores its next token (`column`), both of shape
    `(batch_size * num_beams,)`; the steps taken; the per-step scores."""

    search: hf.BeamSearchState
    origin: torch.Tensor
    column: torch.Tensor
    steps: int
    all_scores: tuple[torch.Tensor, ...] | None


def draft_request(state: BeamState, setup: BeamSetup) -> DraftRequest:
    """What the drafter sees: every live beam as a row, its tokens so far, drafts up to `block_size - 1`."""
    search = state.search
    sequences = search.running.reshape(-1, search.running.shape[-1])  # (b * n, max_length)
    lengths = torch.full((sequences.shape[0],), search.cur_len, dtype=torch.long, device=sequences.device)
    # no draft past the last position beam search feeds (max_length - 2)
    room = max(setup.options.max_length - 1 - search.cur_len, 0)
    return DraftRequest(
        sequences=sequences, lengths=lengths, max_drafts=torch.full_like(lengths, min(setup.block_size - 1, room)),
        last_states=state.last_states, encoder_input_ids=state.encoder_input_ids,
        encoder_attention_mask=state.encoder_attention_mask, drafter_state=state.drafter_state,
        verified_states=state.verified_states, encoder_hidden_states=hf.encoder_hidden_states(state.forward_kwargs),
        compile=None if setup.engine is None else setup.engine.options,
        rows=torch.arange(sequences.shape[0], device=sequences.device),
    )  # fmt: skip


def draft(state: BeamState, setup: BeamSetup) -> Drafts:
    """Each live beam's chain or tree of drafts (none before the first forward, or with one-step blocks)."""
    rows = state.search.running.shape[0] * state.search.running.shape[1]
    if state.cache_length == 0 or setup.block_size == 1:
        return Drafts.empty(rows, state.search.running.device)
    request = draft_request(state, setup)
    drafts = setup.drafter.get_candidates(request)
    if drafts.parents is not None:  # nodes past the positions the model has are dropped (parents come first)
        limit = drafts.tokens.shape[1]
        if setup.position_limit is not None:
            limit = max(min(limit, setup.position_limit - state.cache_length - 1), 0)
        return Drafts(drafts.tokens[:, :limit], drafts.lengths.clamp(max=limit), drafts.parents[:, :limit])
    lengths = torch.minimum(drafts.lengths.to(request.max_drafts), request.max_drafts)
    return Drafts(tokens=drafts.tokens[:, : int(request.max_drafts.max())], lengths=lengths)


def build_feed(state: BeamState, setup: BeamSetup, drafts: Drafts) -> BeamFeed:
    """The forward's input: the prompt at the first forward, else each beam's last token and its drafts, a chain
    or (with `drafts.parents`) a tree, then filler (after a beam's drafts, where the mask hides it)."""
    search = state.search
    running = search.running.reshape(-1, search.running.shape[-1])  # (rows, max_length)
    if state.cache_length == 0:
        prompt = running[:, : search.cur_len]
        columns = torch.arange(prompt.shape[1], device=prompt.device).expand_as(prompt)
        nothing = torch.zeros_like(prompt, dtype=torch.bool)
        return BeamFeed(tokens=prompt, parent=columns - 1, drafted=nothing, depth=columns)
    width = drafts.tokens.shape[1]
    node = torch.arange(width, device=running.device).expand(running.shape[0], -1)  # (rows, D)
    is_node = node < drafts.lengths[:, None]
    last = running[:, search.cur_len - 1 : search.cur_len]  # (rows, 1)
    tokens = torch.cat([last, torch.where(is_node, drafts.tokens, setup.filler_token_id)], dim=1)  # (rows, W)
    drafted = torch.cat([torch.zeros_like(last, dtype=torch.bool), is_node], dim=1)  # (rows, W)
    columns = torch.arange(width + 1, device=running.device).expand_as(tokens)
    if drafts.parents is None:
        return BeamFeed(tokens=tokens, parent=columns - 1, drafted=drafted, depth=columns)
    parent = torch.cat([torch.full_like(last, -1), torch.where(is_node, drafts.parents + 1, -1)], dim=1)
    ancestors = ancestry(parent)  # filler follows nothing: itself only
    depth = torch.where(drafted, ancestors.sum(dim=2) - 1, columns)
    room = setup.options.max_length - 1 - search.cur_len  # no draft past the last position beam search feeds
    drafted = drafted & (depth <= room)
    return BeamFeed(tokens, parent, drafted, depth, hf.TreeInputs(depth=depth, ancestors=ancestors))


def forward(state: BeamState, setup: BeamSetup, feed: BeamFeed) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder pass over the feed: logits `(rows, width, vocab)` and, for drafters that read them, states."""
    if setup.engine is not None:
        return setup.engine.forward(feed.tokens, state.cache, state.forward_kwargs, state.cache_length, feed.tree)
    capture = setup.drafter.reads_decoder_states
    return hf.decoder_forward(
        setup.model, feed.tokens, state.cache, state.forward_kwargs, capture_states=capture, tree=feed.tree
    )


def descend(replay: Replay, feed: BeamFeed) -> Replay | None:
    """Each live beam's column after its last step: the draft of its row that follows its parent's column and holds
    its newest token; `None` when some live beam has none (one host read), which ends the replay."""
    search = replay.search
    last = search.running[:, :, search.cur_len - 1].reshape(-1)  # (rows,) each live beam's newest token
    child = (
        feed.drafted[replay.origin]
        & (feed.parent[replay.origin] == replay.column[:, None])
        & (feed.tokens[replay.origin] == last[:, None])
    )  # (rows, W)
    if not bool(child.any(dim=1).all()):
        return None
    return replace(replay, column=child.long().argmax(dim=1))


def replay_step(replay: Replay, setup: BeamSetup, logits: torch.Tensor) -> Replay:
    """One beam search step on the logits at each live beam's column of its row: scores as `_beam_search` computes
    them (`log_softmax` in float32, then the processors over the live beams), then its step. The new beams keep
    their parent's row and column until [`descend`] finds their own."""
    search = replay.search
    beams = search.running.reshape(-1, search.running.shape[-1])[:, : search.cur_len]  # (b * n, cur_len)
    scores = nn.functional.log_softmax(logits[replay.origin, replay.column].float(), dim=-1)  # (b * n, vocab)
    scores = setup.logits_processor(beams, scores)
    all_scores = None if replay.all_scores is None else (*replay.all_scores, scores.clone())
    search, parents = hf.beam_search_step(
        setup.model, search, scores, setup.stopping_criteria, setup.options, all_scores
    )
    return Replay(
        search=search, origin=replay.origin[parents], column=replay.column[parents], steps=replay.steps + 1,
        all_scores=all_scores,
    )  # fmt: skip


def replay_steps(state: BeamState, setup: BeamSetup, feed: BeamFeed, logits: torch.Tensor) -> Replay:
    """Beam search's steps over one forward, from the column that scores the beams as they were (the last), for as
    long as every live beam stays inside the drafts and beam search goes on."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    first = torch.full_like(rows, feed.tokens.shape[1] - 1 if state.cache_length == 0 else 0)
    replay = replay_step(Replay(state.search, rows, first, 0, state.all_scores), setup, logits)
    while replay.search.unfinished and (descended := descend(replay, feed)) is not None:
        replay = replay_step(descended, setup, logits)
    return replay


def conclude(
    state: BeamState, setup: BeamSetup, feed: BeamFeed, replay: Replay, states: torch.Tensor | None
) -> BeamState:
    """The state after a forward and its replay: the cache rows reordered to the live beams' rows, each one's path
    made consecutive (trees), cropped to the columns every live beam has verified; the states and the drafter's
    state gathered the same way."""
    # the columns of each live beam's path, up to the one that scored its newest token: the same for all beams
    valid = int(feed.depth[replay.origin[:1], replay.column[:1]]) + 1
    # each live beam's path in its row, to the column that scored its newest token
    path = None if feed.tree is None else path_to(feed.tree.ancestors[replay.origin], feed.depth[replay.origin],
                                                  replay.column)  # fmt: skip
    # a tree's paths are compacted from anywhere in the fed columns; a chain keeps its first `valid`
    moved = state.cache_length + (valid if path is None else feed.tokens.shape[1])
    hf.reorder_cache_rows(state.cache, replay.origin, moved)
    if path is not None:
        hf.compact_cache(state.cache, state.cache_length, path)
    hf.crop_cache(state.cache, state.cache_length + valid)
    last_states = verified = None
    if states is not None:
        gathered = states[replay.origin]  # (rows, W, hidden)
        if path is not None:
            gathered = gathered.gather(1, path[..., None].expand(-1, -1, gathered.shape[2]))  # along each path
        last_states = gathered[:, valid - 1]
        num_valid = torch.full((gathered.shape[0],), valid, dtype=torch.long, device=gathered.device)
        verified = VerifiedStates(states=gathered, start=state.cache_length, num_valid=num_valid)
    return replace(
        state, search=replay.search, cache_length=state.cache_length + valid, last_states=last_states,
        verified_states=verified, drafter_state=setup.drafter.select_rows(state.drafter_state, replay.origin),
        all_scores=replay.all_scores, steps=[*state.steps, replay.steps],
    )  # fmt: skip


def beam_step(state: BeamState, setup: BeamSetup) -> BeamState:
    """Draft, one forward, replay, conclude."""
    feed = build_feed(state, setup, draft(state, setup))
    logits, states = forward(state, setup, feed)
    return conclude(state, setup, feed, replay_steps(state, setup, feed, logits), states)


def initial_beam_state(call: hf.GenerateCall, setup: BeamSetup) -> BeamState:
    """The state before the first forward: the prompt in every beam, nothing cached."""
    options, source = setup.options, call.encoder_input_ids  # one row per beam, as the call expands them
    search = hf.initial_beam_search(call.decoder_input_ids, options)
    return BeamState(
        search=search, cache=call.cache, cache_length=0, forward_kwargs=call.forward_kwargs,
        encoder_input_ids=source, encoder_attention_mask=call.encoder_attention_mask, last_states=None,
        verified_states=None, drafter_state=setup.drafter.prepare(source, call.encoder_attention_mask),
        all_scores=() if options.output_scores and options.return_dict else None,
    )  # fmt: skip


def beam_search(state: BeamState, setup: BeamSetup, compiled_before: int) -> Any:
    """Runs the beam loop from `state` to its end; returns what `generate(num_beams=N)` returns."""
    while state.search.unfinished:
        state = beam_step(state, setup)
    options = setup.options
    # (forwards, returned rows): beam steps per forward, the same for every row (all beams of a call step together)
    steps = torch.tensor(state.steps).unsqueeze(1).expand(-1, options.batch_size * options.num_return_sequences)
    compiled = 0 if setup.engine is None else setup.engine.compiled_calls - compiled_before
    stats = DecodingStats(num_forwards=len(state.steps), accepted=steps, compiled_forwards=compiled)
    return hf.beam_search_output(state.search, setup.options, state.all_scores, decoding_stats=stats)

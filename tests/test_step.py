"""Unit tests of the decoding step's pure functions on hand-made tensors (no model)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

from hf_blockwise import Drafts, ExactAcceptance, NoDrafter, TopKAcceptance
from hf_blockwise import boundary as hf
from hf_blockwise.boundary import StopRules
from hf_blockwise.generation.state import DecodingSetup, DecodingState, StepFeed, Verdict
from hf_blockwise.generation.step import (
    advance,
    build_feed,
    decision_columns,
    decision_scores,
    truncate_at_stops,
    verify,
)

FILLER = 0
VOCAB = 10


def make_setup(block_size: int = 4, processors=None, pad_cut=None, max_length: int = 20, batch_size: int = 2):
    return DecodingSetup(
        model=None,
        drafter=NoDrafter(),
        acceptance=ExactAcceptance(),
        logits_processor=LogitsProcessorList(processors or []),
        stop_rules=StopRules(max_length=max_length, eos_token_ids=torch.tensor([9]), others=[]),
        block_size=block_size,
        filler_token_id=FILLER,
        pad_cut_token_id=pad_cut,
        batch_size=batch_size,
    )


def make_cache(batch_size: int, length: int) -> EncoderDecoderCache:
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    positions = torch.arange(length, dtype=torch.float)[None, None, :, None]  # key = position, per row offset
    rows = torch.arange(batch_size, dtype=torch.float)[:, None, None, None] * 100
    cache.self_attention_cache.update(rows + positions, rows + positions, 0)
    cache.cross_attention_cache.update(rows + torch.zeros(1, 1, 3, 1), rows + torch.zeros(1, 1, 3, 1), 0)
    return cache


def make_state(sequences, lengths, cache_length, cache=None) -> DecodingState:
    sequences, lengths = torch.tensor(sequences), torch.tensor(lengths)
    pending = lengths - cache_length
    return DecodingState(
        sequences=sequences,
        lengths=lengths,
        rows=torch.arange(len(lengths)),
        cache_length=cache_length,
        max_pending=int(pending.max()),
        min_pending=int(pending.min()),
        cache=cache if cache is not None else make_cache(len(lengths), cache_length),
        forward_kwargs={},
        encoder_input_ids=None,
        encoder_attention_mask=None,
        last_states=None,
        verified_states=None,
        drafter_state=None,
        output=sequences.clone(),
        output_lengths=lengths.clone(),
    )


# two rows: 4 and 6 verified tokens, 3 of each in the cache; row 1 is two tokens ahead
SEQUENCES = [[1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 5, 6, 7, 0, 0, 0, 0, 0, 0]]


def test_feed_puts_pending_tokens_then_drafts_and_rows_ahead_draft_less() -> None:
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    drafts = Drafts(tokens=torch.tensor([[11, 12, 13], [21, 22, 23]]), lengths=torch.tensor([3, 3]))
    feed = build_feed(state, make_setup(), drafts, max_drafts=torch.tensor([3, 1]))
    assert feed.tokens.tolist() == [[4, 11, 12, 13], [5, 6, 7, 21]]
    assert feed.num_pending.tolist() == [1, 3]
    assert feed.num_drafts_fed.tolist() == [3, 1]
    assert feed.deciding.tolist() == [True, True]


def test_feed_width_is_known_without_reading_drafts_and_short_drafts_leave_filler() -> None:
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    drafts = Drafts(tokens=torch.tensor([[11, 12], [21, 22]]), lengths=torch.tensor([1, 0]))
    feed = build_feed(state, make_setup(), drafts, max_drafts=torch.tensor([3, 1]))
    assert feed.tokens.tolist() == [[4, 11, FILLER, FILLER], [5, 6, 7, FILLER]]
    assert feed.num_drafts_fed.tolist() == [1, 0]


def test_feed_ends_after_a_pad_for_models_counting_non_pad_positions() -> None:
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    drafts = Drafts(tokens=torch.tensor([[11, 7, 13], [21, 22, 23]]), lengths=torch.tensor([3, 3]))
    feed = build_feed(state, make_setup(pad_cut=7), drafts, max_drafts=torch.tensor([3, 1]))
    # row 0 feeds its pad draft and stops there; row 1's pending tokens hold the pad: it is cut after it
    assert feed.tokens.tolist() == [[4, 11, 7, FILLER], [5, 6, 7, FILLER]]
    assert feed.num_drafts_fed.tolist() == [2, 0]
    assert feed.deciding.tolist() == [True, True]


def one_hot_scores(choices: list[list[int]]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(choices), VOCAB).float()  # (b, N, V)


def test_verify_keeps_the_matching_prefix_then_the_models_own_token() -> None:
    feed = StepFeed(
        tokens=torch.tensor([[4, 1, 2, 3], [5, 6, 7, 8]]),
        num_pending=torch.tensor([1, 3]),
        num_pending_fed=torch.tensor([1, 3]),
        num_drafts_fed=torch.tensor([3, 1]),
        deciding=torch.tensor([True, True]),
    )
    # row 0: drafts 1, 2 match, 3 does not (model says 5); row 1: its one draft 8 is rejected (model says 4)
    scores = one_hot_scores([[1, 2, 5, 6], [4, 0, 0, 0]])
    for rule in (ExactAcceptance(), TopKAcceptance(top_k=1)):
        setup = DecodingSetup(**{**make_setup().__dict__, "acceptance": rule})
        columns = decision_columns(make_state(SEQUENCES, [4, 6], cache_length=3), feed)
        new_tokens, num_accepted = verify(scores, feed, setup, columns)
        assert num_accepted.tolist() == [2, 0]
        assert new_tokens[0, :3].tolist() == [1, 2, 5]
        assert new_tokens[1, 0].item() == 4


def test_stops_cut_new_tokens_at_eos_and_at_max_length() -> None:
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    new_tokens = torch.tensor([[1, 9, 2, 3], [4, 5, 6, 7]])
    num_new, stopped = truncate_at_stops(state, make_setup(max_length=8), new_tokens, torch.tensor([4, 4]))
    assert num_new.tolist() == [2, 2]  # row 0 ends with its EOS, row 1 at length 8
    assert stopped.tolist() == [True, True]


class RecordingProcessor(LogitsProcessor):
    def __init__(self) -> None:
        self.prefix_lengths: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.prefix_lengths.append(input_ids.shape[1])
        return scores - 1.0


def test_processors_run_once_per_deciding_column_with_the_prefix_greedy_would_see() -> None:
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    feed = build_feed(
        state,
        make_setup(),
        Drafts(tokens=torch.tensor([[11, 12, 13], [21, 22, 23]]), lengths=torch.tensor([3, 3])),
        max_drafts=torch.tensor([3, 1]),
    )
    recorder = RecordingProcessor()
    logits = torch.randn(2, 4, VOCAB)
    scores = decision_scores(state, make_setup(processors=[recorder]), feed, logits, decision_columns(state, feed))
    # columns 0..3 decide for row 0 (min pending 1): prefixes of 3 cached + 1..4 fed tokens
    assert recorder.prefix_lengths == [4, 5, 6, 7]
    assert scores.shape == (2, 4, VOCAB)
    torch.testing.assert_close(scores[0], logits[0] - 1.0)
    torch.testing.assert_close(scores[1, :2], logits[1, 2:] - 1.0)  # row 1 decides at columns 2 and 3


def verified_step(stopped: list[bool]) -> tuple:
    """A two-row state (lengths 4 and 6, 3 cached), the 4-column feed of its step (row 0: 1 pending + 3 drafts,
    row 1: 3 pending + 1 draft, written into the cache) and its verdict (row 0 accepts 2 drafts + 1 token, row 1
    gains 1 token), rows stopping as `stopped` says."""
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    feed = StepFeed(
        tokens=torch.tensor([[4, 1, 2, 3], [5, 6, 7, 8]]),
        num_pending=torch.tensor([1, 3]),
        num_pending_fed=torch.tensor([1, 3]),
        num_drafts_fed=torch.tensor([3, 1]),
        deciding=torch.tensor([True, True]),
    )
    state.cache.self_attention_cache.update(torch.zeros(2, 1, 4, 1), torch.zeros(2, 1, 4, 1), 0)  # the fed columns
    verdict = Verdict(
        new_tokens=torch.tensor([[1, 2, 5, 0], [4, 0, 0, 0]]),
        num_new=torch.tensor([3, 1]),
        num_accepted=torch.tensor([2, 0]),
        stopped=torch.tensor(stopped),
    )
    return state, feed, verdict


def test_advance_crops_to_the_shortest_verified_prefix_and_drops_finished_rows() -> None:
    state, feed, verdict = verified_step([False, False])
    after = advance(state, make_setup(), feed, verdict, states=None)
    # row 0 verified 3 + 1 + 2 = 6 cached positions, row 1 3 + 3 + 0 = 6: the cache keeps 6
    assert after.cache_length == 6 and after.cache.get_seq_length() == 6
    assert after.lengths.tolist() == [7, 7]
    assert (after.max_pending, after.min_pending) == (1, 1)
    assert after.sequences[0, :7].tolist() == [1, 2, 3, 4, 1, 2, 5]
    assert after.accepted[-1].tolist() == [3, 1]

    finished = Verdict(
        new_tokens=torch.tensor([[9, 0], [3, 0]]),
        num_new=torch.tensor([1, 1]),
        num_accepted=torch.tensor([0, 0]),
        stopped=torch.tensor([True, False]),
    )
    one_step = StepFeed(
        tokens=torch.tensor([[5], [4]]),
        num_pending=torch.tensor([1, 1]),
        num_pending_fed=torch.tensor([1, 1]),
        num_drafts_fed=torch.tensor([0, 0]),
        deciding=torch.tensor([True, True]),
    )
    last = advance(after, make_setup(), one_step, finished, states=None)
    assert last.rows.tolist() == [1]  # row 0 left the batch, and the cache with it
    assert last.cache.self_attention_cache.layers[0].keys.shape[0] == 1
    assert last.cache.self_attention_cache.layers[0].keys[0, 0, 0, 0].item() == 100.0  # row 1's keys kept
    assert last.output[0, :8].tolist() == [1, 2, 3, 4, 1, 2, 5, 9]  # row 0's output, at its caller index
    assert last.output_lengths[0].item() == 8


def test_advance_hands_every_state_of_the_pass_with_its_verified_columns() -> None:
    """What a feature drafter continues from: the pass's states, the position of column 0, and per row the
    columns whose input and next token are both verified now (pending fed + drafts accepted)."""
    state, feed, verdict = verified_step([False, True])
    states = torch.arange(2 * 4 * 3, dtype=torch.float).reshape(2, 4, 3)  # (b, W, d)
    after = advance(state, make_setup(), feed, verdict, states=states)
    verified = after.verified_states
    assert verified.start == 3
    assert verified.num_valid.tolist() == [3]  # row 0: 1 pending + 2 accepted; row 1 finished and left
    assert torch.equal(verified.states, states[:1])
    assert torch.equal(after.last_states, states[0, 2][None])  # the state that chose row 0's last token


def test_prefix_free_and_inactive_processors_skip_per_column_calls_with_the_same_scores() -> None:
    """bad_words of single tokens are applied to all columns at once, a forced EOS only where it acts; the
    scores equal calling the whole list once per column with that column's prefix."""
    from transformers.generation.logits_process import (
        ForcedEOSTokenLogitsProcessor,
        MinLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    recorder = RecordingProcessor()
    for extra in ([], [RepetitionPenaltyLogitsProcessor(1.5)]):
        processors = [
            NoBadWordsLogitsProcessor([[3], [4]], eos_token_id=9),
            MinLengthLogitsProcessor(6, eos_token_id=9),
            ForcedEOSTokenLogitsProcessor(max_length=8, eos_token_id=9),
            *extra,
        ]
        state = make_state(SEQUENCES, [4, 6], cache_length=3)
        drafts = Drafts(tokens=torch.tensor([[1, 2, 5], [2, 5, 6]]), lengths=torch.tensor([3, 3]))
        feed = build_feed(state, make_setup(), drafts, max_drafts=torch.tensor([3, 1]))
        logits = torch.randn(2, 4, VOCAB)
        scores = decision_scores(state, make_setup(processors=processors), feed, logits, decision_columns(state, feed))
        decision_scores(
            state, make_setup(processors=[*processors, recorder]), feed, logits, decision_columns(state, feed)
        )
        context = torch.cat([state.sequences[:, :3], feed.tokens], dim=1)
        expected = torch.stack(
            [LogitsProcessorList(processors)(context[:, : 4 + column], logits[:, column]) for column in range(4)], 1
        )
        torch.testing.assert_close(scores[0], expected[0])
        torch.testing.assert_close(scores[1, :2], expected[1, 2:])
    # the recorder is not known to ignore the prefix, so it ran once per column both times
    assert recorder.prefix_lengths == [4, 5, 6, 7] * 2


def test_only_prefix_free_processors_need_no_per_column_call() -> None:
    from transformers.generation.logits_process import ForcedEOSTokenLogitsProcessor, NoBadWordsLogitsProcessor

    class Forbidden(LogitsProcessor):  # would fail if called per column
        def __call__(self, input_ids, scores):
            raise AssertionError("called per column")

    forced_eos = ForcedEOSTokenLogitsProcessor(max_length=50, eos_token_id=9)  # inactive at these lengths
    bad_words = NoBadWordsLogitsProcessor([[3]], eos_token_id=9)
    state = make_state(SEQUENCES, [4, 6], cache_length=3)
    drafts = Drafts(tokens=torch.tensor([[1, 2, 5], [2, 5, 6]]), lengths=torch.tensor([3, 3]))
    feed = build_feed(state, make_setup(), drafts, max_drafts=torch.tensor([3, 1]))
    logits = torch.randn(2, 4, VOCAB)
    setup = make_setup(processors=[bad_words, forced_eos])
    scores = decision_scores(state, setup, feed, logits, decision_columns(state, feed))
    assert torch.isinf(scores[..., 3]).all() and torch.equal(scores[0, :, 5], logits[0, :, 5])
    assert hf.processor_acts_at(forced_eos, 49) and not hf.processor_acts_at(forced_eos, 7)
    assert not hf.processor_ignores_prefix(Forbidden())

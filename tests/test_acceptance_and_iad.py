"""Approximate acceptance rules (Stern §5, Ge §3.2.3) and input-guided drafting (Ge §3.1)."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter, build_model, random_batch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_blockwise import (
    DistanceAcceptance,
    ExactAcceptance,
    GADPlusPlusAcceptance,
    InputCopyDrafter,
    MinimumBlockAcceptance,
    TopKAcceptance,
    blockwise_generate,
)
from hf_blockwise.drafters.input_copy import input_copy_drafts, sentinel_source

# ---------------------------------------------------------------------------------------------------------
# Rules on hand-made scores
# ---------------------------------------------------------------------------------------------------------

SCORES = torch.tensor([[[0.0, 3.0, 2.5, 1.0, -1.0], [4.0, 0.0, 3.9, 0.0, 0.0]]])  # (1, 2, 5): best 1, then 0


def test_top_k_accepts_within_the_k_best() -> None:
    drafts = torch.tensor([[2, 2]])  # second best at position 0, second best at position 1
    assert TopKAcceptance(1)(SCORES, drafts).tolist() == [[False, False]]
    assert TopKAcceptance(2)(SCORES, drafts).tolist() == [[True, True]]
    assert TopKAcceptance(2)(SCORES, torch.tensor([[3, 4]])).tolist() == [[False, False]]


def test_distance_accepts_close_values_only() -> None:
    values = torch.tensor([0.0, 10.0, 11.0, 13.0, float("nan")])
    drafts = torch.tensor([[2, 2]])  # value 11: distance 1 from 10 (position 0), 11 from 0 (position 1)
    assert DistanceAcceptance(values, epsilon=1.0)(SCORES, drafts).tolist() == [[True, False]]
    assert DistanceAcceptance(values, epsilon=0.0)(SCORES, drafts).tolist() == [[False, False]]
    assert DistanceAcceptance(values, epsilon=100.0)(SCORES, torch.tensor([[4, 0]])).tolist() == [[False, True]]


def test_gad_plus_plus_needs_top_beta_and_tolerance() -> None:
    drafts = torch.tensor([[2, 2]])  # log-prob gaps to the best: 0.5 and 0.1
    assert GADPlusPlusAcceptance(top_beta=2, tolerance=0.2)(SCORES, drafts).tolist() == [[False, True]]
    assert GADPlusPlusAcceptance(top_beta=2, tolerance=0.6)(SCORES, drafts).tolist() == [[True, True]]
    assert GADPlusPlusAcceptance(top_beta=1, tolerance=5.0)(SCORES, drafts).tolist() == [[False, False]]


def test_minimum_block_forces_the_first_drafts() -> None:
    drafts = torch.tensor([[4, 4, 1]])
    scores = torch.cat([SCORES, SCORES[:, :1]], dim=1)  # (1, 3, 5)
    assert MinimumBlockAcceptance(ExactAcceptance(), 3)(scores, drafts).tolist() == [[True, True, True]]
    assert MinimumBlockAcceptance(ExactAcceptance(), 2)(scores, drafts).tolist() == [[True, False, True]]


def test_rules_validate_their_parameters() -> None:
    with pytest.raises(ValueError, match="top_k"):
        TopKAcceptance(0)
    with pytest.raises(ValueError, match="epsilon"):
        DistanceAcceptance(torch.zeros(5), epsilon=-1.0)
    with pytest.raises(ValueError, match="token_values"):
        DistanceAcceptance(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="tolerance"):
        GADPlusPlusAcceptance(2, -0.5)
    with pytest.raises(TypeError, match="AcceptanceRule"):
        MinimumBlockAcceptance(rule="exact", min_block=2)
    with pytest.raises(ValueError, match="entries but the model scores"):
        DistanceAcceptance(torch.zeros(3))(SCORES, torch.tensor([[1, 1]]))


# ---------------------------------------------------------------------------------------------------------
# Approximate rules inside the decoding loop: every token of the output satisfies the rule
# ---------------------------------------------------------------------------------------------------------


def teacher_forced_logits(model, batch, sequences: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch, decoder_input_ids=sequences).logits  # (B, T, V)


@pytest.mark.parametrize(
    "rule",
    [TopKAcceptance(3), GADPlusPlusAcceptance(top_beta=3, tolerance=1.5), DistanceAcceptance(torch.arange(64.0), 4)],
    ids=["top_3", "gad_plus_plus", "distance_4"],
)
@pytest.mark.parametrize("architecture", ["bart", "t5"])
def test_every_output_token_satisfies_an_approximate_rule(architecture: str, rule) -> None:
    base = build_model(architecture, seed=13)
    batch = random_batch(base, 4, seed=5)
    greedy = base.generate(**batch, max_new_tokens=16)
    noisy = torch.where(torch.rand(greedy.shape, generator=torch.Generator().manual_seed(0)) < 0.5, greedy + 1, greedy)
    output = base.generate(
        **batch, max_new_tokens=16, custom_generate=blockwise_generate,
        assistant=OracleDrafter(noisy % 64, block_size=5), acceptance=rule, return_dict_in_generate=True,
    )  # fmt: skip
    sequences = output.sequences
    logits = teacher_forced_logits(base, batch, sequences)
    pad, eos = base.config.pad_token_id, base.config.eos_token_id
    for row in range(sequences.shape[0]):
        for position in range(1, sequences.shape[1]):
            token = sequences[row, position]
            if token == pad and (sequences[row, 1:position] == eos).any():
                break  # padding after the row finished
            assert rule(logits[row : row + 1, position - 1 : position], token.view(1, 1)).item()
    assert output.decoding_stats.mean_accepted > 1.0  # drafts were kept: the rule was exercised, not bypassed


def test_minimum_block_gains_that_many_tokens_per_step() -> None:
    base = build_model("marian", seed=13)
    batch = random_batch(base, 1, seed=6)
    output = base.generate(
        **batch, max_new_tokens=30, min_new_tokens=30, custom_generate=blockwise_generate,
        assistant=OracleDrafter(torch.full((1, 40), 7), block_size=4),
        acceptance=MinimumBlockAcceptance(ExactAcceptance(), min_block=3), return_dict_in_generate=True,
    )  # fmt: skip
    gained = output.decoding_stats.accepted[:, 0]
    # the prefill step has no drafts (Marian's decoder start is the pad token); the last step may be cut short
    assert (gained[1:-1] >= 3).all()


# ---------------------------------------------------------------------------------------------------------
# Input-guided drafting
# ---------------------------------------------------------------------------------------------------------


def drafts_for(
    source: list[int], output: list[int], num_drafts: int = 4, max_ngram: int = 4, realign: bool = False
) -> list[int]:
    ids = torch.tensor([source])
    sentinel, lengths = sentinel_source(ids, torch.ones_like(ids))
    sequences = torch.tensor([[0, *output, 0, 0, 0]])
    length = torch.tensor([1 + len(output)])
    drafts = input_copy_drafts(sentinel, lengths, sequences, length, num_drafts, max_ngram, realign=realign)
    return drafts.tokens[0, : int(drafts.lengths[0])].tolist()


def test_input_copy_drafts_follow_the_unique_match() -> None:
    source = [10, 11, 12, 13, 14, 1]
    assert drafts_for(source, []) == [10, 11, 12, 13]  # the start sentinel anchors the first draft
    assert drafts_for(source, [10, 11]) == [12, 13, 14, 1]
    assert drafts_for(source, [10, 11, 12, 13, 14], num_drafts=4) == [1]  # the source runs out
    assert drafts_for(source, [10, 20]) == []  # the last token is not in the source: decode one at a time
    assert drafts_for(source, [10, 20, 13]) == [14, 1]  # re-anchored after the edit


def test_input_copy_realigns_right_after_an_edit() -> None:
    source = [10, 11, 12, 13, 14, 1]
    # 20 replaced 11: the source resumes after 11, without waiting for the output to match it again
    assert drafts_for(source, [10, 20], realign=True) == [12, 13, 14, 1]
    # 13 right after 10: 11 and 12 were deleted, the source resumes after 13
    assert drafts_for(source, [10, 13], max_ngram=1, realign=True) == drafts_for(source, [10, 13]) == [14, 1]
    assert drafts_for([10, 11, 13, 11, 13, 1], [10, 13], max_ngram=2, realign=True) == [11, 13, 1]  # deleted 11
    assert drafts_for(source, [10, 20, 21], realign=True) == []  # two new tokens: no anchor before the last one
    assert drafts_for(source, [10, 11, 12, 13, 14, 20], realign=True) == []  # past the source's end
    assert drafts_for(source, [20], realign=True) == [11, 12, 13, 14]  # the first token replaced (start sentinel)


def test_input_copy_grows_the_suffix_until_it_is_unique() -> None:
    source = [5, 6, 7, 5, 6, 8, 1]
    assert drafts_for(source, [9, 6], max_ngram=1) == []  # "6" occurs twice; one token is not enough
    assert drafts_for(source, [9, 5, 6]) == []  # "5 6" occurs twice and "9 5 6" nowhere
    assert drafts_for(source, [7, 5, 6]) == [8, 1]  # "7 5 6" is unique


def test_input_copy_handles_padding_on_either_side() -> None:
    right = torch.tensor([[10, 11, 12, 1], [20, 21, 0, 0]])
    left = torch.tensor([[10, 11, 12, 1], [0, 0, 20, 21]])
    for ids, mask in [(right, right != 0), (left, left != 0)]:
        source, lengths = sentinel_source(ids, mask.long())
        assert lengths.tolist() == [5, 3]
        sequences = torch.tensor([[0, 10, 0, 0], [0, 20, 0, 0]])
        drafts = input_copy_drafts(source, lengths, sequences, torch.tensor([2, 2]), 3, 4)
        assert drafts.lengths.tolist() == [3, 1]
        assert drafts.tokens[0].tolist() == [11, 12, 1] and drafts.tokens[1, 0].item() == 21


class CopySource(LogitsProcessor):
    """Forces output token t to be source token t (then EOS): greedy decoding becomes a copy of the input."""

    row_local = True  # row i reads only its own source row

    def __init__(self, input_ids: torch.Tensor, eos_token_id: int, prompt_length: int = 1) -> None:
        self.input_ids, self.eos, self.prompt = input_ids, eos_token_id, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt
        if position < self.input_ids.shape[1]:
            target = self.input_ids[:, position]
        else:
            target = torch.full((scores.shape[0],), self.eos)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter(1, target[:, None], 0.0)


@pytest.mark.parametrize("architecture", ["bart", "t5", "marian", "m2m100"])
def test_input_copy_decodes_a_copy_task_in_one_call(architecture: str) -> None:
    base = build_model(architecture, seed=3)
    source = torch.randint(5, 60, (1, 20), generator=torch.Generator().manual_seed(1))
    source[0, -1] = base.config.eos_token_id
    processors = LogitsProcessorList([CopySource(source, base.config.eos_token_id)])
    greedy = base.generate(input_ids=source, logits_processor=processors, max_new_tokens=30)
    output = base.generate(
        input_ids=source, logits_processor=processors, max_new_tokens=30, custom_generate=blockwise_generate,
        assistant=InputCopyDrafter(base, max_draft_length=32), return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(output.sequences, greedy)
    assert greedy[0, 1:].tolist() == source[0].tolist()
    # all 20 tokens in one verification pass, even where the decoder start token is the pad token
    assert output.decoding_stats.num_forwards == 1


def test_input_copy_refuses_separate_vocabularies() -> None:
    base = build_model("marian", seed=3)
    base.get_decoder().embed_tokens = torch.nn.Embedding(base.config.vocab_size, base.config.d_model)
    with pytest.raises(ValueError, match="separate source and target vocabularies"):
        InputCopyDrafter(base)
    with pytest.raises(ValueError, match="max_draft_length"):
        InputCopyDrafter(build_model("bart", seed=3), max_draft_length=0)

"""Beam search through the blockwise loop (`generation/beam.py`) against transformers' own beam search: sequences,
`sequences_scores`, per-step `scores` and `beam_indices`, over the tiny architectures, batch sizes, the options the
checkpoints users load set, and drafters right most of the time and wrong sometimes."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB_SIZE, build_model, random_batch
from near_ties import count_beam_ties

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel, blockwise_generate
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts
from hf_blockwise.generation.acceptance import TopKAcceptance
from hf_blockwise.generation.capability import UnsupportedModelError

# the generate arguments of the checkpoints that default to beams (opus-mt: 4 beams, bad_words_ids; BART-CNN: length
# penalty 2, min length, no_repeat_ngram_size 3, early stopping), and the other early_stopping values
BEAM_ARGUMENTS = {
    "plain": {"num_beams": 4, "max_new_tokens": 12},
    "opus_mt": {"num_beams": 4, "max_new_tokens": 12, "bad_words_ids": [[5], [7, 8]]},
    "bart_cnn": dict(
        num_beams=4,
        max_new_tokens=14,
        length_penalty=2.0,
        min_new_tokens=6,
        no_repeat_ngram_size=3,
        early_stopping=True,
    ),
    "never_returns_3": {"num_beams": 3, "max_new_tokens": 10, "early_stopping": "never", "num_return_sequences": 3},
    "false_penalty_negative": {"num_beams": 2, "max_new_tokens": 10, "early_stopping": False, "length_penalty": -1.0},
}


class GreedyContinuations(Drafter):
    """Drafts each row's own greedy continuation by the base model (the best a chain drafter can do under beams:
    each beam's best child is its first draft), with a fraction of the drafts corrupted."""

    def __init__(self, model, block_size: int, corruption: float = 0.0, seed: int = 0) -> None:
        self.model, self.block_size, self.corruption, self.seed = model, block_size, corruption, seed

    def get_candidates(self, request: DraftRequest) -> Drafts:
        length = int(request.lengths[0])
        count = int(request.max_drafts.max())
        if count == 0:
            return Drafts.empty(request.lengths.shape[0], request.lengths.device)
        continued = self.model.generate(
            input_ids=request.encoder_input_ids, attention_mask=request.encoder_attention_mask,
            decoder_input_ids=request.sequences[:, :length], max_new_tokens=count, min_new_tokens=count,
            do_sample=False, num_beams=1,
        )  # fmt: skip
        tokens = continued[:, length : length + count]
        generator = torch.Generator().manual_seed(self.seed + length)
        corrupt = torch.rand(tokens.shape, generator=generator) < self.corruption
        tokens = torch.where(corrupt, (tokens + 1) % VOCAB_SIZE, tokens)
        return Drafts(tokens=tokens, lengths=torch.full_like(request.lengths, tokens.shape[1]))


class TopChildrenTrees(Drafter):
    """Drafts, per row, a tree of its `branching` best children by the base model's logits, and each one's
    `branching` best children (depth 2): what beam search keeps is mostly in it. A fraction of nodes corrupted."""

    reads_decoder_states = False

    def __init__(self, model, branching: int = 2, corruption: float = 0.0, seed: int = 0) -> None:
        self.model, self.branching, self.corruption, self.seed = model, branching, corruption, seed
        self.block_size, self.tree_nodes = 3, branching + branching**2

    def best_children(self, request: DraftRequest, prefixes: torch.Tensor, copies: int) -> torch.Tensor:
        logits = self.model(
            input_ids=request.encoder_input_ids.repeat_interleave(copies, dim=0),
            attention_mask=request.encoder_attention_mask.repeat_interleave(copies, dim=0),
            decoder_input_ids=prefixes,
        ).logits[:, -1]
        return logits.topk(self.branching, dim=-1).indices  # (prefixes, m)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        m, rows, length = self.branching, request.lengths.shape[0], int(request.lengths[0])
        prefixes = request.sequences[:, :length]
        first = self.best_children(request, prefixes, 1)  # (rows, m)
        extended = torch.cat([prefixes.repeat_interleave(m, dim=0), first.reshape(-1, 1)], dim=1)
        second = self.best_children(request, extended, m).reshape(rows, m * m)  # (rows, m * m)
        tokens = torch.cat([first, second], dim=1)
        generator = torch.Generator().manual_seed(self.seed + length)
        corrupt = torch.rand(tokens.shape, generator=generator) < self.corruption
        tokens = torch.where(corrupt, (tokens + 1) % VOCAB_SIZE, tokens)
        parents = torch.tensor([-1] * m + [i for i in range(m) for _ in range(m)]).expand(rows, -1)
        count = self.tree_nodes if int(request.max_drafts.max()) >= 2 else m * int(request.max_drafts.max())
        return Drafts(tokens=tokens[:, :count], lengths=torch.full_like(request.lengths, count),
                      parents=parents[:, :count])  # fmt: skip


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: build_model(name) for name in ARCHITECTURES}


def beams_of(model, batch: dict, arguments: dict, **blockwise) -> tuple:
    """transformers' beam search and the beam loop's, with scores and beam indices."""
    common = {**batch, **arguments, "return_dict_in_generate": True, "output_scores": True}
    expected = model.generate(**common)
    actual = model.generate(**common, custom_generate=blockwise_generate, **blockwise)
    return expected, actual


def assert_same_beams(expected, actual, returned: int, tolerance: float = 1e-3) -> None:
    """Eager verification rounds a wider feed otherwise than one-token calls: the same sequences, beam indices and
    scores up to that rounding (relative to the scores: the zoo's peaked models have logits in the thousands, where
    `log_softmax` cancels to ~1e-3). The one freedom: two sequences returned for one input whose scores tie within
    that rounding may come back in either order (the final sort meets a near-tie)."""
    torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, rtol=tolerance, atol=tolerance)
    differing = (expected.sequences != actual.sequences).any(dim=1).nonzero().flatten().tolist()
    for first in sorted({row - row % returned for row in differing}):  # an input whose group came back reordered
        group = range(first, first + returned)
        assert sorted(actual.sequences[row].tolist() for row in group) == sorted(
            expected.sequences[row].tolist() for row in group
        ), f"rows {first}-{first + returned - 1}: not a permutation of beam search's group"
    swaps = []
    for row in differing:  # a sequence of the same input with a tied score took its place
        group = range(row - row % returned, row - row % returned + returned)
        (swapped,) = [other for other in group if torch.equal(actual.sequences[row], expected.sequences[other])][:1]
        gap = float((expected.sequences_scores[row] - expected.sequences_scores[swapped]).abs())
        assert gap <= tolerance, f"row {row}: swapped with row {swapped} at a score gap of {gap}"
        swaps.append((row, gap))
    count_beam_ties(expected.sequences_scores, swaps)
    same = [row for row in range(expected.sequences.shape[0]) if row not in differing]
    assert torch.equal(expected.beam_indices[same], actual.beam_indices[same])


# batch 3 (padded sources) with every option set; batch 1 with the plainest
BATCHED_ARGUMENTS = [(3, name) for name in sorted(BEAM_ARGUMENTS)] + [(1, "plain")]


@pytest.mark.parametrize(("batch_size", "arguments"), BATCHED_ARGUMENTS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_beam_loop_is_transformers_beam_search(models, architecture: str, batch_size: int, arguments: str):
    """Without drafts every forward takes one step, with transformers' own arithmetic: bit for bit."""
    model = models[architecture]
    batch = random_batch(model, batch_size, seed=batch_size)
    expected, actual = beams_of(model, batch, BEAM_ARGUMENTS[arguments])
    assert torch.equal(expected.sequences, actual.sequences)
    assert torch.equal(expected.sequences_scores, actual.sequences_scores)
    assert torch.equal(expected.beam_indices, actual.beam_indices)
    assert len(expected.scores) == len(actual.scores)
    assert all(torch.equal(a, b) for a, b in zip(expected.scores, actual.scores, strict=True))
    assert int(actual.decoding_stats.accepted[:, 0].sum()) == actual.decoding_stats.num_forwards  # a step a forward
    if arguments == "plain":  # without return_dict_in_generate: the sequences
        assert torch.equal(model.generate(**batch, **BEAM_ARGUMENTS[arguments], custom_generate=blockwise_generate),
                           expected.sequences)  # fmt: skip


# drafts right most of the time (30% corrupted) under every option set, and all right under the plainest
DRAFTED_ARGUMENTS = [(name, 0.3) for name in ("plain", "bart_cnn", "never_returns_3")] + [("plain", 0.0)]


@pytest.mark.parametrize(("arguments", "corruption"), DRAFTED_ARGUMENTS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_drafts_under_beams_keep_beam_search_output(models, architecture: str, arguments: str, corruption: float):
    """Each forward verifies a chain per live beam and replays beam search's steps on it while every live beam
    stays inside the drafts: the same sequences, scores equal up to the rounding of a wider feed."""
    model = models[architecture]
    batch = random_batch(model, 3, seed=7)
    drafter = GreedyContinuations(model, block_size=4, corruption=corruption, seed=1)
    expected, actual = beams_of(model, batch, BEAM_ARGUMENTS[arguments], assistant=drafter)
    assert_same_beams(expected, actual, BEAM_ARGUMENTS[arguments].get("num_return_sequences", 1))
    stats = actual.decoding_stats
    assert int(stats.accepted.max()) <= 4 and int(stats.accepted.min()) >= 1


def test_perfect_greedy_drafts_take_several_beam_steps_per_forward(models) -> None:
    """Where every live beam's best child is beam search's choice, a forward replays several steps (the counts are
    the loop's own: every forward's steps sum to the steps beam search took)."""
    model = models["bart"]
    batch = random_batch(model, 1, seed=3)
    arguments = {"num_beams": 2, "max_new_tokens": 12}
    drafter = GreedyContinuations(model, block_size=4)
    expected, actual = beams_of(model, batch, arguments, assistant=drafter)
    assert torch.equal(expected.sequences, actual.sequences)
    stats = actual.decoding_stats
    assert int(stats.accepted[:, 0].sum()) == len(expected.scores)  # every step of beam search, once
    assert stats.num_forwards < len(expected.scores)


TREE_ARCHITECTURES = ("bart", "marian", "mbart", "pegasus")  # decoders with absolute positions (trees need them)


@pytest.mark.parametrize(("arguments", "corruption"), DRAFTED_ARGUMENTS)
@pytest.mark.parametrize("architecture", TREE_ARCHITECTURES)
def test_trees_under_beams_keep_beam_search_output(models, architecture: str, arguments: str, corruption: float):
    """A tree of each beam's best children (and theirs) per live beam: a beam search keeping a beam's runner-up
    child stays inside the drafts, and the output is beam search's."""
    model = models[architecture]
    batch = random_batch(model, 3, seed=5)
    drafter = TopChildrenTrees(model, corruption=corruption, seed=2)
    expected, actual = beams_of(model, batch, BEAM_ARGUMENTS[arguments], assistant=drafter)
    assert_same_beams(expected, actual, BEAM_ARGUMENTS[arguments].get("num_return_sequences", 1))
    assert int(actual.decoding_stats.accepted.max()) <= 3


def test_trees_take_more_beam_steps_per_forward_than_chains(models) -> None:
    """Perfect chains replay a step past the first only when no beam keeps two children; trees of the best two
    children per depth replay more (the figure `scripts/beam_ceiling.py` measures on real data)."""
    model = models["marian"]
    batch = random_batch(model, 2, seed=9)
    arguments = {"num_beams": 3, "max_new_tokens": 12}
    _, chains = beams_of(model, batch, arguments, assistant=GreedyContinuations(model, block_size=3))
    expected, trees = beams_of(model, batch, arguments, assistant=TopChildrenTrees(model))
    assert torch.equal(expected.sequences, trees.sequences)
    assert trees.decoding_stats.num_forwards < chains.decoding_stats.num_forwards


def test_trees_under_beams_through_the_compiled_engine(models) -> None:
    base = models["bart"]
    batch = random_batch(base, 3, seed=13)  # padded sources
    expected = base.generate(**batch, num_beams=3, max_new_tokens=10)
    drafter = TopChildrenTrees(base, corruption=0.2, seed=3)
    actual = base.generate(
        **batch, num_beams=3, max_new_tokens=10, custom_generate=blockwise_generate, assistant=drafter,
        blockwise_compile=True,
    )  # fmt: skip
    assert torch.equal(actual, expected)


def test_heads_draft_under_beams(models) -> None:
    """Heads with random weights (drafts mostly wrong), through their own `generate`: the sequences of beam search
    (the compiled engine under beams: `test_trees_under_beams_through_the_compiled_engine`)."""
    base = models["bart"]
    heads = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    torch.manual_seed(0)
    torch.nn.init.normal_(heads.heads.down.weight, std=1.0)
    batch = random_batch(base, 3, seed=11)
    expected = base.generate(**batch, num_beams=3, max_new_tokens=10)
    assert torch.equal(heads.generate(**batch, num_beams=3, max_new_tokens=10), expected)


def test_what_beam_search_cannot_take_is_refused_by_name(models) -> None:
    model = models["marian"]
    batch = random_batch(model, 1, seed=0)
    call = {**batch, "num_beams": 3, "max_new_tokens": 5, "custom_generate": blockwise_generate}
    with pytest.raises(ValueError, match="output_logits=True is not supported by blockwise beam search"):
        model.generate(**call, output_logits=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="acceptance=TopKAcceptance"):
        model.generate(**call, acceptance=TopKAcceptance(top_k=2))
    with pytest.raises(UnsupportedModelError, match="no absolute position module"):
        models["t5"].generate(**{**call, **random_batch(models["t5"], 1, seed=0)}, assistant=TopChildrenTrees(model))
    with pytest.raises(ValueError, match="do_sample=True selects 'beam_sample'"):
        model.generate(**call, do_sample=True)


def test_the_ceiling_script_counts_the_steps_perfect_drafts_would_replay(models) -> None:
    """`scripts/beam_ceiling.py`: a call takes its first step, then the next while the step just taken allows it,
    up to k; every step of beam search is recorded once."""
    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "beam_ceiling.py"))
    assert script["steps_per_call"]([True, True, False, True], 4) == 2.0
    assert script["steps_per_call"]([True, True, False, True], 2) == 4 / 3
    assert script["steps_per_call"]([False] * 5, 8) == 1.0
    model = models["marian"]
    batch = random_batch(model, 1, seed=4)
    steps = script["recorded_steps"](model, batch, 3, 10)
    expected = model.generate(**batch, num_beams=3, max_new_tokens=10, return_dict_in_generate=True, output_scores=True)
    assert len(steps) == len(expected.scores)
    assert all(rank >= 0 and isinstance(distinct, bool) for rank, distinct in steps)

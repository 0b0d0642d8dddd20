"""The shared suite: blockwise output equals greedy `generate`, over architecture × drafter × batch × arguments."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from conftest import ARCHITECTURES, OracleDrafter, random_batch
from near_ties import assert_greedy_up_to_near_ties

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    DistanceAcceptance,
    Drafter,
    DraftRequest,
    Drafts,
    ExactAcceptance,
    GADPlusPlusAcceptance,
    InputCopyDrafter,
    MinimumBlockAcceptance,
    TopKAcceptance,
    blockwise_generate,
)
from hf_blockwise.modeling.nar_model import NARDrafterModel

GENERATE_ARGUMENTS = {
    "max_new_tokens": lambda model: {"max_new_tokens": 24},
    "max_length": lambda model: {"max_length": 17},
    "min_new_tokens": lambda model: {"min_new_tokens": 14, "max_new_tokens": 20},
    "several_eos": lambda model: {
        "eos_token_id": [model.config.eos_token_id, 7, 11, 13],
        "max_new_tokens": 24,
    },
    "forced_bos": lambda model: {"forced_bos_token_id": 5, "max_new_tokens": 16},
    "repetition_penalty": lambda model: {"repetition_penalty": 1.4, "max_new_tokens": 24},
    "no_repeat_ngram_size": lambda model: {"no_repeat_ngram_size": 2, "max_new_tokens": 24},
    "bad_words_ids": lambda model: {"bad_words_ids": [[7], [8, 9]], "max_new_tokens": 24},
    "suppress_tokens": lambda model: {"suppress_tokens": [5, 6], "begin_suppress_tokens": [7, 8], "max_new_tokens": 20},
    # processors that keep per-row data of the caller's batch, while finished rows leave the loop's batch
    "encoder_penalties": lambda model: {
        "encoder_repetition_penalty": 1.5,
        "encoder_no_repeat_ngram_size": 2,
        "max_new_tokens": 20,
    },
    "decay_renormalize": lambda model: {
        "exponential_decay_length_penalty": (4, 1.6),
        "renormalize_logits": True,
        "max_new_tokens": 24,
    },
    # A strong bias towards the pad token makes greedy emit pad mid-sentence: the hardest case for models
    # that number decoder positions by counting non-pad tokens (M2M100).
    "pad_in_output": lambda model: {
        "sequence_bias": {(model.config.pad_token_id,): 4.0},
        "max_new_tokens": 20,
    },
}

DRAFTERS = ["heads", "token_heads", "zero_heads", "noisy_oracle", "input_copy", "nar"]
# a drafter that proposes greedy's tokens 70% of the time must have drafts kept (a loop that rejected every draft
# would pass the comparisons); the copied NAR layer is right on some architectures only
KEPT_DRAFTERS = ("noisy_oracle",)

# Every acceptance rule with the parameters that make it exact (k=1, ε=0, β=1, τ=0, minimum block 1).
LOSSLESS_RULES = {
    "exact": lambda vocab_size: ExactAcceptance(),
    "top_1": lambda vocab_size: TopKAcceptance(top_k=1),
    "distance_0": lambda vocab_size: DistanceAcceptance(torch.arange(vocab_size, dtype=torch.float), epsilon=0.0),
    "gad_beta_1": lambda vocab_size: GADPlusPlusAcceptance(top_beta=1, tolerance=3.0),
    "gad_tau_0": lambda vocab_size: GADPlusPlusAcceptance(top_beta=5, tolerance=0.0),
    "min_block_1": lambda vocab_size: MinimumBlockAcceptance(ExactAcceptance(), min_block=1),
}


def heads_model(base, block_size: int, seed: int, zero: bool, condition_on_token: bool = False) -> BlockwiseHeadsModel:
    model = BlockwiseHeadsModel(
        base, BlockwiseHeadsConfig(block_size=block_size, condition_on_token=condition_on_token)
    )
    if not zero:
        torch.manual_seed(seed)
        torch.nn.init.normal_(model.heads.down.weight, std=1.0)
    return model


def blockwise_output(base, batch, greedy, drafter_name: str, block_size: int, seed: int, rule, kwargs) -> Any:
    """The blockwise decoding's `generate` output (`return_dict_in_generate=True`: sequences and decoding stats)."""
    kwargs = {**kwargs, "return_dict_in_generate": True}
    if drafter_name in ("heads", "token_heads", "zero_heads"):
        model = heads_model(
            base, block_size, seed, zero=drafter_name == "zero_heads", condition_on_token=drafter_name == "token_heads"
        )
        return model.generate(**batch, acceptance=rule, **kwargs)
    if drafter_name == "noisy_oracle":
        drafter = OracleDrafter(greedy, block_size=block_size, corruption=0.3, seed=seed)
    elif drafter_name == "nar":
        # one decoder layer copied from the base: drafts that are right often, but far from always
        drafter = NARDrafterModel.from_verifier(base, mask_token_id=3, block_size=block_size).drafter()
    else:
        drafter = InputCopyDrafter(base, max_draft_length=block_size - 1, max_ngram=3)
    return base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, acceptance=rule, **kwargs)


def kept_drafts(output: Any) -> int:
    """Tokens gained beyond one per row and call: the drafts the loop kept."""
    return int((output.decoding_stats.accepted - 1).clamp(min=0).sum())


@pytest.mark.parametrize("arguments", sorted(GENERATE_ARGUMENTS))
@pytest.mark.parametrize("drafter_name", DRAFTERS)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_blockwise_equals_greedy(tiny_models, greedy_of, architecture: str, drafter_name: str, arguments: str) -> None:
    base = tiny_models[architecture]
    kwargs = GENERATE_ARGUMENTS[arguments](base)
    drafted = 0
    for batch_size, seed, block_size in [(1, 0, 3), (3, 1, 4), (8, 2, 6)]:
        batch = random_batch(base, batch_size, seed)
        greedy = greedy_of(architecture, batch_size, seed, **kwargs)
        output = blockwise_output(base, batch, greedy, drafter_name, block_size, seed, ExactAcceptance(), kwargs)
        assert_greedy_up_to_near_ties(base, batch, greedy, output.sequences, **kwargs)
        drafted += kept_drafts(output)
    if drafter_name in KEPT_DRAFTERS:
        assert drafted > 0, f"{drafter_name} had no draft kept"


@pytest.mark.parametrize("rule_name", sorted(LOSSLESS_RULES))
@pytest.mark.parametrize("drafter_name", ["heads", "noisy_oracle", "input_copy", "nar"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_lossless_settings_of_every_rule_equal_greedy(
    tiny_models, greedy_of, architecture, drafter_name, rule_name
) -> None:
    base = tiny_models[architecture]
    rule = LOSSLESS_RULES[rule_name](base.config.vocab_size)
    assert rule.lossless
    kwargs = {"max_new_tokens": 20, "repetition_penalty": 1.3}
    drafted = 0
    for batch_size, seed, block_size in [(1, 3, 4), (5, 4, 5)]:
        batch = random_batch(base, batch_size, seed)
        greedy = greedy_of(architecture, batch_size, seed, **kwargs)
        output = blockwise_output(base, batch, greedy, drafter_name, block_size, seed, rule, kwargs)
        assert_greedy_up_to_near_ties(base, batch, greedy, output.sequences, **kwargs)
        drafted += kept_drafts(output)
    if drafter_name in KEPT_DRAFTERS:  # the rule saw drafts it kept, not a loop that rejects every one
        assert drafted > 0, f"{drafter_name} had no draft kept under {rule_name}"


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_no_drafter_is_greedy(tiny_models, architecture: str) -> None:
    base = tiny_models[architecture]
    batch = random_batch(base, 4, seed=7)
    greedy = base.generate(**batch, max_new_tokens=20)
    output = base.generate(**batch, max_new_tokens=20, custom_generate=blockwise_generate, assistant=None)
    assert torch.equal(output, greedy)  # one-token calls: transformers' own arithmetic, bit for bit
    heads = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4))
    assert torch.equal(heads.generate(**batch, max_new_tokens=20, assistant=None), greedy)


def expected_forwards(num_generated: int, block_size: int, drafts_at_prefill: bool) -> int:
    """Decoder calls of a perfect drafter: k tokens per call, or 1 + k per call after a draft-less prefill."""
    if drafts_at_prefill:
        return math.ceil(num_generated / block_size)
    return 1 + math.ceil((num_generated - 1) / block_size)


@pytest.mark.parametrize("block_size", [2, 4, 7])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_perfect_drafter_needs_one_forward_per_block(tiny_models, architecture: str, block_size: int) -> None:
    base = tiny_models[architecture]
    for batch_size in (1, 3):
        batch = random_batch(base, batch_size, seed=block_size)
        greedy = base.generate(**batch, max_new_tokens=30)
        drafter = OracleDrafter(greedy, block_size=block_size)
        output = base.generate(
            **batch, max_new_tokens=30, custom_generate=blockwise_generate, assistant=drafter,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(output.sequences, greedy)
        stats = output.decoding_stats
        pad = base.generation_config.pad_token_id
        generated = (greedy[:, 1:] != pad).sum(dim=1)  # tokens each row produced (padding after EOS excluded)
        assert torch.equal(stats.accepted.sum(dim=0), generated)
        # drafts are verified from the first (prefill) pass on, even where the decoder starts with the pad token
        assert stats.num_forwards == expected_forwards(int(generated.max()), block_size, drafts_at_prefill=True)
        assert stats.mean_accepted > 1.0 or int(generated.max()) <= 1


class RowKeyedReference(Drafter):
    """Greedy's output kept on the drafter itself, one row per row of the caller's batch, with no `prepare` or
    `select_rows`: per-row data found through `DraftRequest.rows` (or, with `use_rows=False`, wrongly, through the
    row's position in the request, which shifts once rows leave the batch)."""

    def __init__(self, reference: torch.Tensor, block_size: int, use_rows: bool = True) -> None:
        self.reference, self.block_size, self.use_rows = reference, block_size, use_rows

    def get_candidates(self, request: DraftRequest) -> Drafts:
        rows = request.rows if self.use_rows else torch.arange(request.lengths.shape[0])
        reference = self.reference[rows]  # (b, R)
        num_drafts, width = self.block_size - 1, reference.shape[1]
        positions = request.lengths[:, None] + torch.arange(num_drafts)  # (b, k - 1)
        tokens = reference.gather(1, positions.clamp(max=width - 1))
        return Drafts(tokens=tokens, lengths=(width - request.lengths).clamp(0, num_drafts))


@pytest.mark.parametrize("architecture", ["bart", "t5"])
def test_a_drafter_keeping_rows_on_itself_stays_aligned_after_rows_leave(tiny_models, architecture: str) -> None:
    base = tiny_models[architecture]
    batch = random_batch(base, 5, seed=3)
    free_running = base.generate(**batch, max_new_tokens=24)
    # end rows at different steps: stop tokens that greedy emits early in some rows
    eos = sorted({int(free_running[1, 3]), int(free_running[3, 9]), base.config.eos_token_id})
    kwargs = {"max_new_tokens": 24, "eos_token_id": eos, "custom_generate": blockwise_generate}
    greedy = base.generate(**batch, max_new_tokens=24, eos_token_id=eos)
    pad = base.generation_config.pad_token_id
    generated = (greedy[:, 1:] != pad).sum(dim=1)
    assert len(set(generated.tolist())) >= 3, "rows must finish at different steps for this test to mean anything"
    outputs = {
        use_rows: base.generate(
            **batch, **kwargs, assistant=RowKeyedReference(greedy, 4, use_rows), return_dict_in_generate=True
        )
        for use_rows in (True, False)
    }
    for output in outputs.values():
        assert torch.equal(output.sequences, greedy)  # exact either way: misaligned drafts are only rejected
    aligned, misaligned = outputs[True].decoding_stats, outputs[False].decoding_stats
    assert aligned.num_forwards == expected_forwards(int(generated.max()), 4, drafts_at_prefill=True)
    assert misaligned.num_forwards > aligned.num_forwards  # the test sees a drafter that loses its rows


def test_heads_forwards_bound_with_perfect_heads(tiny_models) -> None:
    """Heads that copy p1 are perfect on a constant output: decoder calls = 1 + ⌈(m - 1)/k⌉."""
    base = copy.deepcopy(tiny_models["bart"])
    with torch.no_grad():
        base.final_logits_bias[0, 9] = 1e3  # every position now predicts token 9, heads' copies of p1 too
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=5))
    batch = random_batch(base, 1, seed=0)
    output = model.generate(**batch, max_new_tokens=21, return_dict_in_generate=True)
    assert output.sequences[0, 1:].tolist() == [9] * 21
    assert output.decoding_stats.num_forwards == expected_forwards(21, 5, drafts_at_prefill=False)
    assert output.decoding_stats.accepted[:, 0].tolist() == [1, 5, 5, 5, 5]


@pytest.mark.parametrize("architecture", ["bart", "marian"])
def test_drafts_never_reach_positions_greedy_does_not_feed(architecture: str) -> None:
    """With max_length at the model's position limit, greedy search feeds positions up to max_length - 2 only; the
    loop must not feed drafts (or filler) beyond them, where a model with learned positions has none."""
    limit = 14
    torch.manual_seed(0)
    template = ARCHITECTURES[architecture]()
    config = template.config.__class__(**{**template.config.to_dict(), "max_position_embeddings": limit})
    model = template.__class__(config).eval()
    model.generation_config.bad_words_ids = None
    batch = random_batch(model, 3, seed=7, max_source_length=limit)
    kwargs = {"max_length": limit, "min_new_tokens": limit - 1}  # every row runs to the limit
    greedy = model.generate(**batch, do_sample=False, num_beams=1, **kwargs)
    assert greedy.shape[1] == limit
    drafter = OracleDrafter(greedy, block_size=6, corruption=0.2, seed=1)
    output = model.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, **kwargs)
    assert torch.equal(output, greedy)

"""Sampling through the loop (`generation/sampling.py`): greedy search on scores perturbed by noise shared by
(seed, row, position, token). Its output is transformers' greedy search with the same warpers and the same noise as
a logits processor, token for token; the same with drafts (chains and trees) as without; and each token is drawn from
the warped distribution (chi-square over thousands of rows; a mutation that shares the noise between rows fails)."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter, random_batch
from scipy.stats import chisquare
from test_trees import RandomTreeDrafter
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from hf_blockwise import blockwise_generate
from hf_blockwise.engine import CompileOptions
from hf_blockwise.generation import step as step_module
from hf_blockwise.generation.sampling import call_seed, perturbed_scores

# generate arguments, and the warpers transformers builds from them, in its order
WARPERS = {
    "temperature": ({"temperature": 0.7}, [TemperatureLogitsWarper(0.7)]),
    "top_k": ({"temperature": 1.3, "top_k": 6}, [TemperatureLogitsWarper(1.3), TopKLogitsWarper(6)]),
    "top_p": ({"top_p": 0.8}, [TopPLogitsWarper(0.8)]),
    "min_p": ({"min_p": 0.05}, [MinPLogitsWarper(0.05)]),
    "typical_p": ({"typical_p": 0.9}, [TypicalLogitsWarper(0.9)]),
}


class SharedNoise(LogitsProcessor):
    """The loop's perturbation as a processor of transformers' greedy search: row i of the batch, at the position
    its prefix's length gives."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(input_ids.shape[0])
        positions = torch.full((input_ids.shape[0], 1), input_ids.shape[1])
        return perturbed_scores(scores[:, None], self.seed, rows, positions)[:, 0]


def _sampled(model, batch: dict, seed: int, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(**batch, do_sample=True, custom_generate=blockwise_generate, **kwargs)


@pytest.mark.parametrize("warpers", sorted(WARPERS))
@pytest.mark.parametrize("architecture", ["marian", "t5"])
def test_sampling_is_greedy_search_on_the_shared_noise_with_or_without_drafts(
    tiny_models, architecture: str, warpers: str
) -> None:
    base = tiny_models[architecture]
    arguments, warper_list = WARPERS[warpers]
    for batch_size, seed in ((1, 0), (3, 1)):
        batch = random_batch(base, batch_size, seed=seed)
        kwargs = {"max_new_tokens": 12, **arguments}
        sampled = _sampled(base, batch, seed, **kwargs)
        torch.manual_seed(seed)
        noise = SharedNoise(call_seed())  # the seed the call draws first
        reference = base.generate(
            **batch, do_sample=False, max_new_tokens=12, logits_processor=LogitsProcessorList([*warper_list, noise])
        )
        assert torch.equal(sampled, reference), (batch_size, sampled, reference)
        for corruption in (0.0, 0.4):  # drafts right, and right most of the time
            drafter = OracleDrafter(sampled, block_size=4, corruption=corruption, seed=seed)
            assert torch.equal(_sampled(base, batch, seed, assistant=drafter, **kwargs), sampled), corruption


def test_sampled_trees_and_the_engine_give_the_undrafted_tokens(tiny_models) -> None:
    """Trees (a node at depth d decides position d, on any branch: the same noise) and the compiled engine's
    verification (dynamo alone here: the scores are perturbed eagerly after it)."""
    base = tiny_models["marian"]
    kwargs = {"max_new_tokens": 14, "temperature": 0.8, "top_p": 0.95}
    for batch_size, seed in ((1, 2), (3, 3)):
        batch = random_batch(base, batch_size, seed=seed)
        sampled = _sampled(base, batch, seed, **kwargs)
        for right in (1.0, 0.6):
            tree = RandomTreeDrafter(sampled, 4, 7, right, seed)
            assert torch.equal(_sampled(base, batch, seed, assistant=tree, **kwargs), sampled), right
        drafter = OracleDrafter(sampled, block_size=3, corruption=0.3, seed=seed)
        compiled = _sampled(base, batch, seed, assistant=drafter, blockwise_compile=CompileOptions(backend="eager"),
                            **kwargs)  # fmt: skip
        assert torch.equal(compiled, sampled)


def _first_tokens(base, rows: int, seed: int, **kwargs) -> torch.Tensor:
    source = random_batch(base, 1, seed=9)
    batch = {name: value.expand(rows, -1) for name, value in source.items()}  # one source, `rows` times
    return _sampled(base, batch, seed, max_new_tokens=2, **kwargs)[:, 1]


def _chi_square(tokens: torch.Tensor, probabilities: torch.Tensor) -> float:
    """The p-value of `tokens` (samples) against `probabilities`, bins of expected count under 5 pooled."""
    counts = torch.bincount(tokens, minlength=probabilities.shape[0]).double()
    expected = probabilities.double() * tokens.shape[0]
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = wanted > 0
    return float(chisquare(observed[keep].numpy(), wanted[keep].numpy()).pvalue)


@pytest.mark.parametrize("warpers", ["temperature", "top_k", "top_p"])
def test_each_token_is_drawn_from_the_warped_distribution(tiny_models, warpers: str, monkeypatch) -> None:
    """20,000 rows of one source sample their first token: a chi-square test against the warped softmax of the
    model's logits passes; a loop whose noise is shared between rows (a wrong construction) fails it."""
    base = tiny_models["marian"]
    arguments, warper_list = WARPERS[warpers]
    source = random_batch(base, 1, seed=9)
    with torch.no_grad():
        start = torch.full((1, 1), base.generation_config.decoder_start_token_id)
        logits = base(**source, decoder_input_ids=start).logits[:, -1]  # (1, V)
    warped = LogitsProcessorList(warper_list)(start, logits)
    probabilities = torch.softmax(warped, dim=-1)[0]
    tokens = _first_tokens(base, 20_000, seed=4, **arguments)
    assert _chi_square(tokens, probabilities) > 0.01

    def shared_between_rows(scores, seed, rows, positions):
        return perturbed_scores(scores, seed, torch.zeros_like(rows), positions)

    monkeypatch.setattr(step_module, "perturbed_scores", shared_between_rows)
    assert _chi_square(_first_tokens(base, 20_000, seed=4, **arguments), probabilities) < 1e-6


def test_beam_sampling_is_refused_by_name(tiny_models) -> None:
    base = tiny_models["marian"]
    batch = random_batch(base, 1, seed=0)
    with pytest.raises(ValueError, match="do_sample=True selects 'beam_sample'"):
        base.generate(**batch, do_sample=True, num_beams=2, custom_generate=blockwise_generate, max_new_tokens=4)

"""The compiled engine (`blockwise_compile=True`): exact against its own greedy on the core architectures, near-tie
only against eager greedy, no recompiles or graph breaks once warm, stale weights recompiled, and a clear warning
with an eager fallback where compilation is unavailable.

Each model compiles its graphs once per process (batch 1 and batch > 1), so the suite builds its models once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ARCHITECTURES, OracleDrafter, build_model, random_batch

from hf_blockwise import blockwise_generate, first_divergence
from hf_blockwise.drafters.base import NoDrafter
from hf_blockwise.generation import engine as engine_module
from hf_blockwise.generation.engine import CompileOptions, compiled_decoder
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel

# a logit gap below this is a floating-point near-tie between eager and compiled kernels (fp32)
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def compiled_models() -> dict[str, torch.nn.Module]:
    return {name: build_model(name) for name in ARCHITECTURES}


def _generate(model, batch, **kwargs) -> torch.Tensor:
    return model.generate(**batch, custom_generate=blockwise_generate, max_new_tokens=20, **kwargs)


def _assert_equal_or_near_tie(model, batch, reference: torch.Tensor, candidate: torch.Tensor) -> None:
    """Every row equal, or first differing where eager's top two logits are within `NEAR_TIE`."""
    divergences = first_divergence(
        model, batch["input_ids"], reference, candidate, attention_mask=batch["attention_mask"],
        pad_token_id=model.config.pad_token_id,
    )  # fmt: skip
    for divergence in divergences:
        assert divergence.top2_gap < NEAR_TIE, divergence


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_compiled_drafting_is_exact_against_the_engines_greedy(compiled_models, architecture: str) -> None:
    model = compiled_models[architecture]
    for batch_size, seed in ((1, 0), (4, 1)):
        batch = random_batch(model, batch_size, seed=seed)
        eager = model.generate(**batch, max_new_tokens=20)
        greedy = _generate(model, batch, blockwise_compile=True)
        _assert_equal_or_near_tie(model, batch, eager, greedy)
        for corruption in (0.0, 0.3):
            drafter = OracleDrafter(greedy, block_size=4, corruption=corruption, seed=seed)
            drafted = _generate(model, batch, assistant=drafter, blockwise_compile=True)
            assert torch.equal(drafted, greedy), (architecture, batch_size, corruption)


def test_no_recompiles_or_graph_breaks_once_warm(compiled_models) -> None:
    model = compiled_models["bart"]
    warm = random_batch(model, 3, seed=5)
    reference = _generate(model, warm, blockwise_compile=True)
    _generate(model, warm, assistant=OracleDrafter(reference, block_size=5), blockwise_compile=True)
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    # other lengths, batch sizes, feed widths and acceptance patterns: the same graphs serve them all
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch_size, seed, block_size in ((1, 6, 3), (2, 7, 5), (5, 8, 2)):
            batch = random_batch(model, batch_size, seed=seed, max_source_length=9 + seed)
            greedy = _generate(model, batch, blockwise_compile=True)
            drafter = OracleDrafter(greedy, block_size=block_size, corruption=0.25, seed=seed)
            assert torch.equal(_generate(model, batch, assistant=drafter, blockwise_compile=True), greedy)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks_before


def test_changed_weights_are_recompiled_not_served_stale(compiled_models) -> None:
    model = build_model("marian", seed=3)
    batch = random_batch(model, 2, seed=2)
    _generate(model, batch, blockwise_compile=True)
    first = compiled_decoder(model, CompileOptions())
    with torch.no_grad():  # what an optimizer step or load_state_dict does: an in-place change
        model.get_output_embeddings().weight.mul_(-1.0)
    with pytest.warns(UserWarning, match="changed since it was compiled"):
        after = _generate(model, batch, blockwise_compile=True)
    assert compiled_decoder(model, CompileOptions()) is not first
    _assert_equal_or_near_tie(model, batch, model.generate(**batch, max_new_tokens=20), after)


def test_unavailable_compiler_warns_and_decodes_eagerly(monkeypatch) -> None:
    model = build_model("t5", seed=4)
    batch = random_batch(model, 2, seed=3)
    monkeypatch.setattr(engine_module.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="C\\+\\+ compiler.*decoding eagerly instead"):
        output = _generate(model, batch, blockwise_compile=True)
    assert torch.equal(output, model.generate(**batch, max_new_tokens=20))
    assert engine_module.engine_of(model) is None


def test_compile_option_is_validated() -> None:
    model = build_model("marian")
    batch = random_batch(model, 1, seed=0)
    with pytest.raises(TypeError, match="blockwise_compile= takes a bool or a CompileOptions"):
        _generate(model, batch, assistant=NoDrafter(), blockwise_compile="yes")


def test_state_reading_drafter_gets_states_from_the_compiled_graph(compiled_models) -> None:
    """The feature drafter reads every verified state; compiled, they come out of the graph (no eager hook)."""
    base = compiled_models["marian"]
    drafter_model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4, training_depth=2)).eval()
    batch = random_batch(base, 3, seed=11)
    greedy = _generate(base, batch, blockwise_compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it really ran compiled
        drafted = _generate(base, batch, assistant=drafter_model.drafter(), blockwise_compile=True)
    assert torch.equal(drafted, greedy)
    eager_drafted = _generate(base, batch, assistant=drafter_model.drafter())
    _assert_equal_or_near_tie(base, batch, eager_drafted, drafted)

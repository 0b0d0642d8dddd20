"""One compiled call per step: the verification, its acceptance on the raw logits and the feature drafter's next
drafts in one graph (`CompiledDecoder.verify_and_draft`, `CompileOptions.drafting_in_verification`).

The output stays the engine's greedy bit for bit; the drafts are those the drafter makes in calls of its own; the
graph is kept only where its logits equal the engine graph's, and refused with a warning where they do not.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_model, random_batch

from hf_blockwise import blockwise_generate, quantize_dynamic_int8
from hf_blockwise import engine as engine_module
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.engine import CompileOptions, OneArithmeticWarning, drop_compiled, engine_of, greedy_verified
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.quantization import quantize_linears_int8


@pytest.fixture(scope="module")
def int8_feature() -> tuple[torch.nn.Module, FeatureDrafter]:
    """A tiny int8 Marian and an int8 feature drafter of it (random: right sometimes, on repeated tokens)."""
    base = quantize_dynamic_int8(build_model("marian"))
    feature = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4, training_depth=2)).eval()
    quantize_linears_int8(feature.layer)
    yield base, feature.drafter()
    drop_compiled(base)
    drop_compiled(feature)


def _recorded(drafter: FeatureDrafter, monkeypatch) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Every chain the drafter hands out, and how many calls drafted in calls of its own (the drafting block) and
    inside the verification call."""
    chains: list[torch.Tensor] = []
    counts = {"own calls": 0, "inside verification": 0}
    get_candidates, own_call = FeatureDrafter.get_candidates, FeatureDrafter._draft_compiled
    verify_and_draft = engine_module.CompiledDecoder.verify_and_draft

    def recording(self, request):
        drafts = get_candidates(self, request)
        chains.append(drafts.tokens.clone())
        return drafts

    def counted(name, function):
        def run(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(FeatureDrafter, "get_candidates", recording)
    monkeypatch.setattr(FeatureDrafter, "_draft_compiled", counted("own calls", own_call))
    monkeypatch.setattr(
        engine_module.CompiledDecoder, "verify_and_draft", counted("inside verification", verify_and_draft)
    )
    return chains, counts


def test_the_raw_acceptance_counts_pending_tokens_then_matching_drafts_up_to_the_first_miss() -> None:
    vocab = 6
    tokens = torch.tensor([[4, 2, 3, 5, 1], [4, 4, 5, 3, 3], [1, 2, 3, 3, 3]])  # (3, 5)
    greedy = torch.tensor([[2, 3, 0, 1, 1], [9, 2, 3, 3, 3], [2, 3, 3, 3, 3]]) % vocab  # the argmax of each column
    logits = torch.nn.functional.one_hot(greedy, vocab).float()
    num_pending = torch.tensor([1, 2, 1])
    num_fed = torch.tensor([5, 5, 3])
    follow, num_valid = greedy_verified(tokens, logits, num_pending, num_fed)
    assert torch.equal(follow, greedy)
    # row 0: drafts 2, 3 match, 5 misses; row 1: two pending tokens, then 5 misses greedy's 2 and the matches after
    # a miss do not count; row 2: drafts 2 and 3 match, and the filler after num_fed is never counted
    assert num_valid.tolist() == [3, 2, 3]


def test_drafting_inside_the_verification_call_is_one_call_per_step_exact_and_drafts_the_same(
    int8_feature, monkeypatch
) -> None:
    base, drafter = int8_feature
    batch = random_batch(base, 1, seed=3)
    kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 12}
    greedy = base.generate(**batch, blockwise_compile=True, **kwargs)
    chains, counts = _recorded(drafter, monkeypatch)
    outputs = {}
    for inside in (False, True):  # the options decide the engine: the one kept last is the one drafting inside
        chains.clear()
        options = CompileOptions(drafting_in_verification=inside)
        output = base.generate(
            **batch, assistant=drafter, blockwise_compile=options, return_dict_in_generate=True, **kwargs
        )
        assert torch.equal(output.sequences, greedy), inside
        outputs[inside] = ([chain.clone() for chain in chains], dict(counts), output.decoding_stats)
        counts.update({"own calls": 0, "inside verification": 0})
    (chains_inside, counts_inside, stats), (chains_own, counts_own, _) = outputs[True], outputs[False]
    steps = stats.num_forwards  # the first call (the start token, no drafts) and one verification per step after it
    assert steps >= 5
    # the block drafts once in a call of its own (for the first drafted step), then each verification drafts the next
    assert counts_inside == {"own calls": 1, "inside verification": steps - 1}
    assert counts_own == {"own calls": steps - 1, "inside verification": 0}
    assert len(chains_inside) == len(chains_own) and all(map(torch.equal, chains_inside, chains_own))
    block = next(iter(engine_module._COMPILED[drafter.model].values()))
    assert isinstance(block.fused[engine_of(base)], engine_module.CompiledModule)  # checked and kept


def test_a_verify_and_draft_graph_with_other_logits_is_refused_with_a_warning(int8_feature, monkeypatch) -> None:
    base, drafter = int8_feature
    forward = engine_module._VerifyAndDraft.forward

    def other_logits(self, tokens, cache, forward_kwargs, num_pending, num_fed, *inputs):
        logits, states, drafts = forward(self, tokens, cache, forward_kwargs, num_pending, num_fed, *inputs)
        return logits * 1.5, states, drafts  # argmax unchanged: only the bits differ

    monkeypatch.setattr(engine_module._VerifyAndDraft, "forward", other_logits)
    batch = random_batch(base, 1, seed=4)
    options = CompileOptions(drafting_in_verification=True)
    kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 12, "blockwise_compile": options}
    greedy = base.generate(**batch, **kwargs)
    base.generate(**batch, assistant=drafter, **kwargs)  # the block of this engine, looked up or built
    block = next(iter(engine_module._COMPILED[drafter.model].values()))
    block.fused.pop(engine_of(base), None)  # a graph made and kept by another test goes: this one is made anew
    with pytest.warns(OneArithmeticWarning, match="Drafting inside the verification call computed other logits"):
        assert torch.equal(base.generate(**batch, assistant=drafter, **kwargs), greedy)
    assert block.fused[engine_of(base)] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", OneArithmeticWarning)  # refused once: drafts in calls of its own from then on
        assert torch.equal(base.generate(**batch, assistant=drafter, **kwargs), greedy)


def test_options_for_cpu_inductor_graphs_elsewhere_are_refused_before_anything_is_hooked(int8_feature) -> None:
    base, _ = int8_feature
    projection = base.get_output_embeddings()
    hooks = dict(projection._forward_hooks)
    for name in ("compiled_prefill", "drafting_in_verification"):
        options = CompileOptions(backend="eager", **{name: True})
        with pytest.raises(ValueError, match=rf"CompileOptions\({name}=True\) compiles on CPU with inductor"):
            engine_module.CompiledDecoder(base, options)
        assert dict(projection._forward_hooks) == hooks  # no engine's hook left on the model

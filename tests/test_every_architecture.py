"""Exact or refused on every architecture `AutoModelForSeq2SeqLM` builds small (the zoo in tests/zoo.py).

Each architecture decodes padded batches of 1, 5 and 12 rows with drafters that are right most of the time
and wrong sometimes (a corrupted greedy output; random heads; the source copy where the vocabulary is
shared), under generate arguments that exercise the logits processors and stopping rules. The decoders that
cannot verify several tokens in one cached pass are refused with a clear error, and their plain greedy
`generate` (and the loop without a drafter) still works.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_ARCHITECTURES, CORE_ARCHITECTURES, REFUSED_ARCHITECTURES, OracleDrafter, build_model
from conftest import random_batch as make_batch
from near_ties import assert_greedy_up_to_near_ties

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    InputCopyDrafter,
    UnsupportedModelError,
    blockwise_generate,
    check_decoder,
)
from hf_blockwise import boundary as hf
from hf_blockwise.generation.capability import clear_verdicts

# The architectures beyond the core seven, which run the full matrix in test_exactness.py.
EXTRA = sorted(set(ALL_ARCHITECTURES) - set(CORE_ARCHITECTURES) - set(REFUSED_ARCHITECTURES))

# (batch size, seed, block size, generate arguments): one pass each, together covering the processors
_ROW_PENALTIES = {"max_new_tokens": 24, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3}
_SOURCE_PENALTIES = {
    "min_new_tokens": 8,
    "max_new_tokens": 22,
    "suppress_tokens": [5],
    "begin_suppress_tokens": [6],
    "encoder_repetition_penalty": 1.4,
    "encoder_no_repeat_ngram_size": 2,
}
_LENGTH_PENALTIES = {
    "max_new_tokens": 26,
    "exponential_decay_length_penalty": (6, 1.4),
    "renormalize_logits": True,
    "bad_words_ids": [[9]],
}
CASES = [(1, 0, 4, _ROW_PENALTIES), (5, 1, 5, _SOURCE_PENALTIES), (12, 2, 3, _LENGTH_PENALTIES)]


def _drafter(base, name: str, greedy: torch.Tensor, block_size: int, seed: int):
    if name == "noisy_oracle":
        return OracleDrafter(greedy, block_size=block_size, corruption=0.25, seed=seed)
    if name == "heads":
        model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=block_size, condition_on_token=True))
        torch.manual_seed(seed)
        torch.nn.init.normal_(model.heads.down.weight, std=1.0)
        return model.drafter()
    return InputCopyDrafter(base, max_draft_length=block_size - 1, max_ngram=3)


def _shares_vocabulary(base) -> bool:
    try:
        hf.check_shared_vocabulary(base)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("drafter_name", ["noisy_oracle", "heads", "input_copy"])
@pytest.mark.parametrize("architecture", EXTRA)
def test_every_architecture_is_exact(architecture: str, drafter_name: str) -> None:
    base = build_model(architecture)
    if drafter_name == "input_copy" and not _shares_vocabulary(base):
        with pytest.raises(ValueError, match="separate source and target vocabularies"):
            InputCopyDrafter(base)
        return
    for batch_size, seed, block_size, kwargs in CASES:
        batch = make_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, **kwargs)
        drafter = _drafter(base, drafter_name, greedy, block_size, seed)
        output = base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, return_dict_in_generate=True, **kwargs
        )
        assert_greedy_up_to_near_ties(base, batch, greedy, output.sequences, **kwargs)
        if drafter_name == "noisy_oracle":  # drafts were accepted, partly: the verification was exercised
            assert 1.0 < output.decoding_stats.mean_accepted < block_size


def test_sliding_window_outputs_longer_than_the_window_are_exact() -> None:
    """T5Gemma's decoder layers alternate sliding-window (8 positions here) and full attention: rejected drafts
    must be cropped out of the cache after the output has passed the window."""
    base = build_model("t5gemma")
    assert "sliding_attention" in hf.decoder_config(base.config).layer_types
    batch = make_batch(base, 4, seed=3)
    greedy = base.generate(**batch, max_new_tokens=40, min_new_tokens=30)
    drafter = OracleDrafter(greedy, block_size=6, corruption=0.3, seed=3)
    output = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=40, min_new_tokens=30
    )
    assert greedy.shape[1] > 20
    assert_greedy_up_to_near_ties(base, batch, greedy, output, max_new_tokens=40, min_new_tokens=30)


@pytest.mark.parametrize("architecture", REFUSED_ARCHITECTURES)
def test_decoders_that_cannot_verify_are_refused_clearly(architecture: str) -> None:
    base = build_model(architecture)
    batch = make_batch(base, 3, seed=0)
    greedy = base.generate(**batch, max_new_tokens=12)
    drafter = OracleDrafter(greedy, block_size=4)
    with pytest.raises(UnsupportedModelError, match=rf"{type(base).__name__}.*plain greedy generate .*still works"):
        base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=12)
    with pytest.raises(UnsupportedModelError):  # the verdict is cached per model, and raised again
        check_decoder(base)
    # one token per step needs no multi-token verification: the loop without a drafter is still greedy
    plain = base.generate(**batch, custom_generate=blockwise_generate, assistant=None, max_new_tokens=12)
    assert torch.equal(plain, greedy)


def _raise_outside_the_model(error: Exception):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize("error", [AttributeError("'EncoderDecoderCache' has no attribute 'crop'"), RuntimeError("x")])
def test_an_exception_outside_the_models_code_propagates_and_is_not_kept(monkeypatch, error: Exception) -> None:
    """A bug in `boundary/` (here, its cache crop after an upgrade) is not a model limitation: it propagates with its
    traceback, whatever its type, and no verdict is kept, so the model is probed again once it is fixed."""
    base = build_model("marian", seed=7)
    with monkeypatch.context() as patch:
        patch.setattr(hf, "crop_cache", _raise_outside_the_model(error))
        with pytest.raises(type(error), match=str(error)) as raised:
            check_decoder(base)
    assert not isinstance(raised.value, UnsupportedModelError)
    assert raised.traceback[-1].name == "fail"  # the original traceback, down to where it was raised
    assert not check_decoder(base).positions_count_non_pad


def test_a_kept_verdict_is_cleared_and_the_model_probed_again(monkeypatch) -> None:
    probes = []
    probe_inputs = hf.probe_inputs
    monkeypatch.setattr(hf, "probe_inputs", lambda model, length: probes.append(model) or probe_inputs(model, length))
    refused, supported = build_model("prophetnet"), build_model("t5", seed=8)
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match=r"ProphetNet.*AssertionError"):
            check_decoder(refused)
        check_decoder(supported)
    assert probes == [refused, supported]  # kept per model
    clear_verdicts(refused)
    with pytest.raises(UnsupportedModelError):
        check_decoder(refused)
    check_decoder(supported)
    assert probes == [refused, supported, refused]
    clear_verdicts()
    check_decoder(supported)
    assert probes == [refused, supported, refused, supported]


@pytest.mark.parametrize("architecture", REFUSED_ARCHITECTURES)
def test_heads_need_the_output_projection(architecture: str) -> None:
    with pytest.raises(ValueError, match="Proposal heads project their states with the base's output projection"):
        BlockwiseHeadsModel(build_model(architecture), BlockwiseHeadsConfig(block_size=3))


def test_positions_counting_non_pad_tokens_are_detected_from_behaviour() -> None:
    assert check_decoder(build_model("m2m100")).positions_count_non_pad
    assert check_decoder(build_model("nllb-moe")).positions_count_non_pad
    for architecture in ("marian", "t5", "bart", "pegasus"):
        assert not check_decoder(build_model(architecture)).positions_count_non_pad


def test_mixture_of_experts_that_drop_tokens_are_refused_beyond_their_capacity() -> None:
    base = build_model("switch_transformers")
    base.config.expert_capacity = 3
    batch = make_batch(base, 2, seed=0)
    greedy = base.generate(**batch, max_new_tokens=10)
    with pytest.raises(UnsupportedModelError, match="expert_capacity=3"):
        base.generate(
            **batch, custom_generate=blockwise_generate, assistant=OracleDrafter(greedy, 4), max_new_tokens=10
        )
    output = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=OracleDrafter(greedy, 3), max_new_tokens=10
    )
    assert torch.equal(output, greedy)
    moe = build_model("nllb-moe")
    moe.config.moe_eval_capacity_token_fraction = 0.5
    moe_batch = make_batch(moe, 2, seed=0)
    moe_greedy = moe.generate(**moe_batch, max_new_tokens=4)
    with pytest.raises(UnsupportedModelError, match=r"moe_eval_capacity_token_fraction=0\.5"):
        moe.generate(
            **moe_batch, custom_generate=blockwise_generate, assistant=OracleDrafter(moe_greedy, 2), max_new_tokens=4
        )


def test_the_probe_runs_in_eval_mode_and_leaves_the_training_flag_alone() -> None:
    """A model handed back by a Trainer may be in train mode: dropout must not fail the probe for good."""
    config = ALL_ARCHITECTURES["bart"]().config  # dropout 0 in the zoo; give it some
    config.dropout = 0.5
    base = type(ALL_ARCHITECTURES["bart"]())(config)
    batch = make_batch(base, 1, seed=0)
    decoder_input_ids = torch.tensor([[2, 5, 6]])
    base.train()
    first, second = (base(**batch, decoder_input_ids=decoder_input_ids).logits for _ in range(2))
    assert not torch.equal(first, second)  # dropout is active in train mode
    assert not check_decoder(base).positions_count_non_pad
    assert base.training

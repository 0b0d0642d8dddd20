"""`speed_up(model)`: one call puts `model.generate` (and what calls it) through the loop; `restore` undoes it."""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter, build_model, random_batch

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel, restore, speed_up


def test_generate_runs_through_the_loop_with_the_checkpoints_defaults_until_restored() -> None:
    model = build_model("marian", seed=2)
    model.generation_config.max_new_tokens = 9  # the checkpoint's own defaults, which a user's call leaves out
    batch = random_batch(model, 3, seed=5)
    greedy = model.generate(**batch)
    assert greedy.shape[1] == 10
    oracle = OracleDrafter(greedy, block_size=4, corruption=0.2, seed=1)
    with speed_up(model, oracle, compile=False) as fast:
        assert fast is model
        output = model.generate(**batch, return_dict_in_generate=True)
        assert torch.equal(output.sequences, greedy)
        assert output.decoding_stats.num_forwards < 9  # drafts were accepted: fewer decoder calls than tokens
        model.generation_config.num_beams = 2  # beam search, as the checkpoint asks, through the beam loop
        beams = model.generate(**batch, assistant=None, return_dict_in_generate=True)  # a call's own arguments win
        assert hasattr(beams, "decoding_stats")
    assert "generate" not in vars(model)
    assert torch.equal(beams.sequences, model.generate(**batch))  # transformers' own beam search, restored
    assert not hasattr(model.generate(**batch, return_dict_in_generate=True), "decoding_stats")


def test_the_engine_is_the_default_and_drafter_models_give_their_drafter() -> None:
    model = build_model("bart", seed=1)
    heads = BlockwiseHeadsModel(model, BlockwiseHeadsConfig(block_size=3))
    speed_up(model, heads)
    defaults = model.generate.defaults
    assert defaults["blockwise_compile"] is True  # the compiled engine
    assert defaults["assistant"].block_size == 3 and defaults["assistant"].model is heads
    assert restore(model) is model


def test_misuse_is_refused_clearly() -> None:
    model = build_model("t5", seed=1)
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration\.generate was not sped up"):
        restore(model)
    speed_up(model, compile=False)
    with pytest.raises(ValueError, match="already sped up: restore\\(model\\) first"):
        speed_up(model)
    restore(model)
    with pytest.raises(TypeError, match="a Linear does not draft"):
        speed_up(model, torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="takes a loaded model, got the path"):
        speed_up("t5-small")

"""The feature drafter (EAGLE-style) and sequential heads: exact at every batch size, drafts that learn, and a
drafting cache that matches what training teaches (acceptance of an overfitted drafter)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ARCHITECTURES, build_model, random_batch
from datasets import Dataset
from near_ties import assert_greedy_up_to_near_ties
from test_exactness import GENERATE_ARGUMENTS

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    InputCopyDrafter,
    NARDrafterModel,
    blockwise_generate,
)
from hf_blockwise.drafters.base import Drafter, VerifiedStates
from hf_blockwise.drafters.composite import CompositeDrafter
from hf_blockwise.drafters.feature import merge_verified
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_layer import unrolled_mask
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments
from hf_blockwise.training.feature_trainer import FeatureDrafterTrainer

MAX_NEW_TOKENS = 20


def greedy_labels(base, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's greedy outputs, and the same as labels (decoder start dropped, padding -100)."""
    greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS)
    labels = greedy[:, 1:].clone()
    labels[labels == base.config.pad_token_id] = -100
    return greedy, labels


def greedy_rows(base, batch) -> list[dict[str, list[int]]]:
    """The batch's sources and the base's greedy outputs as a trainer's rows (padding dropped)."""
    _, labels = greedy_labels(base, batch)
    return [
        {"input_ids": ids[mask.bool()].tolist(), "labels": row[row != -100].tolist()}
        for ids, mask, row in zip(batch["input_ids"], batch["attention_mask"], labels, strict=True)
    ]


def fit(model: torch.nn.Module, parameters, loss_of, steps: int, lr: float = 3e-3) -> None:
    optimizer = torch.optim.AdamW(parameters, lr=lr)
    for _ in range(steps):
        loss = loss_of()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def fitted_feature_drafter(architecture: str, steps: int, cross_attention: bool = True):
    """A feature drafter overfitted on one batch of the base's own greedy outputs: right most of the time."""
    base = build_model(architecture)
    torch.manual_seed(0)
    config = FeatureDrafterConfig(block_size=5, training_depth=4, cross_attention=cross_attention)
    model = FeatureDrafterModel(base, config)
    batch = random_batch(base, 6, seed=1)
    greedy, labels = greedy_labels(base, batch)

    def loss() -> torch.Tensor:
        out = model(**batch, labels=labels)
        return out.feature_losses.mean() + out.token_losses.mean()

    fit(model, model.layer.parameters(), loss, steps)
    return model.eval(), batch, greedy


@pytest.fixture(scope="module")
def fitted_marian():
    return fitted_feature_drafter("marian", steps=250)


def test_unrolled_mask_sees_verified_prefix_and_own_drafts() -> None:
    assert torch.equal(unrolled_mask(3, 0, torch.device("cpu")), torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    mask = unrolled_mask(4, 2, torch.device("cpu"))  # (4, 12): step 0 keys, step 1 keys, step 2 keys
    # position 3 at step 2: verified keys up to position 1, step 1's key at 2, its own key at 3
    assert mask[3].nonzero().squeeze(1).tolist() == [0, 1, 4 + 2, 8 + 3]
    # position 0 at step 2 has no verified position before it: only its own key
    assert mask[0].nonzero().squeeze(1).tolist() == [8]


def test_overfitted_drafter_is_accepted_at_inference(fitted_marian) -> None:
    """Training and the drafting cache agree: what the drafter learned teacher-forced, it drafts at inference."""
    model, batch, greedy = fitted_marian
    out = model(**batch, labels=greedy_labels(model.base_model, batch)[1])
    assert float(out.token_accuracies.min()) > 0.9
    accepted = []
    for row in range(greedy.shape[0]):
        length = int(batch["attention_mask"][row].sum())
        single = {key: value[row : row + 1, :length] for key, value in batch.items()}
        result = model.generate(**single, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
        expected = model.base_model.generate(**single, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        assert torch.equal(result.sequences, expected)
        accepted.append(result.decoding_stats.mean_accepted)
    assert sum(accepted) / len(accepted) > 3.0  # of at most 5 per call, prefill step (1 token) included
    batched = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    assert torch.equal(batched.sequences, greedy)
    assert batched.decoding_stats.mean_accepted > 2.5


def test_threshold_stops_unlikely_drafts(fitted_marian) -> None:
    model, batch, greedy = fitted_marian
    always = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    never = model.generate(
        **batch, assistant=model.drafter(threshold=0.999999), max_new_tokens=MAX_NEW_TOKENS,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(never.sequences, greedy) and torch.equal(always.sequences, greedy)
    assert never.decoding_stats.mean_accepted < always.decoding_stats.mean_accepted


@pytest.mark.parametrize(
    "arguments", ["max_new_tokens", "bad_words_ids", "encoder_penalties", "several_eos", "min_new_tokens"]
)
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_feature_drafter_is_exact(architecture: str, arguments: str) -> None:
    """A partly trained drafter (right sometimes) under generate arguments, batch sizes 1/4/9, with and without a
    threshold and cross-attention."""
    model, _, _ = fitted_feature_drafter(architecture, steps=25, cross_attention=architecture != "t5")
    base = model.base_model
    kwargs = GENERATE_ARGUMENTS[arguments](base)
    for batch_size, seed, threshold in [(1, 3, None), (4, 4, 0.2), (9, 5, None)]:
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, **kwargs)
        output = model.generate(**batch, assistant=model.drafter(block_size=4, threshold=threshold), **kwargs)
        assert_greedy_up_to_near_ties(base, batch, greedy, output, **kwargs)


def test_save_and_load_round_trip(tmp_path, fitted_marian) -> None:
    model, batch, greedy = fitted_marian
    base = model.base_model
    base.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "base" / "drafter", base_model_name_or_path="..")
    saved = sorted(os.listdir(tmp_path / "base" / "drafter"))
    assert saved == ["feature_drafter.safetensors", "feature_drafter_config.json"]
    loaded = FeatureDrafterModel.from_pretrained(tmp_path / "base" / "drafter")  # the base beside it
    assert torch.equal(loaded.generate(**batch, max_new_tokens=MAX_NEW_TOKENS), greedy)
    # re-saved elsewhere, it names a base that resolves from anywhere
    loaded.save_pretrained(tmp_path / "elsewhere")
    again = FeatureDrafterModel.from_pretrained(tmp_path / "elsewhere")
    assert os.path.isabs(again.feature_config.base_model_name_or_path)
    with_base = FeatureDrafterModel.from_pretrained(tmp_path / "elsewhere", base_model=base)
    for name, tensor in with_base.layer.state_dict().items():
        assert torch.equal(tensor, model.layer.state_dict()[name])


def test_mismatched_base_is_a_clear_error_and_another_checkpoint_a_warning(tmp_path, fitted_marian) -> None:
    model, _, _ = fitted_marian
    model.save_pretrained(tmp_path / "drafter", base_model_name_or_path="some-org/some-base")
    with pytest.raises(ValueError, match="does not fit the base model"):
        FeatureDrafterModel.from_pretrained(tmp_path / "drafter", base_model=build_model("t5"))
    other = build_model("marian", seed=1)
    other.name_or_path = "another-org/another-base"
    with pytest.warns(UserWarning, match="trained for base 'some-org/some-base'"):
        FeatureDrafterModel.from_pretrained(tmp_path / "drafter", base_model=other)


def test_config_and_drafter_arguments_are_validated(fitted_marian) -> None:
    model, _, _ = fitted_marian
    with pytest.raises(ValueError, match="block_size"):
        FeatureDrafterConfig(block_size=1)
    with pytest.raises(ValueError, match="draft_threshold"):
        FeatureDrafterConfig(draft_threshold=1.5)
    with pytest.raises(ValueError, match="threshold"):
        model.drafter(threshold=-0.1)
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))


def test_trainer_learns_checkpoints_the_drafter_only_and_resumes(tmp_path) -> None:
    base = build_model("marian")
    dataset = Dataset.from_list(greedy_rows(base, random_batch(base, 8, seed=2)) * 4)

    def run(output_dir, max_steps: int, resume: str | None = None) -> tuple[FeatureDrafterModel, FeatureDrafterTrainer]:
        torch.manual_seed(0)
        model = FeatureDrafterModel(build_model("marian"), FeatureDrafterConfig(block_size=4, training_depth=2))
        args = FeatureDrafterTrainingArguments(
            output_dir=str(output_dir), per_device_train_batch_size=8, learning_rate=3e-3, max_steps=max_steps,
            save_steps=3, logging_steps=3, report_to=[], use_cpu=True, seed=0, eval_decoding_batch_size=8,
            eval_max_new_tokens=MAX_NEW_TOKENS,
        )  # fmt: skip
        trainer = FeatureDrafterTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    model, trainer = run(tmp_path / "a", max_steps=6)
    assert "step_2_accuracy" in trainer.state.log_history[0]
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert sorted(os.listdir(checkpoint)) >= ["feature_drafter.safetensors", "feature_drafter_config.json"]
    assert not any(name.startswith("model") for name in os.listdir(checkpoint))
    before = {name: tensor.clone() for name, tensor in build_model("marian").state_dict().items()}
    assert all(torch.equal(before[name], tensor) for name, tensor in model.base_model.state_dict().items())
    metrics = trainer.evaluate()
    assert metrics["eval_mean_accepted"] >= 1.0
    # a run resumed from the halfway checkpoint ends where the uninterrupted one did
    resumed, _ = run(tmp_path / "b", max_steps=6, resume=str(checkpoint))
    for name, tensor in resumed.layer.state_dict().items():
        torch.testing.assert_close(tensor, model.layer.state_dict()[name])


def sequential_heads_model(architecture: str, steps: int) -> tuple[BlockwiseHeadsModel, dict, torch.Tensor]:
    base = build_model(architecture)
    torch.manual_seed(0)
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4, sequential=True, head_hidden_size=64))
    batch = random_batch(base, 6, seed=1)
    greedy, labels = greedy_labels(base, batch)
    fit(model, model.heads.parameters(), lambda: model(**batch, labels=labels).loss, steps, lr=1e-2)
    return model.eval(), batch, greedy


def test_sequential_heads_learn_and_draft_from_earlier_drafts() -> None:
    model, batch, greedy = sequential_heads_model("marian", steps=200)
    out = model(**batch, labels=greedy_labels(model.base_model, batch)[1])
    assert float(out.head_accuracies.min()) > 0.8
    result = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    assert torch.equal(result.sequences, greedy)
    assert result.decoding_stats.mean_accepted > 2.0


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_sequential_heads_are_exact(tmp_path, architecture: str) -> None:
    model, _, _ = sequential_heads_model(architecture, steps=10)
    base = model.base_model
    for batch_size, seed in [(1, 3), (7, 4)]:
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS)
        output = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS)
        assert_greedy_up_to_near_ties(base, batch, greedy, output, max_new_tokens=MAX_NEW_TOKENS)
    model.save_pretrained(tmp_path)
    loaded = BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)
    assert loaded.blockwise_config.sequential
    batch = random_batch(base, 3, 9)
    assert torch.equal(
        loaded.generate(**batch, max_new_tokens=MAX_NEW_TOKENS), model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS)
    )


@pytest.mark.parametrize("architecture", ["marian", "bart", "t5"])
def test_composite_of_source_copy_and_feature_drafter_is_exact(architecture: str) -> None:
    model, _, _ = fitted_feature_drafter(architecture, steps=25)
    base = model.base_model
    for batch_size, seed in [(1, 3), (5, 4)]:
        batch = random_batch(base, batch_size, seed)
        # a source that is partly the greedy output: the copy then has long drafts on some rows, none on others
        greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS)
        drafter = CompositeDrafter(InputCopyDrafter(base, max_draft_length=8), model.drafter(block_size=4))
        output = base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=MAX_NEW_TOKENS
        )
        assert_greedy_up_to_near_ties(base, batch, greedy, output, max_new_tokens=MAX_NEW_TOKENS)


def test_composite_uses_the_model_where_the_copy_has_nothing(fitted_marian) -> None:
    """On sources unrelated to the output the copy never drafts: the composite then accepts as the model does."""
    model, batch, greedy = fitted_marian
    drafter = CompositeDrafter(InputCopyDrafter(model.base_model, max_draft_length=8), model.drafter())
    composite = model.base_model.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=MAX_NEW_TOKENS,
        return_dict_in_generate=True,
    )  # fmt: skip
    alone = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    assert torch.equal(composite.sequences, greedy)
    assert composite.decoding_stats.mean_accepted >= 0.8 * alone.decoding_stats.mean_accepted
    with pytest.raises(ValueError, match="min_copy_length"):
        CompositeDrafter(drafter.copy_drafter, drafter.model_drafter, min_copy_length=0)


def test_deferred_verifications_merge_into_the_states_one_pass_would_give() -> None:
    """Rows verify different runs; the next verification starts at the shortest run's end (the loop's cache
    length) and re-feeds what rows further ahead verified. Merged, every position holds a verified state."""
    states = torch.arange(2 * 6, dtype=torch.float).reshape(2, 6, 1)  # position p of row r holds 100 r + p
    states = states * 0 + torch.arange(6.0)[None, :, None] + torch.tensor([0.0, 100.0])[:, None, None]

    def verification(start: int, width: int, num_valid: list[int]) -> VerifiedStates:
        valid = torch.arange(width)[None, :] < torch.tensor(num_valid)[:, None]
        chunk = torch.where(valid[..., None], states[:, start : start + width], -1.0)  # -1: rejected drafts
        return VerifiedStates(chunk, start, torch.tensor(num_valid))

    # step 1 verifies positions 0..1 (row 0) and 0..3 (row 1); step 2 starts at 2 and verifies up to 3 / 5
    merged = merge_verified([verification(0, 4, [2, 4]), verification(2, 4, [2, 4])])
    assert merged.start == 0 and merged.num_valid.tolist() == [4, 6]
    for row, valid in enumerate(merged.num_valid.tolist()):
        assert torch.equal(merged.states[row, :valid, 0], states[row, :valid, 0])


def test_composite_defers_the_feature_drafter_while_the_copy_serves(fitted_marian) -> None:
    """Sources equal to the greedy output: the copy drafts nearly every step, the model drafter mostly waits; the
    output stays greedy's and the model's deferred cache still drafts right when it is asked."""
    model, _, greedy = fitted_marian
    base = model.base_model
    echo = {"input_ids": greedy[:, 1:].clone(), "attention_mask": (greedy[:, 1:] != base.config.pad_token_id).long()}
    expected = base.generate(**echo, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    drafter = CompositeDrafter(InputCopyDrafter(base, max_draft_length=3), model.drafter(block_size=4))
    observed = []
    original = drafter.model_drafter.observe
    drafter.model_drafter.observe = lambda request: (observed.append(1), original(request))
    output = base.generate(**echo, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=MAX_NEW_TOKENS)
    assert torch.equal(output, expected)
    assert observed  # some steps deferred the feature drafter


class _RecordingDrafter(Drafter):
    """Hands everything to `drafter` and records what its `select_rows` was given and returned, with how many rows
    the returned state held then."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.block_size = drafter, drafter.block_size
        self.reads_decoder_states = drafter.reads_decoder_states
        self.selections = []

    def prepare(self, encoder_input_ids, encoder_attention_mask):
        return self.drafter.prepare(encoder_input_ids, encoder_attention_mask)

    def select_rows(self, drafter_state, rows):
        result = self.drafter.select_rows(drafter_state, rows)
        held = getattr(result, "keys", None)  # the feature drafter's cache, or the NAR drafter's encoder output
        held = result.encoder_outputs.last_hidden_state if held is None and hasattr(result, "encoder_outputs") else held
        self.selections.append((drafter_state, result, int(rows.numel()), None if held is None else held.shape[0]))
        return result

    def get_candidates(self, request):
        return self.drafter.get_candidates(request)

    def observe(self, request) -> None:
        self.drafter.observe(request)


@pytest.mark.parametrize("kind", ["feature", "nar"])
def test_a_mutable_draft_state_is_narrowed_in_place_as_rows_leave(kind: str) -> None:
    """One rule for per-call draft state (`drafters/base.py`): updated in place by each step, and narrowed in place
    by `select_rows`, which returns the same object, holding only the rows that keep decoding."""
    base = build_model("marian", seed=2)
    batch = random_batch(base, 4, seed=4)
    plain = base.generate(**batch, max_new_tokens=16)
    # a row ends early, and none in the first steps (the feature drafter's cache is made by its first take-in)
    eos = next(int(token) for row in plain for token in row[4:] if not (plain[:, 1:4] == token).any())
    greedy = base.generate(**batch, max_new_tokens=16, eos_token_id=eos)
    if kind == "feature":
        config = FeatureDrafterConfig(block_size=4, training_depth=2)
        drafter = FeatureDrafterModel(base, config).eval().drafter()
    else:
        drafter = NARDrafterModel.from_verifier(base, mask_token_id=3, block_size=4).drafter()
    recording = _RecordingDrafter(drafter)
    output = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=recording, max_new_tokens=16, eos_token_id=eos
    )
    assert torch.equal(output, greedy)
    assert any(0 < num_rows < 4 for _, _, num_rows, _ in recording.selections)  # rows left while others decoded on
    for state, result, num_rows, held in recording.selections:
        assert result is state
        assert held == num_rows

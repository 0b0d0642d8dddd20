"""The non-autoregressive drafter (GAD) and its trainer: inputs, alignment, errors, saving, training, resume.

Exactness of GAD with every architecture and generate argument is in the shared suite (`test_exactness.py`,
drafter "nar").
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ARCHITECTURES, build_model, random_batch
from safetensors.torch import load_file
from test_trainer import copy_task

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    GADPlusPlusAcceptance,
    NARDrafterConfig,
    NARDrafterModel,
    NonAutoregressiveDrafter,
    blockwise_generate,
)
from hf_blockwise import boundary as hf
from hf_blockwise.drafters.nar import nar_decoder_inputs
from hf_blockwise.training.nar_config import NARDrafterTrainingArguments
from hf_blockwise.training.nar_trainer import NARDrafterTrainer, sample_draft_rows

MASK = 3


def test_decoder_inputs_put_masks_after_each_rows_prefix() -> None:
    sequences = torch.tensor([[0, 11, 12, 13, 99, 99], [0, 21, 99, 99, 99, 99]])
    decoder_input_ids, positions = nar_decoder_inputs(sequences, torch.tensor([4, 2]), num_drafts=3, mask_token_id=7)
    assert decoder_input_ids.tolist() == [[0, 11, 12, 13, 7, 7], [0, 21, 7, 7, 7, 7]]
    assert positions.tolist() == [[3, 4, 5], [1, 2, 3]]


def test_training_rows_match_what_drafting_feeds() -> None:
    labels = torch.tensor([[11, 12, 13, 1], [21, 1, -100, -100]])
    seen = set()
    for seed in range(40):
        decoder_input_ids, positions, draft_labels = sample_draft_rows(
            labels, num_drafts=3, decoder_start_token_id=0, mask_token_id=7, pad_token_id=9,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        for row, length in enumerate([4, 2]):
            prefix = int(positions[row, 0])
            seen.add((row, prefix))
            target = labels[row, :length].tolist()
            assert 0 <= prefix < length
            # at inference the same prefix gives the same decoder input and the drafts at the same positions
            verified = torch.tensor([[0, *target[:prefix]]])
            drafted, draft_positions = nar_decoder_inputs(verified, torch.tensor([prefix + 1]), 3, 7)
            width = prefix + 3
            assert decoder_input_ids[row, :width].tolist() == drafted[0].tolist()
            assert (decoder_input_ids[row, width:] == 9).all()
            assert positions[row].tolist() == draft_positions[0].tolist()
            expected = (target[prefix : prefix + 3] + [-100] * 3)[:3]
            assert draft_labels[row].tolist() == expected
    assert seen == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}  # every prefix length is drawn
    with pytest.raises(ValueError, match="empty labels"):
        sample_draft_rows(torch.full((1, 3), -100), 3, 0, 7, 9)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_projecting_selected_columns_gives_the_full_passs_logits(tiny_models, architecture: str) -> None:
    model = tiny_models[architecture]
    batch = random_batch(model, 3, seed=5)
    decoder_input_ids = torch.randint(4, 60, (3, 7), generator=torch.Generator().manual_seed(0))
    columns = torch.tensor([[0, 2], [6, 1], [3, 3]])
    with torch.no_grad():
        full = model(**batch, decoder_input_ids=decoder_input_ids).logits
        with hf.project_columns(model, columns):
            selected = model(**batch, decoder_input_ids=decoder_input_ids).logits
    expected = full.gather(1, columns[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(selected, expected, rtol=1e-5, atol=1e-4)  # one matmul over fewer rows


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_drafter_equal_to_the_verifier_has_every_draft_accepted(tiny_models, architecture: str) -> None:
    """With k = 2 there is no mask: a full-depth copy of the verifier drafts exactly its next token."""
    base = tiny_models[architecture]
    batch = random_batch(base, 4, seed=6)
    greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=20)
    unused = sorted(set(range(base.config.vocab_size)) - set(greedy.flatten().tolist()))[0]
    drafter = NARDrafterModel.from_verifier(base, mask_token_id=unused, block_size=2, decoder_layers=None).drafter()
    output = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=20, return_dict_in_generate=True
    )
    assert torch.equal(output.sequences, greedy)
    accepted = output.decoding_stats.accepted  # (steps, B)
    # drafts from the first feed on, also where the decoder start token is the pad token (Marian, Pegasus)
    for row in range(accepted.shape[1]):
        steps = accepted[:, row][accepted[:, row] > 0]
        assert (steps[:-1] == 2).all(), f"row {row}: {steps.tolist()}"


class RecordingDrafter(NonAutoregressiveDrafter):
    """Keeps every step's drafts of unfinished rows (-1 for finished ones)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[torch.Tensor] = []

    def get_candidates(self, request):
        drafts = super().get_candidates(request)
        self.steps.append(torch.where(request.max_drafts[:, None] > 0, drafts.tokens, -1))
        return drafts


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_drafters_cache_changes_no_draft(tiny_models, architecture: str) -> None:
    """Rows of different lengths, drafts partly rejected: the cache must keep exactly the verified tokens."""
    base = tiny_models[architecture]
    batch = random_batch(base, 4, seed=9)
    source = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=5, decoder_layers=None)
    runs = {}
    for use_cache in (True, False):
        drafter = RecordingDrafter(source, verifier=base, use_cache=use_cache)
        output = base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=20,
            return_dict_in_generate=True,
        )  # fmt: skip
        runs[use_cache] = (output.sequences, drafter.steps, output.decoding_stats.accepted)
    (cached_sequences, cached_steps, accepted), (sequences, steps, _) = runs[True], runs[False]
    assert torch.equal(cached_sequences, sequences)
    assert len(cached_steps) == len(steps) > 2
    for step, (cached, recomputed) in enumerate(zip(cached_steps, steps, strict=True)):
        assert torch.equal(cached, recomputed), f"step {step}"
    assert ((accepted > 1) & (accepted < 5)).any()  # some drafts accepted, some rejected: the cache was cropped


def test_gad_plus_plus_runs_with_the_drafter(tiny_models) -> None:
    base = tiny_models["bart"]
    batch = random_batch(base, 3, seed=7)
    drafter = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=5).drafter()
    exact = base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=16,
                          return_dict_in_generate=True)  # fmt: skip
    loose = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=16,
        acceptance=GADPlusPlusAcceptance(top_beta=5, tolerance=5.0), return_dict_in_generate=True,
    )  # fmt: skip
    assert loose.decoding_stats.mean_accepted >= exact.decoding_stats.mean_accepted


def test_drafter_works_beside_a_heads_model(tiny_models) -> None:
    base = tiny_models["marian"]
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    drafter = NARDrafterModel.from_verifier(model, mask_token_id=MASK, block_size=4).drafter(verifier=model)
    batch = random_batch(base, 2, seed=8)
    greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=16)
    assert torch.equal(model.generate(**batch, assistant=drafter, max_new_tokens=16), greedy)


def test_a_drafter_model_in_training_mode_is_refused_and_its_mode_left_alone(tiny_models) -> None:
    """Dropout would make the drafts random; the drafter neither switches the caller's model to eval nor drafts
    with dropout: it says what to do."""
    base = tiny_models["marian"]
    nar = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=4)
    batch = random_batch(base, 2, seed=9)
    nar.model.train()
    with pytest.raises(ValueError, match=r"is in training mode.*call \.eval\(\) on it"):
        base.generate(**batch, custom_generate=blockwise_generate, assistant=nar.drafter(), max_new_tokens=12)
    assert nar.model.training
    nar.model.eval()
    output = base.generate(**batch, custom_generate=blockwise_generate, assistant=nar.drafter(), max_new_tokens=12)
    assert torch.equal(output, base.generate(**batch, max_new_tokens=12))
    assert not nar.model.training


def test_bad_input_gets_clear_errors(tiny_models) -> None:
    base = tiny_models["bart"]
    nar = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=4)
    drafter = nar.drafter()
    with pytest.raises(ValueError, match="block_size must be between 2 and the drafter's trained block size 4"):
        NonAutoregressiveDrafter(nar, block_size=5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        NARDrafterModel(nar.model, NARDrafterConfig(mask_token_id=10_000)).drafter()
    with pytest.raises(ValueError, match="mask_token_id must be a non-negative int"):
        NARDrafterConfig(mask_token_id=-1)
    with pytest.raises(TypeError, match="config must be a NARDrafterConfig"):
        NARDrafterModel(nar.model, {"mask_token_id": MASK})
    with pytest.raises(ValueError, match="decoder_layers of the drafter must be between 1 and the verifier's 2"):
        NARDrafterModel.from_verifier(base, mask_token_id=MASK, decoder_layers=3)
    other = build_model("marian")
    other.resize_token_embeddings(80)
    with pytest.raises(ValueError, match="vocabulary has 64 tokens but the verifier's has 80"):
        nar.drafter(verifier=other)
    with pytest.raises(ValueError, match="starts decoding with token 2 but the verifier with 0"):
        nar.drafter(verifier=build_model("marian"))
    batch = random_batch(base, 1, seed=0)
    embeds = base.get_input_embeddings()(batch["input_ids"])
    with pytest.raises(ValueError, match="needs its token ids"):
        base.generate(
            inputs_embeds=embeds, attention_mask=batch["attention_mask"], custom_generate=blockwise_generate,
            assistant=drafter, max_new_tokens=4,
        )  # fmt: skip


def test_save_and_load_round_trip(tmp_path, tiny_models) -> None:
    base = tiny_models["t5"]
    drafter = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=6, verifier_name_or_path="b")
    drafter.save_pretrained(tmp_path / "d")
    assert sorted(name for name in os.listdir(tmp_path / "d") if not name.startswith(".")) == [
        "config.json", "generation_config.json", "model.safetensors", "nar_drafter_config.json",
    ]  # fmt: skip
    assert json.loads((tmp_path / "d" / "nar_drafter_config.json").read_text())["block_size"] == 6
    loaded = NARDrafterModel.from_pretrained(tmp_path / "d", verifier=base)
    assert loaded.nar_config == drafter.nar_config and loaded.drafter(4).block_size == 4
    for name, tensor in drafter.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], tensor)
    batch = random_batch(base, 3, seed=9)
    run = dict(custom_generate=blockwise_generate, max_new_tokens=16, return_dict_in_generate=True)
    first = base.generate(**batch, assistant=NonAutoregressiveDrafter(drafter, 4), **run)
    second = base.generate(**batch, assistant=loaded.drafter(4), **run)
    assert torch.equal(first.decoding_stats.accepted, second.decoding_stats.accepted)

    (tmp_path / "d" / "nar_drafter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        NARDrafterModel.from_pretrained(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match=r"nar_drafter_config\.json"):
        NARDrafterModel.from_pretrained(tmp_path)


def test_saving_relative_to_the_verifier_keeps_only_changed_weights(tmp_path, tiny_models) -> None:
    verifier = tiny_models["marian"]
    verifier.save_pretrained(tmp_path)
    drafter = NARDrafterModel.from_verifier(verifier, mask_token_id=MASK, block_size=4, decoder_layers=1)
    with torch.no_grad():  # as after training with a frozen encoder: only the decoder layer moved
        for parameter in drafter.model.get_decoder().layers.parameters():
            parameter.add_(0.01)
    drafter.save_pretrained(tmp_path / "d", relative_to=verifier, verifier_name_or_path="..")
    saved = load_file(tmp_path / "d" / "nar_drafter_weights.safetensors")
    assert saved and all(".decoder.layers.0." in name for name in saved)
    assert not (tmp_path / "d" / "model.safetensors").exists()

    for loaded in (
        NARDrafterModel.from_pretrained(tmp_path / "d"),  # the verifier named in the config
        NARDrafterModel.from_pretrained(tmp_path / "d", verifier=verifier),
    ):
        state = loaded.model.state_dict()
        for name, tensor in drafter.model.state_dict().items():
            torch.testing.assert_close(state[name], tensor)

    config = json.loads((tmp_path / "d" / "nar_drafter_config.json").read_text())
    (tmp_path / "d" / "nar_drafter_config.json").write_text(json.dumps({**config, "verifier_name_or_path": None}))
    with pytest.raises(ValueError, match="names no verifier; pass verifier="):
        NARDrafterModel.from_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="vocabulary has 64 tokens but the verifier's has 80"):
        wrong = build_model("marian")
        wrong.resize_token_embeddings(80)
        NARDrafterModel.from_pretrained(tmp_path / "d", verifier=wrong)
    (tmp_path / "d" / "nar_drafter_weights.safetensors").write_bytes(b"truncated")
    with pytest.raises(ValueError, match="corrupt"):
        NARDrafterModel.from_pretrained(tmp_path / "d", verifier=verifier)


def make_args(output_dir, **overrides) -> NARDrafterTrainingArguments:
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        max_steps=6,
        save_steps=3,
        logging_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        prefixes_per_example=2,
        eval_decoding_batch_size=8,
        eval_max_new_tokens=12,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return NARDrafterTrainingArguments(**settings)


def test_training_arguments_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="prefixes_per_example must be >= 1"):
        make_args(tmp_path, prefixes_per_example=0)


def test_training_moves_the_decoder_only_and_checkpoints_load(tmp_path) -> None:
    verifier = build_model("marian", seed=3)
    verifier_before = {name: tensor.clone() for name, tensor in verifier.state_dict().items()}
    drafter = NARDrafterModel.from_verifier(verifier, mask_token_id=MASK, block_size=4, decoder_layers=1)
    before = {name: tensor.clone() for name, tensor in drafter.model.state_dict().items()}
    data = copy_task(48, seed=1)
    trainer = NARDrafterTrainer(drafter, make_args(tmp_path, freeze_encoder=True), train_dataset=data)
    trainer.train()

    after = drafter.model.state_dict()
    assert all(torch.equal(verifier_before[name], tensor) for name, tensor in verifier.state_dict().items())
    assert any(not torch.equal(before[name], after[name]) for name in after if ".decoder.layers." in name)
    assert all(torch.equal(before[name], after[name]) for name in after if ".encoder." in name)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and {"draft_1_accuracy", "draft_3_accuracy"} <= set(logged[0])
    reloaded = NARDrafterModel.from_pretrained(tmp_path / "checkpoint-6", verifier=verifier)
    for name, tensor in after.items():
        torch.testing.assert_close(reloaded.model.state_dict()[name], tensor)


def test_training_improves_acceptance_and_evaluate_reports_it(tmp_path) -> None:
    verifier = build_model("bart", seed=4)
    data = copy_task(64, seed=2)
    greedy = [
        verifier.generate(input_ids=torch.tensor([row]), max_new_tokens=12)[0, 1:].tolist() for row in data["input_ids"]
    ]
    distilled = data.remove_columns("labels").add_column("labels", greedy)  # the verifier's own outputs
    drafter = NARDrafterModel.from_verifier(verifier, mask_token_id=MASK, block_size=4, decoder_layers=1)
    args = make_args(tmp_path, max_steps=40, save_steps=100, eval_decoding_samples=16)
    trainer = NARDrafterTrainer(drafter, args, verifier=verifier, train_dataset=distilled, eval_dataset=distilled)
    untrained = trainer.mean_accepted(distilled.select(range(16)))
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_mean_accepted"] > untrained
    assert "eval_draft_1_accuracy" in {key for entry in trainer.state.log_history for key in entry}


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tmp_path) -> None:
    data = copy_task(48, seed=2)

    def run(output_dir, resume: str | None = None) -> NARDrafterModel:
        drafter = NARDrafterModel.from_verifier(build_model("t5", seed=4), mask_token_id=MASK, block_size=3)
        trainer = NARDrafterTrainer(drafter, make_args(output_dir, prefixes_per_example=1), train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return drafter

    straight = run(tmp_path / "straight")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoint-3"))
    for name, tensor in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor)

"""BlockwiseTrainer on a tiny model: heads learn, a frozen base stays put, checkpoints hold heads, resume works."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_model
from datasets import Dataset

from hf_blockwise import BlockwiseConfig, BlockwiseHeadsModel
from hf_blockwise.trainer import BlockwiseTrainer, head_accuracies
from hf_blockwise.trainer_config import BlockwiseTrainingArguments


def copy_task(num_examples: int, seed: int) -> Dataset:
    """Targets repeat the source: a pattern heads can learn within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        length = int(torch.randint(4, 10, (1,), generator=generator))
        tokens = torch.randint(4, 60, (length,), generator=generator).tolist()
        rows.append({"input_ids": [*tokens, 1], "labels": [*tokens, 1]})
    return Dataset.from_list(rows)


def make_args(output_dir, **overrides) -> BlockwiseTrainingArguments:
    settings = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        max_steps=6,
        save_steps=3,
        logging_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        eval_decoding_batch_size=8,
        eval_max_new_tokens=12,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return BlockwiseTrainingArguments(**settings)


def test_training_arguments_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="head_loss must be one of"):
        make_args(tmp_path, head_loss="max")
    with pytest.raises(ValueError, match="base_training must be one of"):
        make_args(tmp_path, base_training="partial")
    assert make_args(tmp_path).prediction_loss_only


def test_head_accuracies_shift_per_head() -> None:
    labels = torch.tensor([[5, 6, 7, 8]])
    logits = torch.zeros(1, 4, 2, 10)
    logits[0, torch.arange(3), 0, labels[0, 1:]] = 1.0  # head 1 right everywhere
    logits[0, 0, 1, 7] = 1.0  # head 2 right at its first position, wrong at the second
    assert head_accuracies(logits, labels).tolist() == [1.0, 0.5]


@pytest.mark.parametrize("head_loss", ["mean", "sampled"])
def test_frozen_base_training_moves_heads_only(tmp_path, head_loss: str) -> None:
    base = build_model("marian", seed=3)
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(base, BlockwiseConfig(block_size=3))
    heads_before = {name: tensor.clone() for name, tensor in model.heads.state_dict().items()}
    data = copy_task(48, seed=1)
    trainer = BlockwiseTrainer(model=model, args=make_args(tmp_path, head_loss=head_loss), train_dataset=data)
    trainer.train()

    assert all(torch.equal(base_before[name], tensor) for name, tensor in base.state_dict().items())
    assert any(not torch.equal(heads_before[name], t) for name, t in model.heads.state_dict().items())
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and {"head_1_loss", "head_2_loss", "head_1_accuracy", "head_2_accuracy"} <= set(logged[0])
    checkpoint = tmp_path / "checkpoint-3"
    files = set(os.listdir(checkpoint))
    assert {"blockwise_config.json", "blockwise_heads.safetensors", "optimizer.pt", "trainer_state.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}  # heads only: the frozen base is not copied


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tmp_path) -> None:
    data = copy_task(48, seed=2)

    def run(output_dir, max_steps: int, resume: bool | str = False) -> BlockwiseHeadsModel:
        model = BlockwiseHeadsModel(build_model("bart", seed=4), BlockwiseConfig(block_size=3))
        trainer = BlockwiseTrainer(model=model, args=make_args(output_dir, max_steps=max_steps), train_dataset=data)
        trainer.train(resume_from_checkpoint=resume or None)
        return model

    straight = run(tmp_path / "straight", max_steps=6)
    resumed = run(tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "straight" / "checkpoint-3"))
    for name, tensor in straight.heads.state_dict().items():
        torch.testing.assert_close(resumed.heads.state_dict()[name], tensor)


def test_full_fine_tuning_trains_base_and_saves_it(tmp_path) -> None:
    base = build_model("t5", seed=5)
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(base, BlockwiseConfig(block_size=3))
    trainer = BlockwiseTrainer(
        model=model, args=make_args(tmp_path, base_training="full", max_steps=3), train_dataset=copy_task(24, 3)
    )
    trainer.train()
    assert any(not torch.equal(base_before[name], tensor) for name, tensor in base.state_dict().items())
    reloaded = BlockwiseHeadsModel.from_pretrained(tmp_path / "checkpoint-3")
    for name, tensor in base.state_dict().items():
        torch.testing.assert_close(reloaded.base_model.state_dict()[name], tensor)


def test_evaluate_decodes_blockwise(tmp_path) -> None:
    model = BlockwiseHeadsModel(build_model("pegasus", seed=6), BlockwiseConfig(block_size=4))
    data = copy_task(16, seed=4)
    trainer = BlockwiseTrainer(model=model, args=make_args(tmp_path), train_dataset=data, eval_dataset=data)
    metrics = trainer.evaluate()
    assert metrics["eval_mean_accepted"] >= 1.0
    assert {"eval_loss", "eval_head_1_loss", "eval_head_3_accuracy"} <= set(metrics) | {
        key for entry in trainer.state.log_history for key in entry
    }

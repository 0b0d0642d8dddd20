"""BlockwiseHeadsTrainer on a tiny model: heads learn, a frozen base stays put, checkpoints hold heads, resume works."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import build_model, random_batch
from datasets import Dataset

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel
from hf_blockwise.training.heads_config import BlockwiseHeadsTrainingArguments
from hf_blockwise.training.heads_trainer import BlockwiseHeadsTrainer


def copy_task(num_examples: int, seed: int) -> Dataset:
    """Targets repeat the source: a pattern heads can learn within a few steps."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        length = int(torch.randint(4, 10, (1,), generator=generator))
        tokens = torch.randint(4, 60, (length,), generator=generator).tolist()
        rows.append({"input_ids": [*tokens, 1], "labels": [*tokens, 1]})
    return Dataset.from_list(rows)


def make_args(output_dir, **overrides) -> BlockwiseHeadsTrainingArguments:
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
    return BlockwiseHeadsTrainingArguments(**settings)


def test_training_arguments_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="head_loss must be one of"):
        make_args(tmp_path, head_loss="max")
    with pytest.raises(ValueError, match="base_training must be one of"):
        make_args(tmp_path, base_training="partial")
    assert make_args(tmp_path).prediction_loss_only


def test_head_losses_use_each_heads_shifted_labels() -> None:
    """Per-head loss and accuracy (labelled positions only) equal those computed from the full head logits."""
    model = BlockwiseHeadsModel(build_model("marian", seed=8), BlockwiseHeadsConfig(block_size=4))
    torch.nn.init.normal_(model.heads.down.weight, std=0.5)
    batch = random_batch(model.base_model, 3, seed=2)
    labels = torch.randint(3, 50, (3, 6))
    labels[0, 4:] = -100
    labels[1, 2:] = -100
    trained, labelled = trained_and_labelled_logits(model, batch, labels)
    for head, (logits, targets) in enumerate(labelled):
        expected_loss = torch.nn.functional.cross_entropy(logits, targets)
        expected_accuracy = (logits.argmax(-1) == targets).float().mean()
        torch.testing.assert_close(trained.head_losses[head], expected_loss)
        torch.testing.assert_close(trained.head_accuracies[head], expected_accuracy)


def test_heads_with_a_shortlist_are_scored_over_it() -> None:
    """With a shortlist, each head's loss is the cross-entropy over the shortlist's logits of the labels inside it, and
    its accuracy counts labels outside it as misses (no head can draft them)."""
    model = BlockwiseHeadsModel(build_model("marian", seed=8), BlockwiseHeadsConfig(block_size=3))
    torch.nn.init.normal_(model.heads.down.weight, std=0.5)
    shortlist = torch.arange(3, 40)
    model.set_shortlist(shortlist)
    batch = random_batch(model.base_model, 3, seed=2)
    labels = torch.randint(3, 50, (3, 7))  # some labels (40..49) outside the shortlist
    labels[2, 5:] = -100
    trained, labelled = trained_and_labelled_logits(model, batch, labels)
    for head, (logits, targets) in enumerate(labelled):
        logits, targets = logits[:, shortlist], targets - 3  # shortlist slot = id - 3
        inside = targets < shortlist.shape[0]
        assert bool(inside.any()) and not bool(inside.all())
        expected_loss = torch.nn.functional.cross_entropy(logits[inside], targets[inside])
        expected_accuracy = ((logits.argmax(-1) == targets) & inside).float().mean()
        torch.testing.assert_close(trained.head_losses[head], expected_loss)
        torch.testing.assert_close(trained.head_accuracies[head], expected_accuracy)


def trained_and_labelled_logits(model: BlockwiseHeadsModel, batch: dict, labels: torch.Tensor) -> tuple[Any, list]:
    """The model's training output on `labels`, and per head its full-vocabulary logits at the labelled positions
    with the labels it predicts there (head i at position t: label t + i + 1), `[((N, V), (N,)), ...]`."""
    with torch.no_grad():
        trained = model(**batch, labels=labels)
        full = model(**batch, decoder_input_ids=trained_decoder_inputs(model, labels)).head_logits  # (B, T, k-1, V)
    labelled = []
    for head in range(full.shape[2]):
        logits, targets = full[:, : labels.shape[1] - head - 1, head], labels[:, head + 1 :]
        valid = targets != -100
        labelled.append((logits[valid], targets[valid]))
    return trained, labelled


def trained_decoder_inputs(model: BlockwiseHeadsModel, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs the base derives from `labels` (labels shifted right after the start token)."""
    shifted = torch.full_like(labels, model.base_model.config.decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, model.base_model.config.pad_token_id)


def test_a_head_without_targets_adds_no_loss() -> None:
    model = BlockwiseHeadsModel(build_model("bart", seed=8), BlockwiseHeadsConfig(block_size=4))
    batch = random_batch(model.base_model, 2, seed=2)
    output = model(**batch, labels=torch.tensor([[5, 6], [7, -100]]))  # head 2 and 3 look past the end
    assert torch.isfinite(output.loss) and output.head_losses[1:].tolist() == [0.0, 0.0]
    output.loss.backward()
    assert model.heads.up.weight.grad is not None


@pytest.mark.parametrize("head_loss", ["mean", "sampled"])
def test_frozen_base_training_moves_heads_only(tmp_path, head_loss: str) -> None:
    base = build_model("marian", seed=3)
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    heads_before = {name: tensor.clone() for name, tensor in model.heads.state_dict().items()}
    data = copy_task(48, seed=1)
    trainer = BlockwiseHeadsTrainer(model=model, args=make_args(tmp_path, head_loss=head_loss), train_dataset=data)
    trainer.train()

    assert all(torch.equal(base_before[name], tensor) for name, tensor in base.state_dict().items())
    assert any(not torch.equal(heads_before[name], t) for name, t in model.heads.state_dict().items())
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and {"head_1_loss", "head_2_loss", "head_1_accuracy", "head_2_accuracy"} <= set(logged[0])
    checkpoint = tmp_path / "checkpoint-3"
    files = set(os.listdir(checkpoint))
    assert {"blockwise_config.json", "blockwise_heads.safetensors", "optimizer.pt", "trainer_state.json"} <= files
    assert not files & {"model.safetensors", "pytorch_model.bin"}  # heads only: the frozen base is not copied


@pytest.mark.parametrize("base_training", ["frozen", "full"])
def test_a_frozen_base_serves_its_heads_without_dropout(tmp_path, base_training: str) -> None:
    """Heads learn from the states greedy decoding produces: a frozen base runs in eval mode within a training
    step (two passes over one batch agree), while a base being fine-tuned keeps its dropout."""
    config = build_model("marian").config  # dropout 0 in the zoo; give it some
    config.dropout = 0.5
    model = BlockwiseHeadsModel(type(build_model("marian"))(config), BlockwiseHeadsConfig(block_size=3))
    trainer = BlockwiseHeadsTrainer(
        model=model, args=make_args(tmp_path, base_training=base_training), train_dataset=copy_task(8, seed=4)
    )
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(4)])
    model.train()
    first, second = (trainer.training_loss(model, batch)[0] for _ in range(2))
    assert torch.equal(first, second) == (base_training == "frozen")
    assert model.heads.training  # the heads themselves stay in train mode


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tmp_path) -> None:
    data = copy_task(48, seed=2)

    def run(output_dir, max_steps: int, resume: bool | str = False) -> BlockwiseHeadsModel:
        model = BlockwiseHeadsModel(build_model("bart", seed=4), BlockwiseHeadsConfig(block_size=3))
        trainer = BlockwiseHeadsTrainer(
            model=model, args=make_args(output_dir, max_steps=max_steps), train_dataset=data
        )
        trainer.train(resume_from_checkpoint=resume or None)
        return model

    straight = run(tmp_path / "straight", max_steps=6)
    resumed = run(tmp_path / "resumed", max_steps=6, resume=str(tmp_path / "straight" / "checkpoint-3"))
    for name, tensor in straight.heads.state_dict().items():
        torch.testing.assert_close(resumed.heads.state_dict()[name], tensor)


def test_full_fine_tuning_trains_base_and_saves_it(tmp_path) -> None:
    base = build_model("t5", seed=5)
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    trainer = BlockwiseHeadsTrainer(
        model=model, args=make_args(tmp_path, base_training="full", max_steps=3), train_dataset=copy_task(24, 3)
    )
    trainer.train()
    assert any(not torch.equal(base_before[name], tensor) for name, tensor in base.state_dict().items())
    reloaded = BlockwiseHeadsModel.from_pretrained(tmp_path / "checkpoint-3")
    for name, tensor in base.state_dict().items():
        torch.testing.assert_close(reloaded.base_model.state_dict()[name], tensor)


def test_the_base_trains_at_its_own_learning_rate(tmp_path) -> None:
    base = build_model("t5", seed=5)
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    args = make_args(
        tmp_path,
        base_training="full",
        max_steps=2,
        save_steps=10,
        base_learning_rate=3e-5,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=4,
    )
    trainer = BlockwiseHeadsTrainer(model=model, args=args, train_dataset=copy_task(16, 3))
    trainer.train()
    base_ids = {id(parameter) for parameter in base.parameters()}
    rates = {
        "base" if id(group["params"][0]) in base_ids else "heads": group["lr"]
        for group in trainer.optimizer.param_groups
        if all((id(parameter) in base_ids) == (id(group["params"][0]) in base_ids) for parameter in group["params"])
    }
    assert sum(len(group["params"]) for group in trainer.optimizer.param_groups) == sum(
        1 for parameter in model.parameters() if parameter.requires_grad
    )
    assert rates["heads"] == pytest.approx(3e-3 * 2 / 4)  # halfway through the warmup: both rates scaled
    assert rates["base"] == pytest.approx(3e-5 * 2 / 4)
    with pytest.raises(ValueError, match="base_learning_rate needs base_training='full'"):
        make_args(tmp_path, base_learning_rate=1e-4)


def test_evaluate_decodes_blockwise(tmp_path) -> None:
    model = BlockwiseHeadsModel(build_model("pegasus", seed=6), BlockwiseHeadsConfig(block_size=4))
    data = copy_task(16, seed=4)
    trainer = BlockwiseHeadsTrainer(model=model, args=make_args(tmp_path), train_dataset=data, eval_dataset=data)
    metrics = trainer.evaluate()
    assert metrics["eval_mean_accepted"] >= 1.0
    assert {"eval_loss", "eval_head_1_loss", "eval_head_3_accuracy"} <= set(metrics) | {
        key for entry in trainer.state.log_history for key in entry
    }


def test_lora_trains_adapters_and_heads_and_reloads_merged(tmp_path) -> None:
    base = build_model("bart", seed=7)
    base.save_pretrained(tmp_path / "base")
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(
        base, BlockwiseHeadsConfig(block_size=3, base_model_name_or_path=str(tmp_path / "base"))
    )
    heads_before = {name: tensor.clone() for name, tensor in model.heads.state_dict().items()}
    args = make_args(tmp_path / "run", base_training="lora", max_steps=3, lora_r=4)
    trainer = BlockwiseHeadsTrainer(model=model, args=args, train_dataset=copy_task(24, 3))
    trainer.train()

    adapted = dict(model.base_model.named_parameters())
    lora_b = [tensor for name, tensor in adapted.items() if "lora_B" in name]
    assert lora_b and all(tensor.abs().sum() > 0 for tensor in lora_b)  # LoRA's B starts at zero: it trained
    for name, tensor in adapted.items():
        if "lora_" not in name:  # the base's own weights stay frozen
            original = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(tensor, base_before[original]), name
    assert any(not torch.equal(heads_before[name], t) for name, t in model.heads.state_dict().items())

    checkpoint = tmp_path / "run" / "checkpoint-3"
    files = set(os.listdir(checkpoint))
    assert {"adapter_config.json", "adapter_model.safetensors", "blockwise_heads.safetensors"} <= files
    assert "model.safetensors" not in files and not any(name.startswith(".adapter-") for name in files)

    reloaded = BlockwiseHeadsModel.from_pretrained(checkpoint).eval()
    model.eval()
    inputs = torch.randint(4, 60, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=inputs, decoder_input_ids=inputs).logits
        merged = reloaded(input_ids=inputs, decoder_input_ids=inputs).logits
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    greedy = reloaded.generate(input_ids=inputs, assistant=None, max_new_tokens=10)
    assert torch.equal(reloaded.generate(input_ids=inputs, max_new_tokens=10), greedy)


def test_lora_arguments_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="lora_r must be >= 1"):
        make_args(tmp_path, base_training="lora", lora_r=0)


@pytest.mark.parametrize("base_training", ["lora", "full"])
def test_resume_with_a_trained_base_matches_an_uninterrupted_run(tmp_path, base_training: str) -> None:
    """Resuming goes through the adapter checkpoint: heads plus the LoRA adapter, or plus the whole base."""
    data = copy_task(48, seed=2)

    def run(output_dir, resume: str | None = None) -> BlockwiseHeadsModel:
        model = BlockwiseHeadsModel(build_model("bart", seed=4), BlockwiseHeadsConfig(block_size=3))
        args = make_args(output_dir, base_training=base_training, lora_r=4)
        BlockwiseHeadsTrainer(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)
        return model

    straight = run(tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    files = set(os.listdir(checkpoint))
    assert {"blockwise_heads.safetensors", "training_args.bin"} <= files
    assert ("model.safetensors" in files) == (base_training == "full")
    assert ("adapter_model.safetensors" in files) == (base_training == "lora")
    resumed = run(tmp_path / "resumed", resume=str(checkpoint))
    resumed_state = resumed.state_dict()  # heads, base and (with LoRA) its adapter
    for name, tensor in straight.state_dict().items():
        torch.testing.assert_close(resumed_state[name], tensor)
    untouched = build_model("bart", seed=4).state_dict()
    if base_training == "full":  # the base moved, and the resumed run moved it the same way
        assert any(not torch.equal(untouched[name], t) for name, t in resumed.base_model.state_dict().items())


def test_load_best_model_at_end_restores_the_best_checkpoints_heads(tmp_path) -> None:
    model = BlockwiseHeadsModel(build_model("marian", seed=3), BlockwiseHeadsConfig(block_size=3))
    data = copy_task(24, seed=5)
    # "best" is the highest eval loss: the first checkpoint, so the end of training must roll the heads back
    args = make_args(
        tmp_path, eval_strategy="steps", eval_steps=3, load_best_model_at_end=True, metric_for_best_model="loss",
        greater_is_better=True, eval_decoding_samples=4,
    )  # fmt: skip
    trainer = BlockwiseHeadsTrainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-3")
    best = BlockwiseHeadsModel.from_pretrained(tmp_path / "checkpoint-3", base_model=build_model("marian", seed=3))
    last = BlockwiseHeadsModel.from_pretrained(tmp_path / "checkpoint-6", base_model=build_model("marian", seed=3))
    for name, tensor in model.heads.state_dict().items():
        assert torch.equal(tensor, best.heads.state_dict()[name]), name
    assert any(
        not torch.equal(tensor, last.heads.state_dict()[name]) for name, tensor in model.heads.state_dict().items()
    )


def test_trainers_override_no_private_trainer_method_but_through_the_boundary(tmp_path) -> None:
    from hf_blockwise.boundary.trainer import AdapterCheckpointMixin
    from hf_blockwise.training.feature_trainer import FeatureDrafterTrainer
    from hf_blockwise.training.nar_trainer import NARDrafterTrainer

    for trainer_class in (BlockwiseHeadsTrainer, FeatureDrafterTrainer, NARDrafterTrainer):
        for name in ("_save", "_load_from_checkpoint", "_load_best_model"):
            owner = next(klass for klass in trainer_class.__mro__ if name in vars(klass))
            assert owner is AdapterCheckpointMixin, (trainer_class.__name__, name, owner.__name__)
    model = BlockwiseHeadsModel(build_model("marian", seed=3), BlockwiseHeadsConfig(block_size=3))
    trainer = BlockwiseHeadsTrainer(model=model, args=make_args(tmp_path), train_dataset=copy_task(8, seed=1))
    # DeepSpeed ZeRO 1/2 hand over a gathered state_dict while every process holds whole weights: saved as usual
    trainer._save(str(tmp_path / "zero2"), state_dict=model.state_dict())
    assert BlockwiseHeadsModel.from_pretrained(tmp_path / "zero2", base_model=build_model("marian", seed=3))
    # sharded parameters (FSDP, ZeRO-3) are empty on each process: refused
    model.heads.parameters().__next__().data = torch.empty(0)
    with pytest.raises(ValueError, match="cannot save sharded parameters"):
        trainer._save(str(tmp_path / "sharded"), state_dict={})

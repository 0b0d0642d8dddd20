"""Training recipes run end to end on a tiny model: the heads recipe under `accelerate launch` with 2 CPU processes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import build_model, load_recipe_module, word_tokenizer
from safetensors.torch import load_file

REPOSITORY = Path(__file__).resolve().parent.parent


def write_multi30k_like(directory: Path, num_train: int = 24) -> None:
    """A Multi30k-shaped folder (train / val / test_2016_flickr, .en.gz / .de.gz) over the tiny vocabulary."""
    directory.mkdir()
    sentences = [" ".join(f"w{3 + (i * 7 + j * 5) % 60}" for j in range(3 + i % 5)) for i in range(num_train)]
    for split, lines in {"train": sentences, "val": sentences[:4], "test_2016_flickr": sentences[:3]}.items():
        for language in ("en", "de"):
            with gzip.open(directory / f"{split}.{language}.gz", "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")


def test_heads_recipe_runs_under_accelerate_launch_with_two_cpu_processes(tmp_path) -> None:
    base_dir, data_dir, out_dir = tmp_path / "base", tmp_path / "data", tmp_path / "heads"
    build_model("marian", seed=11).save_pretrained(base_dir)
    word_tokenizer().save_pretrained(base_dir)
    write_multi30k_like(data_dir)
    # accelerate starts several local processes through torchrun only in its "--multi_gpu" mode; with no GPU
    # the recipe's PartialState(cpu=True) joins them as a MULTI_CPU (gloo) group.
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        str(REPOSITORY / "training" / "train_heads.py"),
        "--base", str(base_dir), "--dataset", str(data_dir), "--out", str(out_dir), "--block-size", "3",
        "--targets", "distilled", "--max-steps", "3", "--batch-size", "4", "--eval-sentences", "3", "--threads", "1",
        "--max-new-tokens", "16",
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    log = json.loads((out_dir / "heads_log.json").read_text())
    assert log["world_size"] == 2
    assert log["identical"] == log["num_sentences"] == 3
    assert (out_dir / "final" / "blockwise_heads.safetensors").is_file()
    distilled = (out_dir / "distilled-beam1.jsonl").read_text().splitlines()
    assert len(distilled) == 24  # filled once, by the main process
    state = json.loads((out_dir / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3


def test_nar_drafter_recipe_trains_resumes_and_ships(tmp_path) -> None:
    base_dir, data_dir, out_dir = tmp_path / "base", tmp_path / "data", tmp_path / "nar"
    model = build_model("marian", seed=12)
    model.generation_config.max_length = None
    model.save_pretrained(base_dir)
    word_tokenizer().save_pretrained(base_dir)
    write_multi30k_like(data_dir)
    command = [
        sys.executable, str(REPOSITORY / "training" / "train_nar_drafter.py"), "--base", str(base_dir),
        "--dataset", str(data_dir), "--out", str(out_dir), "--block-size", "4", "--decoder-layers", "1",
        "--freeze-encoder", "--batch-size", "4", "--eval-sentences", "3", "--threads", "1", "--max-new-tokens", "16",
    ]  # fmt: skip
    first = subprocess.run([*command, "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    first_clock = out_dir / "checkpoint-2" / "training_clock.json"
    assert json.loads(first_clock.read_text())["train_seconds"] > 0
    first_clock.write_text('{"train_seconds": 1000.0}')  # as if the first run had trained for 1000 s
    ship_dir = base_dir / "nar-drafter"
    second = subprocess.run([*command, "--max-steps", "4", "--ship", str(ship_dir)], capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]

    state = json.loads((out_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # resumed from checkpoint-2, not restarted
    assert '"global_step": 2' in (out_dir / "checkpoint-2" / "trainer_state.json").read_text()
    log = json.loads((out_dir / "nar_log.json").read_text())
    assert log["identical"] == log["num_sentences"] == 3
    # the first run's training time is carried by its checkpoint into the resumed run's total
    total_seconds = json.loads((out_dir / "checkpoint-4" / "training_clock.json").read_text())["train_seconds"]
    assert 1000 < total_seconds <= log["train_wall_time_s"] < 1000 + log["wall_time_s"]
    assert "non-autoregressive drafter" in (ship_dir / "README.md").read_text()
    assert json.loads((ship_dir / "nar_drafter_config.json").read_text())["verifier_name_or_path"] == ".."
    assert (ship_dir / "nar_drafter_weights.safetensors").is_file() and not (ship_dir / "model.safetensors").exists()


def test_self_distillation_and_feature_drafter_recipes_train_resume_and_ship(tmp_path) -> None:
    base_dir, data_dir, distilled, out_dir = tmp_path / "base", tmp_path / "data", tmp_path / "dist", tmp_path / "f"
    model = build_model("marian", seed=13)
    model.generation_config.max_length = None
    model.save_pretrained(base_dir)
    word_tokenizer().save_pretrained(base_dir)
    data_dir.mkdir()
    write_multi30k_like(data_dir / "multi30k")
    distill = [
        sys.executable, str(REPOSITORY / "training" / "distill_sources.py"), "--base", str(base_dir), "--out",
        str(distilled), "--data-dir", str(data_dir), "--corpora", "multi30k_en:20", "--max-new-tokens", "12",
        "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(distill, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((distilled / "sources.txt").read_text().splitlines()) == 20
    assert len((distilled / "distilled.jsonl").read_text().splitlines()) == 20
    command = [
        sys.executable, str(REPOSITORY / "training" / "train_feature_drafter.py"), "--base", str(base_dir),
        "--distilled", str(distilled), "--out", str(out_dir), "--data-dir", str(data_dir), "--batch-size", "4",
        "--eval-sentences", "3", "--threads", "1", "--max-new-tokens", "12", "--training-depth", "2",
        "--shortlist", "30", "--logging-steps", "1",
    ]  # fmt: skip
    first = subprocess.run([*command, "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    ship_dir = base_dir / "feature-drafter"
    evaluating = ["--eval-steps", "1", "--eval-decoding-sentences", "2"]  # tokens per call during training
    second = subprocess.run(
        [*command, "--max-steps", "4", "--ship", str(ship_dir), *evaluating], capture_output=True, text=True
    )
    assert second.returncode == 0, second.stderr[-3000:]
    state = json.loads((out_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # resumed from checkpoint-2
    evaluations = [entry for entry in state["log_history"] if "eval_mean_accepted" in entry]
    assert evaluations and evaluations[-1]["step"] == 4 and evaluations[-1]["eval_mean_accepted"] >= 1.0
    curve = subprocess.run(
        [sys.executable, str(REPOSITORY / "scripts" / "drafter_curve.py"), "--state", str(out_dir / "checkpoint-4" /
         "trainer_state.json"), "--out", str(tmp_path / "curve"), "--seconds-per-step", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert curve.returncode == 0, curve.stderr[-3000:]
    assert (tmp_path / "curve" / "drafter_curve.png").is_file() and "| 0.1 | 4 |" in curve.stdout
    log = json.loads((out_dir / "feature_drafter_log.json").read_text())
    assert log["identical"] == log["num_sentences"] == 3 and len(log["step_accuracies"]) == 2
    config = json.loads((ship_dir / "feature_drafter_config.json").read_text())
    assert config["base_model_name_or_path"] == ".." and 1 <= config["shortlist_size"] <= 30
    assert sorted(os.listdir(ship_dir)) == ["README.md", "feature_drafter.safetensors", "feature_drafter_config.json"]
    # a later session trains the shipped drafter further: with a zero learning rate its weights are the shipped ones
    again = [*command[:7], str(tmp_path / "again"), *command[8:], "--max-steps", "1", "--lr", "0"]
    third = subprocess.run([*again, "--init-from", str(ship_dir)], capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    shipped = load_file(ship_dir / "feature_drafter.safetensors")
    continued = load_file(tmp_path / "again" / "final" / "feature_drafter.safetensors")
    assert shipped.keys() == continued.keys()
    assert all(torch.equal(shipped[name].float(), continued[name].float()) for name in shipped)


def test_synthetic_errors_are_learner_like_reproducible_and_leave_some_sentences_clean() -> None:
    errors = load_recipe_module("synthetic_errors")
    assert errors.bea_tokenize("Mr. Smith's dog isn't here, is it?") == [
        "Mr.", "Smith", "'s", "dog", "is", "n't", "here", ",", "is", "it", "?",
    ]  # fmt: skip
    texts = [f"The {pet} went to the market with {count} friends ." for pet in ("cat", "dog") for count in range(50)]
    sources, targets = errors.synthetic_pairs(texts, seed=3)
    assert targets == texts  # already BEA-tokenized: the targets are the texts
    assert errors.synthetic_pairs(texts, seed=3) == (sources, targets)  # reproducible
    changed = sum(source != target for source, target in zip(sources, targets, strict=True))
    assert 0.6 * len(texts) < changed < len(texts)  # most corrupted, some left clean (copying is learned too)
    edits = [
        sum(a != b for a, b in zip(source.split(), target.split(), strict=False)) + abs(len(source.split()) - 11)
        for source, target in zip(sources, targets, strict=True)
    ]
    assert sum(edits) / len(edits) < 4  # a few errors per sentence, not a rewrite
    assert errors.synthetic_pairs(["#Person1# says hi ."], seed=0) == ([], [])  # DialogSum's speaker tags: skipped


def write_gec_like(directory: Path) -> None:
    """W&I+LOCNESS, FCE, JFLEG and Multi30k-shaped folders of a few English sentences."""
    right = [f"The {w} is on the table ." for w in ("cat", "book", "cup", "key", "pen", "hat", "map", "box")]
    wrong = [sentence.replace(" is ", " are ") for sentence in right]
    files = {
        "gec_wi_locness/train.src.gz": wrong, "gec_wi_locness/train.tgt.gz": right,
        "gec_wi_locness/dev.src.gz": wrong[:4], "gec_wi_locness/dev.tgt.gz": right[:4],
        "gec_fce/train.src.gz": wrong[4:], "gec_fce/train.tgt.gz": right[4:],
        "jfleg/dev.src": wrong[:3], **{f"jfleg/dev.ref{i}": right[:3] for i in range(4)},
        "multi30k/train.en.gz": right,
    }  # fmt: skip
    for relative, lines in files.items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "wt", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")


def test_gec_recipe_adds_synthetic_errors_and_scores_against_copying_the_source(tmp_path) -> None:
    data_dir, out_dir, ship_dir = tmp_path / "data", tmp_path / "gec", tmp_path / "ship"
    write_gec_like(data_dir)
    command = [
        sys.executable, str(REPOSITORY / "training" / "train_base.py"), "--task", "gec", "--dataset", str(data_dir),
        "--out", str(out_dir), "--synthetic", "multi30k_en:6", "--max-steps", "2", "--epochs", "1",
        "--vocab-size", "120", "--eval-sentences", "2", "--threads", "1", "--ship", str(ship_dir),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "synthetic errors on multi30k_en: 6 pairs" in done.stdout
    log = json.loads((out_dir / "training_log.json").read_text())
    assert log["train_pairs"] == 8 + 4 + 6  # W&I, FCE, synthetic
    scores = log["scores"]
    assert scores["jfleg_dev_4refs"]["sentences"] == 3 and scores["wi_locness_dev"]["sentences"] == 4
    assert all(0 <= score["bleu_copy_source"] < 100 for score in scores.values())
    card = (ship_dir / "README.md").read_text()
    assert "| jfleg_dev_4refs (3 sentences) |" in card and "multi30k_en:6" in card
    again = subprocess.run([*command[:-2], "--init-from", str(ship_dir), "--out", str(tmp_path / "again")], text=True,
                           capture_output=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting from the weights and tokenizer of" in again.stdout

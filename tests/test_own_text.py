"""`hf-blockwise train`: a drafter for a user's own checkpoint from the user's own text, in one command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import build_model, word_tokenizer
from test_corpus import random_sources

from hf_blockwise import BlockwiseHeadsModel, FeatureDrafterModel, blockwise_generate
from hf_blockwise.tools.cli import main
from hf_blockwise.training.own_text import MIN_TRAINING_LINES, OwnDrafterOptions, train_own_drafter

MAX_NEW_TOKENS = 16


def save_tiny_model(directory: Path, architecture: str = "marian") -> Path:
    base = build_model(architecture, seed=3)
    base.generation_config.max_length = None
    base.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("own-model"))


@pytest.fixture(scope="module")
def source_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("own-text") / "sources.txt"
    path.write_text("\n".join(random_sources(80, seed=1)) + "\n", encoding="utf-8")
    return path


def train_command(kind: str, model_dir: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", kind, "--model", str(model_dir), "--source-file", str(source), "--out", str(out),
        "--eval-lines", "8", "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress", "--threads", "1", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["feature-drafter", "heads"])
def test_one_command_trains_a_drafter_that_decodes_other_lines_exactly(tmp_path, model_dir, source_file, kind) -> None:
    out = tmp_path / "drafter"
    assert main(train_command(kind, model_dir, source_file, out, "--max-steps", "80")) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 80 and summary["identical"] == summary["eval_lines"] == 8
    assert summary["training_lines"] == 72 and summary["stopped_by"] == "max steps"

    # the saved adapter, loaded on the base as a user would, on lines it never saw: greedy's tokens, fewer calls
    base = build_model("marian", seed=3)
    loader = FeatureDrafterModel if kind == "feature-drafter" else BlockwiseHeadsModel
    drafter = loader.from_pretrained(out, base_model=base).drafter()
    tokenizer = word_tokenizer()
    accepted = []
    for text in random_sources(12, seed=7):
        batch = tokenizer([text], return_tensors="pt")
        greedy = base.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, num_beams=1)
        output = base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=MAX_NEW_TOKENS,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(output.sequences, greedy)
        accepted.append(output.decoding_stats.mean_accepted)
    assert sum(accepted) / len(accepted) > 1.2


def test_a_run_resumes_with_more_steps_and_keeps_its_distillation(tmp_path, model_dir, source_file, capsys) -> None:
    out = tmp_path / "drafter"
    main(train_command("heads", model_dir, source_file, out, "--max-steps", "4"))
    distilled = (out / "distilled.jsonl").read_bytes()
    stamp = (out / "distilled.jsonl").stat().st_mtime_ns
    main(train_command("heads", model_dir, source_file, out, "--max-steps", "8"))
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 8
    assert (out / "distilled.jsonl").read_bytes() == distilled
    assert (out / "distilled.jsonl").stat().st_mtime_ns == stamp  # not decoded again
    assert (out / "checkpoints" / "checkpoint-8").is_dir()
    assert "after 8 steps" in capsys.readouterr().out


def test_the_time_limit_stops_training_and_max_lines_bounds_the_text(tmp_path, model_dir, source_file) -> None:
    texts = source_file.read_text().splitlines()
    options = OwnDrafterOptions(
        kind="heads", max_minutes=1e-9, max_lines=40, eval_lines=8, max_new_tokens=MAX_NEW_TOKENS
    )
    report = train_own_drafter(model_dir, texts, tmp_path / "drafter", options, progress=False)
    assert report.stopped_by == "time limit" and report.steps == 1
    distilled = (tmp_path / "drafter" / "distilled.jsonl").read_text().splitlines()
    assert report.training_lines == len(distilled) == 40
    assert (tmp_path / "drafter" / "checkpoints" / "checkpoint-1").is_dir()


def test_bad_runs_are_refused_clearly(tmp_path, model_dir, source_file) -> None:
    few = tmp_path / "few.txt"
    few.write_text("\n".join(random_sources(MIN_TRAINING_LINES + 7, seed=2)) + "\n")
    with pytest.raises(SystemExit, match=r"too little text: 39 non-blank lines.*at least 32 beside the 8 held out"):
        main(train_command("heads", model_dir, few, tmp_path / "a"))

    out = tmp_path / "b"
    main(train_command("heads", model_dir, source_file, out, "--max-steps", "2"))
    with pytest.raises(SystemExit, match=r"holds a run with other settings \(kind differ\)"):
        main(train_command("feature-drafter", model_dir, source_file, out, "--max-steps", "2"))

    foreign = tmp_path / "c"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"is not empty \(notes.txt\) and no drafter run wrote it"):
        main(train_command("heads", model_dir, source_file, foreign))
    assert (foreign / "notes.txt").read_text() == "mine"

    refused = save_tiny_model(tmp_path / "moe", "nllb-moe")
    config = json.loads((refused / "config.json").read_text())
    (refused / "config.json").write_text(json.dumps({**config, "moe_eval_capacity_token_fraction": 0.5}))
    with pytest.raises(SystemExit, match=r"cannot decode NllbMoeForConditionalGeneration .* exactly"):
        main(train_command("heads", refused, source_file, tmp_path / "d"))
    assert os.listdir(tmp_path / "d") == []  # refused before any decoding, and the folder left free

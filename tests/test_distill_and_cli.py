"""Sequence-level distillation (cached, resumable) and the `hf-blockwise demo` console script."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from conftest import build_model, save_with_random_heads, word_tokenizer
from datasets import Dataset

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    FeatureDrafterConfig,
    FeatureDrafterModel,
    NARDrafterModel,
)
from hf_blockwise.tools.cli import main
from hf_blockwise.training.distill import distill_dataset, distill_texts

SOURCES = [" ".join(f"w{3 + (i * 7 + j * 5) % 60}" for j in range(3 + i % 6)) for i in range(10)]


def test_distillation_matches_generate_and_resumes(tmp_path) -> None:
    model, tokenizer = build_model("marian", seed=2), word_tokenizer()
    cache = tmp_path / "distilled.jsonl"
    outputs = distill_texts(model, tokenizer, SOURCES, str(cache), batch_size=4, num_beams=2, max_new_tokens=8)
    for source, output in zip(SOURCES, outputs, strict=True):
        ids = model.generate(**tokenizer([source], return_tensors="pt"), num_beams=2, max_new_tokens=8)
        assert output == tokenizer.decode(ids[0], skip_special_tokens=True)

    # Interrupt: keep four finished lines and a torn fifth; a rerun decodes only what is missing.
    lines = cache.read_text().splitlines(keepends=True)
    cache.write_text("".join(lines[:4]) + lines[4][:10])
    calls = []
    original_generate = model.generate
    model.generate = lambda **kwargs: calls.append(kwargs["input_ids"].shape[0]) or original_generate(**kwargs)
    resumed = distill_texts(model, tokenizer, SOURCES, str(cache), batch_size=4, num_beams=2, max_new_tokens=8)
    assert resumed == outputs and sum(calls) == len(SOURCES) - 4


def test_distill_dataset_adds_a_column(tmp_path) -> None:
    model, tokenizer = build_model("bart", seed=2), word_tokenizer()
    dataset = Dataset.from_dict({"en": SOURCES[:3]})
    out = distill_dataset(dataset, model, tokenizer, "en", str(tmp_path / "c.jsonl"), num_beams=1, max_new_tokens=5)
    assert out.column_names == ["en", "distilled"] and len(out["distilled"]) == 3
    with pytest.raises(ValueError, match="Column 'de' not in the dataset"):
        distill_dataset(dataset, model, tokenizer, "de", str(tmp_path / "d.jsonl"))


def test_demo_runs_offline_on_a_saved_directory(tmp_path, capsys) -> None:
    base = save_with_random_heads(tmp_path, dtype=torch.float16)
    assert json.loads((tmp_path / "blockwise_config.json").read_text())["base_model_name_or_path"] == "."

    arguments = ["demo", "--model", str(tmp_path), "--repeats", "1", "--max-new-tokens", "20"]
    assert main([*arguments, "--no-compile", "w5 w6 w7", "w9 w10"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[identical: True]") == 2 and "mean accepted block" in printed and "speedup" in printed
    assert "compiling" not in printed
    # compiled, the demo's default: here in int8 (the float32 engine's graphs are tests/test_engine.py's)
    assert main([*arguments, "--int8", "w5 w6 w7"]) == 0
    printed = capsys.readouterr().out
    assert "int8, compiled engine" in printed and "the compiled engine's int8 greedy" in printed
    assert printed.count("[identical: True]") == 1
    # the one-time compilation is announced before it starts, and its measured time after
    assert printed.index("compiling the decoder's verification forward") < printed.index("compiled (inductor")
    with pytest.raises(SystemExit, match="ships no feature-drafter"):
        main(["demo", "--model", str(tmp_path), "--drafter", "feature"])
    # a shipped feature drafter is the demo's default drafter
    FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4)).save_pretrained(
        tmp_path / "feature-drafter", base_model_name_or_path=".."
    )
    arguments = ["demo", "--model", str(tmp_path), "--repeats", "1", "--max-new-tokens", "20", "--no-compile"]
    assert main([*arguments, "w5 w6 w7"]) == 0
    printed = capsys.readouterr().out
    assert "feature drafter, k=4" in printed and printed.count("[identical: True]") == 1
    with pytest.raises(SystemExit, match="No checkpoint"):
        main(["demo", "--model", str(tmp_path / "missing")])


# every kind of mode: transformers' references, every family eager, the loop and the oracle, int8, and the engine's
# kinds of compiled mode once each (its reference, a drafter with a compiled drafting block, transformers' compiled
# greedy, int8 greedy and drafting): the engine under every drafter is tests/test_engine.py's
EVERY_KIND_OF_MODE = (
    "greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_top2", "seq_heads", "feature", "composite", "iad",
    "gad", "gad_pp", "loop", "oracle", "greedy_compiled", "feature_compiled", "oracle_k4_compiled",
    "hf_greedy_compiled", "greedy_int8", "ct2", "ct2_int8",
)  # fmt: skip  # the int8 engine's modes: tests/test_one_arithmetic.py and test_trees.py (engine), test_bench_modes.py


def checkpoint_with_every_drafter(checkpoint: Path) -> None:
    """A tiny BART saved with its tokenizer, heads, and the drafters the bench finds beside a model."""
    base = save_with_random_heads(checkpoint, "bart", generation={"max_length": 64})  # build_model's length kept
    # a drafter shipped beside the model is found by the gad modes without --nar-drafter
    NARDrafterModel.from_verifier(base, mask_token_id=2, block_size=4).save_pretrained(checkpoint / "nar-drafter")
    # so are a feature drafter and sequential heads (saved naming the base as the folder above)
    FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4)).save_pretrained(
        checkpoint / "feature-drafter", base_model_name_or_path=".."
    )
    sequential = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3, sequential=True))
    sequential.save_pretrained(checkpoint / "sequential-heads", base_model_name_or_path="..")


def test_bench_compares_every_mode_and_writes_reports(tmp_path, capsys) -> None:
    checkpoint = tmp_path / "model"
    checkpoint_with_every_drafter(checkpoint)
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SOURCES[:5]) + "\n")
    out = tmp_path / "bench"
    arguments = ["bench", "--model", str(checkpoint), "--source-file", str(sources), "--reference-file", str(sources)]
    # the drafter's model also serves, used autoregressively, as transformers' assistant model
    arguments += ["--assistant-model", str(checkpoint / "nar-drafter")]
    arguments += ["--max-new-tokens", "8", "--batch-sizes"]
    assert main([*arguments, "1", "--modes", *EVERY_KIND_OF_MODE, "--out", str(out), "--cost-curve"]) == 0
    # every mode again at batch 3, the compiled ones aside (their graphs at batch > 1: tests/test_engine.py)
    eager = [mode for mode in EVERY_KIND_OF_MODE if not mode.endswith("_compiled")]
    assert main([*arguments, "3", "--modes", *eager, "--out", str(tmp_path / "bench3")]) == 0

    rows = {
        (row["mode"], row["batch_size"]): row
        for folder in (out, tmp_path / "bench3")
        for row in json.loads((folder / "bench.json").read_text())["results"]
    }
    expected_at_one = {"greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_top2", "iad", "gad", "gad_pp"}
    expected_at_one |= {"loop", "oracle_k4"}  # the loop alone, and drafting greedy's own output
    expected_at_one |= {"seq_heads", "feature", "composite"}
    # the compiled engine's modes, and transformers' own compiled greedy beside them
    expected_at_one |= {"greedy_compiled", "feature_compiled", "oracle_k4_compiled", "hf_greedy_compiled"}
    # int8 greedy (CTranslate2 is skipped: a BART)
    expected_at_one |= {"greedy_int8"}
    assert {mode for mode, batch in rows if batch == 1} == expected_at_one
    at_three = {mode for mode in expected_at_one if not mode.endswith("_compiled")} - {"prompt_lookup", "assisted"}
    assert {mode for mode, batch in rows if batch == 3} == at_three
    for (mode, _), row in rows.items():
        assert row["sentences"] == 5 and row["speedup"] > 0 and row["bleu"] is not None
        lossless = ("greedy", "heads", "iad", "prompt_lookup", "assisted", "gad", "loop", "oracle_k4", "seq_heads")
        if mode in (*lossless, "feature", "composite"):
            assert row["identical_rate"] == 1.0, mode
    assert rows[("greedy", 1)]["forwards_per_token"] >= rows[("heads", 1)]["forwards_per_token"] > 0
    # compiled decoder calls run no hooks; the engine counts them: one call per token, as eager greedy
    assert rows[("greedy_compiled", 1)]["forwards_per_token"] == rows[("greedy", 1)]["forwards_per_token"]
    assert rows[("loop", 3)]["mean_accepted"] == 1.0 and rows[("oracle_k4", 3)]["mean_accepted"] > 2
    assert (out / "bench.md").read_text().count("\n| 1 |") == len(expected_at_one)
    assert (out / "bench.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "speedup vs greedy" in printed and f"report written to {out}" in printed
    curve = json.loads((out / "cost_curve.json").read_text())["ms_per_call"]
    assert len(curve) == 32 and all(value > 0 for value in curve.values())
    assert rows[("heads", 1)]["speedup_ceiling"] > 0 and (out / "cost_curve.png").is_file()
    times = curve  # a GAD step feeds the drafter's block size (4) every time, so its ceiling uses t(4)
    expected = rows[("gad", 1)]["mean_accepted"] * times["1"] / times["4"]
    assert rows[("gad", 1)]["speedup_ceiling"] == pytest.approx(expected)
    assert rows[("iad", 1)]["speedup_ceiling"] is None and rows[("greedy", 1)]["speedup_ceiling"] is None
    oracle = rows[("oracle_k4", 1)]  # feeds 4 tokens every step
    assert oracle["speedup_ceiling"] == pytest.approx(oracle["mean_accepted"] * times["1"] / times["4"])
    # a compiled mode's ceiling comes from the engine's own calls, timed because compiled modes ran
    compiled_times = json.loads((out / "cost_curve.json").read_text())["ms_per_call_compiled"]
    assert len(compiled_times) == 32 and all(value > 0 for value in compiled_times.values())
    oracle = rows[("oracle_k4_compiled", 1)]
    expected = oracle["mean_accepted"] * compiled_times["1"] / compiled_times["4"]
    assert oracle["speedup_ceiling"] == pytest.approx(expected)


def test_bench_runs_drafters_at_other_block_sizes_and_thresholds(tmp_path, capsys) -> None:
    base, tokenizer = build_model("marian", seed=3), word_tokenizer()
    base.generation_config.max_length = None
    checkpoint = tmp_path / "model"
    base.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4)).save_pretrained(tmp_path / "drafter")
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SOURCES[:4]) + "\n")
    modes = ["feature_k6", "feature_k3_t0.2", "feature_t0.5"]
    arguments = ["bench", "--model", str(checkpoint), "--source-file", str(sources), "--feature-drafter"]
    arguments += [str(tmp_path / "drafter"), "--modes", *modes, "--batch-sizes", "2", "--max-new-tokens", "8"]
    assert main([*arguments, "--out", str(tmp_path / "bench")]) == 0
    rows = {row["mode"]: row for row in json.loads((tmp_path / "bench" / "bench.json").read_text())["results"]}
    assert set(rows) == {"greedy", *modes}
    assert all(row["identical_rate"] == 1.0 for row in rows.values())
    assert f", feature drafter {tmp_path / 'drafter'}\n" in (tmp_path / "bench" / "bench.md").read_text()
    assert json.loads((tmp_path / "bench" / "bench.json").read_text())["settings"]["feature_drafter"] == str(
        tmp_path / "drafter"
    )
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(checkpoint), "--modes", "feature_x"])
    assert "Unknown mode 'feature_x'; choose from" in capsys.readouterr().err


def test_gad_sweep_times_every_setting_against_one_greedy_run(tmp_path, monkeypatch) -> None:
    base, tokenizer = build_model("marian", seed=5), word_tokenizer()
    base.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    drafter = NARDrafterModel.from_verifier(base, mask_token_id=2, block_size=4)
    drafter.save_pretrained(tmp_path / "model" / "nar-drafter")
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SOURCES[:4]) + "\n")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))  # as `python scripts/gad_sweep.py`
    sweep = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "gad_sweep.py"))
    out = tmp_path / "sweep"
    sweep["main"]([
        "--model", str(tmp_path / "model"), "--source-file", str(sources), "--reference-file", str(sources),
        "--block-sizes", "2", "4", "--betas", "1", "3", "--taus", "0", "2", "--max-new-tokens", "8",
        "--out", str(out),
    ])  # fmt: skip
    results = {row["mode"]: row for row in json.loads((out / "sweep.json").read_text())["results"]}
    assert set(results) == {
        "greedy", "gad_k2", "gad_k4", "gad_pp_k4_beta1_tau2", "gad_pp_k4_beta3_tau2", "gad_pp_k4_beta3_tau0",
    }  # fmt: skip
    for name in ("gad_k2", "gad_k4", "gad_pp_k4_beta1_tau2", "gad_pp_k4_beta3_tau0"):  # the lossless settings
        assert results[name]["identical_rate"] == 1.0, name
    assert all(row["sentences"] == 4 and row["speedup"] > 0 for row in results.values())
    assert (out / "sweep.png").stat().st_size > 0 and "gad_k4" in (out / "sweep.md").read_text()

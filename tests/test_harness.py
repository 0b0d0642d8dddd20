"""The measurement harness (one loop, one definition of identical), the bench's oracle and loop modes, report
clean-ups, and `hf-blockwise bench --model-config`."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB_SIZE, build_model, word_tokenizer

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel, compare_to_greedy
from hf_blockwise.evaluation.harness import ModeResult, generated_tokens, measure, same_output
from hf_blockwise.evaluation.model_configs import MODEL_CONFIGS, resolve_name
from hf_blockwise.evaluation.model_configs import build_model as build_shaped_model
from hf_blockwise.loading import LoadedModel
from hf_blockwise.tools.bench import (
    BenchSetup,
    markdown_table,
    mode_colours,
    run_bench,
    usable_batch_sizes,
    write_report,
)
from hf_blockwise.tools.bench.runners import padded_after_eos
from hf_blockwise.tools.cli import main

PAD = 0


def test_identical_means_the_same_generated_tokens() -> None:
    # position 0 is the decoder start (not generated); pads are batch padding
    assert generated_tokens(torch.tensor([PAD, 5, 6, 1, PAD, PAD]), PAD).tolist() == [5, 6, 1]
    assert generated_tokens(torch.tensor([2, 5, 6]), None).tolist() == [5, 6]
    assert same_output(torch.tensor([PAD, 5, 6, 1]), torch.tensor([2, 5, 6, 1, PAD, PAD]), PAD)
    assert not same_output(torch.tensor([PAD, 5, 6, 1]), torch.tensor([PAD, 5, 7, 1]), PAD)
    assert not same_output(torch.tensor([PAD, 5, 6, 1]), torch.tensor([PAD, 5, 6]), PAD)  # a shorter output


class CountedModel(torch.nn.Module):
    """Stands in for a seq2seq model: its `get_decoder()` is what the harness hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = torch.nn.Identity()

    def get_decoder(self) -> torch.nn.Module:
        return self.decoder


class TextTokenizer:
    def batch_decode(self, sequences: torch.Tensor, skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(f"w{token}" for token in row.tolist() if token > 2) for row in sequences]


def test_measure_interleaves_modes_and_compares_each_with_its_reference() -> None:
    batches = [{"input_ids": torch.zeros(2, 3, dtype=torch.long)}, {"input_ids": torch.ones(2, 3, dtype=torch.long)}]
    greedy_rows = {
        0: torch.tensor([[PAD, 5, 6, 7, 8, 1], [PAD, 9, 10, 11, 1, PAD]]),
        1: torch.tensor([[PAD, 13, 14, 15, 16, 1], [PAD, 17, 18, 19, 20, 1]]),
    }
    model, calls = CountedModel(), []

    def greedy(batch, earlier):
        index = int(batch["input_ids"][0, 0])
        calls.append(("greedy", index))
        for _ in range(3):
            model.decoder(batch["input_ids"])  # three decoder calls
        return greedy_rows[index]

    def blockwise(batch, earlier):
        index = int(batch["input_ids"][0, 0])
        calls.append(("blockwise", index))
        model.decoder(batch["input_ids"])
        rows = earlier["greedy"].clone()  # builds on the earlier mode's output of the same batch
        rows[1, 0] = 2  # another start token: still identical
        if index == 1:
            rows[1, 1] = 4  # a real difference
        # (steps, B); 0: row finished. Eager: no compiled forwards for the harness to add to its hook counts
        stats = SimpleNamespace(accepted=torch.tensor([[3, 2], [1, 0]]), compiled_forwards=0)
        return SimpleNamespace(sequences=rows, decoding_stats=stats)

    results = measure(
        {"greedy": greedy, "blockwise": blockwise}, batches, pad_token_id=PAD, reference="greedy",
        tokenizer=TextTokenizer(), references=["w5 w6 w7 w8", "w9 w10 w11", "w13 w14 w15 w16", "w17 w18 w19 w20"],
        count_forwards_of=[model], repeats=2,
        progress=False,
    )  # fmt: skip
    warmup = [("greedy", 0), ("blockwise", 0)]
    timed = [("greedy", 0), ("greedy", 0), ("blockwise", 0), ("blockwise", 0)]
    timed += [("greedy", 1), ("greedy", 1), ("blockwise", 1), ("blockwise", 1)]
    assert calls == warmup + timed  # interleaved per batch; each batch timed `repeats` times per mode
    greedy_result, blockwise_result = results["greedy"], results["blockwise"]
    assert greedy_result.identical_rows == [True] * 4 and blockwise_result.identical_rows == [True, True, True, False]
    assert blockwise_result.summary()["identical_rate"] == 0.75
    assert greedy_result.target_tokens == 5 + 4 + 5 + 5 and greedy_result.sentences == 4  # no start, no pads
    assert (greedy_result.decoder_forwards, blockwise_result.decoder_forwards) == (6, 2)  # first run of each batch
    assert blockwise_result.mean_accepted == pytest.approx(6 / 3) and greedy_result.mean_accepted is None
    assert len(blockwise_result.batch_seconds) == 2 and blockwise_result.speedup > 0 and greedy_result.speedup == 1
    assert greedy_result.bleu == pytest.approx(100.0) and blockwise_result.bleu < 100.0
    with pytest.raises(ValueError, match="must be a mode that runs before it"):
        measure({"blockwise": blockwise, "greedy": greedy}, batches, pad_token_id=PAD, reference="greedy")


def random_ids(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 10, (count,), generator=generator)
    return [torch.randint(3, VOCAB_SIZE, (int(length),), generator=generator).tolist() for length in lengths]


def test_oracle_and_loop_modes_on_a_tiny_model(capsys) -> None:
    base = build_model("marian", seed=4)
    setup = BenchSetup(LoadedModel(base=base, tokenizer=None), max_new_tokens=12, oracle_block_sizes=(2, 4))
    results = run_bench(setup, random_ids(4, seed=1), None, ["loop", "oracle"], [1, 3, 8], progress=False)
    assert "skipping batch size 8: larger than the 4 sentences" in capsys.readouterr().out
    rows = {(result.mode, result.batch_size): result.summary() for result in results}
    assert set(rows) == {(mode, b) for mode in ("greedy", "loop", "oracle_k2", "oracle_k4") for b in (1, 3)}
    for (mode, _), row in rows.items():  # drafting greedy's own output, or nothing, reproduces greedy
        assert row["identical_rate"] == 1.0 and row["sentences"] == 4, mode
        assert row["words_per_second"] is None and row["bleu"] is None  # no tokenizer: token ids only
    assert rows[("loop", 1)]["mean_accepted"] == 1.0
    assert rows[("loop", 1)]["decoder_forwards"] == rows[("greedy", 1)]["decoder_forwards"]  # one token per call
    assert 1 < rows[("oracle_k2", 1)]["mean_accepted"] <= 2 < rows[("oracle_k4", 1)]["mean_accepted"] <= 4
    assert rows[("oracle_k4", 3)]["decoder_forwards"] < rows[("loop", 3)]["decoder_forwards"]


def test_batch_sizes_larger_than_the_sentences_are_skipped(capsys) -> None:
    assert usable_batch_sizes([1, 16, 4, 5], 4) == [1, 4]
    assert capsys.readouterr().out.count("skipping batch size") == 2
    with pytest.raises(ValueError, match="larger than the 2 sentences"):
        usable_batch_sizes([4], 2)


def test_markdown_table_and_plot_leave_out_what_is_empty(tmp_path) -> None:
    # transformers' modes at batch > 1: no mean accepted block; no BLEU, texts or cost curve
    results = [
        ModeResult(mode=mode, batch_size=2, seconds=1.0, target_tokens=8, decoder_forwards=4, identical=2,
                   compared=2, sentences=2, speedup=1.0)
        for mode in ("greedy", "beam4")
    ]  # fmt: skip
    table = markdown_table(results, "# header")
    header, rule, *rows = table.split("\n\n")[1].splitlines()
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns == ["batch", "mode", "speedup vs greedy", "tokens/s", "forwards/token", "identical¹"]
    assert rule.count("---") == len(columns)
    for column in range(len(columns)):  # no column is empty in every row
        assert any(row.strip("|").split("|")[column].strip() for row in rows)
    assert "ceiling:" not in table
    written = write_report(results, str(tmp_path), "# header", {})
    assert [path.rsplit("/", 1)[1] for path in written] == ["bench.json", "bench.md"]  # nothing to plot
    assert not (tmp_path / "bench.png").exists()
    for count in (11, 13, 25):  # every mode of a plot gets its own colour
        names = [f"mode{index}" for index in range(count)]
        assert len(set(map(tuple, mode_colours(names).values()))) == count


def test_compare_to_greedy_is_built_from_the_harness() -> None:
    base, tokenizer = build_model("bart", seed=3), word_tokenizer()
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    torch.nn.init.normal_(model.heads.down.weight, std=1.0)
    sources = [" ".join(f"w{3 + (i * 7 + j * 5) % 60}" for j in range(3 + i)) for i in range(3)]
    comparison = compare_to_greedy(
        model, tokenizer, sources, sources, assistant=model.drafter(), batch_size=2, max_new_tokens=10, progress=False
    )
    batches = [tokenizer(sources[:2], return_tensors="pt", padding=True), tokenizer(sources[2:], return_tensors="pt")]
    greedy = [ids for batch in batches for ids in base.generate(**batch, max_new_tokens=10)]
    assert comparison.greedy_texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in greedy]
    assert comparison.identical == 3 and comparison.blockwise_texts == comparison.greedy_texts
    assert comparison.target_tokens == sum(
        int(generated_tokens(ids, base.config.pad_token_id).numel()) for ids in greedy
    )
    assert comparison.greedy_bleu == comparison.blockwise_bleu is not None
    assert 1.0 <= comparison.mean_accepted <= 3 and 0 < comparison.decoder_forwards <= comparison.target_tokens
    assert comparison.speedup == pytest.approx(comparison.greedy_seconds / comparison.blockwise_seconds)


# (class, d_model, layers a side, heads, ffn, vocabulary): the hub configs of these models
REAL_SHAPES = {
    "opus-mt-en-de": ("MarianMTModel", 512, 6, 8, 2048, 58101),
    "t5-base": ("T5ForConditionalGeneration", 768, 12, 12, 3072, 32128),
    "bart-large": ("BartForConditionalGeneration", 1024, 12, 16, 4096, 50265),
    "nllb-200-distilled-600M": ("M2M100ForConditionalGeneration", 1024, 12, 16, 4096, 256206),
}


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_model_configs_have_the_real_models_shapes(name: str) -> None:
    model = build_shaped_model(name, device="meta")  # the module structure only: no memory for the weights
    class_name, d_model, layers, heads, ffn, vocab_size = REAL_SHAPES[name]
    assert type(model).__name__ == class_name and next(model.parameters()).device.type == "meta"
    assert model.get_input_embeddings().weight.shape == (vocab_size, d_model)
    assert model.get_output_embeddings().weight.shape == (vocab_size, d_model)
    decoder_layers = [module for module in model.get_decoder().modules() if isinstance(module, torch.nn.ModuleList)]
    assert len(decoder_layers[0]) == layers and model.config.num_hidden_layers == layers
    feed_forward = [p.shape for n, p in model.get_decoder().named_parameters() if p.dim() == 2 and p.shape[0] == ffn]
    assert len(feed_forward) == layers and feed_forward[0] == (ffn, d_model)
    assert model.config.num_attention_heads == heads
    generation = model.generation_config  # EOS and pad never generated: every output has max_new_tokens tokens
    assert set(generation.suppress_tokens) == {model.config.eos_token_id, model.config.pad_token_id}
    assert resolve_name(MODEL_CONFIGS[name].hub_name) == name


# the other two shapes (t5-base, bart-large) run end to end under the model size script's test below
@pytest.mark.parametrize("name", ["nllb-200-distilled-600M", "opus-mt-en-de"])
def test_bench_model_config_end_to_end_on_a_tiny_shape(tmp_path, capsys, name: str) -> None:
    out = tmp_path / "bench"
    arguments = ["bench", "--model-config", MODEL_CONFIGS[name].hub_name, "--tiny-model-config", "--sentences", "3"]
    arguments += ["--max-new-tokens", "8", "--batch-sizes", "1", "4", "--oracle-block-sizes", "2", "4"]
    assert main([*arguments, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipping batch size 4" in printed and f"report written to {out}" in printed
    rows = {row["mode"]: row for row in json.loads((out / "bench.json").read_text())["results"]}
    assert set(rows) == {"greedy", "loop", "oracle_k2", "oracle_k4"} and {r["batch_size"] for r in rows.values()} == {1}
    for mode, row in rows.items():
        assert row["identical_rate"] == 1.0, mode
        assert row["target_tokens"] == 3 * 8, mode  # EOS suppressed: every sentence runs to max_new_tokens
    assert rows["oracle_k4"]["speedup_ceiling"] > 0 and rows["oracle_k4"]["mean_accepted"] > 2
    curves = json.loads((out / "cost_curve.json").read_text())
    assert set(curves["ms_per_call"]) == {"1", "2", "3", "4"}
    assert "ms_per_call_compiled" not in curves  # no compiled mode ran: nothing compiled for the curve
    table = (out / "bench.md").read_text()
    assert "BLEU" not in table and "words/s" not in table and "(tiny)" in table
    assert (out / "bench.png").stat().st_size > 0


def test_model_size_script_tabulates_the_bench_reports(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))  # as `python scripts/NAME.py`
    script = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "model_size_table.py"))
    table = tmp_path / "model_sizes.md"
    script["main"]([
        "--models", "bart-large", "--tiny-model-config", "--sentences", "2", "--max-new-tokens", "6",
        "--oracle-block-sizes", "2", "3", "--threads", "1", "--out-dir", str(tmp_path / "runs"), "--table", str(table),
    ])  # fmt: skip
    text = table.read_text()
    rows = {
        row["mode"]: row for row in json.loads((tmp_path / "runs" / "bart-large" / "bench.json").read_text())["results"]
    }
    curve = json.loads((tmp_path / "runs" / "bart-large" / "cost_curve.json").read_text())["ms_per_call"]
    loop_ratio = rows["loop"]["seconds"] / rows["greedy"]["seconds"]
    ms_per_token = 1000 * rows["greedy"]["seconds"] / rows["greedy"]["target_tokens"]
    speed = next(line for line in text.splitlines() if line.startswith("| bart-large |") and "x (a=" in line)
    assert f"| {ms_per_token:.2f} | {loop_ratio:.2f} | {rows['oracle_k2']['speedup']:.2f}x (a=2.00) |" in speed
    assert speed.endswith("| 8/8 |")  # greedy, loop, oracle k=2, k=3: 2 sentences each, all identical
    cost = next(line for line in text.splitlines() if line.startswith("| bart-large |") and "x (a=" not in line)
    assert cost.endswith(f"| {curve['2'] / curve['1']:.2f} | {curve['3'] / curve['1']:.2f} |")
    assert "expected speedup ≈ oracle speedup at k × a / a_oracle(k)" in text


def test_the_bench_runs_beam_search_modes_against_transformers_beam_search(tmp_path, capsys) -> None:
    """`beam4` (transformers'), the loop's beam search without drafts and with the feature drafter: identical to
    `beam4`, with the same generated tokens counted (beam search's EOS fill after a row's end counts as padding)."""
    out = tmp_path / "bench"
    model = str(Path(__file__).parents[1] / "hf_blockwise" / "pretrained" / "multi30k-en-de")
    arguments = ["bench", "--model", model, "--sentences", "4", "--batch-sizes", "1", "2", "--max-new-tokens", "24"]
    assert main([*arguments, "--modes", "greedy", "beam4", "loop_b4", "feature_b4", "--out", str(out)]) == 0
    capsys.readouterr()
    rows = {(row["mode"], row["batch_size"]): row for row in json.loads((out / "bench.json").read_text())["results"]}
    for batch_size in (1, 2):
        for mode in ("loop_b4", "feature_b4"):
            assert rows[mode, batch_size]["identical_rate"] == 1.0, mode
            assert rows[mode, batch_size]["target_tokens"] == rows["beam4", batch_size]["target_tokens"], mode
    assert rows["loop_b4", 1]["mean_accepted"] == 1.0 and rows["feature_b4", 1]["mean_accepted"] >= 1.0


def test_the_bench_samples_with_drafts_as_without_and_beside_transformers_sampling(tmp_path, capsys) -> None:
    """`_sample` modes at the bench's temperature and top-p, seeded alike per batch: the feature drafter's sampling
    is the loop's undrafted sampling on every sentence (batch 1 and 2); transformers' sampling and assisted sampling
    (batch 1 only) run beside them, compared with nothing; sampling is not greedy's output."""
    out = tmp_path / "bench"
    model = str(Path(__file__).parents[1] / "hf_blockwise" / "pretrained" / "multi30k-en-de")
    arguments = ["bench", "--model", model, "--sentences", "4", "--batch-sizes", "1", "2", "--max-new-tokens", "24",
                 "--assistant-model", model, "--temperature", "1.5", "--top-p", "0.95"]  # fmt: skip
    modes = ["greedy", "greedy_sample", "assisted_sample", "loop_sample", "feature_sample"]
    assert main([*arguments, "--modes", *modes, "--out", str(out)]) == 0
    capsys.readouterr()
    report = json.loads((out / "bench.json").read_text())
    assert (report["settings"]["temperature"], report["settings"]["top_p"]) == (1.5, 0.95)
    rows = {(row["mode"], row["batch_size"]): row for row in report["results"]}
    for batch_size in (1, 2):
        assert rows["feature_sample", batch_size]["identical_rate"] == 1.0
        assert rows["loop_sample", batch_size]["identical_rate"] is None
        assert rows["greedy_sample", batch_size]["identical_rate"] is None
    assert ("assisted_sample", 2) not in rows and rows["assisted_sample", 1]["identical_rate"] is None
    assert rows["loop_sample", 1]["target_tokens"] != rows["greedy", 1]["target_tokens"]  # at 1.5, not greedy's


def test_beam_outputs_are_padded_after_their_end_as_greedy_pads() -> None:
    """Beam search fills a finished row with EOS where the pad id is 0: the bench counts those as padding."""
    config = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    beams = torch.tensor([[2, 5, 6, 2, 2, 2], [2, 7, 2, 2, 2, 2], [2, 8, 9, 10, 11, 12]])  # BART-style start = EOS
    run = padded_after_eos(lambda batch, earlier: beams, config)
    expected = torch.tensor([[2, 5, 6, 2, 0, 0], [2, 7, 2, 0, 0, 0], [2, 8, 9, 10, 11, 12]])
    assert torch.equal(run({}, {}), expected)
    assert [len(generated_tokens(row, 0)) for row in run({}, {})] == [3, 2, 5]

"""`hf-blockwise profile calls|step|divergences|acceptance` on a small saved model (eager: the compiled kinds are
timed by the same functions, whose engine is tested in test_engine.py)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from conftest import save_with_random_heads

from hf_blockwise.drafters import feature_block, heads, trees
from hf_blockwise.engine import CompileOptions, registry
from hf_blockwise.generation import loop, step
from hf_blockwise.loading import load_model
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.tools import profile
from hf_blockwise.tools.cli import main


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> str:
    """A tiny Marian with trained-looking (random, non-zero) heads and a word tokenizer, saved."""
    folder = tmp_path_factory.mktemp("profiled")
    save_with_random_heads(folder)
    (folder / "sources.txt").write_text("w5 w6 w7\nw9 w10\nw4 w8 w8 w11\n")
    return str(folder)


def _table_rows(printed: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in printed.splitlines() if line[:2] == "| "]


def test_the_step_profile_splits_a_decode_into_its_phases(saved_model: str, capsys) -> None:
    """Greedy (the loop alone) spends nothing drafting, the heads do; every phase is a time, the phases sum to the
    total; generate's fixed cost splits into the encoder, the engine's stale check (none: eager) and the rest; the
    loop's functions, the engine's check, the encoder's hooks and the drafter are put back afterwards."""
    originals = (loop.decode_step, step.run_decoder, registry._kept)
    arguments = ["profile", "step", "--model", saved_model, "--drafter", "heads", "--threads", "1"]
    assert main([*arguments, "--source-file", f"{saved_model}/sources.txt", "--max-new-tokens", "12"]) == 0
    phases_table, fixed_table = capsys.readouterr().out.split("\n\n")
    rows = {row[0]: [float(cell) for cell in row[1:]] for row in _table_rows(phases_table)[1:]}
    fixed = {row[0]: [float(cell) for cell in row[1:]] for row in _table_rows(fixed_table)[1:]}
    assert set(rows) == set(fixed) == {"greedy (the loop, no drafts)", "heads"}
    greedy, heads = rows["greedy (the loop, no drafts)"], rows["heads"]
    assert greedy[1] == 0.0 and heads[1] > 0 and heads[6] > 0  # drafting per sentence, one drafter call
    for name, phases in rows.items():
        assert all(value >= 0 for value in phases[:4])
        assert phases[4] == pytest.approx(sum(phases[:4]), abs=0.25)  # each printed to 0.1 ms
        encoder, engine_check, setup, block_check = fixed[name]
        assert encoder > 0 and engine_check == block_check == 0.0 and setup >= 0  # eager: no compiled object
        assert encoder + setup == pytest.approx(phases[3], abs=0.25)
    assert (loop.decode_step, step.run_decoder, registry._kept) == originals
    with pytest.raises(SystemExit) as usage:  # how the engine compiles: nothing to compile
        main([*arguments, "--compiled-prefill"])
    assert usage.value.code == 2 and "it needs --compiled" in capsys.readouterr().err
    loaded = load_model(saved_model)
    phases = profile.step_phases(loaded.base, loaded.tokenizer, ["w5 w6"], None, False, max_new_tokens=4)
    assert phases["encoder"] > 0
    encoder = loaded.base.get_encoder()
    assert not encoder._forward_pre_hooks and not encoder._forward_hooks


def test_divergences_and_call_costs_are_reported(saved_model: str, capsys) -> None:
    common = ["--model", saved_model, "--threads", "1"]
    sources = ["--source-file", f"{saved_model}/sources.txt", "--max-new-tokens", "12"]
    assert main(["profile", "divergences", *common, "--drafter", "heads", *sources]) == 0
    printed = capsys.readouterr().out
    assert "identical to transformers' greedy: 3/3" in printed
    assert "departs from transformers' greedy (float spacings): none" in printed
    kinds = ["--kinds", "float32 eager", "int8 eager", "--max-tokens", "3", "--repeats", "1"]
    assert main(["profile", "calls", *common, *kinds]) == 0
    printed = capsys.readouterr().out
    assert "GB/s from memory (400 MB)" in printed and "from cache (4 MB)" in printed
    rows = _table_rows(printed)
    assert [row[0] for row in rows[1:]] == ["float32 eager", "int8 eager"] and rows[0][-1] == "3 tok"
    float_bytes, int8_bytes = (float(row[1].split()[0]) for row in rows[1:])
    assert int8_bytes == pytest.approx(float_bytes / 4, rel=0.05)  # the int8 kind streams a quarter of the bytes
    with pytest.raises(ValueError, match="unknown call kinds"):
        profile.call_cost_rows(None, None, ["int4 eager"])


def test_guard_cost_pairs_calls_with_and_without_guards(saved_model: str) -> None:
    """`hf-blockwise profile calls --guards`: a compiled call's time with dynamo's guards, and what they cost
    (dynamo alone, for time: the guards are dynamo's, whatever the backend)."""
    loaded = load_model(saved_model)
    eager = CompileOptions(backend="eager")
    costs = profile.guard_cost(loaded.base, loaded.tokenizer, widths=(1, 3), blocks=3, calls=4, options=eager)
    assert set(costs) == {1, 3} and all(ms > 0 for ms, _ in costs.values())


def test_guard_cost_is_the_median_difference_of_paired_blocks(monkeypatch) -> None:
    """On a clock that a call advances by 2 ms with guards and by 1.5, 1.0, 1.5 ms in the three blocks under
    `skip_guard_eval_unsafe`: the median call with guards (2 ms), and the median of the pairs' differences (0.5
    ms, where their mean would be 0.67)."""
    clock = {"now": 0.0, "skipped_blocks": 0, "skipping": False, "calls": 0}

    @contextlib.contextmanager
    def stance(name: str, skip_guard_eval_unsafe: bool = False):
        assert name == "default" and skip_guard_eval_unsafe
        clock["skipping"] = True
        yield
        clock["skipping"], clock["skipped_blocks"] = False, clock["skipped_blocks"] + 1

    def call() -> None:
        clock["calls"] += 1
        clock["now"] += (1.0 if clock["skipped_blocks"] == 1 else 1.5) if clock["skipping"] else 2.0

    monkeypatch.setattr(profile, "compiled_call", lambda *args, **kwargs: call)
    monkeypatch.setattr(profile, "wall_clock", lambda: clock["now"] / 1000)
    monkeypatch.setattr(torch.compiler, "set_stance", stance)
    (ms, guards) = profile.guard_cost(None, None, widths=(2,), blocks=3, calls=5)[2]
    assert clock["calls"] == 3 + 3 * 2 * 5  # warm-up, then 3 pairs of 5-call blocks
    assert ms == pytest.approx(2.0) and guards == pytest.approx(0.5)


def test_sampling_acceptance_compares_the_two_constructions_on_first_drafts(saved_model: str, capsys) -> None:
    """Each first draft's probability of being kept: no coupling of p and q agrees more often than speculative
    sampling's `sum(min(p, q))`, so shared noise's expectation stays under it (up to its draws' error); the decodes'
    own share lies in [0, 1]; the drafter and `drafted_candidates` are put back afterwards."""
    arguments = ["profile", "acceptance", "--model", saved_model, "--drafter", "heads", "--threads", "1"]
    sources = ["--source-file", f"{saved_model}/sources.txt", "--max-new-tokens", "12", "--temperature", "1.5"]
    assert main([*arguments, *sources, "--top-p", "0.95", "--draws", "2000"]) == 0
    rows = {row[0]: float(row[1]) for row in _table_rows(capsys.readouterr().out)[1:]}
    speculative = rows["speculative sampling, min(1, p/q) (expected)"]
    shared = rows["shared noise, the loop's (expected over 2000 draws)"]
    assert 0 < shared <= speculative + 0.02 and speculative <= 1
    assert 0 <= rows["shared noise, these decodes"] <= 1
    assert feature_block.drafted_candidates is heads.drafted_candidates is trees.drafted_candidates


def test_sampling_acceptance_reads_the_feature_drafters_first_drafts(saved_model: str) -> None:
    """The feature drafter draws its chains in its drafting block: each step's first draft is recorded there too."""
    loaded = load_model(saved_model)
    drafter = FeatureDrafterModel(loaded.base, FeatureDrafterConfig(block_size=3)).eval().drafter()
    sources = ["w5 w6 w7", "w9 w10"]
    measured = profile.sampling_acceptance(loaded.base, loaded.tokenizer, sources, drafter, 1.5, 1.0, 10, draws=50)
    assert measured.drafts >= 10 and 0 <= measured.shared_noise <= 1


def test_profile_usage_errors_name_what_is_wrong(saved_model: str, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "step", "--model", saved_model, "--drafter", "feature"])
    assert "drafter 'feature'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "divergences", "--model", f"{saved_model}/missing"])
    assert "no such directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="holds no tokenizer"):
        main(["profile", "calls", "--model", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["profile", "step", "--model", saved_model, "--source-file", f"{saved_model}/missing.txt"])
    assert "--source-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "step", "--model", saved_model, "--feature-drafter", str(tmp_path / "missing")])
    assert "--feature-drafter" in capsys.readouterr().err


def test_the_step_profile_takes_a_feature_drafter_saved_elsewhere(saved_model: str, tmp_path, capsys) -> None:
    """A feature drafter saved outside the model's folder: its drafting is timed."""
    base = load_model(saved_model).base
    config = FeatureDrafterConfig(block_size=4, training_depth=2)
    FeatureDrafterModel(base, config).save_pretrained(tmp_path / "elsewhere")
    arguments = ["profile", "step", "--model", saved_model, "--feature-drafter", str(tmp_path / "elsewhere")]
    assert main([*arguments, "--threads", "1", "--sentences", "2", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "drafter feature, k = 4" in printed
    rows = {row[0]: row[1:] for row in _table_rows(printed.split("\n\n")[0])[1:]}
    assert float(rows["feature"][1]) > 0  # drafting


def test_a_compiled_calls_time_is_split_into_its_parts() -> None:
    """`profile calls --torch-profile`: each profiler event's self time goes to one part, per call."""
    event = collections.namedtuple("event", "key self_cpu_time_total")  # microseconds, as torch.profiler's
    events = [
        event("hf_blockwise::int8_mm", 900.0),
        event("aten::_int_mm", 100.0),
        event("graph_0_cpp_fused_add_amax_0", 400.0),
        event("## Call CompiledFxGraph fa1b2c3 ##", 600.0),
        event("TorchDynamo Cache Lookup", 150.0),
        event("Torch-Compiled Region: 0/0", 50.0),
        event("aten::empty", 200.0),
    ]
    parts = profile.call_time_parts(events, calls=2)
    assert list(parts) == list(profile.CALL_PARTS)
    assert parts == {
        "int8 products": 0.5,
        "the graph's own kernels": 0.2,
        "inductor's Python between kernels": 0.3,
        "dynamo": 0.1,
        "other": 0.1,
    }

"""Bench mode names parse once into a frozen `Mode`, and drafters come from one factory
(`hf_blockwise.loading.build_drafter`) that names what a model lacks."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import build_model

from hf_blockwise import InputCopyDrafter
from hf_blockwise.corpus import DRAFTERS as CORPUS_DRAFTERS
from hf_blockwise.engine import CompileOptions
from hf_blockwise.loading import DRAFTER_NAMES, DRAFTERS, LoadedModel, build_drafter, missing_drafter
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.quantization import Int8Linear
from hf_blockwise.tools.bench import DEFAULT_MODES, MODE_NAMES, BenchSetup, Mode, available_modes, run_bench
from hf_blockwise.tools.bench.runners import acceptance_rule, drafter_options
from hf_blockwise.tools.cli import build_parser, main
from hf_blockwise.tools.cli.bench import requested_modes


def test_every_listed_mode_parses_and_keeps_its_name() -> None:
    for name in MODE_NAMES:
        assert Mode.parse(name).name == name


def test_every_entry_point_names_drafters_from_the_one_registry() -> None:
    """The bench's drafting families, the corpus job's and the demo's choices all come from `loading.DRAFTERS`."""
    drafting = {Mode.parse(name).family: Mode.parse(name).drafter for name in MODE_NAMES if Mode.parse(name).drafter}
    assert set(drafting.values()) == set(DRAFTERS) and set(DRAFTER_NAMES) == {"none", *DRAFTERS}
    for name, kind in DRAFTERS.items():
        assert {family for family, drafter in drafting.items() if drafter == name} == set(kind.bench_families)
    assert set(CORPUS_DRAFTERS) == {"auto", "none"} | {name for name, kind in DRAFTERS.items() if kind.corpus}
    demo = next(action for action in _demo_parser()._actions if "--drafter" in action.option_strings)
    assert set(demo.choices) == {"best"} | {name for name, kind in DRAFTERS.items() if kind.demo}


def _demo_parser():
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    return subparsers.choices["demo"]


def test_modes_all_runs_every_mode_and_the_default_set_is_short() -> None:
    parser = build_parser()
    assert requested_modes(parser.parse_args(["bench", "--modes", "all"])) == list(MODE_NAMES)
    default = requested_modes(parser.parse_args(["bench"]))
    assert default == list(DEFAULT_MODES) and len(default) < len(MODE_NAMES) / 3
    assert {"greedy", "ct2", "ct2_int8", "oracle_compiled"} <= set(default)
    with pytest.raises(SystemExit):
        main(["bench", "--modes", "all", "greedy"])


@pytest.mark.parametrize(
    ("name", "family", "compiled", "int8", "block_size", "threshold", "reference"),
    [
        ("greedy", "greedy", False, False, None, "config", "greedy"),
        ("greedy_int8", "greedy", False, True, None, "config", "greedy_int8"),
        ("heads_int8", "heads", False, True, None, "config", "greedy_int8"),
        ("greedy_compiled", "greedy", True, False, None, "config", "greedy"),
        ("hf_greedy_compiled", "hf_greedy", True, False, None, "config", "greedy"),
        ("heads_compiled", "heads", True, False, None, "config", "greedy_compiled"),
        ("oracle_k4_compiled", "oracle", True, False, 4, "config", "greedy_compiled"),
        ("heads_k3", "heads", False, False, 3, None, "greedy"),
        ("feature_k6_t0.3", "feature", False, False, 6, 0.3, "greedy"),
        ("feature_t0.5", "feature", False, False, None, 0.5, "greedy"),
        ("seq_heads_k2_compiled", "seq_heads", True, False, 2, None, "greedy_compiled"),
        ("ct2_int8", "ct2", False, True, None, "config", "greedy"),  # another engine, compared with float greedy
        ("greedy_int8_compiled", "greedy", True, True, None, "config", "greedy_int8"),
        ("feature_int8_compiled", "feature", True, True, None, "config", "greedy_int8_compiled"),
        ("feature_int8", "feature", False, True, None, "config", "greedy_int8"),
        ("feature_int8d_compiled", "feature_int8d", True, False, None, "config", "greedy_compiled"),
        ("feature_int8d", "feature_int8d", False, False, None, "config", "greedy"),
    ],
)
def test_mode_fields(name, family, compiled, int8, block_size, threshold, reference) -> None:
    mode = Mode.parse(name)
    assert (mode.family, mode.compiled, mode.int8, mode.block_size, mode.threshold) == (
        family, compiled, int8, block_size, threshold,
    )  # fmt: skip
    assert mode.reference == reference
    with pytest.raises(dataclasses.FrozenInstanceError):
        mode.family = "other"  # type: ignore[misc]


def test_mode_properties() -> None:
    assert Mode.parse("iad_realign").drafter == "input_copy" and Mode.parse("gad_pp").drafter == "nar"
    assert Mode.parse("beam4").drafter is None
    assert Mode.parse("ct2_int8").ct2_compute_type == "int8" and Mode.parse("ct2").ct2_compute_type == "float32"
    assert not Mode.parse("ct2_int8").on_int8_model and Mode.parse("iad_int8").on_int8_model
    assert Mode.parse("assisted").batch_one_only and not Mode.parse("heads").batch_one_only
    assert Mode.parse("oracle_compiled").at_block_size(3) == Mode.parse("oracle_k3_compiled")
    assert Mode.parse("feature_int8d").on_int8_drafter and Mode.parse("feature_int8d").drafter == "feature"
    assert not Mode.parse("feature_int8d").on_int8_model and not Mode.parse("feature_int8").on_int8_drafter


def test_compiled_modes_alone_get_a_compiled_first_call_with_compiled_prefill() -> None:
    setup = BenchSetup(LoadedModel(base=build_model("marian"), tokenizer=None), compiled_prefill=True)
    assert setup.engine(True) == CompileOptions(compiled_prefill=True)
    assert setup.engine(False) is False
    assert dataclasses.replace(setup, compiled_prefill=False).engine(True) is True
    assert build_parser().parse_args(["bench", "--compiled-prefill"]).compiled_prefill
    assert not build_parser().parse_args(["bench"]).compiled_prefill


def test_tree_modes_parse_their_nodes_and_branching() -> None:
    tree = Mode.parse("feature_k6_n16_m4_int8_compiled")
    assert (tree.family, tree.block_size, tree.tree_nodes, tree.tree_branching) == ("feature", 6, 16, 4)
    assert tree.compiled and tree.on_int8_model and tree.reference == "greedy_int8_compiled"
    heads = Mode.parse("heads_k4_n8")
    assert (heads.tree_nodes, heads.tree_branching, heads.on_int8_model) == (8, 2, False)
    assert Mode.parse("heads_k3_int8").on_int8_model and Mode.parse("feature_k5").tree_nodes is None


def test_gad_modes_parse_their_block_size_top_beta_and_tolerance() -> None:
    """`gad_k<k>` and `gad_pp_k<k>_beta<β>_tau<τ>` (the sweep's settings): the drafter at that k, GAD++ with that
    β and τ, else the bench's flags."""
    setup = BenchSetup(LoadedModel(base=build_model("marian"), tokenizer=None), gad_block_size=3, gad_top_beta=2)
    exact = Mode.parse("gad_k5_compiled")
    assert (exact.family, exact.block_size, exact.compiled, exact.reference) == ("gad", 5, True, "greedy_compiled")
    assert drafter_options(exact, setup).block_size == 5 and drafter_options(Mode.parse("gad"), setup).block_size == 3
    loose = Mode.parse("gad_pp_k8_beta3_tau0.5")
    assert (loose.family, loose.block_size, loose.top_beta, loose.tolerance) == ("gad_pp", 8, 3, 0.5)
    rule = acceptance_rule(loose, setup)
    assert (rule.top_beta, rule.tolerance) == (3, 0.5)
    default = acceptance_rule(Mode.parse("gad_pp_k8_tau0"), setup)
    assert (default.top_beta, default.tolerance) == (2, 0.0)


def test_beam_modes_parse_their_beams_and_compare_with_transformers_beam_search() -> None:
    """`beam<N>`: transformers' beam search (compared with greedy); a chain mode of the loop or CTranslate2 with
    `_b<N>` last: a beam search of N beams, compared with `beam<N>`, which runs before it."""
    assert (Mode.parse("beam5").family, Mode.parse("beam5").num_beams, Mode.parse("beam5").reference) == (
        "beam", 5, "greedy"
    )  # fmt: skip
    ours = Mode.parse("feature_k5_compiled_b4")
    assert (ours.family, ours.block_size, ours.compiled, ours.num_beams, ours.reference) == (
        "feature", 5, True, 4, "beam4"
    )  # fmt: skip
    assert Mode.parse("greedy_compiled_b3").reference == "beam3" and Mode.parse("ct2_int8_b4").int8
    assert not Mode.parse("ct2_b4").cpu_only and Mode.parse("loop").num_beams == 1
    tree = Mode.parse("feature_k4_n10_compiled_b4")
    assert (tree.tree_nodes, tree.num_beams, tree.reference) == (10, 4, "beam4")
    for name, match in (
        ("greedy_b4", "transformers' beam search is beam<N>"), ("iad_b4", "follows a mode of"),
        ("loop_b4_b2", "follows a mode of"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Mode.parse(name)
    base = build_model("marian")
    setup = BenchSetup(LoadedModel(base=base, tokenizer=None, feature_model=FeatureDrafterModel(base)))
    names = [mode.name for mode in available_modes(setup, ["feature_compiled_b4", "loop_b2"])]
    assert names == ["greedy", "beam2", "beam4", "feature_compiled_b4", "loop_b2"]


def test_sampling_modes_parse_and_compare_with_the_loops_undrafted_sampling() -> None:
    """`_sample` last: transformers' own sampling (`greedy_sample`) and assisted sampling are compared with nothing
    (another random stream); the loop's drafting modes with its undrafted sampling, eager (`loop_sample`) or through
    the engine (`greedy_compiled_sample`, itself compared with `loop_sample` and run after it)."""
    references = {
        "greedy_sample": None, "assisted_sample": None, "loop_sample": None, "greedy_compiled_sample": "loop_sample",
        "feature_sample": "loop_sample", "heads_k3_sample": "loop_sample",
        "feature_compiled_sample": "greedy_compiled_sample", "feature_k4_n10_compiled_sample": "greedy_compiled_sample",
    }  # fmt: skip
    for name, reference in references.items():
        mode = Mode.parse(name)
        assert (mode.sample, mode.reference, mode.num_beams) == (True, reference, 1), name
    assert Mode.parse("feature_k4_n10_compiled_sample").tree_nodes == 10 and not Mode.parse("feature").sample
    for name in ("feature_int8_sample", "beam4_sample", "ct2_sample", "feature_b4_sample", "loop_sample_sample"):
        with pytest.raises(ValueError, match="a _sample suffix follows a float32 chain or tree mode"):
            Mode.parse(name)
    base = build_model("marian")
    setup = BenchSetup(LoadedModel(base=base, tokenizer=None, feature_model=FeatureDrafterModel(base)))
    names = [mode.name for mode in available_modes(setup, ["feature_compiled_sample", "greedy_sample"])]
    assert names == ["greedy", "loop_sample", "greedy_compiled_sample", "feature_compiled_sample", "greedy_sample"]


@pytest.mark.parametrize(
    "name",
    [
        "beam4_compiled",
        "heads_k3_n",
        "feature_t0.3.4",
        "loop_int8",
        "nope",
        "beam1",
        "gad_k4_beta2",
        "gad_pp_k4_compiled",
    ],
)
def test_unknown_modes_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"Unknown mode {name!r}"):
        Mode.parse(name)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("feature_k0", "block_size must be an int from 2 to 64.*got 0"),
        ("oracle_k1", "block_size must be an int from 2 to 64.*got 1"),
        ("feature_k4_n0", "tree_nodes must be a positive int"),
        ("heads_k4_n1000", "tree_nodes=1000 is more than the 10 candidates of 3 depths"),
        ("feature_k4_t1.5", r"the threshold \(_t\) must be a number in \[0, 1\)"),
    ],
)
def test_sizes_no_drafter_takes_are_refused_by_name_before_anything_loads(name: str, message: str, capsys) -> None:
    with pytest.raises(ValueError, match=f"mode {name!r}: {message}"):
        Mode.parse(name)
    with pytest.raises(SystemExit) as exit:  # a usage error of the command line, before the model loads
        main(["bench", "--model", "no-such-model-dir", "--modes", "greedy", name])
    assert exit.value.code == 2 and f"mode {name!r}" in capsys.readouterr().err


def test_the_drafter_factory_names_what_a_model_lacks() -> None:
    loaded = LoadedModel(base=build_model("marian", seed=0), tokenizer=None)
    assert build_drafter("none", loaded) is None
    assert isinstance(build_drafter("input_copy", loaded), InputCopyDrafter)
    assert missing_drafter("input_copy", loaded) is None
    for name, lacks in (("heads", "proposal heads"), ("feature", "feature drafter"), ("nar", "NAR drafter")):
        assert lacks in missing_drafter(name, loaded)
        with pytest.raises(ValueError, match=f"drafter '{name}': the model has no {lacks}"):
            build_drafter(name, loaded)
    with pytest.raises(ValueError, match="unknown drafter 'beam'"):
        build_drafter("beam", loaded)


def test_a_mode_brings_its_references_references() -> None:
    base = build_model("marian")
    setup = BenchSetup(LoadedModel(base=base, tokenizer=None, feature_model=FeatureDrafterModel(base)))
    names = [mode.name for mode in available_modes(setup, ["feature_int8_compiled"])]
    assert names[:3] == ["greedy", "greedy_int8", "greedy_int8_compiled"]


def test_an_int8_drafter_over_the_float_model_drafts_and_gives_float_greedy() -> None:
    """`feature_int8d`: the feature drafter's layer in int8 (a copy), the float32 base unchanged and shared; drafts
    are only proposals, so the output is float32 greedy's."""
    base = build_model("marian")
    loaded = LoadedModel(base=base, tokenizer=None, feature_model=FeatureDrafterModel(base).eval())
    copy = loaded.int8_drafter_copy()
    assert copy.base is base and copy.feature_model is not loaded.feature_model
    assert isinstance(copy.feature_model.layer.out, Int8Linear) and copy.feature_model.base_model is base
    assert not any(isinstance(module, Int8Linear) for module in base.modules())
    sources = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    results = run_bench(BenchSetup(loaded, max_new_tokens=12), sources, None, ["feature_int8d"], [1], progress=False)
    row = {result.mode: result for result in results}["feature_int8d"]
    assert row.identical == row.compared == 2
    with pytest.raises(ValueError, match="ships none"):
        LoadedModel(base=base, tokenizer=None).int8_drafter_copy()

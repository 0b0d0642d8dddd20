"""The compiled engine (`blockwise_compile=True`): exact against its own greedy on the core architectures, near-tie
only against eager greedy, no recompiles or graph breaks once warm, stale weights recompiled, and a clear warning
with an eager fallback where compilation is unavailable.

Each model compiles its graphs once per process (batch 1 and batch > 1), so the suite builds its models once.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from conftest import ARCHITECTURES, OracleDrafter, build_model, random_batch
from near_ties import assert_greedy_up_to_near_ties

from hf_blockwise import blockwise_generate
from hf_blockwise import boundary as hf
from hf_blockwise import engine as engine_module
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts, NoDrafter
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.drafters.heads import HeadsDrafter
from hf_blockwise.engine import CompileOptions, compiled_decoder, drop_compiled, engine_of
from hf_blockwise.evaluation.harness import measure
from hf_blockwise.modeling.config import BlockwiseHeadsConfig, FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.snapshot import SAMPLE_STEP, ModuleState, TensorSnapshot


@pytest.fixture(scope="module")
def compiled_models() -> dict[str, torch.nn.Module]:
    return {name: build_model(name) for name in ARCHITECTURES}


def _generate(model, batch, **kwargs) -> torch.Tensor:
    return model.generate(**batch, custom_generate=blockwise_generate, **{"max_new_tokens": 20, **kwargs})


# one of each kind of decoder the engine meets: learned positions (BART), relative attention bias (T5), sinusoidal
# positions counted from the padding (M2M100); the eager loop covers every core architecture
# M2M100 (positions from padding) is compiled and drafted bitwise in tests/test_one_arithmetic.py
COMPILED_ARCHITECTURES = ("bart", "t5")


@pytest.mark.parametrize("architecture", COMPILED_ARCHITECTURES)
def test_compiled_drafting_is_exact_against_the_engines_greedy(compiled_models, architecture: str) -> None:
    model = compiled_models[architecture]
    for batch_size, seed in ((4, 1),):  # the batch-1 graph: test_no_recompiles_or_graph_breaks_once_warm
        batch = random_batch(model, batch_size, seed=seed)
        eager = model.generate(**batch, max_new_tokens=20)
        greedy = _generate(model, batch, blockwise_compile=True)
        assert_greedy_up_to_near_ties(model, batch, eager, greedy, max_new_tokens=20)
        for corruption in (0.0, 0.3):
            drafter = OracleDrafter(greedy, block_size=4, corruption=corruption, seed=seed)
            drafted = _generate(model, batch, assistant=drafter, blockwise_compile=True)
            assert torch.equal(drafted, greedy), (architecture, batch_size, corruption)


def test_no_recompiles_or_graph_breaks_once_warm(compiled_models, monkeypatch) -> None:
    model = compiled_models["bart"]
    # greedy alone warms: batch 1 has graphs of its own, and 3 rows feeding 3 columns are equal sizes the graph
    # must not take for one (duck shaping), or every wider feed would compile again
    for batch_size in (3, 1):
        _generate(model, random_batch(model, batch_size, seed=5), blockwise_compile=True)
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    windows = []  # (positions shown, buffer length) of each compiled call
    attention_window = hf.attention_window

    def recorded(cache, length):
        windows.append((length, hf.static_cache_capacity(cache)))
        return attention_window(cache, length)

    monkeypatch.setattr(hf, "attention_window", recorded)
    # other lengths, length limits (buffers), batch sizes, feed widths and acceptance patterns, and the attention
    # windows they give: the same graphs serve them all
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch_size, seed, block_size, limit in ((1, 6, 3, 20), (2, 7, 5, 60), (5, 8, 2, 20)):
            batch = random_batch(model, batch_size, seed=seed, max_source_length=9 + seed)
            greedy = _generate(model, batch, blockwise_compile=True, max_new_tokens=limit)
            drafter = OracleDrafter(greedy, block_size=block_size, corruption=0.25, seed=seed)
            drafted = _generate(model, batch, assistant=drafter, blockwise_compile=True, max_new_tokens=limit)
            assert torch.equal(drafted, greedy)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks_before
    # each call shows the positions in use rounded up to 16, within all but the buffer's last 16 (which keep every
    # window a view of the same layout); only the probe's reference calls show all of those
    assert {(16, 80), (32, 80), (16, 144), (48, 144)} <= set(windows)
    assert all(length % 16 == 0 and length <= buffer - 16 for length, buffer in windows)


def test_changed_weights_are_recompiled_not_served_stale_and_other_models_keep_their_graphs(compiled_models) -> None:
    other = compiled_models["t5"]
    other_batch = random_batch(other, 2, seed=9)
    other_output = _generate(other, other_batch, blockwise_compile=True)
    other_engine = engine_of(other)
    model = build_model("marian", seed=3)
    batch = random_batch(model, 2, seed=2)
    _generate(model, batch, blockwise_compile=True)
    first = compiled_decoder(model, CompileOptions())
    with torch.no_grad():  # what an optimizer step or load_state_dict does: an in-place change
        model.get_output_embeddings().weight.mul_(-1.0)
    with pytest.warns(UserWarning, match="changed since it was compiled"):
        after = _generate(model, batch, blockwise_compile=True)
    assert compiled_decoder(model, CompileOptions()) is not first
    assert_greedy_up_to_near_ties(model, batch, model.generate(**batch, max_new_tokens=20), after, max_new_tokens=20)
    # no process-wide reset: the other model's engine and its graphs are still there, served without recompiling
    assert engine_of(other) is other_engine
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(_generate(other, other_batch, blockwise_compile=True), other_output)


def _negate_projection(model) -> None:
    model.get_output_embeddings().weight.data.mul_(-1.0)  # no version counter moves


def _scale_attention(model) -> None:
    model.get_decoder().layers[0].self_attn.v_proj.weight.data.mul_(-4.0)


def _assign_zeros(model) -> None:
    weight = model.get_decoder().layers[-1].fc2.weight
    weight.data = torch.zeros_like(weight)


def _copy_into(model) -> None:
    weight = model.get_decoder().layers[0].fc1.weight
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight))


def _load_state_dict(model) -> None:
    state = {name: value.clone() for name, value in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    model.load_state_dict(state)


def _optimizer_step(model) -> None:
    batch = random_batch(model, 2, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()


@pytest.mark.parametrize(
    "change", [_negate_projection, _scale_attention, _assign_zeros, _copy_into, _load_state_dict, _optimizer_step]
)
def test_every_way_of_changing_weights_changes_the_weights_snapshot(change) -> None:
    """Writes through `.data` (no version counter moves), `copy_` and in-place ops under `no_grad`,
    `load_state_dict`, an optimizer step: the engine's snapshot sees each, so the next compiled generate recompiles
    (end to end below, for a `.data` write)."""
    model = build_model("marian", seed=4)
    snapshot = engine_module.WeightsSnapshot(model)
    change(model)
    assert not snapshot.matches(model), change.__name__


def _recompiled_after(change: Callable[[torch.nn.Module], None], warning: str) -> None:
    """A compiled generate, `change` on the model, then another: it warns (`warning`), compiles again and decodes the
    changed model; a third, with nothing changed since, is served as it is, without a warning. Dynamo alone, for
    time (a rebuilt engine's frozen inductor graph decoding new weights is tested in place above)."""
    model = build_model("marian", seed=4)
    batch = random_batch(model, 2, seed=3)
    options = CompileOptions(backend="eager")
    before = _generate(model, batch, blockwise_compile=options)
    engine = compiled_decoder(model, options)
    change(model)
    with pytest.warns(UserWarning, match=warning):
        after = _generate(model, batch, blockwise_compile=options)
    assert compiled_decoder(model, options) is not engine
    eager = model.generate(**batch, max_new_tokens=20)
    assert not torch.equal(eager, before)  # the output changed: a stale graph would be seen
    assert_greedy_up_to_near_ties(model, batch, eager, after, max_new_tokens=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_generate(model, batch, blockwise_compile=options), after)


def test_writes_through_data_are_seen_and_recompiled() -> None:
    """A write through `.data` (no version counter moves) after a compiled generate; every kind of write is seen by
    the same snapshot (above)."""
    _recompiled_after(_negate_projection, "The weights of this MarianMTModel changed since it was compiled")


def _swap_activation(model) -> None:
    for layer in model.get_decoder().layers:  # a submodule without weights replaced: the weights are the same
        layer.activation_fn = torch.nn.Tanh()


def _sharpen_attention(model) -> None:
    for layer in model.get_decoder().layers:
        layer.encoder_attn.scaling = 30.0


@pytest.mark.parametrize("change", [_swap_activation, _sharpen_attention])
def test_changed_module_attributes_are_recompiled_not_served_stale(change) -> None:
    """The engine leaves dynamo's guards on module attributes out (they cost ~0.3 ms a call) and compares the
    modules, their flags, plain attributes and config once per generate instead: a submodule swapped or an attribute
    changed after a compiled generate is seen."""
    _recompiled_after(change, "plain attributes or config of this MarianMTModel changed since it was compiled")


def test_the_module_state_sees_flags_attributes_and_config_and_nothing_else() -> None:
    model = build_model("bart", seed=1)
    model.get_decoder().layers[0].nan_attribute = float("nan")  # equal to itself in the snapshot
    state = ModuleState(model)
    assert state.matches(model)
    model.get_decoder().layers[0].fc1.train()
    assert not state.matches(model)
    model.eval()
    assert state.matches(model)
    model.config.use_cache = not model.config.use_cache
    assert not state.matches(model)


def test_the_weights_snapshot_sees_a_strided_write_and_nothing_else() -> None:
    model = build_model("bart", seed=1)
    snapshot = engine_module.WeightsSnapshot(model)
    assert snapshot.matches(model)
    model.get_decoder().layers[0].fc1.weight.data[::7] += 1.0  # one row in seven
    assert not snapshot.matches(model)


def test_the_samples_are_compared_bit_for_bit() -> None:
    """A NaN weight matches itself (compared by value it never would: a rebuild every call), a zero turned to minus
    zero is a change (a frozen graph holds the old bits), and a bfloat16 weight (read through torch, not NumPy) is
    compared bit for bit as well."""
    weight = torch.randn(3000)
    weight[SAMPLE_STEP] = float("nan")
    bf16 = torch.randn(3000).to(torch.bfloat16)
    bf16[0] = float("nan")
    snapshot = TensorSnapshot([weight, bf16])
    assert snapshot.matches([weight, bf16])
    weight.data[0] = 0.0
    zeroed = TensorSnapshot([weight, bf16])
    weight.data[0] = -0.0  # through .data: no version counter moves
    assert not zeroed.matches([weight, bf16])
    watched = TensorSnapshot([weight, bf16])
    bf16.data[2 * SAMPLE_STEP] += 1.0
    assert not watched.matches([weight, bf16])


def test_a_new_engine_of_the_same_model_compiles_its_own_graphs() -> None:
    """Dynamo guards do not look at weight values: an engine sharing its code object with the model's dropped one
    would be served the old frozen graph. Each engine has its own, so after `drop_compiled` and an in-place weight
    change (no warning: nothing compiled is left to compare with) the new engine computes with the new weights. The
    registry, keyed weakly, then lets the model go. Compiling leaves no global config changed: the recompile limit is
    not raised (each engine has its own code object, so its few graphs stay within dynamo's per-code limit) and
    inductor's freezing is set around the engine's calls only."""
    dynamo_before = torch._dynamo.config.get_config_copy()
    inductor_before = torch._inductor.config.get_config_copy()
    model = build_model("marian", seed=5)
    batch = random_batch(model, 2, seed=4)
    before = _generate(model, batch, blockwise_compile=True)
    assert engine_of(model).freezing
    assert torch._dynamo.config.get_config_copy() == dynamo_before
    assert torch._inductor.config.get_config_copy() == inductor_before
    first = engine_of(model)
    projection = model.get_output_embeddings()
    drop_compiled(model)
    assert engine_of(model) is None and not projection._forward_hooks  # the engine's hook went with it
    with torch.no_grad():
        projection.weight.mul_(-1.0)
    after = _generate(model, batch, blockwise_compile=True)
    assert engine_of(model) is not first
    assert not torch.equal(after, before)
    assert_greedy_up_to_near_ties(model, batch, model.generate(**batch, max_new_tokens=20), after, max_new_tokens=20)
    # the registry does not keep a model alive: dropped by the caller, it goes, engine and graphs with it
    assert engine_of(model) is not None
    gone = weakref.ref(model)
    del model, first, projection
    gc.collect()
    assert gone() is None


class _LinearThenProduct(torch.nn.Module):
    """A linear (the GEMM template takes it: its weight is a constant of the frozen graph), then, with `other`, a
    product of two activations (the template takes none: no constant operand)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, inputs: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.linear(inputs)
        return hidden if other is None else hidden @ other


def test_linears_compile_on_the_gemm_template_and_a_product_it_cannot_take_on_the_libraries_said() -> None:
    """`CompileOptions.gemm_template`: a graph whose products the template takes compiles on it; one with a product
    it cannot take compiles on the libraries, and its report says why; both compute what the module computes."""
    torch.manual_seed(0)
    inputs, other = torch.randn(3, 8), torch.randn(8, 5)
    for extra, expected in (((), "template"), ((other,), "libraries (the GEMM template took no choice")):
        module = _LinearThenProduct().eval()
        compiled = engine_module.CompiledModule(module, CompileOptions(), module)
        with torch.no_grad():
            torch.testing.assert_close(compiled(inputs, *extra), module(inputs, *extra))
        assert [report.linear_kernels[: len(expected)] for report in compiled.graph_products] == [expected]


def test_compiled_forwards_come_back_in_the_stats_and_the_harness_counts_them(compiled_models) -> None:
    # counting, not arithmetic: dynamo alone (the engine's graphs under inductor are the tests above)
    compiled = CompileOptions(backend="eager")
    model = compiled_models["marian"]
    batch = random_batch(model, 3, seed=15)
    greedy = _generate(model, batch, blockwise_compile=compiled)
    drafter = OracleDrafter(greedy, block_size=4, corruption=0.3, seed=1)
    output = _generate(model, batch, assistant=drafter, blockwise_compile=compiled, return_dict_in_generate=True)
    stats = output.decoding_stats
    assert stats.compiled_forwards == stats.num_forwards - 1  # the first pass of a call runs eagerly
    row = stats[0]
    assert 0 < row.compiled_forwards == row.num_forwards - 1
    eager = _generate(model, batch, assistant=drafter, return_dict_in_generate=True).decoding_stats
    assert eager.compiled_forwards == 0
    runners = {
        "compiled": lambda inputs, _: _generate(
            model, inputs, assistant=drafter, blockwise_compile=compiled, return_dict_in_generate=True
        ),
        "eager": lambda inputs, _: _generate(model, inputs, assistant=drafter, return_dict_in_generate=True),
    }
    pad_token_id = model.config.pad_token_id
    results = measure(runners, [batch], pad_token_id=pad_token_id, count_forwards_of=[model], progress=False)
    assert results["compiled"].decoder_forwards == stats.num_forwards  # hooked eager pass + reported compiled ones
    assert results["eager"].decoder_forwards == eager.num_forwards


def test_a_drafting_block_is_recompiled_when_what_it_reads_changes_and_only_then() -> None:
    """The feature drafter's compiled block (dynamo alone, for time) watches its layer, the base's embeddings and the
    base's output projection (its shortlist's source), not the base's other layers, which the engine watches: each
    write through `.data` rebuilds the compiled objects that read it, and only those."""
    base = build_model("marian", seed=8)
    drafter_model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4)).eval()
    drafter_model.set_shortlist(torch.arange(base.config.vocab_size // 2))  # the block copies these projection rows
    drafter = drafter_model.drafter()
    batch = random_batch(base, 1, seed=4)
    options = CompileOptions(backend="eager")

    def recompiled(change: Callable[[], None]) -> set[str]:
        """The models whose compiled objects a generate after `change` rebuilt, by the warnings' class names."""
        change()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _generate(base, batch, assistant=drafter, blockwise_compile=options)
        return {name for w in caught for name in ("MarianMTModel", "FeatureDrafterModel") if f"this {name} " in str(w)}

    recompiled(lambda: None)  # compiles the engine and the block
    assert recompiled(lambda: None) == set()
    layer = drafter.model.layer
    assert recompiled(lambda: next(layer.parameters()).data.mul_(-1.0)) == {"FeatureDrafterModel"}
    assert recompiled(lambda: base.get_output_embeddings().weight.data.mul_(-1.0)) == {
        "MarianMTModel",
        "FeatureDrafterModel",
    }
    assert recompiled(lambda: base.get_decoder().layers[0].fc1.weight.data.mul_(-1.0)) == {"MarianMTModel"}


def test_a_compiled_prefill_off_cpu_inductor_is_a_clear_error() -> None:
    # the first call compiled in a module of its own: CPU with inductor only (tests/test_one_arithmetic.py decodes
    # with it)
    with pytest.raises(ValueError, match="compiled_prefill=True"):
        compiled_decoder(build_model("bart", seed=12), CompileOptions(backend="eager", compiled_prefill=True))


def test_unavailable_compiler_warns_and_decodes_eagerly(monkeypatch) -> None:
    model = build_model("t5", seed=4)
    batch = random_batch(model, 2, seed=3)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C++ compiler on PATH
    with pytest.warns(UserWarning, match="C\\+\\+ compiler.*decoding eagerly instead"):
        output = _generate(model, batch, blockwise_compile=True)
    assert torch.equal(output, model.generate(**batch, max_new_tokens=20))
    assert engine_module.engine_of(model) is None


def test_compile_option_is_validated() -> None:
    model = build_model("marian")
    batch = random_batch(model, 1, seed=0)
    with pytest.raises(TypeError, match="blockwise_compile= takes a bool or a CompileOptions"):
        _generate(model, batch, assistant=NoDrafter(), blockwise_compile="yes")
    # a compiled first call is a CPU inductor graph: refused elsewhere before any hook is placed on the model
    projection = model.get_output_embeddings()
    hooks = dict(projection._forward_hooks)
    with pytest.raises(ValueError, match=r"CompileOptions\(compiled_prefill=True\) compiles on CPU with inductor"):
        engine_module.CompiledDecoder(model, CompileOptions(backend="eager", compiled_prefill=True))
    assert dict(projection._forward_hooks) == hooks


def test_state_reading_drafter_gets_states_from_the_compiled_graph(compiled_models) -> None:
    """The feature drafter reads every verified state; compiled, they come out of the graph (no eager hook)."""
    base = compiled_models["marian"]
    drafter_model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4, training_depth=2)).eval()
    batch = random_batch(base, 3, seed=11)
    greedy = _generate(base, batch, blockwise_compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it really ran compiled
        drafted = _generate(base, batch, assistant=drafter_model.drafter(), blockwise_compile=True)
    assert torch.equal(drafted, greedy)
    eager_drafted = _generate(base, batch, assistant=drafter_model.drafter())
    assert_greedy_up_to_near_ties(base, batch, eager_drafted, drafted, max_new_tokens=20)


class _TwinDrafter(Drafter):
    """Runs a drafter's eager and compiled drafting side by side on the same requests (each with its own per-call
    state), records both, and drafts with the compiled one."""

    reads_decoder_states = True

    def __init__(self, drafter: FeatureDrafter | HeadsDrafter) -> None:
        self.drafter, self.block_size, self.pairs = drafter, drafter.block_size, []

    def prepare(self, encoder_input_ids, encoder_attention_mask):
        return tuple(self.drafter.prepare(encoder_input_ids, encoder_attention_mask) for _ in range(2))

    def select_rows(self, drafter_state, rows):
        return tuple(self.drafter.select_rows(state, rows) for state in drafter_state)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        assert request.compile is not None
        eager_state, compiled_state = self.last_state = request.drafter_state
        eager = self.drafter.get_candidates(dataclasses.replace(request, drafter_state=eager_state, compile=None))
        compiled = self.drafter.get_candidates(dataclasses.replace(request, drafter_state=compiled_state))
        self.pairs.append((eager, compiled, request.max_drafts))
        return compiled


# the block under inductor, and the threshold's cut under dynamo alone: the cut is applied to the block's outputs,
# outside its graph, which is the same with a threshold or without
@pytest.mark.parametrize(("threshold", "backend"), [(None, "inductor"), (0.5, "eager")])
def test_compiled_feature_drafting_drafts_what_the_eager_drafter_drafts(compiled_models, threshold, backend) -> None:
    """The feature drafter's compiled block (take-in and unrolled drafts in one call, over the whole buffers and a
    chunk padded to the block size) proposes, row by row, the drafts of the same block run as a plain module (over
    the used slots and the verified columns only), over steps with narrower verified chunks (batch 1, where it is
    compiled); a threshold cuts both alike."""
    # a model of its own under another backend: the shared one's engine stays the inductor one
    base = compiled_models["bart"] if backend == "inductor" else build_model("bart")
    options = CompileOptions(backend=backend)
    config = FeatureDrafterConfig(block_size=4, training_depth=2)
    drafter_model = FeatureDrafterModel(base, config).eval()
    with torch.no_grad():  # confident drafts, some above the threshold and some below (random ones are all near 0.1)
        drafter_model.layer.out.weight.mul_(8.0)
    twin = _TwinDrafter(drafter_model.drafter(threshold=threshold))
    for seed in (12, 13, 14):  # batch 1: where the compiled block drafts
        batch = random_batch(base, 1, seed=seed, max_source_length=8 + seed % 4)
        greedy = _generate(base, batch, blockwise_compile=options)
        twin.pairs.append(None)  # each call starts with a step that has no states to draft from
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: it really ran compiled
            assert torch.equal(_generate(base, batch, assistant=twin, blockwise_compile=options), greedy)
    compared = 0
    pairs, first = [], False
    for pair in twin.pairs:
        if pair is None:
            first = True
        elif first:  # before a call's first verification there are no states to draft from
            assert pair[0].tokens.shape[1] == pair[1].tokens.shape[1] == 0
            first = False
        else:
            pairs.append(pair)
    for eager, compiled, max_drafts in pairs:
        assert compiled.tokens.shape[1] == twin.block_size - 1
        usable = torch.minimum(eager.lengths, max_drafts)  # drafts past a row's room are never fed
        assert torch.equal(torch.minimum(compiled.lengths, max_drafts), usable)
        for row, count in enumerate(usable.tolist()):
            assert torch.equal(compiled.tokens[row, :count], eager.tokens[row, :count]), (row, eager, compiled)
            compared += count
    assert compared > 10, compared
    if threshold is not None:  # the threshold cut some rows' drafts short, and not all of them
        cut = torch.cat([eager.lengths for eager, _, _ in pairs])
        assert bool((cut < twin.block_size - 1).any()) and bool((cut > 0).any()), cut


def test_compiled_heads_drafting_drafts_what_the_eager_heads_draft(compiled_models) -> None:
    """The heads' compiled drafting block (heads and shortlist projection in one graph) proposes what the same
    block run as a plain module proposes, step by step (batch 1, where it is compiled), on heads whose drafts are
    not the base's own next token (random output layers instead of their zero start)."""
    base = compiled_models["marian"]
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4, head_hidden_size=16)).eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.heads.down.weight, std=0.5)
    model.set_shortlist(torch.arange(10, 60))
    twin = _TwinDrafter(model.drafter())
    for seed in (30, 31):
        batch = random_batch(base, 1, seed=seed, max_source_length=8 + seed % 3)
        greedy = _generate(base, batch, blockwise_compile=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback warning: it really ran compiled
            assert torch.equal(_generate(base, batch, assistant=twin, blockwise_compile=True), greedy)
    drafted = [(eager, compiled) for eager, compiled, _ in twin.pairs if eager.tokens.shape[1] > 0]
    assert len(drafted) > 4
    for eager, compiled in drafted:
        assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.lengths, eager.lengths)
        assert bool(((compiled.tokens >= 10) & (compiled.tokens < 60)).all())  # from the shortlist
    eager_state, compiled_state = twin.last_state  # the compiled side drafted through its compiled block
    assert compiled_state.compiled is not None and compiled_state.eager is None
    assert eager_state.compiled is None and eager_state.eager is not None


def test_compiled_feature_drafting_does_not_recompile_once_warm(compiled_models) -> None:
    base = compiled_models["marian"]
    drafter = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=3, training_depth=2)).eval().drafter()
    for batch_size, seed in ((1, 20), (3, 21)):  # warm-up: batch 1 and batch > 1 have a graph each
        _generate(base, random_batch(base, batch_size, seed=seed), assistant=drafter, blockwise_compile=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        for batch_size, seed in ((1, 22), (2, 23), (5, 24)):
            batch = random_batch(base, batch_size, seed=seed, max_source_length=7 + seed % 5)
            greedy = _generate(base, batch, blockwise_compile=True)
            assert torch.equal(_generate(base, batch, assistant=drafter, blockwise_compile=True), greedy)


def test_an_attention_window_shows_views_of_the_buffers_and_restores_them() -> None:
    cache = hf.static_decoder_cache(2, 48)
    for layer in cache.self_attention_cache.layers:
        layer.lazy_initialization(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    buffers = [(layer.keys, layer.values) for layer in cache.self_attention_cache.layers]
    with hf.attention_window(cache, 16):
        for layer, (keys, _values) in zip(cache.self_attention_cache.layers, buffers, strict=True):
            assert layer.keys.shape[2] == layer.max_cache_len == 16 and layer.keys._base is keys
            layer.keys[0, 0, 3] = 1.0  # a write through the window reaches the buffer
    for layer, (keys, values) in zip(cache.self_attention_cache.layers, buffers, strict=True):
        assert layer.keys is keys and layer.values is values
    assert hf.static_cache_capacity(cache) == 48 and float(buffers[0][0][0, 0, 3].sum()) == 4.0
    refused = pytest.raises(ValueError, match="an attention window of 64 positions in a cache of 48")
    with refused, hf.attention_window(cache, 64):
        pass
    assert cache.self_attention_cache.layers[0].keys is buffers[0][0]  # restored after the refusal too

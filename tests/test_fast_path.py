"""The CPU fast path: int8 base, vocabulary shortlist on/off, encoder and cross-attention computed once."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import warnings

import pytest
import torch
import torch._inductor.config
from conftest import ARCHITECTURES, OracleDrafter, build_model, random_batch, word_tokenizer
from near_ties import assert_greedy_up_to_near_ties

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    FeatureDrafterModel,
    blockwise_generate,
    check_decoder,
    frequent_tokens,
    quantize_dynamic_int8,
)
from hf_blockwise.drafters.base import DraftRequest
from hf_blockwise.drafters.feature_block import FeatureDraftBlock
from hf_blockwise.drafters.heads import ShortlistProjection
from hf_blockwise.engine import CompileOptions, own_code
from hf_blockwise.kernels import int8 as int8_kernel
from hf_blockwise.loading import LoadedModel, load_model
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.quantization import Int8Linear, Int8StateDictWarning, float_state_dict, is_int8, refresh_int8
from hf_blockwise.tools.cli import main


def draft(drafter, request: DraftRequest):
    """One drafting step outside the loop: the drafter's per-call state first, as `generate` prepares it."""
    return drafter.get_candidates(dataclasses.replace(request, drafter_state=drafter.prepare(None, None)))


def heads_with_shortlist(base, seed: int) -> BlockwiseHeadsModel:
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4))
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.heads.down.weight, std=1.0)
    model.set_shortlist(frequent_tokens([list(range(3, 40))], size=24, always=[base.config.eos_token_id]))
    return model


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_int8_blockwise_reproduces_int8_greedy(tiny_models, architecture: str) -> None:
    """Quantizing changes the model; blockwise decoding stays exact with respect to the quantized model, at
    every batch size, because each token's input is scaled by its own maximum (batch-invariant products)."""
    model = quantize_dynamic_int8(heads_with_shortlist(copy.deepcopy(tiny_models[architecture]), seed=1))
    base = model.base_model
    assert isinstance(base.get_output_embeddings(), Int8Linear)
    assert not any(type(module) is torch.nn.Linear for module in base.modules())
    assert isinstance(model.heads.up, torch.nn.Linear)  # heads stay in full precision
    for batch_size, seed in ((1, 2), (4, 3), (7, 5)):
        batch = random_batch(base, batch_size, seed=seed)
        greedy = base.generate(**batch, max_new_tokens=16, do_sample=False)
        for drafter in (model.drafter(), model.drafter(use_shortlist=False), OracleDrafter(greedy, 4, 0.3, seed)):
            output = model.generate(**batch, assistant=drafter, max_new_tokens=16, return_dict_in_generate=True)
            assert_greedy_up_to_near_ties(base, batch, greedy, output.sequences, max_new_tokens=16)


def test_int8_rows_are_batch_invariant() -> None:
    layer = torch.nn.Linear(32, 24)
    quantized = Int8Linear(layer).requires_grad_(False)
    layer.requires_grad_(False)
    inputs = torch.randn(5, 3, 32) * torch.logspace(-2, 2, 5)[:, None, None]
    together = quantized(inputs)
    alone = torch.stack([quantized(inputs[i : i + 1])[0] for i in range(5)])
    assert torch.equal(together, alone)
    assert torch.allclose(together, layer(inputs), rtol=0.05, atol=0.05 * float(layer(inputs).abs().max()))


def test_int8_refuses_what_it_cannot_quantize_and_training() -> None:
    with pytest.raises(ValueError, match="meta device"):
        quantize_dynamic_int8(build_model("marian").to("meta"))
    with pytest.raises(TypeError, match=r"Int8Linear\(layer\)"):
        quantize_dynamic_int8(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        quantize_dynamic_int8(torch.nn.Sequential(torch.nn.ReLU()))
    base = quantize_dynamic_int8(build_model("marian"))
    batch = random_batch(base, 2, seed=0)
    loss = base(**batch, labels=batch["input_ids"]).loss
    with pytest.raises(RuntimeError, match=r"int8 models are for inference\. Train the float model"):
        loss.backward()


def _mul_in_place(model) -> None:
    with torch.no_grad():
        model.get_decoder().layers[0].fc1.weight.mul_(-3.0)


def _write_through_data(model) -> None:
    model.get_decoder().layers[0].self_attn.v_proj.weight.data.mul_(-4.0)  # no version counter moves


def _assign_data(model) -> None:
    layer = model.get_decoder().layers[-1].fc2
    layer.weight.data = layer.weight.data.flip(0).contiguous()
    layer.bias.data = torch.randn_like(layer.bias)


def _copy_every_weight(model) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)


def _load_state_dict(model) -> None:
    model.load_state_dict({name: value * -1.0 for name, value in float_state_dict(model).items()})


def _optimizer_step(model) -> None:
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    torch.optim.SGD(model.parameters(), lr=0.5).step()


INT8_WEIGHT_CHANGES = [_mul_in_place, _write_through_data, _assign_data, _copy_every_weight, _load_state_dict,
                       _optimizer_step]  # fmt: skip


def test_int8_copies_follow_every_change_of_their_float_weights() -> None:
    """After each way of changing the float weights, the int8 model computes what a model quantized afresh from the
    new weights computes, bit for bit (the encoder's hook makes the stale layers again), and not what it did."""
    float_model = build_model("marian", seed=5)
    batch = random_batch(float_model, 2, seed=4)
    decoder_input_ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(**batch, decoder_input_ids=decoder_input_ids).logits

    for change in INT8_WEIGHT_CHANGES:
        changed = copy.deepcopy(float_model)
        int8 = quantize_dynamic_int8(copy.deepcopy(float_model))
        before = logits(int8)
        torch.manual_seed(0)
        change(changed)
        torch.manual_seed(0)
        change(int8)
        fresh = logits(quantize_dynamic_int8(changed))
        after = logits(int8)
        assert torch.equal(after, fresh), change.__name__
        assert not torch.equal(after, before), change.__name__
    int8 = quantize_dynamic_int8(copy.deepcopy(float_model))
    int8.get_decoder().layers[0].fc1.weight.data[0, 1] += 1.0  # one value the sample (0, 1021, ...) does not read
    assert not refresh_int8(int8) and refresh_int8(int8, force=True)  # force: every layer made again


def test_the_int8_refresh_remakes_only_the_layers_whose_weights_changed(monkeypatch) -> None:
    """`refresh_int8` makes again the layers whose float weights changed (a write through `.data`, a replaced bias)
    and only those; a layer swapped for a new one is fresh, not stale."""
    int8 = quantize_dynamic_int8(build_model("marian", seed=5))
    layers = [module for module in int8.modules() if isinstance(module, Int8Linear)]
    made: list[Int8Linear] = []
    requantize = Int8Linear.requantize
    monkeypatch.setattr(Int8Linear, "requantize", lambda layer: (made.append(layer), requantize(layer))[1])
    assert not refresh_int8(int8) and not made
    layers[3].weight.data.mul_(-1.0)  # no version counter moves: the sampled values tell
    layers[7].bias = torch.nn.Parameter(torch.randn_like(layers[7].bias))
    assert refresh_int8(int8) and made == [layers[3], layers[7]]
    assert not refresh_int8(int8) and len(made) == 2
    decoder = int8.get_decoder().layers[0]
    decoder.fc1 = Int8Linear(torch.nn.Linear(decoder.fc1.in_features, decoder.fc1.out_features))
    assert not refresh_int8(int8) and len(made) == 2  # the new layer is fresh: nothing made again


def test_the_int8_engine_decodes_the_new_int8_weights_after_load_state_dict() -> None:
    """The compiled engine (through dynamo, for time) sees the int8 copies made again: it warns, compiles again and
    decodes a fresh quantization's greedy output."""
    float_model = build_model("marian", seed=6)
    int8 = quantize_dynamic_int8(copy.deepcopy(float_model))
    batch = random_batch(float_model, 2, seed=5)
    options = CompileOptions(backend="eager")
    kwargs = {"max_new_tokens": 12, "custom_generate": blockwise_generate, "blockwise_compile": options}
    before = int8.generate(**batch, **kwargs)
    _load_state_dict(float_model)
    int8.load_state_dict(float_state_dict(float_model))
    with pytest.warns(UserWarning, match="changed since it was compiled"):
        after = int8.generate(**batch, **kwargs)
    expected = quantize_dynamic_int8(float_model).generate(**batch, max_new_tokens=12, do_sample=False, num_beams=1)
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_saving_an_int8_model_says_it_writes_the_float_weights_and_requantizing_restores_it(tmp_path) -> None:
    """`save_pretrained` of an int8 model writes the float weights its int8 copies were made from, and says so:
    quantized again after loading, it is the same int8 model, bit for bit."""
    base = quantize_dynamic_int8(build_model("marian", seed=7))
    with pytest.warns(Int8StateDictWarning, match="quantize_dynamic_int8"):
        base.save_pretrained(tmp_path)
    reloaded = type(base).from_pretrained(tmp_path)
    assert not any(isinstance(module, Int8Linear) for module in reloaded.modules())
    requantized = quantize_dynamic_int8(reloaded)
    pairs = [(a, b) for a, b in zip(base.modules(), requantized.modules(), strict=True) if isinstance(a, Int8Linear)]
    assert pairs and all(torch.equal(a.weight_int8, b.weight_int8) for a, b in pairs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Int8StateDictWarning)
        float_state_dict(base)  # the package's own reads of the float weights stay quiet
    heads = heads_with_shortlist(base, seed=1)  # heads saved from an int8 base say the base is not saved with them
    with pytest.warns(Int8StateDictWarning, match="wrote the proposal heads only; they were used on an int8 base"):
        heads.save_pretrained(tmp_path / "heads", base_model_name_or_path=str(tmp_path))
    reattached = BlockwiseHeadsModel.from_pretrained(tmp_path / "heads")
    assert not any(isinstance(module, Int8Linear) for module in reattached.modules())


def test_drafting_without_the_shortlist_uses_the_whole_vocabulary(tiny_models) -> None:
    model = heads_with_shortlist(tiny_models["bart"], seed=4)
    states = torch.randn(6, model.config.d_model)
    request = DraftRequest(
        sequences=torch.zeros(6, 4, dtype=torch.long),
        lengths=torch.ones(6, dtype=torch.long),
        max_drafts=torch.full((6,), 3),
        last_states=states,
    )
    shortlisted = draft(model.drafter(), request).tokens
    everything = draft(model.drafter(use_shortlist=False), request).tokens
    assert torch.isin(shortlisted, model.heads.shortlist).all()
    full_argmax = model.base_model.get_output_embeddings()(model.heads(states)) + model.base_model.final_logits_bias
    assert torch.equal(everything, full_argmax.argmax(dim=-1))
    assert not torch.isin(everything, model.heads.shortlist).all()  # random heads do propose rare tokens


@pytest.mark.parametrize("architecture", ["marian", "t5"])
def test_encoder_and_cross_attention_run_once_per_generate(tiny_models, architecture: str) -> None:
    """The encoder output and each layer's cross-attention keys/values are computed once per source, not per
    verification step: transformers' cache keeps them, and cropping it after a step leaves them alone."""
    base = tiny_models[architecture]
    model = heads_with_shortlist(base, seed=6)
    cross_key_projections = [
        module
        for name, module in base.get_decoder().named_modules()
        if name.endswith(("encoder_attn.k_proj", "EncDecAttention.k"))
    ]
    layers = base.config.num_decoder_layers if architecture == "t5" else base.config.decoder_layers
    assert layers >= 2 and len(cross_key_projections) == layers  # one cross-attention key projection per layer
    check_decoder(base)  # the one-off capability probe runs per model, not per generate call
    calls = {"encoder": 0, "cross_keys": 0}
    hooks = [base.get_encoder().register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1))]
    hooks += [
        module.register_forward_hook(lambda *_: calls.__setitem__("cross_keys", calls["cross_keys"] + 1))
        for module in cross_key_projections
    ]
    try:
        output = model.generate(**random_batch(base, 3, seed=7), max_new_tokens=20, return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert output.decoding_stats.num_forwards > 3
    assert calls == {"encoder": 1, "cross_keys": len(cross_key_projections)}


def test_bench_fast_path_reports_each_step(tmp_path) -> None:
    base, tokenizer = build_model("marian", seed=3), word_tokenizer()
    model = heads_with_shortlist(base, seed=8)
    checkpoint = tmp_path / "model"
    base.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    model.save_pretrained(checkpoint, base_model_name_or_path=".")
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(" ".join(f"w{3 + (i * j) % 50}" for j in range(6 + i)) for i in range(4)) + "\n")
    out = tmp_path / "bench"
    arguments = ["bench", "--model", str(checkpoint), "--source-file", str(sources), "--fast-path"]
    assert main([*arguments, "--batch-sizes", "1", "2", "--max-new-tokens", "8", "--out", str(out)]) == 0

    rows = {(row["mode"], row["batch_size"]): row for row in json.loads((out / "bench.json").read_text())["results"]}
    modes = {"greedy", "heads_full_vocab", "heads", "greedy_int8", "heads_int8"}
    assert set(rows) == {(mode, batch) for mode in modes for batch in (1, 2)}
    for row in rows.values():  # every step is exact with respect to its own greedy reference
        assert row["identical_rate"] == 1.0 and row["sentences"] == 4, row
    assert rows[("heads_int8", 1)]["forwards_per_token"] <= rows[("greedy_int8", 1)]["forwards_per_token"]
    assert "int8 modes: the int8 model" in (out / "bench.md").read_text()

    iad_arguments = ["--modes", "iad", "iad_int8", "--iad-max-draft-length", "4", "--batch-sizes", "2"]
    assert main([*arguments[:-1], *iad_arguments, "--max-new-tokens", "8", "--out", str(out)]) == 0
    rows = {row["mode"]: row for row in json.loads((out / "bench.json").read_text())["results"]}
    assert set(rows) == {"greedy", "greedy_int8", "iad", "iad_int8"}  # each mode brings its greedy reference
    assert all(row["identical_rate"] == 1.0 for row in rows.values()), rows


@pytest.mark.parametrize("freezing", [False, True])
def test_int8_products_compile_to_the_same_numbers(freezing: bool) -> None:
    """The compiled int8 product computes exactly what eager does, with and without inductor's `freezing` (which
    rewrites `_int_mm` followed by two products as torchao's int8 linear, and computed garbage for ours)."""
    layer = Int8Linear(torch.nn.Linear(32, 24)).requires_grad_(False)
    layer.forward = types.MethodType(own_code(Int8Linear.forward), layer)  # graphs of its own, for this `freezing`
    with torch._inductor.config.patch(freezing=freezing), torch.no_grad():
        compiled = torch.compile(layer, dynamic=True)
        for rows in (3, 5):
            inputs = torch.randn(rows, 32) * torch.logspace(-2, 2, rows)[:, None]
            assert torch.equal(compiled(inputs), layer(inputs))


def test_the_int8_copy_puts_a_copy_of_the_feature_drafter_on_the_quantized_base() -> None:
    """The int8 copy drafts from the int8 base's states with a copy of the drafter, its layer in int8 where the int8
    kernel runs and float32 elsewhere (its block on the GEMM template); the int8 drafter copy quantizes the layer
    over the float base."""

    base = build_model("marian", seed=5)
    feature = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=3)).eval()
    loaded = LoadedModel(base=base, tokenizer=None, feature_model=feature)
    quantized = loaded.int8_copy()
    assert quantized.feature_model.base_model is quantized.base and quantized.feature_model is not feature
    assert not any(type(module) is torch.nn.Linear for module in quantized.base.modules() if module is not
                   quantized.base.get_output_embeddings())  # fmt: skip
    float_layer = any(type(module) is torch.nn.Linear for module in quantized.feature_model.layer.modules())
    assert float_layer != int8_kernel.available()
    int8_drafter = loaded.int8_drafter_copy().feature_model
    assert int8_drafter.base_model is base and not any(type(m) is torch.nn.Linear for m in int8_drafter.layer.modules())
    assert any(type(module) is torch.nn.Linear for module in feature.layer.modules())  # the float one is untouched
    batch = random_batch(base, 3, seed=6)
    greedy = quantized.base.generate(**batch, max_new_tokens=16, do_sample=False)
    drafted = quantized.base.generate(
        **batch, custom_generate=blockwise_generate, assistant=quantized.feature_model.drafter(), max_new_tokens=16
    )
    assert_greedy_up_to_near_ties(quantized.base, batch, greedy, drafted, max_new_tokens=16)


def test_an_int8_load_puts_the_feature_drafters_layer_in_int8_where_the_kernel_runs(tmp_path) -> None:
    """`load_model(int8=True)` (the demo's and `profile step`'s `--int8`) quantizes the feature drafter's layer as
    the int8 copy does: in int8 where the int8 kernel runs, float32 elsewhere; the base's linears always."""
    base = build_model("marian", seed=5)
    base.save_pretrained(tmp_path)
    word_tokenizer().save_pretrained(tmp_path)
    FeatureDrafterModel(base, FeatureDrafterConfig(block_size=3)).save_pretrained(
        tmp_path / "feature-drafter", base_model_name_or_path=".."
    )
    loaded = load_model(str(tmp_path), int8=True)
    assert loaded.feature_model.base_model is loaded.base and is_int8(loaded.base)
    assert is_int8(loaded.feature_model.layer) == int8_kernel.available()
    assert not is_int8(load_model(str(tmp_path)).feature_model.layer)  # a float32 load keeps it float32


def test_an_int8_drafter_layer_drafts_through_its_int8_products() -> None:
    """An int8 drafter layer computes through its int8 layers (the layer once applied the float weight an
    `Int8Linear` keeps, so an "int8" drafter drafted in float32), and its drafting block projects onto the shortlist
    in int8 too; a float32 layer's block keeps the float rows. Drafting stays exact."""
    base = build_model("marian", seed=5)
    loaded = LoadedModel(base=base, tokenizer=None, feature_model=FeatureDrafterModel(base, FeatureDrafterConfig(3)))
    int8_drafter = loaded.int8_drafter_copy().feature_model.eval()
    calls = []
    for module in int8_drafter.layer.modules():
        if isinstance(module, Int8Linear):
            module.register_forward_hook(lambda *_: calls.append(1))
    batch = random_batch(base, 2, seed=6)
    greedy = base.generate(**batch, max_new_tokens=16, do_sample=False)
    drafted = base.generate(
        **batch, custom_generate=blockwise_generate, assistant=int8_drafter.drafter(), max_new_tokens=16
    )
    assert calls and torch.equal(drafted, greedy)
    rows = torch.tensor([3, 5, 9])
    projection = ShortlistProjection(token_ids=rows, weight=base.get_output_embeddings().weight[rows], bias=None)
    assert isinstance(FeatureDraftBlock(int8_drafter, projection, 2).int8_projection, Int8Linear)
    assert FeatureDraftBlock(loaded.feature_model, projection, 2).int8_projection is None

"""Bad input as a new user gives it to the Python API: each gets a clear error naming what is wrong and the fix, a
warning, or the output plain greedy search gives for it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings

import huggingface_hub
import pytest
import torch
from conftest import OracleDrafter, build_model, load_recipe_module, random_batch
from transformers import AutoModelForSeq2SeqLM, LogitsProcessor, LogitsProcessorList, MarianConfig, MarianMTModel
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from zoo_media import build_media_model, media_batch, whisper_tokenizer

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    CompositeDrafter,
    FeatureDrafterConfig,
    FeatureDrafterModel,
    InputCopyDrafter,
    MinimumBlockAcceptance,
    NARDrafterModel,
    blockwise_generate,
    quantize_dynamic_int8,
)
from hf_blockwise.boundary import base_weights_fingerprint, from_hub
from hf_blockwise.engine import CompileOptions
from hf_blockwise.modeling.config import CONFIG_NAME, MAX_BLOCK_SIZE


@pytest.fixture(scope="module")
def marian():
    return build_model("marian")


@pytest.fixture(scope="module")
def heads(marian) -> BlockwiseHeadsModel:
    model = BlockwiseHeadsModel(marian, BlockwiseHeadsConfig(block_size=4))
    torch.manual_seed(0)
    torch.nn.init.normal_(model.heads.down.weight, std=1.0)  # heads that draft something, right or wrong
    return model


def other_shape(base, **changes) -> MarianMTModel:
    """A Marian model built in memory from `base`'s config with `changes`; it copies the config's name."""
    torch.manual_seed(1)
    return MarianMTModel(MarianConfig(**{**base.config.to_dict(), **changes})).eval()


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def no_warnings(function):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return function()


# --- 1. assistant_model= -----------------------------------------------------------------------------------------


def test_assistant_model_is_refused_rather_than_dropped(marian, heads) -> None:
    batch = random_batch(marian, 2, seed=1)
    assistant_model = build_model("marian", seed=2)
    feature = FeatureDrafterModel(marian)
    calls = [
        lambda: heads.generate(**batch, assistant_model=assistant_model, max_new_tokens=5),
        lambda: feature.generate(**batch, assistant_model=assistant_model, max_new_tokens=5),
        lambda: marian.generate(
            **batch, assistant_model=assistant_model, max_new_tokens=5, custom_generate=blockwise_generate
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"assistant_model= .* Pass assistant= .*base_model\.generate"):
            call()
    # without blockwise decoding it is transformers' own assisted generation (batch size 1), greedy's output
    row = {name: tensor[:1] for name, tensor in batch.items()}
    greedy = marian.generate(**row, max_new_tokens=5)
    assisted = heads.generate(**row, assistant=None, assistant_model=assistant_model, max_new_tokens=5)
    assert torch.equal(assisted, greedy)


# --- 2. MinimumBlockAcceptance(min_block) past the block size ------------------------------------------------------


def test_min_block_larger_than_the_block_size_is_refused(marian, heads) -> None:
    batch = random_batch(marian, 2, seed=1)
    with pytest.raises(ValueError, match=r"min_block=10\) forces 10 tokens .* block_size is 4.*min_block <= 4"):
        heads.generate(**batch, acceptance=MinimumBlockAcceptance(min_block=10), max_new_tokens=5)
    nested = MinimumBlockAcceptance(MinimumBlockAcceptance(min_block=5), min_block=2)
    with pytest.raises(ValueError, match=r"min_block=5\) forces 5 tokens"):
        heads.generate(**batch, acceptance=nested, max_new_tokens=5)
    output = heads.generate(**batch, acceptance=MinimumBlockAcceptance(min_block=4), max_new_tokens=5)
    assert output.shape[0] == 2  # min_block == block_size: every draft forced, allowed


# --- 3. the other-base check compares weights --------------------------------------------------------------------


def test_other_base_check_compares_weights(marian, tmp_path) -> None:
    base_dir, heads_dir = str(tmp_path / "base"), str(tmp_path / "heads")
    marian.save_pretrained(base_dir)
    base = AutoModelForSeq2SeqLM.from_pretrained(base_dir).eval()
    BlockwiseHeadsModel(base).save_pretrained(heads_dir)
    assert read_json(os.path.join(heads_dir, CONFIG_NAME))["base_fingerprint"] == base_weights_fingerprint(base)

    # the same weights saved elsewhere (here in fp16, loaded back as fp32, as the shipped models are): no warning
    resaved = str(tmp_path / "resaved")
    load_recipe_module("recipe_common").save_shipped_model(AutoModelForSeq2SeqLM.from_pretrained(base_dir), resaved)
    no_warnings(
        lambda: BlockwiseHeadsModel.from_pretrained(
            heads_dir, base_model=AutoModelForSeq2SeqLM.from_pretrained(resaved)
        )
    )

    # a model of the same shapes built in memory copies the recorded name, but not the weights: warned
    impostor = other_shape(base)
    impostor.name_or_path = base.name_or_path
    with pytest.warns(UserWarning, match="whose weights differ from that base's"):
        BlockwiseHeadsModel.from_pretrained(heads_dir, base_model=impostor)


def test_feature_drafter_other_base_check_compares_weights(marian, tmp_path) -> None:
    FeatureDrafterModel(marian).save_pretrained(str(tmp_path))
    no_warnings(lambda: FeatureDrafterModel.from_pretrained(str(tmp_path), base_model=marian))
    with pytest.warns(UserWarning, match="whose weights differ from that base's"):
        FeatureDrafterModel.from_pretrained(str(tmp_path), base_model=other_shape(marian))


def test_adapter_config_without_fingerprint_falls_back_to_names(marian, tmp_path) -> None:
    BlockwiseHeadsModel(marian, BlockwiseHeadsConfig(base_model_name_or_path="org/base-a")).save_pretrained(
        str(tmp_path)
    )
    path = os.path.join(str(tmp_path), CONFIG_NAME)
    config = read_json(path)
    del config["base_fingerprint"]  # as written before fingerprints existed
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    other = other_shape(marian)
    other.name_or_path = "org/base-b"
    with pytest.warns(UserWarning, match="trained for base 'org/base-a' .*compared by name only"):
        BlockwiseHeadsModel.from_pretrained(str(tmp_path), base_model=other)
    other.name_or_path = "org/base-a"  # same name, other weights: a name check cannot tell
    no_warnings(lambda: BlockwiseHeadsModel.from_pretrained(str(tmp_path), base_model=other))


# --- 4. a padded batch without attention_mask --------------------------------------------------------------------


def test_padding_without_attention_mask_warns_once(marian, heads) -> None:
    batch = random_batch(marian, 3, seed=1)
    assert bool((batch["input_ids"] == marian.config.pad_token_id).any())
    with pytest.warns(UserWarning, match="attention_mask") as record:
        output = heads.generate(input_ids=batch["input_ids"], max_new_tokens=8)
    assert sum("attention_mask" in str(warning.message) for warning in record) == 1
    # the output is still what greedy search gives for the same (unmasked) input
    assert torch.equal(output, marian.generate(input_ids=batch["input_ids"], max_new_tokens=8))
    no_warnings(lambda: heads.generate(**batch, max_new_tokens=8))  # with the mask
    no_warnings(lambda: heads.generate(input_ids=batch["input_ids"][:1], max_new_tokens=8))  # row 0: no padding


# --- 5. logits processors that read other rows -------------------------------------------------------------------


class BiasRowOneByRowZero(LogitsProcessor):
    """Boosts, in row 1, the token row 0 ended with: row 1's scores depend on row 0."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[1, input_ids[0, -1]] += 3.0
        return scores


class PenaliseOwnLastToken(LogitsProcessor):
    """Row-local: lowers each row's own last token, and says so."""

    row_local = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.scatter_add(1, input_ids[:, -1:], torch.full_like(scores[:, :1], -2.0))


class BiasRowZeroOnItself(LogitsProcessor):
    """Not declared row-local; at batch 1 it reads its own row only."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[0, input_ids[0, -1]] += 3.0
        return scores


def test_processors_not_known_to_be_row_local_are_refused(marian, heads) -> None:
    batch = random_batch(marian, 2, seed=1)
    processors = LogitsProcessorList([BiasRowOneByRowZero()])
    with pytest.raises(ValueError, match=r"BiasRowOneByRowZero is not known to be row-local.*row_local = True"):
        heads.generate(**batch, logits_processor=processors, max_new_tokens=10)
    with pytest.raises(ValueError, match="not known to be row-local"):
        marian.generate(**batch, logits_processor=processors, max_new_tokens=10, custom_generate=blockwise_generate)
    # declared row-local, or one of transformers' own: run, and give greedy search's output
    for processor in (PenaliseOwnLastToken(), RepetitionPenaltyLogitsProcessor(1.5)):
        processors = LogitsProcessorList([processor])
        greedy = marian.generate(**batch, logits_processor=processors, max_new_tokens=10)
        assert torch.equal(heads.generate(**batch, logits_processor=processors, max_new_tokens=10), greedy)
    # a single row has no other row to read: any processor runs
    row = random_batch(marian, 1, seed=2)
    processors = LogitsProcessorList([BiasRowZeroOnItself()])
    greedy = marian.generate(**row, logits_processor=processors, max_new_tokens=10)
    assert torch.equal(heads.generate(**row, logits_processor=processors, max_new_tokens=10), greedy)


# --- 6. block sizes past what can be allocated or fed --------------------------------------------------------------


def test_block_size_past_the_limits_is_refused_early(marian) -> None:
    for config_class in (BlockwiseHeadsConfig, FeatureDrafterConfig):
        with pytest.raises(ValueError, match=f"block_size must be an int from 2 to {MAX_BLOCK_SIZE}.*got 1000"):
            config_class(block_size=1000)
    short = other_shape(marian, max_position_embeddings=8)
    for wrapper, config in (
        (BlockwiseHeadsModel, BlockwiseHeadsConfig(block_size=10)),
        (FeatureDrafterModel, FeatureDrafterConfig(block_size=10)),
    ):
        with pytest.raises(ValueError, match=r"block_size=10 exceeds the 8 decoder positions .* block_size <= 8"):
            wrapper(short, config)
    assert BlockwiseHeadsModel(short, BlockwiseHeadsConfig(block_size=8)).blockwise_config.block_size == 8


def test_a_config_file_field_of_the_wrong_type_names_the_file_and_the_field(tmp_path) -> None:
    for config_class, field, value, expected in (
        (FeatureDrafterConfig, "draft_threshold", "high", "draft_threshold must be a number in"),
        (FeatureDrafterConfig, "draft_threshold", True, "draft_threshold must be a number in"),
        (BlockwiseHeadsConfig, "block_size", "4", "block_size must be an int"),
        (BlockwiseHeadsConfig, "sequential", "yes", "sequential must be a bool"),
    ):
        path = tmp_path / config_class.file_name
        path.write_text(json.dumps({field: value}))
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {expected}.*got {re.escape(repr(value))}"):
            config_class.from_json_file(path)


# --- 7. a drafter made for a base of another shape ---------------------------------------------------------------


def test_drafter_of_another_shape_is_refused_naming_both(marian, heads, tmp_path) -> None:
    batch = random_batch(marian, 2, seed=1)
    wider = other_shape(marian, d_model=48)
    wide_heads = BlockwiseHeadsModel(wider).drafter()
    composite = CompositeDrafter(InputCopyDrafter(marian), wide_heads)
    for drafter in (wide_heads, FeatureDrafterModel(wider).drafter(), composite):
        with pytest.raises(ValueError, match=r"made for a base with vocab_size=64, hidden_size=48 .* hidden_size=32"):
            heads.generate(**batch, assistant=drafter, max_new_tokens=5)
    BlockwiseHeadsModel(wider).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="hidden_size: heads expect 48, base has 32"), pytest.warns(UserWarning):
        BlockwiseHeadsModel.from_pretrained(str(tmp_path), base_model=marian)  # warned of other weights, then refused


# --- 8, 9. wrapping what is not a loaded model and config ---------------------------------------------------------


def test_wrapping_a_path_or_a_dict_gives_type_errors_naming_the_fix(marian) -> None:
    for wrapper in (BlockwiseHeadsModel, FeatureDrafterModel):
        with pytest.raises(TypeError, match=rf"got the path 'path'.*{wrapper.__name__}\.from_pretrained\(path\)"):
            wrapper("path", None)
        with pytest.raises(TypeError, match=r"got a dict: pass \w+Config\(\*\*config\)"):
            wrapper(marian, {"block_size": 3})
        with pytest.raises(TypeError, match="wraps a transformers seq2seq model"):
            wrapper(42)
    with pytest.raises(TypeError, match="takes a BlockwiseHeadsConfig or None, got FeatureDrafterConfig"):
        BlockwiseHeadsModel(marian, FeatureDrafterConfig())


def test_a_path_where_a_loaded_model_belongs_is_a_type_error_naming_the_fix() -> None:
    for call, name in ((quantize_dynamic_int8, "quantize_dynamic_int8"), (InputCopyDrafter, "InputCopyDrafter")):
        with pytest.raises(TypeError, match=rf"{name}\(model\) takes a loaded model, got the path 'a/path'.*"
                           r"from_pretrained\(path\)"):  # fmt: skip
            call("a/path")
        with pytest.raises(TypeError, match=rf"{name}\(model\) takes a loaded transformers model, got int"):
            call(3)


def test_a_model_on_the_meta_device_is_refused(heads) -> None:
    with torch.device("meta"):
        meta = build_model("marian")
    for call in (lambda: BlockwiseHeadsModel(meta), lambda: FeatureDrafterModel(meta)):
        with pytest.raises(ValueError, match=r"weights on the meta device .* Load it with from_pretrained"):
            call()
    with pytest.raises(ValueError, match="weights on the meta device"):
        meta.generate(input_ids=torch.tensor([[5, 6, 1]]), custom_generate=blockwise_generate, max_new_tokens=3)


# --- 10, 11. generate arguments that transformers drops or plain greedy accepts ------------------------------------


def test_stop_strings_with_a_tokenizer_stop_as_greedy_does(marian, heads) -> None:
    tokenizer = whisper_tokenizer()  # one printable character per token id below 64, as StopStringCriteria needs
    batch = random_batch(marian, 2, seed=1)
    full = marian.generate(**batch, max_new_tokens=12)
    stop = tokenizer.decode([int(full[0, 7])])  # a token greedy search writes in row 0
    kwargs = {"max_new_tokens": 12, "stop_strings": stop, "tokenizer": tokenizer}
    greedy = marian.generate(**batch, **kwargs)
    assert not torch.equal(greedy, full)  # the stop string took effect
    assert torch.equal(heads.generate(**batch, **kwargs), greedy)
    assert torch.equal(FeatureDrafterModel(marian).generate(**batch, **kwargs), greedy)


def test_fractional_max_new_tokens_gives_greedy_output(marian, heads) -> None:
    batch = random_batch(marian, 2, seed=1)
    for max_new_tokens in (2.5, 5.01):
        greedy = marian.generate(**batch, max_new_tokens=max_new_tokens)
        assert torch.equal(heads.generate(**batch, max_new_tokens=max_new_tokens), greedy)


# --- 12. speech features of another shape --------------------------------------------------------------------------


def test_whisper_features_with_the_wrong_mel_bins_name_the_expected_number() -> None:
    whisper = build_media_model("whisper")
    model = BlockwiseHeadsModel(whisper)
    features = media_batch("whisper", 2, seed=0)["input_features"]  # (2, 8, 100)
    with pytest.raises(ValueError, match=r"input_features has 7 mel bins .* takes num_mel_bins=8"):
        model.generate(input_features=features[:, :7], max_new_tokens=4)
    with pytest.raises(ValueError, match="num_mel_bins=8"):
        model.generate(features[:, :7], max_new_tokens=4)
    greedy = whisper.generate(input_features=features, max_new_tokens=4)
    assert torch.equal(model.generate(input_features=features, max_new_tokens=4), greedy)


def test_a_name_neither_local_nor_on_the_hub_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """A hub id typo (or any model offline and not cached): transformers' `OSError` about connecting becomes a
    `ValueError` naming the model and the likely causes, which the CLI prints as its message."""

    def unreachable(name: str) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    with pytest.raises(ValueError, match=r"'org/opus-mt-en-dee' is no local folder.*typo"):
        from_hub(unreachable, "org/opus-mt-en-dee", "--model / model")
    with pytest.raises(OSError, match="couldn't connect"):  # a folder that exists keeps transformers' own error
        from_hub(unreachable, tmp_path, "--model / model")
    # the adapters' own files, through the Python API, offline (the hub reads its environment at import: set its flag)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for model_class in (BlockwiseHeadsModel, FeatureDrafterModel):
        with pytest.raises(ValueError, match=r"'org/heads-typo' is no local folder.*typo"):
            model_class.from_pretrained("org/heads-typo")


@pytest.mark.parametrize("shape", [(0, 5), (1, 0), (1, 600)], ids=["no rows", "no tokens", "past the positions"])
def test_inputs_the_encoder_cannot_take_raise_what_greedy_raises(marian, shape) -> None:
    """Empty batches, empty sources and sources past the model's positions fail in the encoder, before any
    decoding: `custom_generate=blockwise_generate` raises transformers' own greedy error, word for word."""
    input_ids = torch.randint(5, 50, shape, generator=torch.Generator().manual_seed(0))
    errors = []
    for kwargs in ({}, {"custom_generate": blockwise_generate}):
        with pytest.raises((RuntimeError, IndexError)) as raised:
            marian.generate(input_ids=input_ids, max_new_tokens=5, **kwargs)
        errors.append((raised.type, str(raised.value)))
    assert errors[0] == errors[1]


# --- 13. CompileOptions fields of the wrong type or an unknown name ---------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("freezing", "no", TypeError("freezing takes a bool (True or False), got str")),
        ("compiled_prefill", 1, TypeError("compiled_prefill takes a bool (True or False), got int")),
        ("backend", 5, TypeError("backend takes a str naming a torch.compile backend, got int")),
        ("mode", 3, TypeError("mode takes a str naming a torch.compile mode, or None, got int")),
        ("backend", "inductr", ValueError("torch.compile knows no such backend; choose one of [")),
        ("mode", "fast", ValueError("torch.compile knows no such mode; choose one of [")),
    ],
)
def test_compile_options_of_the_wrong_type_name_the_field_value_and_type(field, value, expected) -> None:
    """Refused when made, not when `torch.compile` fails on them seconds later, or reads `"no"` as true."""
    with pytest.raises(type(expected), match=re.escape(f"CompileOptions({field}={value!r}): {expected}")):
        CompileOptions(**{field: value})
    with pytest.raises(type(expected), match=re.escape(f"CompileOptions({field}={value!r})")):
        dataclasses.replace(CompileOptions(), **{field: value})  # options changed later are checked again
    backend = lambda graph, example_inputs: graph.forward  # noqa: E731  # a backend function, as torch.compile takes
    assert CompileOptions(backend="eager", mode="default").backend == "eager" and CompileOptions(backend=backend)


# --- 14. several samples per source ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [2, 3])
def test_several_samples_per_source_are_drawn_as_transformers_orders_them(marian, batch_size) -> None:
    """`num_return_sequences=3` with `do_sample=True`: transformers expands every input to 3 rows per source
    (`repeat_interleave`: row `i * 3 + j` is source `i`'s), but not the source ids it hands the loop, which then
    selected rows of the wrong source, or none (an `IndexError` once a row ended)."""
    batch = random_batch(marian, batch_size, seed=1)
    sample = {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 10, "custom_generate": blockwise_generate}
    torch.manual_seed(0)
    reference = marian.generate(**batch, do_sample=True, num_return_sequences=3, max_new_tokens=10)
    torch.manual_seed(0)
    plain = marian.generate(**batch, **sample)
    assert plain.shape[0] == reference.shape[0] == 3 * batch_size  # transformers' own sampling: other tokens
    for drafter in (OracleDrafter(plain, block_size=4, corruption=0.3), InputCopyDrafter(marian)):
        torch.manual_seed(0)
        assert torch.equal(marian.generate(**batch, **sample, assistant=drafter), plain)  # the same draws, drafted
    # sampling from the top token only is greedy search: each row holds its own source's greedy output
    greedy = marian.generate(**batch, max_new_tokens=10).repeat_interleave(3, dim=0)
    assert torch.equal(marian.generate(**batch, **(sample | {"top_k": 1}), assistant=InputCopyDrafter(marian)), greedy)


# --- 15. a base model given by its path -------------------------------------------------------------------------


def test_a_base_model_given_by_its_path_is_loaded_and_anything_else_is_a_type_error(marian, tmp_path) -> None:
    """`from_pretrained(path, base_model="some/dir")` (`verifier=` for the NAR drafter) loads that base, as the one
    the config records would be (it raised an `AttributeError` on the string)."""
    base_dir = tmp_path / "base"
    marian.save_pretrained(base_dir)
    BlockwiseHeadsModel(marian).save_pretrained(tmp_path / "heads", base_model_name_or_path=None)
    FeatureDrafterModel(marian).save_pretrained(tmp_path / "feature", base_model_name_or_path=None)
    NARDrafterModel.from_verifier(marian, mask_token_id=3, block_size=4).save_pretrained(tmp_path / "nar")
    batch = random_batch(marian, 2, seed=1)
    greedy = marian.generate(**batch, max_new_tokens=8)
    for model_class, name in ((BlockwiseHeadsModel, "heads"), (FeatureDrafterModel, "feature")):
        for given in (str(base_dir), base_dir):
            loaded = no_warnings(lambda: model_class.from_pretrained(tmp_path / name, base_model=given))  # noqa: B023
            assert loaded.base_model is not marian and torch.equal(loaded.generate(**batch, max_new_tokens=8), greedy)
        with pytest.raises(TypeError, match=r"base_model= takes a loaded model .* or its directory or hub id as a str, "
                           "got int"):  # fmt: skip
            model_class.from_pretrained(tmp_path / name, base_model=42)
        with pytest.raises(ValueError, match=r"base_model= '\./no/such/base': no such directory"):
            model_class.from_pretrained(tmp_path / name, base_model="./no/such/base")
    nar = NARDrafterModel.from_pretrained(tmp_path / "nar", verifier=str(base_dir))
    assert isinstance(nar, NARDrafterModel)
    with pytest.raises(TypeError, match="verifier= takes a loaded model"):
        NARDrafterModel.from_pretrained(tmp_path / "nar", verifier=3.0)


# --- 16. inputs the encoder cannot take, through the wrappers' generate and the loop ----------------------------


def _with(batch: dict, **changes) -> dict:
    return {**batch, **changes}


# name: (the generate inputs made from a batch of 2 rows of 12 tokens, the error, its message)
BAD_INPUTS = {
    "a mask of another length": (
        lambda batch: _with(batch, attention_mask=batch["attention_mask"][:, :5]),
        ValueError, r"attention_mask has shape \(2, 5\), but the encoder inputs have \(2, 12\) .*tokenizer\(texts",
    ),
    "a mask of one row": (  # broadcast over both rows by the encoder: row 1 masked by row 0's padding
        lambda batch: _with(batch, attention_mask=batch["attention_mask"][:1]),
        ValueError, r"attention_mask has shape \(1, 12\), but the encoder inputs have \(2, 12\)",
    ),
    "inputs on the meta device": (
        lambda batch: {name: tensor.to("meta") for name, tensor in batch.items()},
        ValueError, r"input_ids is on the meta device: .*\.to\(model\.device\)",
    ),
    "no rows": (lambda batch: {"input_ids": batch["input_ids"][:0]}, ValueError, r"empty batch \(batch size 0\)"),
    "no tokens": (
        lambda batch: {"input_ids": batch["input_ids"][:, :0]},
        ValueError, r"input_ids has no tokens \(shape \(2, 0\)\): every source needs at least one",
    ),
    "an id past the vocabulary": (
        lambda batch: _with(batch, input_ids=batch["input_ids"].index_put((torch.tensor(1), torch.tensor(3)),
                                                                          torch.tensor(70))),
        ValueError, r"input_ids holds the id 70 at \(1, 3\), .* embeds 64 tokens \(ids 0 to 63\): tokenize with",
    ),
    "a negative id": (
        lambda batch: _with(batch, input_ids=batch["input_ids"] - 3),
        ValueError, r"input_ids holds the id -\d+ at \(\d, \d+\), .* embeds 64 tokens",
    ),
    "float ids": (
        lambda batch: _with(batch, input_ids=batch["input_ids"].float()),
        TypeError, r"input_ids holds torch.float32 values, but token ids are integers: .*input_ids\.long\(\)",
    ),
    "a source past the positions": (
        lambda batch: {"input_ids": batch["input_ids"].repeat(1, 20)},
        ValueError, r"the input is 240 tokens long, but the encoder of .* has 128 positions; truncate it",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_inputs_the_encoder_cannot_take_are_refused_by_the_wrappers_naming_the_argument(marian, heads, case) -> None:
    """The wrappers' `generate` checks its inputs before the encoder runs. Through `custom_generate=` transformers
    runs the encoder before the loop, which sees only what got past it (a mask of another shape, below); the rest
    raise transformers' own greedy error (`test_inputs_the_encoder_cannot_take_raise_what_greedy_raises`)."""
    inputs, error, message = BAD_INPUTS[case]
    batch = inputs(random_batch(marian, 2, seed=1))
    for model in (heads, FeatureDrafterModel(marian)):
        with pytest.raises(error, match=message):
            model.generate(**batch, max_new_tokens=5)
    if case.startswith("a mask"):
        with pytest.raises(error, match=message):
            marian.generate(**batch, max_new_tokens=5, custom_generate=blockwise_generate)


def test_drafters_of_another_dtype_than_the_base_are_refused_naming_both() -> None:
    """A base cast alone (`heads_model.base_model.to(torch.bfloat16)`) leaves the drafter's weights in float32: its
    drafts failed in a matrix product ("mat1 and mat2 must have the same dtype")."""
    batch = random_batch(build_model("marian"), 2, seed=1)
    for model_class, name in ((BlockwiseHeadsModel, "HeadsDrafter"), (FeatureDrafterModel, "FeatureDrafter")):
        model = model_class(build_model("marian"))
        model.base_model.to(torch.bfloat16)
        message = rf"This {name}'s weights are torch.float32, but generate runs on .* in torch.bfloat16: .*model\.to"
        with pytest.raises(ValueError, match=message):
            model.generate(**batch, max_new_tokens=5)
        with pytest.raises(ValueError, match=message):
            model.base_model.generate(
                **batch, max_new_tokens=5, custom_generate=blockwise_generate, assistant=model.drafter()
            )
        model.to(torch.bfloat16)  # cast as a whole: greedy's output
        greedy = model.base_model.generate(**batch, max_new_tokens=5)
        assert torch.equal(model.generate(**batch, max_new_tokens=5), greedy)

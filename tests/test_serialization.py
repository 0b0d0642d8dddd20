"""The one adapter save/load path (`serialization.save_adapter` / `read_adapter_weights`): every adapter round-trips
through it, a save that fails midway leaves the previous one intact, and wrong or missing files are clear errors."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import build_model
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForSeq2SeqLM

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    FeatureDrafterConfig,
    FeatureDrafterModel,
    NARDrafterModel,
    serialization,
)
from hf_blockwise.modeling.nar_model import NAR_CONFIG_NAME
from hf_blockwise.serialization import load_adapter_weights, read_adapter_weights

MASK = 3


@dataclass
class Adapter:
    """One kind of adapter: the model, how to save it and load it back, and the weights it owns."""

    original: nn.Module
    files: list[str]
    save: Callable[[Path], None]
    load: Callable[[Path], nn.Module]
    weights: Callable[[nn.Module], dict[str, torch.Tensor]]
    perturb: Callable[[], None]


def _perturbed(module: nn.Module) -> Callable[[], None]:
    def perturb() -> None:
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(0.5)

    return perturb


def make_adapter(kind: str) -> Adapter:
    base = build_model("marian", seed=1)
    if kind in ("heads", "sequential_heads"):
        model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3, sequential=kind == "sequential_heads"))
        model.set_shortlist(torch.arange(4, 40))
        return Adapter(
            model,
            ["blockwise_config.json", "blockwise_heads.safetensors"],
            model.save_pretrained,
            lambda path: BlockwiseHeadsModel.from_pretrained(path, base_model=base),
            lambda loaded: loaded.heads.state_dict(),
            _perturbed(model.heads),
        )
    if kind == "feature":
        model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=3))
        return Adapter(
            model,
            ["feature_drafter.safetensors", "feature_drafter_config.json"],
            model.save_pretrained,
            lambda path: FeatureDrafterModel.from_pretrained(path, base_model=base),
            lambda loaded: loaded.layer.state_dict(),
            _perturbed(model.layer),
        )
    nar = NARDrafterModel.from_verifier(base, mask_token_id=MASK, block_size=4, decoder_layers=1)
    decoder_layer = nar.model.get_decoder().layers[0]
    _perturbed(decoder_layer)()  # as after training with a frozen encoder: the decoder layer moved
    if kind == "nar":
        return Adapter(
            nar,
            ["config.json", "generation_config.json", "model.safetensors", "nar_drafter_config.json"],
            nar.save_pretrained,
            lambda path: NARDrafterModel.from_pretrained(path, verifier=base),
            lambda loaded: loaded.model.state_dict(),
            _perturbed(decoder_layer),
        )
    return Adapter(
        nar,
        ["config.json", "nar_drafter_config.json", "nar_drafter_weights.safetensors"],
        lambda path: nar.save_pretrained(path, relative_to=base),
        lambda path: NARDrafterModel.from_pretrained(path, verifier=base),
        lambda loaded: loaded.model.state_dict(),
        _perturbed(decoder_layer),
    )


ADAPTERS = ["heads", "sequential_heads", "feature", "nar", "nar_relative"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("kind", ADAPTERS)
def test_every_adapter_round_trips_through_the_one_helper(tmp_path, kind: str) -> None:
    adapter = make_adapter(kind)
    adapter.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == adapter.files  # the formats of before: no staging directory left
    loaded = adapter.load(tmp_path)
    assert loaded is not adapter.original
    assert_same_weights(adapter.weights(loaded), adapter.weights(adapter.original))
    adapter.perturb()
    adapter.save(tmp_path)  # saving over a previous save replaces it
    assert sorted(os.listdir(tmp_path)) == adapter.files
    assert_same_weights(adapter.weights(adapter.load(tmp_path)), adapter.weights(adapter.original))
    assert any(
        not torch.equal(adapter.weights(loaded)[name], tensor)
        for name, tensor in adapter.weights(adapter.original).items()
    )


def test_saved_files_have_the_usual_permissions(tmp_path) -> None:
    make_adapter("heads").save(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(tmp_path):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o666 & ~umask, name


def _fail_after_writing_part() -> Callable:
    """A writer that leaves a partial file behind and then fails, as a full disk would."""

    def failing(*args, **kwargs) -> None:
        path = next(arg for arg in args if isinstance(arg, str | os.PathLike) and os.path.dirname(arg))
        Path(path).write_bytes(b"partial")
        raise OSError("No space left on device")

    return failing


def _fail_writing_into_the_directory(directory: str, *args, **kwargs) -> None:
    Path(directory, "model.safetensors").write_bytes(b"partial")
    raise OSError("No space left on device")


@pytest.mark.parametrize("kind", ADAPTERS)
@pytest.mark.parametrize("failing", ["weights", "config"])
def test_a_save_that_fails_midway_leaves_the_previous_one_intact(tmp_path, monkeypatch, kind: str, failing) -> None:
    adapter = make_adapter(kind)
    (tmp_path / "tokenizer.json").write_text("{}")  # other files of the directory are left alone
    adapter.save(tmp_path)
    before = snapshot(tmp_path)
    expected = adapter.weights(adapter.load(tmp_path))
    adapter.perturb()
    if failing == "weights" and kind == "nar":  # a whole model's weights: written by transformers, staged alike
        monkeypatch.setattr(adapter.original.model, "save_pretrained", _fail_writing_into_the_directory)
    else:
        name = "save_file" if failing == "weights" else "atomic_write_text"
        monkeypatch.setattr(serialization, name, _fail_after_writing_part())
    with pytest.raises(OSError, match="No space left"):
        adapter.save(tmp_path)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before  # no partial file, no staging directory, the old files byte for byte
    assert_same_weights(adapter.weights(adapter.load(tmp_path)), expected)


def test_a_save_into_a_new_directory_that_fails_leaves_no_adapter(tmp_path, monkeypatch) -> None:
    adapter = make_adapter("feature")
    monkeypatch.setattr(serialization, "atomic_write_text", _fail_after_writing_part())
    with pytest.raises(OSError, match="No space left"):
        adapter.save(tmp_path / "new")
    assert os.listdir(tmp_path / "new") == []


def test_lora_adapter_of_the_heads_round_trips_and_is_checked(tmp_path) -> None:
    from peft import LoraConfig, TaskType, get_peft_model

    def lora_heads(rank: int) -> BlockwiseHeadsModel:
        torch.manual_seed(rank)
        base = get_peft_model(build_model("bart", seed=2), LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=rank))
        model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
        _perturbed(model)()  # LoRA's B starts at zero; make every weight differ from a fresh model's
        return model

    saved = lora_heads(rank=4)
    saved.save_pretrained(tmp_path)
    names = sorted(name for name in os.listdir(tmp_path) if name != "README.md")  # PEFT writes a model card
    assert names == [
        "adapter_config.json", "adapter_model.safetensors", "blockwise_config.json", "blockwise_heads.safetensors",
    ]  # fmt: skip
    fresh = lora_heads(rank=4)
    fresh.load_weights(tmp_path)
    assert_same_weights(fresh.state_dict(), saved.state_dict())
    with pytest.raises(ValueError, match=r"LoRA weights in .*adapter_model\.safetensors do not match.*other shapes"):
        lora_heads(rank=8).load_weights(tmp_path)


def test_wrong_weights_are_errors_that_name_the_file_and_the_tensors(tmp_path) -> None:
    module = nn.Linear(4, 3)
    path = str(tmp_path / "weights.safetensors")
    save_file({"weight": torch.zeros(3, 5), "extra": torch.zeros(1)}, path)
    with pytest.raises(ValueError) as error:
        load_adapter_weights(path, module, "Head")
    message = str(error.value)
    assert path in message and "do not match the config" in message
    assert "missing ['bias']" in message and "unexpected ['extra']" in message
    assert "weight: expected (3, 4), found (3, 5)" in message

    save_file({"weight": torch.ones(3, 4)}, path)
    base = {"bias": torch.full((3,), 2.0), "unrelated": torch.zeros(2)}
    load_adapter_weights(path, module, "Drafter", base_weights=base)  # the base provides what the file lacks
    assert torch.equal(module.weight, torch.ones(3, 4)) and torch.equal(module.bias, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"the wrong base, or a corrupt file\? missing \['bias'\]"):
        read_adapter_weights(path, module.state_dict(), "Drafter", base_weights={"bias": torch.zeros(7)})

    Path(path).write_bytes(Path(path).read_bytes()[:20])
    with pytest.raises(ValueError, match=r"Cannot read drafter weights from .*: .*corrupt or truncated"):
        read_adapter_weights(path, module.state_dict(), "Drafter")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_adapter_weights(str(tmp_path / "absent.safetensors"), module.state_dict(), "Drafter")


@pytest.mark.parametrize("kind", ["heads", "feature"])
def test_a_missing_weights_file_is_a_clear_error(tmp_path, kind: str) -> None:
    adapter = make_adapter(kind)
    adapter.save(tmp_path)
    weights = next(name for name in adapter.files if name.endswith(".safetensors"))
    (tmp_path / weights).unlink()
    with pytest.raises(FileNotFoundError, match=rf"holds no {weights}"):
        adapter.load(tmp_path)


def test_heads_saved_with_their_base_record_its_weights_as_they_are_now(tmp_path) -> None:
    """Full fine-tuning trains the base after the heads were attached: the checkpoint's fingerprint is the trained
    base's, so attaching the heads to that base again gives no "other base" warning."""
    model = BlockwiseHeadsModel(build_model("marian", seed=1), BlockwiseHeadsConfig(block_size=3))
    recorded_at_attach = model.blockwise_config.base_fingerprint
    with torch.no_grad():
        model.base_model.get_output_embeddings().weight.add_(0.5)  # what training the base does to it
    model.save_pretrained(tmp_path, include_base=True)
    trained_base = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=trained_base)
    assert loaded.blockwise_config.base_fingerprint != recorded_at_attach
    assert loaded.blockwise_config.base_model_name_or_path == os.path.abspath(tmp_path)


SHIPPED = Path(__file__).resolve().parent.parent / "hf_blockwise" / "pretrained"


def test_an_adapter_copied_without_its_base_never_picks_up_the_current_directory(tmp_path, monkeypatch) -> None:
    """The shipped heads record their base as ".", meaning their own folder. Copied alone and loaded from inside
    another model's folder, they must not attach to that model: a clear error names where the base was looked for."""
    copy = tmp_path / "heads-only"
    copy.mkdir()
    for name in ("blockwise_config.json", "blockwise_heads.safetensors"):
        (copy / name).write_bytes((SHIPPED / "multi30k-en-de" / name).read_bytes())
    monkeypatch.chdir(SHIPPED / "gec-en")  # a model folder: "." read against the current directory would load it
    with pytest.raises(ValueError, match="relative to itself") as error:
        BlockwiseHeadsModel.from_pretrained(copy)
    assert str(copy) in str(error.value)
    # with the base given explicitly the heads attach, and the recorded fingerprint tells a stranger from their base
    stranger = AutoModelForSeq2SeqLM.from_pretrained(SHIPPED / "gec-en")
    with pytest.warns(UserWarning, match="weights differ from that base's"):
        BlockwiseHeadsModel.from_pretrained(copy, base_model=stranger)
    own = AutoModelForSeq2SeqLM.from_pretrained(SHIPPED / "multi30k-en-de")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BlockwiseHeadsModel.from_pretrained(copy, base_model=own)


def test_every_shipped_adapter_records_its_bases_fingerprint() -> None:
    configs = [
        path
        for pattern in ("*/blockwise_config.json", "*/*/blockwise_config.json", "*/*/feature_drafter_config.json")
        for path in SHIPPED.glob(pattern)
    ]
    assert len(configs) == 8
    for path in configs:
        assert json.loads(path.read_text())["base_fingerprint"], path
    nar_config = SHIPPED / "multi30k-en-de" / "nar-drafter" / NAR_CONFIG_NAME
    assert json.loads(nar_config.read_text())["verifier_fingerprint"]


def test_a_nar_drafter_loaded_onto_another_verifier_warns() -> None:
    """The shipped NAR drafter holds only the weights that differ from its verifier: loaded onto gec-en (same
    vocabulary size) it would silently take gec-en's weights for the rest; its recorded fingerprint tells."""
    stranger = AutoModelForSeq2SeqLM.from_pretrained(SHIPPED / "gec-en")
    with pytest.warns(UserWarning, match="weights differ from that base's"):
        NARDrafterModel.from_pretrained(SHIPPED / "multi30k-en-de" / "nar-drafter", verifier=stranger)
    own = AutoModelForSeq2SeqLM.from_pretrained(SHIPPED / "multi30k-en-de")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NARDrafterModel.from_pretrained(SHIPPED / "multi30k-en-de" / "nar-drafter", verifier=own)

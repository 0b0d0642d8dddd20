"""A Hugging Face hub cache holding tiny models under real checkpoints' ids, read offline, so that pages showing hub
ids (`docs/guides/hub-models.md`) run in the tests without a download: transformers' `from_pretrained("<id>")` and
pipelines resolve the ids from the cache (`HF_HUB_CACHE`, with `HF_HUB_OFFLINE`), as after a real download.

Each tiny model has the architecture of the checkpoint it stands for (zoo configs, random weights) and the fields of
its `generation_config` that choose the search (opus-mt and BART: 4 beams; BART: `no_repeat_ngram_size` 3), with a
word-level tokenizer (Whisper: the tiny Whisper's own tokenizer and feature extractor).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest
from conftest import build_model, word_tokenizer
from zoo_media import MEDIA_ARCHITECTURES, whisper_feature_extractor, whisper_tokenizer

_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot's name; refs/main points to it


def _text_model(architecture: str, **generation: object) -> Callable[[Path], None]:
    def save(folder: Path) -> None:
        model = build_model(architecture, seed=5)
        for name, value in generation.items():
            setattr(model.generation_config, name, value)
        model.save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)

    return save


def _whisper(folder: Path) -> None:
    MEDIA_ARCHITECTURES["whisper"].build().eval().save_pretrained(folder)
    whisper_tokenizer().save_pretrained(folder)
    whisper_feature_extractor().save_pretrained(folder)


# hub id -> how its stand-in is saved
HUB_MODELS: dict[str, Callable[[Path], None]] = {
    "Helsinki-NLP/opus-mt-en-de": _text_model("marian", num_beams=4, bad_words_ids=[[0]]),
    "google-t5/t5-small": _text_model("t5"),
    "facebook/bart-base": _text_model("bart", num_beams=4, no_repeat_ngram_size=3),
    "openai/whisper-tiny": _whisper,
}


def fake_hub_cache(root: Path) -> Path:
    """Writes every model of [`HUB_MODELS`] into a hub cache under `root` (the layout `huggingface_hub` downloads
    into: `models--ORG--NAME/snapshots/COMMIT/`, `refs/main`) and returns it."""
    for hub_id, save in HUB_MODELS.items():
        repository = root / f"models--{hub_id.replace('/', '--')}"
        save(repository / "snapshots" / _COMMIT)
        (repository / "refs").mkdir(parents=True, exist_ok=True)
        (repository / "refs" / "main").write_text(_COMMIT)
    return root


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Points this process (huggingface_hub's constants, read at each download) and its subprocesses (the
    environment) at `cache`, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

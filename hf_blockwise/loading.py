"""Loading a model directory with everything it ships, and building its drafters by name: the one place every
entry point (bench, demo, corpus job, CLI) loads models and drafters.

A model directory holds the base (with proposal heads when it has `blockwise_config.json`), its tokenizer or
feature extractor, and the drafters kept beside it: `feature-drafter/`, `nar-drafter/`, `sequential-heads/`.
[`load_model`] reads all of it into a [`LoadedModel`]; [`build_drafter`] makes any of its drafters, and
[`missing_drafter`] says why a loaded model cannot make one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoFeatureExtractor, AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.drafters.composite import CompositeDrafter
from hf_blockwise.drafters.input_copy import InputCopyDrafter
from hf_blockwise.kernels import int8 as int8_kernel
from hf_blockwise.modeling.config import CONFIG_NAME, FEATURE_DRAFTER_CONFIG_NAME
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.modeling.nar_model import NAR_CONFIG_NAME, NARDrafterModel
from hf_blockwise.quantization import quantize_dynamic_int8, quantize_linears_int8

# where a model directory keeps its other drafters, if it ships them
NAR_DRAFTER_SUBDIR = "nar-drafter"
FEATURE_DRAFTER_SUBDIR = "feature-drafter"
SEQUENTIAL_HEADS_SUBDIR = "sequential-heads"
# the drafters [`build_drafter`] makes: `none` drafts nothing (the loop alone, one token per decoder call)
# the models shipped inside the package: the small Multi30k model (7.7M parameters: a quick try, notebooks), the
# realistic one (43M, opus-mt-en-de's decoder shape), which the demo and the bench run by default, and the speech one
PRETRAINED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrained")
SHIPPED_MODEL = os.path.join(PRETRAINED, "multi30k-en-de")
REALISTIC_MODEL = os.path.join(PRETRAINED, "marian-base-en-de")
SHIPPED_SPEECH_MODEL = os.path.join(PRETRAINED, "speech-en")

SOURCE_COPY_NEEDS = "different source and target vocabularies (source copy needs one)"


@dataclass(frozen=True)
class LoadedModel:
    """A model with what it ships, loaded in float32 and in eval mode.

    Attributes:
        base: the transformers seq2seq model (greedy reference and verifier).
        tokenizer (*optional*): turns sources into ids and outputs into texts; `None` for a model built in memory
            that decodes token ids.
        feature_extractor (*optional*): for models whose encoder reads audio (Whisper...): its `sampling_rate`
            and log-mel features.
        heads_model ([`BlockwiseHeadsModel`], *optional*): the base with its proposal heads.
        feature_model ([`FeatureDrafterModel`], *optional*): the feature drafter on `base`.
        sequential_heads_model ([`BlockwiseHeadsModel`] with sequential heads, *optional*).
        nar_model ([`NARDrafterModel`], *optional*): the non-autoregressive drafter of GAD decoding.
        assistant_model (*optional*): a smaller seq2seq model for transformers' assisted generation.
    """

    base: nn.Module
    tokenizer: Any
    feature_extractor: Any = None
    heads_model: nn.Module | None = None
    feature_model: nn.Module | None = None
    sequential_heads_model: nn.Module | None = None
    nar_model: NARDrafterModel | None = None
    assistant_model: nn.Module | None = None

    def check_reads_text(self, name: str) -> None:
        """A `ValueError` naming the model (`name`) when its encoder reads something other than text (audio
        features, pixels): the corpus job and `hf-blockwise train` decode text lines."""
        if self.feature_extractor is not None or hf.encoder_input_name(self.base) != "input_ids":
            raise ValueError(f"{name}: its encoder reads {hf.encoder_input_name(self.base)}, not text")

    def int8_copy(self) -> LoadedModel:
        """An int8 quantized copy of the base (with its heads, when there are some), and a copy of its feature
        drafter on it (drafting from the int8 base's states; its layer in int8 where hf_blockwise's int8 kernel runs,
        else float32, see [`load_model`]'s `int8`); the other drafters and the assistant are left out, since they were
        made for the float base."""
        source = self.heads_model if self.heads_model is not None else self.base
        quantized = quantize_dynamic_int8(copy.deepcopy(source))
        heads_model = quantized if self.heads_model is not None else None
        base = quantized.base_model if heads_model is not None else quantized
        feature_model = None if self.feature_model is None else self._feature_model_on(base)
        return dataclasses.replace(
            self, base=base, heads_model=heads_model, assistant_model=None, sequential_heads_model=None,
            feature_model=_int8_layer_where_fast(feature_model), nar_model=None,
        )  # fmt: skip

    def int8_drafter_copy(self) -> LoadedModel:
        """This model with a copy of its feature drafter whose layer runs in int8, on the same (float) base: a
        draft moves a quarter of the layer's bytes, and drafts are only proposals, so the output is the base's own.

        Raises:
            `ValueError` when the model ships no feature drafter.
        """
        if self.feature_model is None:
            raise ValueError("an int8 drafter needs the model's feature drafter, and this model ships none")
        feature_model = self._feature_model_on(self.base)
        quantize_linears_int8(feature_model.layer)
        return dataclasses.replace(self, feature_model=feature_model)

    def _feature_model_on(self, base: nn.Module) -> FeatureDrafterModel:
        """A copy of the feature drafter on `base` (shared, not copied: the float base or its int8 copy)."""
        return copy.deepcopy(self.feature_model, memo={id(self.base): base})

    def to(self, device: torch.device | str) -> LoadedModel:
        """Moves every loaded model to `device` (in place, as `nn.Module.to` does); returns `self`."""
        models = (self.base, self.heads_model, self.feature_model, self.sequential_heads_model, self.nar_model)
        for model in (*models, self.assistant_model):
            if model is not None:
                model.to(device)
        return self


def _int8_layer_where_fast(feature_model: FeatureDrafterModel | None) -> FeatureDrafterModel | None:
    """`feature_model` with its layer quantized to int8 (in place) where hf_blockwise's int8 kernel runs, else as it
    is: the one rule of [`load_model`]'s `int8` and [`LoadedModel.int8_copy`] for the drafter over an int8 base."""
    if feature_model is not None and int8_kernel.available():
        quantize_linears_int8(feature_model.layer)
    return feature_model


def shipped_drafter_path(model_path: str, subdir: str, config_name: str) -> str | None:
    """`<model_path>/<subdir>` when it holds a saved drafter (its `config_name`), else `None`."""
    path = os.path.join(model_path, subdir)
    return path if os.path.isfile(os.path.join(path, config_name)) else None


def load_model(
    model_path: str,
    *,
    assistant_path: str | None = None,
    nar_drafter_path: str | None = None,
    feature_drafter_path: str | None = None,
    sequential_heads_path: str | None = None,
    int8: bool = False,
) -> LoadedModel:
    """A model directory (or hub id) with what it ships: base (with heads if it has some), tokenizer, feature
    extractor (speech encoders), and the drafters in `<model>/nar-drafter`, `<model>/feature-drafter` and
    `<model>/sequential-heads` when present and none is given.

    Args:
        assistant_path (`str`, *optional*): a small seq2seq model (or a NAR drafter directory) for assisted
            generation.
        nar_drafter_path, feature_drafter_path, sequential_heads_path (`str`, *optional*): drafters saved elsewhere.
        int8 (`bool`): quantize the base (with its heads) to int8 before the drafters are put on it (CPU). The
            feature drafter's layer (and its drafting block's shortlist projection) is quantized too where
            hf_blockwise's int8 kernel runs ([`hf_blockwise.kernels.int8.available`]): measured on the AMD EPYC Zen 4
            over the int8 base, its compiled block costs ~2.2 ms a step in int8 against ~3.4 ms in float32 on
            inductor's GEMM template. Elsewhere it stays float32: `torch._int_mm` is slower than the template there.
    """
    for what, path in (
        ("model_path", model_path), ("assistant_path", assistant_path), ("nar_drafter_path", nar_drafter_path),
        ("feature_drafter_path", feature_drafter_path), ("sequential_heads_path", sequential_heads_path),
    ):  # fmt: skip
        if path is not None:
            hf.check_local_path(path, what)
    tokenizer = hf.from_hub(AutoTokenizer.from_pretrained, model_path, "--model / model")
    heads_model, base = _load_base(model_path)
    if int8:
        quantized = quantize_dynamic_int8(heads_model if heads_model is not None else base)
        base = quantized.base_model if heads_model is not None else quantized
    # speech encoders read features of audio (Whisper's log-mel frames), made by the checkpoint's feature extractor
    feature_extractor = (
        None if hf.encoder_input_name(base) == "input_ids" else AutoFeatureExtractor.from_pretrained(model_path)
    )
    nar_drafter_path = nar_drafter_path or shipped_drafter_path(model_path, NAR_DRAFTER_SUBDIR, NAR_CONFIG_NAME)
    feature_drafter_path = feature_drafter_path or shipped_drafter_path(
        model_path, FEATURE_DRAFTER_SUBDIR, FEATURE_DRAFTER_CONFIG_NAME
    )
    sequential_heads_path = sequential_heads_path or shipped_drafter_path(
        model_path, SEQUENTIAL_HEADS_SUBDIR, CONFIG_NAME
    )
    feature_model = _load_if(
        feature_drafter_path, lambda path: FeatureDrafterModel.from_pretrained(path, base_model=base).eval()
    )
    return LoadedModel(
        base=base, tokenizer=tokenizer, feature_extractor=feature_extractor, heads_model=heads_model,
        # over an int8 base, the drafter's layer in int8 where the kernel runs (the docstring's `int8`)
        feature_model=_int8_layer_where_fast(feature_model) if int8 else feature_model,
        sequential_heads_model=_load_if(sequential_heads_path, lambda path: BlockwiseHeadsModel.from_pretrained(
            path, base_model=base).eval()),
        nar_model=_load_if(nar_drafter_path, lambda path: NARDrafterModel.from_pretrained(
            path, verifier=base, dtype=torch.float32).eval()),
        assistant_model=_load_if(assistant_path, lambda path: _load_assistant(path, base)),
    )  # fmt: skip


def _load_base(model_path: str) -> tuple[nn.Module | None, nn.Module]:
    """(heads model or `None`, base): the heads model when the directory has heads, its base either way; float32
    (checkpoints may be stored in fp16 to stay small; CPU matmuls are fast in fp32)."""
    if os.path.isfile(os.path.join(model_path, CONFIG_NAME)):
        heads_model = BlockwiseHeadsModel.from_pretrained(model_path, dtype=torch.float32).eval()
        return heads_model, heads_model.base_model
    return None, hf.load_encoder_decoder(model_path, dtype=torch.float32).eval()


def _load_if(path: str | None, load: Callable[[str], Any]) -> Any:
    return None if path is None else load(path)


def _load_assistant(path: str, base: nn.Module) -> nn.Module:
    """An assistant model for transformers' assisted generation. A NAR drafter is a small seq2seq model of the same
    vocabulary; fed no masks, its output at the last verified position is an autoregressive next-token prediction,
    which is all an assistant model makes."""
    if os.path.isfile(os.path.join(path, NAR_CONFIG_NAME)):
        return NARDrafterModel.from_pretrained(path, verifier=base, dtype=torch.float32).model.eval()
    return AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()


def shares_vocabulary(model: nn.Module) -> bool:
    """Whether `model`'s encoder and decoder embed the same token ids (what source copy needs)."""
    try:
        hf.check_shared_vocabulary(model)
    except ValueError:
        return False
    return True


def missing_drafter(name: str, loaded: LoadedModel) -> str | None:
    """Why `loaded` cannot make the drafter `name` (one of `DRAFTER_NAMES`), or `None` when it can."""
    if name not in DRAFTER_NAMES:
        raise ValueError(f"unknown drafter {name!r}; choose one of {DRAFTER_NAMES}")
    return None if name == "none" else DRAFTERS[name].lacks(loaded)


@dataclass(frozen=True)
class DrafterOptions:
    """How [`build_drafter`] sets a drafter up; each drafter reads the fields that concern it.

    Attributes:
        block_size (`int`, *optional*): tokens per step of heads, sequential heads, feature and NAR drafters
            (default: the trained block size).
        threshold (`float`, `"config"` or `None`): the feature drafter's draft threshold (`"config"`: its config's;
            `None`: no threshold).
        use_shortlist (`bool`): the heads propose from their vocabulary shortlist (when they have one).
        tree_nodes (`int`, *optional*): heads and feature drafters propose trees of this many drafts per row
            (`None`: chains); tree_branching (`int`): candidates per drafted state (feature: also nodes expanded per
            depth).
        max_draft_length (`int`): most source tokens source copy drafts per step. realign (`bool`): source copy
            drafts right after an edit too.
    """

    block_size: int | None = None
    threshold: float | str | None = "config"
    use_shortlist: bool = True
    tree_nodes: int | None = None
    tree_branching: int = 2
    max_draft_length: int = 32
    realign: bool = False


def _input_copy(loaded: LoadedModel, options: DrafterOptions) -> Drafter:
    return InputCopyDrafter(loaded.base, max_draft_length=options.max_draft_length, realign=options.realign)


def _feature(loaded: LoadedModel, options: DrafterOptions) -> Drafter:
    return loaded.feature_model.drafter(
        block_size=options.block_size, threshold=options.threshold, tree_nodes=options.tree_nodes,
        tree_branching=options.tree_branching,
    )  # fmt: skip


def _nar(loaded: LoadedModel, options: DrafterOptions) -> Drafter:
    return loaded.nar_model.drafter(block_size=options.block_size, verifier=loaded.base)


def _lacks_source_copy(loaded: LoadedModel) -> str | None:
    return None if shares_vocabulary(loaded.base) else SOURCE_COPY_NEEDS


def _lacks_feature(loaded: LoadedModel) -> str | None:
    return f"no feature drafter ({FEATURE_DRAFTER_SUBDIR}/ folder)" if loaded.feature_model is None else None


@dataclass(frozen=True)
class DrafterKind:
    """A drafter by its one name, which every entry point uses: [`build_drafter`], `hf-blockwise generate
    --drafter` (and `generate_corpus`), the demo's `--drafter` and the bench's modes.

    Attributes:
        name (`str`): the name.
        build (`Callable[[LoadedModel, DrafterOptions], Drafter]`): makes it over a loaded model.
        lacks (`Callable[[LoadedModel], str | None]`): what a loaded model lacks to make it, in words, or `None`.
        bench_families (`tuple[str, ...]`): the bench's mode families that draft with it (named after the papers'
            methods where the name says more: `iad` and `gad` draft with `input_copy` and `nar`).
        corpus (`bool`): offered by the corpus job (`generate --drafter`, besides `auto` and `none`).
        demo (`bool`): offered by the demo (`--drafter`, besides `best`).
    """

    name: str
    build: Callable[[LoadedModel, DrafterOptions], Drafter]
    lacks: Callable[[LoadedModel], str | None]
    bench_families: tuple[str, ...]
    corpus: bool = True
    demo: bool = False


DRAFTERS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            "heads", lambda loaded, options: loaded.heads_model.drafter(
                options.block_size, options.use_shortlist, options.tree_nodes, options.tree_branching
            ),
            lambda loaded: "no proposal heads (blockwise_config.json)" if loaded.heads_model is None else None,
            ("heads", "heads_full_vocab", "heads_top2"), demo=True,
        ),
        DrafterKind(
            "seq_heads", lambda loaded, options: loaded.sequential_heads_model.drafter(options.block_size),
            lambda loaded: None if loaded.sequential_heads_model is not None
            else f"no sequential heads ({SEQUENTIAL_HEADS_SUBDIR}/ folder)",
            ("seq_heads",), corpus=False,
        ),
        DrafterKind("feature", _feature, _lacks_feature, ("feature", "feature_int8d"), demo=True),
        DrafterKind("input_copy", _input_copy, _lacks_source_copy, ("iad", "iad_realign")),
        DrafterKind(
            "composite",
            lambda loaded, options: CompositeDrafter(_input_copy(loaded, options), _feature(loaded, options)),
            lambda loaded: _lacks_feature(loaded) or _lacks_source_copy(loaded), ("composite",),
        ),
        DrafterKind(
            "nar", _nar,
            lambda loaded: f"no NAR drafter ({NAR_DRAFTER_SUBDIR}/ folder)" if loaded.nar_model is None else None,
            ("gad", "gad_pp"), corpus=False,
        ),
    )
}  # fmt: skip
# every name `build_drafter` takes: `"none"` decodes without a drafter (the loop alone)
DRAFTER_NAMES = ("none", *DRAFTERS)


def build_drafter(name: str, loaded: LoadedModel, options: DrafterOptions | None = None) -> Drafter | None:
    """The drafter called `name` (one of `DRAFTER_NAMES`) over `loaded`'s models; `None` for `"none"`.

    Raises:
        `ValueError` naming what the model lacks ([`missing_drafter`]).
    """
    missing = missing_drafter(name, loaded)
    if missing:
        raise ValueError(f"drafter {name!r}: the model has {missing}")
    if name == "none":
        return None
    return DRAFTERS[name].build(loaded, options or DrafterOptions())


# transformers' length when neither the call nor the checkpoint's generation_config gives one
TRANSFORMERS_DEFAULT_NEW_TOKENS = 20


def default_max_new_tokens(model: nn.Module) -> tuple[int, str]:
    """The new-token limit that `model.generate()` applies when the call gives none, and where it comes from, for
    the entry points that need a number (the bench, the demo's report): the checkpoint's `generation_config`
    `max_new_tokens`; else its `max_length` less the one-token decoder prompt of an encoder-decoder; else
    transformers' default of 20 new tokens.

    Returns:
        `tuple[int, str]`: the limit, and its source in words (`"the checkpoint's generation_config"`).
    """
    config = model.generation_config
    if config.max_new_tokens is not None:
        return config.max_new_tokens, "the checkpoint's generation_config"
    if config.max_length is not None:
        return config.max_length - 1, f"the checkpoint's generation_config (max_length {config.max_length})"
    return TRANSFORMERS_DEFAULT_NEW_TOKENS, "transformers' default (the checkpoint's generation_config sets none)"

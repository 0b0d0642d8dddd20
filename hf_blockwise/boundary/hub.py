"""Checkpoint locations, loading and saving: local directories and hub ids.

A checkpoint's files ([`has_file`], [`resolve_file`]) and a clear error for local-looking paths that do not exist
([`check_local_path`]); where an adapter's (heads', drafter's) recorded base is, and the base it attaches to
([`base_location`], [`resolved_base_location`], [`warn_if_other_base`] by [`base_weights_fingerprint`],
[`adapter_base`], [`given_base`]); and the auto class that loads an encoder-decoder checkpoint
([`load_encoder_decoder`]).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)
from transformers.utils import cached_file

from hf_blockwise.boundary.models import unwrap_base

T = TypeVar("T")


def from_hub(load: Callable[..., T], name: str | os.PathLike, what: str, **kwargs: Any) -> T:
    """`load(name, **kwargs)`, a transformers `from_pretrained`, with its `OSError` for a `name` that is no local
    path and could not be fetched from the Hub (offline, or a typo) turned into a `ValueError` that names it.

    Args:
        what (`str`): how the caller calls `name` (`"--model / model"`), for the message.
    """
    try:
        return load(name, **kwargs)
    except OSError as error:
        if os.path.exists(name):
            raise
        reason = str(error).strip().splitlines()[0]
        raise ValueError(
            f"{what} {os.fspath(name)!r} is no local folder, and transformers could not load it from the Hub: "
            f"{reason} Check the name for a typo; offline, only checkpoints already in the Hugging Face cache load."
        ) from error


def has_file(name_or_path: str | os.PathLike, filename: str) -> bool:
    check_local_path(name_or_path, "no model")
    if os.path.isdir(name_or_path):
        return os.path.isfile(os.path.join(name_or_path, filename))
    found = from_hub(cached_file, str(name_or_path), "the checkpoint", filename=filename,
                     _raise_exceptions_for_missing_entries=False)  # fmt: skip
    return found is not None


def resolve_file(name_or_path: str | os.PathLike, filename: str) -> str:
    check_local_path(name_or_path, "no model")
    path = os.path.join(name_or_path, filename)
    if os.path.isdir(name_or_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{name_or_path} holds no {filename}; is it a directory written by save_pretrained?"
            )
        return path
    resolved = from_hub(cached_file, str(name_or_path), "the checkpoint", filename=filename)
    if resolved is None:
        raise FileNotFoundError(f"{name_or_path} holds no {filename}")
    return resolved


def check_local_path(name_or_path: str | os.PathLike, what: str) -> None:
    """A `ValueError` for a location that looks like a local directory but is none, instead of the hub's "couldn't
    connect" or "not a valid model identifier" message. Local-looking: absolute, starting with `.` or `~`, with a
    backslash or more than one `/`, or whose first part is an existing local directory (`checkpoints/hedas`);
    anything else may be a hub id (`org/name`) and is left to transformers."""
    text = os.fspath(name_or_path)
    if os.path.isdir(text):
        return
    first = text.replace("\\", "/").split("/")[0]
    looks_local = (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or "\\" in text
        or text.count("/") > 1
        or (first != text and os.path.isdir(first))
    )
    if looks_local:
        where = os.path.abspath(os.path.expanduser(text))
        kind = "a file, not a directory" if os.path.isfile(where) else "no such directory"
        raise ValueError(f"{what} {text!r}: {kind} ({where}); check the path (hub ids have the form 'org/name')")


def base_location(heads_name_or_path: str | os.PathLike, base_name_or_path: str, required: bool = True) -> str | None:
    """Where the base an adapter records is: a relative path is read against the adapter's own directory, never
    against the current one, so a directory holding both (e.g. with `base_model_name_or_path="."`) can be moved or
    shipped as one piece, and an adapter copied without its base finds no stray model.

    A name with no base beside the adapter is a hub id (`org/name`) or an absolute path, as written.

    Args:
        required (`bool`): whether a base relative to the adapter must be there; without, such a missing base is
            `None` (a base model is passed explicitly, and the recorded one is not loaded).

    Raises:
        `ValueError` for a path relative to the adapter (`"."`, `"./x"`, `"../x"`) with no model there, naming
        where it looked (when `required`).
    """
    beside_heads = os.path.join(heads_name_or_path, base_name_or_path)
    if not os.path.isabs(base_name_or_path) and os.path.isfile(os.path.join(beside_heads, "config.json")):
        return beside_heads
    if base_name_or_path.replace("\\", "/").split("/")[0] in (".", ".."):
        if not required:
            return None
        raise ValueError(
            f"{os.fspath(heads_name_or_path)!r} names its base as {base_name_or_path!r}, relative to itself, and "
            f"{os.path.abspath(beside_heads)} holds no model (no config.json): copy the base there, or pass the "
            "base model explicitly (base_model=, verifier=)"
        )
    return base_name_or_path


def resolved_base_location(
    adapter_name_or_path: str | os.PathLike, base_name_or_path: str | None, required: bool = True
) -> str | None:
    """Where an adapter's (heads', drafter's) recorded base is: [`base_location`], made absolute when it is a local
    directory, so that the adapter re-saved anywhere still names a base that resolves (a bare `"."` would be
    read against the current directory)."""
    if base_name_or_path is None:
        return None
    location = base_location(adapter_name_or_path, base_name_or_path, required)
    return location if location is None or not os.path.isdir(location) else os.path.abspath(location)


# How many weights of the output projection a fingerprint samples, and how close two samples must be to be taken
# for the same base: a base saved in fp16 or bf16 and loaded back (the shipped models are) rounds each weight by
# at most 2 ** -8 of its size, while two different models' weights differ by their own size.
_FINGERPRINT_SIZE = 16
_FINGERPRINT_RTOL = 1e-2


def base_weights_fingerprint(model: nn.Module) -> list[float] | None:
    """A few weights of a base's output projection, at fixed evenly spaced positions: what an adapter records of the
    base it was made for, so that attaching it to another base with the same shapes can be noticed.

    Returns `None` where the weights cannot be read as numbers (no output projection, a quantized or meta weight).
    """
    projection = unwrap_base(model).get_output_embeddings()
    weight = getattr(projection, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.is_meta:
        return None
    flat = weight.detach().reshape(-1)
    index = torch.linspace(0, flat.numel() - 1, _FINGERPRINT_SIZE, device=flat.device).long()
    return [float(f"{value:.6g}") for value in flat[index].float().tolist()]


def same_fingerprint(recorded: list[float], actual: list[float]) -> bool:
    """Whether two [`base_weights_fingerprint`]s are of the same weights, up to fp16/bf16 rounding."""
    if len(recorded) != len(actual):
        return False
    # fp16 rounds tiny (subnormal) weights by up to its smallest step, 2 ** -24, more than 2 ** -8 of them; the
    # absolute term covers that and stays far below the size of the sample's weights
    atol = max(1e-7, 1e-4 * max((abs(value) for value in recorded), default=0.0))
    return all(
        abs(a - b) <= _FINGERPRINT_RTOL * max(abs(a), abs(b)) + atol for a, b in zip(recorded, actual, strict=True)
    )


def warn_if_other_base(
    recorded: str | None, base_model: nn.Module, what: str, fingerprint: list[float] | None = None
) -> None:
    """Warns when an adapter made for one base is attached to another: same shapes are not the same model, and its
    drafts would rarely be accepted (decoding stays exact).

    With the `fingerprint` the adapter's config recorded ([`base_weights_fingerprint`]), the weights are compared, so a
    model built in memory under the same name is noticed and the same weights saved elsewhere are not. Configs
    written before fingerprints existed are compared by name only (local directories by their real paths, hub
    names as written), and the warning says so; so are bases whose weights cannot be fingerprinted (quantized).
    """
    actual_weights = None if fingerprint is None else base_weights_fingerprint(base_model)
    actual = getattr(base_model, "name_or_path", "") or ""
    if fingerprint is not None and actual_weights is not None:
        if not same_fingerprint(fingerprint, actual_weights):
            warnings.warn(
                f"These {what} were trained for {'base ' + repr(recorded) if recorded else 'another base'} and are "
                f"attached to {actual or type(base_model).__name__!r}, whose weights differ from that base's: "
                "decoding stays exact, but their drafts will rarely be accepted unless the two are the same model",
                stacklevel=4,
            )
        return
    if not recorded or not actual:
        return
    if os.path.isdir(recorded) and os.path.isdir(actual):
        same = os.path.realpath(recorded) == os.path.realpath(actual)
    else:
        same = recorded.rstrip("/") == actual.rstrip("/")
    if not same:
        why = (
            "this adapter config records no base_fingerprint; save it again to record one"
            if fingerprint is None
            else "the base's output projection has no floating-point weights to fingerprint"
        )
        warnings.warn(
            f"These {what} were trained for base {recorded!r} and are attached to {actual!r}: decoding stays exact, "
            f"but their drafts will rarely be accepted unless the two are the same model (compared by name only: "
            f"{why})",
            stacklevel=4,
        )


def adapter_base(
    adapter_name_or_path: str | os.PathLike,
    recorded: str | None,
    base_model: nn.Module | None,
    what: str,
    base_model_kwargs: dict[str, Any],
    fingerprint: list[float] | None = None,
) -> tuple[str | None, nn.Module]:
    """The base an adapter (heads, feature drafter) attaches to, and where its config says that base is.

    With `base_model` given, that one ([`given_base`]: a path or hub id is loaded with `base_model_kwargs`), with a
    warning when the adapter was made for another base ([`warn_if_other_base`], by `fingerprint` when the config
    recorded one); else the recorded base ([`resolved_base_location`]) loaded with
    [`load_encoder_decoder`]`(location, **base_model_kwargs)`.
    """
    base_model = given_base(base_model, "base_model=", base_model_kwargs)
    location = resolved_base_location(adapter_name_or_path, recorded, required=base_model is None)
    if base_model is not None:
        warn_if_other_base(location, unwrap_base(base_model), what, fingerprint)
        return location, base_model
    if location is None:
        raise ValueError(
            f"{adapter_name_or_path} names no base checkpoint (base_model_name_or_path is null); pass base_model= "
            "explicitly"
        )
    check_local_path(location, "the recorded base model (pass base_model= to attach one)")
    return location, load_encoder_decoder(location, **base_model_kwargs)


def given_base(model: Any, argument: str, kwargs: dict[str, Any]) -> nn.Module | None:
    """The model passed as `argument` (`"base_model="`, `"verifier="`) of a `from_pretrained`: a loaded model as it
    is, a local directory or hub id loaded with [`load_encoder_decoder`]`(model, **kwargs)`, `None` as `None`.

    Raises:
        `TypeError` for anything else, naming what to pass; `ValueError` for a path that is not there or a name the
        Hub does not have ([`check_local_path`], [`from_hub`]).
    """
    if model is None or isinstance(model, nn.Module):
        return model
    if not isinstance(model, str | os.PathLike):
        raise TypeError(
            f"{argument} takes a loaded model (e.g. AutoModelForSeq2SeqLM.from_pretrained(name)) or its directory or "
            f"hub id as a str, got {type(model).__name__}"
        )
    check_local_path(model, argument)
    return from_hub(load_encoder_decoder, model, argument, **kwargs)


def load_encoder_decoder(location: str | os.PathLike, **kwargs: Any) -> PreTrainedModel:
    """An encoder-decoder checkpoint through the auto class its config's `model_type` maps to: speech (Whisper,
    Speech2Text, `SpeechEncoderDecoderModel`), image-text (`VisionEncoderDecoderModel`, Pix2Struct) or, for every
    other type, `AutoModelForSeq2SeqLM` (whose error names a type it cannot load)."""
    model_type = AutoConfig.from_pretrained(location).model_type
    if model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq.from_pretrained(location, **kwargs)
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText.from_pretrained(location, **kwargs)
    return AutoModelForSeq2SeqLM.from_pretrained(location, **kwargs)

"""The models a corpus job decodes with ([`load_for_corpus`]), and how its progress file names them: a model
directory by its resolved path, a hub id as given, a model given in memory by a digest of its weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import torch
from torch import nn

from hf_blockwise.corpus.paths import check_tokenizer, model_identity
from hf_blockwise.loading import LoadedModel, load_model
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.quantization import float_state_dict, is_int8


def load_for_corpus(
    model: str | os.PathLike | nn.Module | LoadedModel, tokenizer: Any, int8: bool = False
) -> tuple[LoadedModel, str]:
    """The models a job decodes with, and how its progress file names them: a local directory by its resolved path,
    a hub id as given, a model in memory by its class, name and a digest of its weights. With `int8`, the base
    quantized to int8 (a directory or hub id loaded so, a model in memory as an int8 copy unless it is int8 already;
    see [`load_model`] and [`LoadedModel.int8_copy`])."""
    if isinstance(model, str | os.PathLike):
        if tokenizer is not None:
            raise ValueError("tokenizer= goes with a loaded model: a model directory or hub id loads its own")
        check_tokenizer(model)
        return load_model(os.fspath(model), int8=int8), model_identity(model)
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ValueError(
                f"generate_corpus was given a loaded {type(model).__name__}: pass its tokenizer too (tokenizer="
                "AutoTokenizer.from_pretrained(...)), or give the model's directory instead"
            )
        model = _loaded_from_module(model, tokenizer)
    if not isinstance(model, LoadedModel):
        raise ValueError(f"model must be a model directory, a hub id or a loaded model, got {type(model).__name__}")
    loaded = model if tokenizer is None else dataclasses.replace(model, tokenizer=tokenizer)
    if loaded.tokenizer is None:
        raise ValueError("the LoadedModel has no tokenizer: pass tokenizer=")
    for module in (loaded.base, loaded.heads_model, loaded.feature_model):
        if module is not None and module.training:
            raise ValueError(f"the {type(module).__name__} is in training mode (dropout on): call .eval() first")
    if int8 and not is_int8(loaded.base):
        loaded = loaded.int8_copy()
    return loaded, in_memory_identity(loaded)


def _loaded_from_module(model: nn.Module, tokenizer: Any) -> LoadedModel:
    """A loaded model with what it carries: a heads model's heads, a feature drafter model's drafter."""
    heads_model = model if isinstance(model, BlockwiseHeadsModel) else None
    feature_model = model if isinstance(model, FeatureDrafterModel) else None
    base = model.base_model if heads_model is not None or feature_model is not None else model
    return LoadedModel(base=base, tokenizer=tokenizer, heads_model=heads_model, feature_model=feature_model)


def in_memory_identity(loaded: LoadedModel) -> str:
    """`<in-memory CLASS NAME, weights SHA-256>` of a model given loaded: a resumed run must decode with the same
    weights, whatever the model's recorded name says."""
    digest, seen = hashlib.sha256(), set()
    for module in (loaded.base, loaded.heads_model, loaded.feature_model):
        for key, value in sorted((float_state_dict(module) if module is not None else {}).items()):
            storage = (value.data_ptr(), tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else key
            if storage in seen:
                continue  # a heads or drafter model holds its base: each tensor once
            seen.add(storage)
            digest.update(key.encode("utf-8") + _value_bytes(value))
    name = getattr(loaded.base, "name_or_path", "") or "unnamed"
    return f"<in-memory {type(loaded.base).__name__} {name}, weights sha256 {digest.hexdigest()[:16]}>"


def _value_bytes(value: Any) -> bytes:
    """The bytes of a state dict entry: a tensor's data (int8 weights: their integers), else its repr."""
    if not isinstance(value, torch.Tensor):
        return repr(value).encode("utf-8")
    tensor = value.detach().cpu()
    tensor = tensor.int_repr() if tensor.is_quantized else tensor
    return tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()

"""`NARDrafterModel`: the model of a non-autoregressive drafter (GAD: Ge et al. 2022, §3.2) and its persistence.

The model is an ordinary transformers seq2seq model (its own encoder, a shallow decoder), so it is saved, loaded and
trained with transformers' own machinery; only a small JSON file (`nar_drafter_config.json`) says which token is the
mask and how many tokens it was trained to draft. Saved relative to its verifier, it is an adapter as PEFT saves
them: only the weights that differ from the verifier's are stored. Drafting with it is
[`NonAutoregressiveDrafter`]'s (`drafters/nar.py`), which reads this model through its `NARModel` Protocol.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedModel

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.nar import NonAutoregressiveDrafter, check_same_vocabulary
from hf_blockwise.modeling.config import check_block_size, check_fingerprint
from hf_blockwise.quantization import float_state_dict
from hf_blockwise.serialization import JsonConfigMixin, atomic_write_text, load_adapter_weights, save_adapter

NAR_CONFIG_NAME = "nar_drafter_config.json"
# a drafter saved relative to its verifier: only the weights that differ from the verifier's
CHANGED_WEIGHTS_NAME = "nar_drafter_weights.safetensors"
# beside `CHANGED_WEIGHTS_NAME`, the drafter model's transformers config (transformers' own file name)
MODEL_CONFIG_NAME = "config.json"

# How configs name their layer counts (encoder, decoder): BART, mBART, Marian, Pegasus, M2M100/NLLB; T5, mT5.
_LAYER_COUNT_ATTRIBUTES = (("encoder_layers", "decoder_layers"), ("num_layers", "num_decoder_layers"))


@dataclass
class NARDrafterConfig(JsonConfigMixin):
    """What turns a seq2seq model into a non-autoregressive drafter.

    Args:
        mask_token_id (`int`): the placeholder fed where drafts are to be predicted; a token the drafter never
            needs to output (the tokenizer's mask token, or its unknown token when it has none).
        block_size (`int`, defaults to 8): k: tokens per step including the verifier's own, so the drafter
            predicts `block_size - 1` tokens from the prefix and `block_size - 2` masks.
        verifier_name_or_path (`str`, *optional*): the model whose outputs the drafter was trained on.
        verifier_fingerprint (`list[float]`, *optional*): a few of that verifier's weights
            ([`boundary.base_weights_fingerprint`]), recorded by a save relative to it, so that loading the drafter
            onto another verifier warns.
    """

    mask_token_id: int
    block_size: int = 8
    verifier_name_or_path: str | None = None
    verifier_fingerprint: list[float] | None = None

    file_name: ClassVar[str] = NAR_CONFIG_NAME

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        if self.verifier_name_or_path is not None and not isinstance(self.verifier_name_or_path, str):
            raise ValueError(f"verifier_name_or_path must be a string or None, got {self.verifier_name_or_path!r}")
        check_fingerprint(self.verifier_fingerprint)


class NARDrafterModel(nn.Module):
    """A seq2seq model trained to fill masks with the next tokens, and its [`NARDrafterConfig`].

    Args:
        model ([`PreTrainedModel`]): a seq2seq model over the verifier's vocabulary ([`from_verifier`] makes one),
            trained by [`NARDrafterTrainer`].
        config ([`NARDrafterConfig`]): its mask token and trained block size.

    Example:

    ```python
    >>> nar = NARDrafterModel.from_verifier(base, mask_token_id=tokenizer.unk_token_id, block_size=8)
    >>> out = base.generate(**inputs, custom_generate=blockwise_generate, assistant=nar.drafter(verifier=base))
    ```
    """

    def __init__(self, model: PreTrainedModel, config: NARDrafterConfig) -> None:
        super().__init__()
        hf.encoder_decoder_only(model)
        if not isinstance(config, NARDrafterConfig):
            raise TypeError(f"config must be a NARDrafterConfig, got {type(config).__name__}")
        self.model = model
        self.nar_config = config

    def drafter(
        self, block_size: int | None = None, verifier: nn.Module | None = None, use_cache: bool = True
    ) -> NonAutoregressiveDrafter:
        """The [`NonAutoregressiveDrafter`] that drafts with this model (see there for the arguments)."""
        return NonAutoregressiveDrafter(self, block_size=block_size, verifier=verifier, use_cache=use_cache)

    @classmethod
    def from_verifier(
        cls,
        verifier: nn.Module,
        mask_token_id: int,
        block_size: int = 8,
        decoder_layers: int | None = 1,
        encoder_layers: int | None = None,
        verifier_name_or_path: str | None = None,
    ) -> NARDrafterModel:
        """A drafter of the verifier's architecture with fewer layers, initialised from the verifier's weights.

        The drafter then starts with the verifier's embeddings, encoder and lowest decoder layers, and training
        only has to teach it to read masks. Layers are taken from the bottom of each stack. The model comes in
        eval mode, as `from_pretrained` models do ([`NARDrafterTrainer`] switches it to training).

        Args:
            verifier: the seq2seq model (or [`BlockwiseHeadsModel`]) whose greedy output is to be drafted.
            mask_token_id (`int`), block_size (`int`), verifier_name_or_path (`str`, *optional*): see
                [`NARDrafterConfig`].
            decoder_layers (`int`, defaults to 1), encoder_layers (`int`, *optional*): layer counts of the
                drafter; `None` keeps the verifier's depth.
        """
        base = hf.unwrap_base(verifier)
        config = copy.deepcopy(base.config)
        for name, depth in zip(_layer_count_attributes(config), (encoder_layers, decoder_layers), strict=True):
            available = getattr(config, name)
            if depth is not None and not 1 <= depth <= available:
                raise ValueError(f"{name} of the drafter must be between 1 and the verifier's {available}, got {depth}")
            if depth is not None:
                setattr(config, name, depth)
        model = AutoModelForSeq2SeqLM.from_config(config)
        missing, _unused_deeper_layers = model.load_state_dict(float_state_dict(base), strict=False)
        if missing:
            raise ValueError(f"Could not initialise the drafter from the verifier; missing weights {missing[:5]}")
        model.to(device=base.device, dtype=base.dtype).eval()
        model.generation_config = copy.deepcopy(base.generation_config)
        nar_config = NARDrafterConfig(
            mask_token_id=mask_token_id, block_size=block_size, verifier_name_or_path=verifier_name_or_path
        )
        return cls(model, nar_config)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        dtype: torch.dtype | None = None,
        relative_to: nn.Module | None = None,
        verifier_name_or_path: str | None = None,
    ) -> None:
        """Writes the drafter into `save_directory` atomically ([`save_adapter`]), `nar_drafter_config.json` last.

        By default the whole model is written in transformers' format. With `relative_to=verifier`, only the
        weights that differ from the verifier's are written (`nar_drafter_weights.safetensors`, beside the
        drafter's `config.json`), as PEFT saves adapters: a drafter made by [`from_verifier`] and trained with
        a frozen encoder then takes a fraction of the space, and loading rebuilds it from the verifier.

        Args:
            dtype (`torch.dtype`, *optional*): store the weights in this dtype (e.g. `torch.float16`).
            relative_to (`nn.Module`, *optional*): the verifier the drafter was made from.
            verifier_name_or_path (`str`, *optional*): the verifier to record in the config (a path relative to
                `save_directory`, such as `".."`, is looked up there first); required to load a relative save
                without passing `verifier=`.
        """
        config = self.nar_config
        if verifier_name_or_path is not None:
            config = dataclasses.replace(config, verifier_name_or_path=verifier_name_or_path)
        if relative_to is None:
            model = self.model if dtype is None else copy.deepcopy(self.model).to(dtype)
            save_adapter(save_directory, config, write_beside=[model.save_pretrained])
            return
        config = dataclasses.replace(config, verifier_fingerprint=hf.base_weights_fingerprint(relative_to))
        write_model_config = functools.partial(_write_model_config, self.model.config.to_json_string())
        save_adapter(
            save_directory, config, CHANGED_WEIGHTS_NAME, _changed_weights(self.model, relative_to), dtype,
            metadata={"format": "pt", "relative_to": "verifier"}, write_beside=[write_model_config],
        )  # fmt: skip

    def load_weights(self, name_or_path: str | os.PathLike, verifier: nn.Module | None = None) -> None:
        """Loads into this model, checked, the weights [`save_pretrained`] wrote: the whole model, or, saved
        relative to its verifier, the stored weights over the `verifier`'s.

        Raises:
            ValueError: when the file is corrupt, or lacks weights neither it nor the verifier provides (the wrong
                verifier), holds unexpected ones or ones of other shapes (the message names the file).
        """
        if not hf.has_file(name_or_path, CHANGED_WEIGHTS_NAME):
            self.model.load_state_dict(AutoModelForSeq2SeqLM.from_pretrained(name_or_path).state_dict())
            return
        if verifier is None:
            raise ValueError(f"{name_or_path} holds only the weights that differ from its verifier; pass verifier=")
        base = hf.unwrap_base(verifier)
        check_same_vocabulary(self.model, base)
        weights = hf.resolve_file(name_or_path, CHANGED_WEIGHTS_NAME)
        load_adapter_weights(weights, self.model, "Drafter", base_weights=float_state_dict(base))

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        verifier: nn.Module | str | os.PathLike | None = None,
        **model_kwargs: Any,
    ) -> NARDrafterModel:
        """Loads a drafter written by [`save_pretrained`] (a local directory or a hub repository).

        Args:
            verifier (`nn.Module`, `str` or `os.PathLike`, *optional*): the model it drafts for (or its directory or
                hub id, loaded with `model_kwargs`), checked for a matching vocabulary; a drafter saved relative to
                its verifier is rebuilt from it (by default from the config's `verifier_name_or_path`).
            model_kwargs: passed to `from_pretrained` of the model (and of the verifier it loads, if any).
        """
        verifier = hf.given_base(verifier, "verifier=", model_kwargs)
        config = NARDrafterConfig.from_json_file(hf.resolve_file(name_or_path, NAR_CONFIG_NAME))
        if not hf.has_file(name_or_path, CHANGED_WEIGHTS_NAME):
            model = AutoModelForSeq2SeqLM.from_pretrained(name_or_path, **model_kwargs)
            if verifier is not None:
                check_same_vocabulary(model, verifier)
            return cls(model, config)
        if verifier is None:
            verifier = _recorded_verifier(name_or_path, config, model_kwargs)
        else:
            location = hf.resolved_base_location(name_or_path, config.verifier_name_or_path, required=False)
            hf.warn_if_other_base(location, hf.unwrap_base(verifier), "drafter weights", config.verifier_fingerprint)
        base = hf.unwrap_base(verifier)
        nar = cls(AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(name_or_path)), config)
        nar.load_weights(name_or_path, verifier=base)
        nar.model.to(device=base.device, dtype=base.dtype).eval()
        return nar


def _recorded_verifier(name_or_path: str | os.PathLike, config: NARDrafterConfig, model_kwargs: dict) -> nn.Module:
    """The verifier a drafter saved relative to it names in its config, loaded with `model_kwargs`."""
    if config.verifier_name_or_path is None:
        raise ValueError(
            f"{name_or_path} holds only the weights that differ from its verifier and names no verifier; pass verifier="
        )
    location = hf.base_location(name_or_path, config.verifier_name_or_path)
    hf.check_local_path(location, "the recorded verifier (pass verifier= to attach one)")
    return AutoModelForSeq2SeqLM.from_pretrained(location, **model_kwargs)


def _changed_weights(model: nn.Module, verifier: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of `model` that the verifier does not hold identically (name, shape and values)."""
    reference = float_state_dict(hf.unwrap_base(verifier))
    changed = {}
    for name, tensor in model.state_dict().items():
        same = name in reference and reference[name].shape == tensor.shape
        if not (same and torch.equal(reference[name].to(tensor.device, tensor.dtype), tensor)):
            changed[name] = tensor
    return changed


def _write_model_config(model_config_json: str, directory: str) -> None:
    atomic_write_text(os.path.join(directory, MODEL_CONFIG_NAME), model_config_json)


def _layer_count_attributes(config: Any) -> tuple[str, str]:
    for names in _LAYER_COUNT_ATTRIBUTES:
        if all(name in config.to_dict() for name in names):
            return names
    raise ValueError(
        f"{type(config).__name__} names its layer counts in none of the known ways {_LAYER_COUNT_ATTRIBUTES}; "
        "build the drafter model yourself and pass it to NARDrafterModel(model, config)"
    )

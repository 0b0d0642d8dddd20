"""What any adapter model over a base (proposal heads, a feature drafter) shares: the checks of what it wraps, the
base it records, its `generate`, and loading: its config, read from the adapter's directory, the base it attaches
to, then its weights."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.generation.loop import blockwise_generate

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

    from hf_blockwise.drafters.base import Drafter

# `generate(assistant=...)` default: draft with the model's own drafter. `assistant=None` means plain greedy.
_OWN_DRAFTER = object()


def check_base_signature(config: Any, signature: dict[str, Any], expects: str, refusal: str) -> None:
    """Raises a `ValueError` listing every field of `signature` (what the base is) that `config` (what the adapter
    was made for) records otherwise; fields the config leaves `None` are not compared.

    Args:
        signature (`dict[str, Any]`): the base's model type and widths, keyed by config field.
        expects (`str`): the adapter's side of each mismatch, e.g. `"heads expect"`.
        refusal (`str`): the message's opening, naming the adapter and the base.
    """
    mismatches = [
        f"{key}: {expects} {getattr(config, key)!r}, base has {value!r}"
        for key, value in signature.items()
        if getattr(config, key) is not None and getattr(config, key) != value
    ]
    if mismatches:
        raise ValueError(f"{refusal}: " + "; ".join(mismatches))


def base_identity(config: Any, base_model: nn.Module) -> dict[str, Any]:
    """The config fields that name the base an adapter is made for, filled from `base_model` where `config` leaves
    them empty: its checkpoint (`base_model_name_or_path`, `None` for a model built in memory) and the fingerprint
    of its weights (`base_fingerprint`, [`base_weights_fingerprint`])."""
    return {
        "base_model_name_or_path": config.base_model_name_or_path or getattr(base_model, "name_or_path", None) or None,
        "base_fingerprint": config.base_fingerprint or hf.base_weights_fingerprint(base_model),
    }


def load_adapter_config(
    adapter_name_or_path: str | os.PathLike,
    config_class: Any,
    base_model: nn.Module | None,
    what: str,
    base_model_kwargs: dict[str, Any],
) -> tuple[Any, nn.Module]:
    """An adapter's config and its base, before its weights are loaded.

    Args:
        adapter_name_or_path: local directory or hub repository holding the adapter.
        config_class: the config dataclass ([`BlockwiseHeadsConfig`], [`FeatureDrafterConfig`]); read from its
            `file_name`.
        base_model (`nn.Module`, *optional*): the base to attach to; by default the one the config names, loaded
            with `base_model_kwargs` ([`adapter_base`]).
        what (`str`): what the adapter is, for messages, e.g. `"proposal heads"`.

    Returns:
        The config, its `base_model_name_or_path` resolved to where the base is, and the base model.
    """
    config = config_class.from_json_file(hf.resolve_file(adapter_name_or_path, config_class.file_name))
    location, base_model = hf.adapter_base(
        adapter_name_or_path, config.base_model_name_or_path, base_model, what, base_model_kwargs,
        fingerprint=config.base_fingerprint,
    )  # fmt: skip
    return dataclasses.replace(config, base_model_name_or_path=location), base_model


class AdapterModelMixin:
    """What a model that is an adapter over a base ([`BlockwiseHeadsModel`], [`FeatureDrafterModel`]) shares: the
    checks of its `__init__(base_model, config)` ([`checked_config`]), its `generate`, and `from_pretrained`, which
    builds it as `cls(base_model, config)` and fills it with its own `load_weights(directory)`.

    Attributes:
        config_class: its config dataclass, read from the adapter's directory.
        adapter_name (`str`): what the adapter is, for messages, e.g. `"proposal heads"`.
    """

    config_class: ClassVar[Any]
    adapter_name: ClassVar[str]
    base_model: nn.Module

    @staticmethod
    def check_fits(config: Any, base_model: nn.Module) -> None:
        """Raises a `ValueError` naming both sides when `config` was made for another kind of base."""
        raise NotImplementedError("an adapter model says what base its config fits")

    @staticmethod
    def base_fields(config: Any, base_model: nn.Module) -> dict[str, Any]:
        """The config fields read from the base (its widths, vocabulary size, model type) or defaulted from it."""
        raise NotImplementedError("an adapter model says which config fields it reads from its base")

    def drafter(self) -> Drafter:
        """The [`Drafter`] that drafts with this model's own adapter."""
        raise NotImplementedError("an adapter model drafts with its own drafter")

    @classmethod
    def checked_config(cls, base_model: Any, config: Any) -> Any:
        """The config `__init__(base_model, config)` builds on (`config_class()` for `None`), once both are checked.

        Raises:
            `TypeError` for a path, a dict or another type where a model or a config belongs, naming what to pass;
            `ValueError` for a base that is not an encoder-decoder, has no output projection or unloaded weights,
            whose decoder has fewer positions than the block size, or that the config was not made for.
        """
        hf.check_wrap_arguments(cls.__name__, base_model, config, cls.config_class)
        hf.encoder_decoder_only(base_model)
        hf.check_output_projection(base_model)
        config = cls.config_class() if config is None else config
        hf.check_block_size_fits(base_model, config.block_size)
        cls.check_fits(config, base_model)
        return config

    @classmethod
    def filled_config(cls, base_model: Any, config: Any) -> Any:
        """The model's own config: `config` ([`checked_config`]) with its base-specific fields filled in from
        `base_model` ([`base_fields`], [`base_identity`]), as a fresh `config_class`."""
        config = cls.checked_config(base_model, config)
        return cls.config_class.from_dict(
            {**config.to_dict(), **cls.base_fields(config, base_model), **base_identity(config, base_model)}
        )

    @torch.no_grad()
    def generate(self, *args: Any, assistant: Any = _OWN_DRAFTER, acceptance: Any = None, **kwargs: Any):
        """The base model's `generate`, decoded blockwise with this model's own drafter ([`drafter`]: the proposal
        heads, the feature drafter).

        Takes every argument of transformers' `generate`. `assistant=None` runs the base model's own greedy
        `generate`; another [`Drafter`] replaces the model's own. See [`blockwise_generate`] for the return value.
        """
        hf.check_generate_inputs(self.base_model, args, kwargs)
        if assistant is None:
            return self.base_model.generate(*args, **kwargs)
        drafter = self.drafter() if assistant is _OWN_DRAFTER else assistant
        kwargs = hf.stop_string_kwargs(self.base_model, kwargs)  # transformers drops tokenizer= for custom_generate
        return self.base_model.generate(
            *args, custom_generate=blockwise_generate, assistant=drafter, acceptance=acceptance, **kwargs
        )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        base_model: nn.Module | str | os.PathLike | None = None,
        **base_model_kwargs: Any,
    ) -> Self:
        """Loads an adapter saved by `save_pretrained` and attaches it to a base model.

        Args:
            name_or_path: local directory or hub repository holding the adapter.
            base_model: the base to attach it to: a loaded model (e.g. `heads_model.base_model`), or its directory
                or hub id, loaded with `AutoModelForSeq2SeqLM.from_pretrained(base_model, **base_model_kwargs)`; by
                default the checkpoint named in the adapter's config is loaded so, a relative name being looked up
                inside the adapter's directory first.
        """
        config, base_model = load_adapter_config(
            name_or_path, cls.config_class, base_model, cls.adapter_name, base_model_kwargs
        )
        model = cls(cls.attachable_base(name_or_path, hf.unwrap_base(base_model)), config)
        model.load_weights(name_or_path)
        return model

    @classmethod
    def attachable_base(cls, name_or_path: str | os.PathLike, base_model: nn.Module) -> nn.Module:
        """The base as the adapter saved in `name_or_path` attaches to it; by default `base_model` itself."""
        return base_model

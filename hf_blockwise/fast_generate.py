"""The fast path in one call: `speed_up(model)` makes `model.generate(...)`, and every pipeline built on `model`, decode
through the blockwise loop (the compiled engine, a drafter, int8 if asked), with the checkpoint's
`generation_config` as before; `restore(model)` undoes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.compile_options import CompileOptions
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.quantization import quantize_dynamic_int8


@dataclass(frozen=True)
class FastGenerate:
    """`model.generate` after [`speed_up`]: transformers' own `generate` of the model's class with the loop's
    arguments as defaults (a call's own arguments win: `assistant=None` drafts nothing for that call)."""

    model: nn.Module = field(repr=False)  # `print(model.generate)` shows the defaults, not the whole model
    defaults: dict[str, Any]

    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = hf.stop_string_kwargs(self.model, kwargs)  # transformers drops tokenizer= for custom_generate
        return type(self.model).generate(self.model, *args, **{**self.defaults, **kwargs})


@dataclass(frozen=True)
class SpedUp:
    """What [`speed_up`] returns: the model, and a context manager that restores it on exit."""

    model: nn.Module

    def __enter__(self) -> nn.Module:
        return self.model

    def __exit__(self, *exc_info: object) -> None:
        restore(self.model)


def speed_up(
    model: nn.Module,
    assistant: Drafter | nn.Module | None = None,
    *,
    compile: bool | CompileOptions = True,
    int8: bool = False,
    acceptance: Any = None,
) -> SpedUp:
    """Makes `model.generate` decode through the blockwise loop until [`restore`] (or the end of a `with` block).

    >>> speed_up(model, FeatureDrafterModel.from_pretrained(path, base_model=model))
    >>> model.generate(**inputs)  # the same tokens as before, sooner; pipelines on `model` too

    Args:
        model: a transformers encoder-decoder (text, speech or image-to-text), in eval mode.
        assistant: what drafts: a [`Drafter`], or a drafter model ([`FeatureDrafterModel`], [`BlockwiseHeadsModel`])
            whose `drafter()` is used; `None` runs the loop alone (the engine's gain needs no drafter).
        compile (`bool` or [`CompileOptions`]): verify through the compiled engine, as `blockwise_compile=` does;
            the first `generate` compiles (seconds to a minute; a batch above 1 compiles a graph of its own).
            `CompileOptions(compiled_prefill=True)` compiles each call's first decoder call too, which pays on
            long runs (the corpus job's choice).
        int8 (`bool`): quantize the model's linears to int8 first ([`quantize_dynamic_int8`], CPU, in place:
            [`restore`] leaves them so). Exact against the int8 model's own greedy, not the float model's.
        acceptance: an [`AcceptanceRule`] other than exact (lossy: see the acceptance guide).

    Returns:
        [`SpedUp`]: `with speed_up(model): ...` restores `model` on exit.

    Raises:
        `ValueError`: the model's `generate` is already replaced ([`restore`] it first).
    """
    hf.check_model_argument("speed_up(model)", model)
    if isinstance(vars(model).get("generate"), FastGenerate):
        raise ValueError(f"{type(model).__name__}.generate is already sped up: restore(model) first to change how")
    drafter = _drafter_of(assistant)
    if int8:
        quantize_dynamic_int8(model)
    defaults = {"custom_generate": blockwise_generate, "assistant": drafter, "acceptance": acceptance}
    if compile:
        defaults["blockwise_compile"] = compile
    model.generate = FastGenerate(model, defaults)
    return SpedUp(model)


def restore(model: nn.Module) -> nn.Module:
    """Undoes [`speed_up`]: `model.generate` is transformers' own again (int8 linears stay int8). Returns `model`.

    Raises:
        `ValueError`: `speed_up` did not replace this model's `generate`.
    """
    if not isinstance(vars(model).get("generate"), FastGenerate):
        raise ValueError(f"{type(model).__name__}.generate was not sped up: there is nothing to restore")
    del model.generate
    return model


def _drafter_of(assistant: Drafter | nn.Module | None) -> Drafter | None:
    if not isinstance(assistant, nn.Module):
        return assistant
    if not callable(getattr(assistant, "drafter", None)):
        raise TypeError(
            f"speed_up(model, assistant): a {type(assistant).__name__} does not draft; pass a Drafter or a drafter "
            "model (FeatureDrafterModel, BlockwiseHeadsModel)"
        )
    return assistant.drafter()

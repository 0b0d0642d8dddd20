"""Model quirks: where a transformers seq2seq model keeps what the loop and the heads need.

Read from the model and its config rather than from its type: the wrapper base class ([`BaseModelWrapper`],
[`unwrap_base`]), the decoder's config, layer count and feed-forward width, a mixture-of-experts decoder's capacity,
the encoder's output width and input name, the token embeddings (and whether encoder and decoder share them), the
output projection and the logit bias after it (its input captured, its columns selected, its rows for a shortlist),
the name its forward takes the KV cache by ([`cache_argument`]), and one cached decoder forward as `generate` runs
it ([`decoder_forward`]).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import EncoderDecoderCache
from transformers.generation import GenerationConfig

from hf_blockwise.boundary.cache import CACHE_ARGUMENTS
from hf_blockwise.boundary.tree import TreeInputs, tree_attention_mask, tree_positions


class BaseModelWrapper(nn.Module):
    """A module that wraps a transformers seq2seq model as `self.base_model` (PEFT's `PeftModel` pattern).

    [`BlockwiseHeadsModel`] and [`FeatureDrafterModel`] subclass it, so [`unwrap_base`] can tell a wrapper from a
    transformers model (which also has a `base_model` attribute: its bare backbone), and `config`, `device` and
    `generation_config` are the base's.
    """

    base_model: nn.Module

    @property
    def config(self) -> PretrainedConfig:
        """The base model's config, as for PEFT's `PeftModel`; the wrapper's own settings live beside it."""
        return self.base_model.config

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    @property
    def generation_config(self) -> GenerationConfig:
        return self.base_model.generation_config


@functools.cache
def _named_cache_argument(forward: Any) -> tuple[str | None, bool]:
    """The cache argument a forward names (or `None`), and whether it takes other keyword arguments (`**kwargs`)."""
    parameters = inspect.signature(forward).parameters
    name = next((name for name in CACHE_ARGUMENTS if name in parameters), None)
    return name, any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())


def cache_argument(model: nn.Module) -> str:
    """The name under which `model`'s forward takes its KV cache (`"cache"` from transformers 5.25 on,
    `"past_key_values"` before), read from the forward's signature (once per class); a wrapper whose forward passes
    `**kwargs` on (PEFT's `PeftModel`) takes it under its base model's name."""
    name, passes_kwargs = _named_cache_argument(type(model).forward)
    if name is not None:
        return name
    base = getattr(model, "get_base_model", None)
    if passes_kwargs and callable(base) and base() is not model:
        return cache_argument(base())
    raise ValueError(
        f"{type(model).__name__}.forward takes none of {CACHE_ARGUMENTS}: its decoder cannot be run one cached step "
        "at a time"
    )


def unwrap_base(model: nn.Module) -> nn.Module:
    """The transformers model inside a [`BlockwiseHeadsModel`], or `model` itself.

    Not `getattr(model, "base_model", model)`: every transformers model has a `base_model` attribute too (its
    bare backbone, without the output layer).
    """
    return model.base_model if isinstance(model, BaseModelWrapper) else model


def model_name(model: nn.Module) -> str:
    """The checkpoint a model was loaded from, or its model type when built from a config."""
    return getattr(model, "name_or_path", "") or f"model_type={getattr(model.config, 'model_type', '?')!r}"


def check_materialized(model: nn.Module) -> None:
    """A `ValueError` for a model whose weights are on the meta device (built without loading them): every read of
    them would otherwise fail deep inside a probe or a forward with "cannot be called on meta tensors"."""
    name = next((name for name, parameter in model.named_parameters() if parameter.is_meta), None)
    if name is not None:
        raise ValueError(
            f"{model_name(model)} has weights on the meta device ({name!r} among them): it was built without "
            "loading them (under torch.device('meta'), init_empty_weights or device_map='meta'). Load it with "
            "from_pretrained, or call model.to_empty(device=...) and load its state dict, before wrapping it or "
            "calling generate."
        )


def check_model_argument(callee: str, model: Any) -> None:
    """A `TypeError` naming what to pass when `callee` is given a path, or anything else, where a loaded model
    belongs (instead of an `AttributeError` from deep inside).

    Args:
        callee (`str`): what was called, e.g. `"quantize_dynamic_int8(model)"`.
    """
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"{callee} takes a loaded model, got the path {os.fspath(model)!r}: load it first, e.g. "
            "AutoModelForSeq2SeqLM.from_pretrained(path)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{callee} takes a loaded transformers model, got {type(model).__name__}")


def check_wrap_arguments(wrapper: str, base_model: Any, config: Any, config_class: type) -> None:
    """`TypeError`s for what a wrapper's `__init__(base_model, config)` is commonly given instead (a path, a
    dict), naming what to call, and a `ValueError` for a base whose weights were never loaded.

    Args:
        wrapper (`str`): the wrapper's class name, e.g. `"BlockwiseHeadsModel"`.
        config_class (`type`): the config dataclass the wrapper takes, e.g. `BlockwiseHeadsConfig`.
    """
    if isinstance(base_model, (str, os.PathLike)):
        raise TypeError(
            f"{wrapper}(base_model, config) wraps a loaded transformers model, got the path "
            f"{os.fspath(base_model)!r}: to load a saved {wrapper} use {wrapper}.from_pretrained(path); to wrap a "
            "base checkpoint load it first, e.g. AutoModelForSeq2SeqLM.from_pretrained(path)"
        )
    if not isinstance(base_model, nn.Module):
        raise TypeError(
            f"{wrapper} wraps a transformers seq2seq model (e.g. AutoModelForSeq2SeqLM.from_pretrained(...)), got "
            f"{type(base_model).__name__}"
        )
    if isinstance(config, dict):
        raise TypeError(f"config= takes a {config_class.__name__}, got a dict: pass {config_class.__name__}(**config)")
    if config is not None and not isinstance(config, config_class):
        raise TypeError(f"config= takes a {config_class.__name__} or None, got {type(config).__name__}")
    check_materialized(base_model)


def check_same_projection(drafter_base: nn.Module, model: nn.Module, drafter: str) -> None:
    """A `ValueError` naming both shapes when a drafter made for `drafter_base` is used on `model` and their output
    projections differ in shape (hidden size or vocabulary): its drafts would fail inside a matrix product.

    Args:
        drafter (`str`): what the drafter is, for the message (e.g. `"HeadsDrafter"`).
    """
    made_for = unwrap_base(drafter_base).get_output_embeddings().weight.shape
    actual = unwrap_base(model).get_output_embeddings().weight.shape
    if made_for != actual:
        raise ValueError(
            f"This {drafter} was made for a base with vocab_size={made_for[0]}, hidden_size={made_for[1]} "
            f"({model_name(unwrap_base(drafter_base))}), but generate runs on {model_name(unwrap_base(model))} with "
            f"vocab_size={actual[0]}, hidden_size={actual[1]}: pass a drafter made for this model (e.g. one loaded "
            "with from_pretrained(path, base_model=model))"
        )


def check_same_dtype(weights: nn.Module, model: nn.Module, drafter: str) -> None:
    """A `ValueError` naming both dtypes when a drafter's own `weights` (proposal heads, a feature drafter's layer)
    are of another floating-point dtype than the output projection of `model`, whose states they read (a base cast
    alone, e.g. `heads_model.base_model.to(torch.bfloat16)`): its drafts would fail inside a matrix product.

    Args:
        drafter (`str`): what the drafter is, for the message (e.g. `"HeadsDrafter"`).
    """
    expected = unwrap_base(model).get_output_embeddings().weight.dtype
    own = next((parameter.dtype for parameter in weights.parameters() if parameter.is_floating_point()), None)
    if own is not None and expected.is_floating_point and own != expected:
        raise ValueError(
            f"This {drafter}'s weights are {own}, but generate runs on {model_name(unwrap_base(model))} in {expected}: "
            f"cast both to one dtype, e.g. the wrapper as a whole (model.to({expected}), which casts its base too), "
            f"or the drafter's model alone"
        )


def encoder_decoder_only(model: nn.Module) -> None:
    if not getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"hf_blockwise decodes encoder-decoder (seq2seq) models; {type(model).__name__} has "
            "config.is_encoder_decoder=False"
        )


def decoder_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config that describes the decoder: its own sub-config where the model has one (`decoder`:
    `EncoderDecoderModel`, `VisionEncoderDecoderModel`, `SpeechEncoderDecoderModel`, T5Gemma; `text_config`: the
    text decoder of Pix2Struct), else the model's config.

    Not `config.get_text_config(decoder=True)`: for configs without a decoder sub-config (Marian in 5.23) it
    returns a freshly built config with default sizes, not the model's.
    """
    for name in ("decoder", "text_config"):
        sub_config = getattr(config, name, None)
        if isinstance(sub_config, PretrainedConfig):
            return sub_config
    return config


def decoder_layer_count(model: nn.Module) -> int:
    """How many layers the model's decoder has, from the standard transformers config attributes."""
    config = decoder_config(model.config)
    for name in ("decoder_layers", "num_decoder_layers", "num_hidden_layers", "num_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"Cannot tell how many decoder layers a {type(model.config).__name__} has from its config")


def decoder_ffn_width(config: Any) -> int:
    """The base decoder's feed-forward width, read from the standard transformers config attributes."""
    for name in ("decoder_ffn_dim", "d_ff", "ffn_dim", "intermediate_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"Cannot tell the decoder feed-forward width of a {type(config).__name__}; set "
        "BlockwiseHeadsConfig(head_hidden_size=...) explicitly"
    )


def expert_capacity_limit(model: nn.Module) -> tuple[int, str] | None:
    """The most decoder tokens a row may feed in one forward before a mixture-of-experts decoder drops tokens.

    Switch Transformers routes at most `expert_capacity` tokens of a sequence to one expert per forward and
    drops the rest, so a wider verification pass is computed differently from one-token steps. NLLB-MoE in
    eval mode sizes its capacity as `moe_eval_capacity_token_fraction` of the forward's tokens: below 1,
    what is dropped depends on how many tokens a forward holds, so any multi-token feed may differ.

    Returns:
        `(limit, reason)`, or `None` when the decoder drops nothing.
    """
    config = decoder_config(model.config)
    fraction = getattr(config, "moe_eval_capacity_token_fraction", None)
    if fraction is not None:
        if float(fraction) < 1.0:
            return 1, f"its experts keep only moe_eval_capacity_token_fraction={fraction} of a forward's tokens"
        return None
    capacity = getattr(config, "expert_capacity", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        return capacity, f"its experts drop tokens beyond expert_capacity={capacity} per sequence and forward"
    return None


def encoder_hidden_size(model: nn.Module) -> int:
    """Width of the model's encoder output, read from the encoder's config (`d_model` or `hidden_size`)."""
    encoder = model.get_encoder()
    for config in (getattr(encoder, "config", None), getattr(model.config, "encoder", None), model.config):
        for name in ("d_model", "hidden_size"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"Cannot tell the encoder output width of {type(model).__name__} from its config")


def encoder_input_name(model: nn.Module) -> str:
    """What the model's encoder reads: `input_ids` for text, `input_features` (Whisper, Speech2Text), `input_values`
    (wav2vec2-style speech encoders), `pixel_values` (vision encoders), `flattened_patches` (Pix2Struct)."""
    return getattr(model.get_encoder(), "main_input_name", "input_ids")


def input_embeddings(module: nn.Module | None) -> nn.Module | None:
    """A module's input embeddings: `get_input_embeddings()` where it has one, else its `embed_tokens` (FSMT)."""
    if module is None:
        return None
    if hasattr(module, "get_input_embeddings"):
        return module.get_input_embeddings()
    return getattr(module, "embed_tokens", None)


def decoder_input_embeddings(model: nn.Module) -> nn.Module:
    """The embedding layer of the model's decoder tokens."""
    embeddings = input_embeddings(model.get_decoder() if hasattr(model, "get_decoder") else None)
    if embeddings is None:
        raise ValueError(f"Cannot find the decoder's token embeddings of {type(model).__name__}")
    return embeddings


def check_shared_vocabulary(model: nn.Module) -> None:
    """Raises a `ValueError` unless the model's encoder and decoder embed the same token ids the same way."""
    encoder_embeddings = input_embeddings(model.get_encoder())
    decoder_embeddings = input_embeddings(model.get_decoder() if hasattr(model, "get_decoder") else None)
    shared = encoder_embeddings is not None and (
        encoder_embeddings is decoder_embeddings
        or (
            decoder_embeddings is not None
            and encoder_embeddings.weight.shape == decoder_embeddings.weight.shape
            and encoder_embeddings.weight.data_ptr() == decoder_embeddings.weight.data_ptr()
        )
    )
    if not shared:
        raise ValueError(
            f"InputCopyDrafter copies source token ids into the output, but {type(model).__name__} has separate "
            "source and target vocabularies (its encoder and decoder embeddings differ), so a source id means "
            "another token in the output. Use a model with a shared vocabulary, or another drafter."
        )


@contextmanager
def capture_output_projection_input(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Records what the model feeds its output projection (`get_output_embeddings()`) during the block.

    That tensor is the decoder state *after* whatever the architecture does before its logits (T5 rescales
    it by `d_model ** -0.5` when embeddings are tied), so heads built on it need no per-architecture code.

    Yields:
        A list that receives one tensor of shape `(batch_size, num_tokens, hidden_size)` per forward.
    """
    projection = model.get_output_embeddings()
    if projection is None:
        raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")
    captured: list[torch.Tensor] = []
    handle = projection.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


@contextmanager
def project_columns(model: nn.Module, columns: torch.Tensor) -> Iterator[None]:
    """Within the block, the model's output projection sees only the given decoder positions.

    Seq2seq models in transformers project every decoder position onto the vocabulary; a drafter that needs
    a few positions per row would spend most of its time there. The states are selected at the projection's
    input, after whatever the architecture does before its logits, so the logits equal those of a full pass.

    Args:
        columns (`torch.LongTensor` of shape `(batch_size, num_columns)`): positions to keep per row; the model's
            `logits` then have shape `(batch_size, num_columns, vocab_size)`.
    """
    projection = model.get_output_embeddings()
    if projection is None:
        raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")

    def select(module: nn.Module, args: tuple) -> tuple:
        states = args[0]  # (B, W, d)
        index = columns[..., None].expand(-1, -1, states.shape[-1]).to(states.device)
        return (states.gather(1, index), *args[1:])

    handle = projection.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def output_projection_logits(base_model: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """Applies the base model's output projection, and the logit bias it adds after it, to `states`.

    BART, mBART, Marian and Pegasus add a `final_logits_bias` buffer after `lm_head`; the rescaling T5 applies
    happens *before* `lm_head`, so it is already part of the captured states.

    Args:
        base_model: a transformers seq2seq model.
        states (`torch.Tensor` of shape `(..., hidden_size)`).

    Returns:
        `torch.Tensor` of shape `(..., vocab_size)`.
    """
    logits = base_model.get_output_embeddings()(states)
    final_logits_bias = getattr(base_model, "final_logits_bias", None)
    if final_logits_bias is not None:
        logits = logits + final_logits_bias.reshape(-1).to(logits.dtype)
    return logits


def shortlist_projection(base_model: nn.Module, shortlist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of the base's output projection (and its biases) for the token ids in `shortlist`.

    Returns:
        weight (`torch.Tensor` of shape `(shortlist_size, hidden_size)`) and bias (`torch.Tensor` of shape
        `(shortlist_size,)`, or `None` when the base adds none).
    """
    projection = base_model.get_output_embeddings()
    weight = projection.weight[shortlist]
    bias = None if getattr(projection, "bias", None) is None else projection.bias[shortlist]
    final_logits_bias = getattr(base_model, "final_logits_bias", None)
    if final_logits_bias is not None:
        extra = final_logits_bias.reshape(-1)[shortlist].to(weight.dtype)
        bias = extra if bias is None else bias + extra
    return weight, bias


def decoder_forward(
    model: nn.Module,
    decoder_input_ids: torch.Tensor,
    cache: EncoderDecoderCache,
    forward_kwargs: dict[str, Any],
    capture_states: bool = False,
    tree: TreeInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One cached decoder pass over `decoder_input_ids`, as `generate` runs it.

    Args:
        decoder_input_ids (`torch.LongTensor` of shape `(batch_size, width)`).
        capture_states (`bool`): also return what the model feeds its output projection.
        tree ([`TreeInputs`], *optional*): the feed is a tree of drafts: positions by depth, attention by ancestry
            (`boundary/tree.py`).

    Returns:
        logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`) and, with `capture_states`,
        states (`torch.Tensor` of shape `(batch_size, width, hidden_size)`), else `None`.
    """
    with ExitStack() as stack:
        if tree is not None:
            stack.enter_context(tree_positions(model, tree.depth))
            mask = tree_attention_mask(model, cache, cache.get_seq_length(), tree)
            forward_kwargs = {**forward_kwargs, "decoder_attention_mask": mask}
        captured = stack.enter_context(capture_output_projection_input(model)) if capture_states else None
        outputs = model(
            decoder_input_ids=decoder_input_ids, use_cache=True, return_dict=True,
            **{cache_argument(model): cache, **forward_kwargs},
        )  # fmt: skip
    if captured is None:
        return outputs.logits, None
    if not captured:
        raise ValueError(
            f"{type(model).__name__}'s get_output_embeddings() ({type(model.get_output_embeddings()).__name__}) "
            "was not called in its forward, so the decoder states it projects cannot be read"
        )
    return outputs.logits, captured[-1]

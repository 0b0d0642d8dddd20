"""Can this model verify several tokens in one cached decoder pass, exactly? Checked once per model.

Blockwise decoding relies on three things every decoder in transformers is meant to do, and a few do not:

1. take several new tokens in one forward *with* a non-empty KV cache (ProphetNet's decoder takes one);
2. give each of them the same logits as feeding them one at a time (FSMT builds no causal mask once its
   cache is non-empty, so earlier fed tokens would see later ones: a silently wrong output);
3. let the cache be cropped back to a shorter prefix and continue from there as if never extended.

[`check_decoder`] probes these on the model itself, with a handful of tiny forward passes, and raises an
[`UnsupportedModelError`] naming the model and the reason when one fails; plain `generate` still works. A decoder
that refuses a multi-token feed raises in its own modeling code (ProphetNet asserts a one-token feed); only such
exceptions count as a refusal, and anything else (a bug in `boundary/` after a transformers upgrade, say)
propagates with its traceback. Verdicts are kept per model object until [`clear_verdicts`].
The same probe tells whether decoder positions count non-pad tokens (M2M100, NLLB): then a pad inside a
multi-token feed shifts later positions, and the loop must end a row's feed after a pad.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.generation.tree import ancestry

_PROBE_LENGTH = 6  # decoder tokens per probe: start token + 5
# what a decoder's own code raises when it cannot take a multi-token feed with a cache: an assert (ProphetNet), an
# explicit refusal, or a torch op refusing the shapes the model's code built; counted only when raised there
_REFUSAL_TYPES = (AssertionError, NotImplementedError, ValueError, RuntimeError, IndexError)


class UnsupportedModelError(ValueError):
    """A model whose decoder cannot verify drafted tokens exactly; blockwise decoding refuses it."""


@dataclass(frozen=True)
class DecoderCapability:
    """What the probe found about a model that passed it.

    Attributes:
        positions_count_non_pad (`bool`): decoder positions are numbered by counting non-pad tokens, so a pad
            must end a row's feed.
    """

    positions_count_non_pad: bool


# the verdict of each probed model (weakly keyed: it goes with the model); [`clear_verdicts`] empties it
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, DecoderCapability | UnsupportedModelError] = weakref.WeakKeyDictionary()
# whether each model probed for trees takes them: `None`, or why not
_TREE_VERDICTS: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()


def check_decoder(model: nn.Module) -> DecoderCapability:
    """Probes `model` (once; the verdict is kept per model object until [`clear_verdicts`]) and returns what it
    found. An exception of the probe that is not the model's own refusal propagates and is not kept.

    Raises:
        UnsupportedModelError: the model cannot verify several tokens in one cached pass exactly.
    """
    verdict = _VERDICTS.get(model)
    if verdict is None:
        try:
            verdict = _probe(model)
        except UnsupportedModelError as error:
            verdict = error
        _VERDICTS[model] = verdict
    if isinstance(verdict, UnsupportedModelError):
        raise verdict
    return verdict


def clear_verdicts(model: nn.Module | None = None) -> None:
    """Forgets the verdict kept for `model` (every model's with `None`): the next [`check_decoder`] probes again,
    e.g. after changing the model's config or upgrading transformers in a running process."""
    if model is None:
        _VERDICTS.clear()
        _TREE_VERDICTS.clear()
    else:
        _VERDICTS.pop(model, None)
        _TREE_VERDICTS.pop(model, None)


def check_tree_decoder(model: nn.Module, capability: DecoderCapability) -> None:
    """Raises an [`UnsupportedModelError`] naming the reason when `model`, which passed [`check_decoder`], cannot
    verify a tree of drafts in one pass (`generation/tree.py`); probed once per model, only for drafters of trees."""
    if model not in _TREE_VERDICTS:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                _TREE_VERDICTS[model] = _tree_refusal(model, capability.positions_count_non_pad)
        finally:
            model.train(was_training)
    refusal = _TREE_VERDICTS[model]
    if refusal is not None:
        raise _refuse(model, f"tree drafts: {refusal}; draft chains instead (tree_nodes=None)")


def check_verification_width(model: nn.Module, block_size: int) -> None:
    """Raises an [`UnsupportedModelError`] when a feed of `block_size` tokens per row would be computed
    differently from one-token steps (mixture-of-experts decoders that drop tokens beyond a capacity)."""
    limit = hf.expert_capacity_limit(model)
    if limit is not None and block_size > limit[0]:
        raise _refuse(
            model, f"{limit[1]}, and a verification pass feeds up to {block_size} tokens per row; use a drafter "
            f"with block_size <= {limit[0]}" if limit[0] > 1 else limit[1]
        )  # fmt: skip


def _refuse(model: nn.Module, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"hf_blockwise cannot decode {type(model).__name__} ({hf.model_name(model)}) exactly: {reason}. "
        "Its plain greedy generate (assistant=None, or the model's own generate) still works."
    )


def _close(reference: torch.Tensor, other: torch.Tensor, quantized: bool) -> bool:
    """Equal up to the rounding of batched matrix products in the logits' dtype, or of int8 products: a row's int8
    scale rounds last-bit differences of its float input (another attention kernel at another width) into whole
    quantization steps (measured: 5e-3 of the largest logit on marian-base-en-de), where a missing causal mask
    changes logits by their own size."""
    full_precision = reference.dtype == torch.float32 or reference.dtype == torch.float64
    relative = 1e-3 if full_precision and not quantized else 5e-2
    return bool((reference.float() - other.float()).abs().max() <= relative * (1 + reference.float().abs().max()))


def has_int8_weights(model: nn.Module) -> bool:
    """Whether some product of `model` runs on int8 weights (`quantize_dynamic_int8`'s layers keep them as buffers)."""
    return any(buffer.dtype == torch.int8 for buffer in model.buffers())


def _probe(model: nn.Module) -> DecoderCapability:
    # in eval mode: dropout would make the two ways of feeding differ, and the verdict is kept for the model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _probe_in_eval_mode(model)
    finally:
        model.train(was_training)


def _probe_in_eval_mode(model: nn.Module) -> DecoderCapability:
    inputs = hf.probe_inputs(model, _PROBE_LENGTH)  # encoder inputs and decoder tokens, batch of 2
    try:
        plain = _compare_feeds(model, inputs, inputs.decoder_tokens)
    except _REFUSAL_TYPES as error:
        if not _raised_by_model_code(model, error.__traceback__):
            raise
        raise _refuse(
            model, f"its decoder fails when fed several tokens with a non-empty cache ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from error  # fmt: skip
    if plain == "multi":
        raise _refuse(
            model, "feeding several tokens in one cached pass gives other logits than feeding them one at a "
            "time (e.g. no causal mask over the fed tokens once the cache is non-empty)"
        )  # fmt: skip
    if plain == "crop":
        raise _refuse(model, "its KV cache cannot be cropped back to a shorter prefix exactly")
    if inputs.pad_token_id is None:
        return DecoderCapability(positions_count_non_pad=False)
    with_pad = inputs.decoder_tokens.clone()
    with_pad[:, 2] = inputs.pad_token_id
    return DecoderCapability(positions_count_non_pad=_compare_feeds(model, inputs, with_pad) is not None)


def _tree_refusal(model: nn.Module, counts_non_pad: bool) -> str | None:
    """Why the decoder cannot take a tree feed, or `None` when a probe tree gives every node a chain's logits.

    After the start token, the tree feeds t1, then a branch x and t2 both after t1, then t3 after t2: t2 and t3 must
    get the logits of the chain t1 t2 t3 (positions by depth, and t2 must not see x), x those of the chain t1 x.
    """
    if counts_non_pad:
        return "its decoder positions count non-pad tokens, so a pad in one branch would move the others"
    reason = hf.tree_support(model)
    if reason is not None:
        return reason
    inputs = hf.probe_inputs(model, _PROBE_LENGTH)
    try:
        return _probe_tree(model, inputs)
    except _REFUSAL_TYPES as error:
        if not _raised_by_model_code(model, error.__traceback__):
            raise
        first_line = str(error).splitlines()[0] if str(error) else ""
        return f"its decoder fails on a tree feed ({type(error).__name__}: {first_line})"


def _probe_tree(model: nn.Module, inputs: hf.ProbeInputs) -> str | None:
    """[`_tree_refusal`]'s probe: `None` when the tree's logits are the chains'."""
    tokens = inputs.decoder_tokens  # (2, T)
    branch = tokens[:, 4:5]
    chain = _fed_after_start(model, inputs, tokens[:, 1:4])  # (2, 3, V): t1 t2 t3
    side = _fed_after_start(model, inputs, torch.cat([tokens[:, 1:2], branch], dim=1))[:, 1:]  # (2, 1, V): x
    parents = torch.tensor([[-1, 0, 0, 2]], device=tokens.device).expand(tokens.shape[0], -1)
    ancestors = ancestry(parents)
    tree = hf.TreeInputs(depth=ancestors.sum(dim=2) - 1, ancestors=ancestors)
    feed = torch.cat([tokens[:, 1:2], branch, tokens[:, 2:4]], dim=1)
    cache = hf.new_decoder_cache()
    hf.decoder_forward(model, tokens[:, :1], cache, inputs.forward_kwargs)
    logits = hf.decoder_forward(model, feed, cache, inputs.forward_kwargs, tree=tree)[0]  # (2, 4, V)
    expected = torch.cat([chain[:, :1], side, chain[:, 1:]], dim=1)
    if not _close(expected, logits, has_int8_weights(model)):
        return "a probe tree's nodes got other logits than the same tokens fed as chains"
    return None


def _fed_after_start(model: nn.Module, inputs: hf.ProbeInputs, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of `tokens` fed as one chain after the probe's start token."""
    cache = hf.new_decoder_cache()
    hf.decoder_forward(model, inputs.decoder_tokens[:, :1], cache, inputs.forward_kwargs)
    return hf.decoder_forward(model, tokens, cache, inputs.forward_kwargs)[0]


def _raised_by_model_code(model: nn.Module, trace: TracebackType | None) -> bool:
    """Whether the innermost frame of `trace` outside torch runs the code of one of `model`'s module classes
    (its modeling files: `transformers.models.<arch>.modeling_<arch>`), not ours, transformers' generic code or
    anything else."""
    modeling = {type(module).__module__ for module in model.modules()}
    innermost = None
    while trace is not None:
        name = trace.tb_frame.f_globals.get("__name__", "")
        if name != "torch" and not name.startswith("torch."):
            innermost = name
        trace = trace.tb_next
    return innermost in modeling


def _compare_feeds(model: nn.Module, inputs: hf.ProbeInputs, tokens: torch.Tensor) -> str | None:
    """Feeds `tokens` one at a time, then (after the first) all at once, then crops two and feeds them again.

    Returns:
        `None` when all agree, `"multi"` when the multi-token pass differs, `"crop"` when the re-fed pass after
        cropping does.
    """
    one_at_a_time = hf.new_decoder_cache()
    reference = torch.cat(
        [
            hf.decoder_forward(model, tokens[:, i : i + 1], one_at_a_time, inputs.forward_kwargs)[0]
            for i in range(tokens.shape[1])
        ],
        dim=1,
    )  # (2, T, V)
    cache = hf.new_decoder_cache()
    hf.decoder_forward(model, tokens[:, :1], cache, inputs.forward_kwargs)
    together = hf.decoder_forward(model, tokens[:, 1:], cache, inputs.forward_kwargs)[0]  # (2, T-1, V)
    quantized = has_int8_weights(model)
    if not _close(reference[:, 1:], together, quantized):
        return "multi"
    hf.crop_cache(cache, tokens.shape[1] - 2)
    again = hf.decoder_forward(model, tokens[:, -2:], cache, inputs.forward_kwargs)[0]  # (2, 2, V)
    if not _close(reference[:, -2:], again, quantized):
        return "crop"
    return None

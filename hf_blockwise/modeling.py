"""`BlockwiseHeadsModel`: any transformers seq2seq model plus k − 1 proposal heads, saved like an adapter."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel
from transformers.utils import ModelOutput, cached_file

from . import _hf_generation as hf
from .config import CONFIG_NAME, BlockwiseConfig
from .decoding import blockwise_generate
from .drafters import Drafter, HeadsDrafter
from .heads import BlockwiseHeads, output_projection_logits
from .serialization import atomic_write

WEIGHTS_NAME = "blockwise_heads.safetensors"

# `generate(assistant=...)` default: draft with this model's own heads. `assistant=None` means plain greedy.
_OWN_HEADS = object()


@dataclass
class BlockwiseHeadsOutput(ModelOutput):
    """Output of [`BlockwiseHeadsModel.forward`].

    Attributes:
        loss (`torch.FloatTensor` of shape `()`, *optional*): mean cross-entropy of the heads, with `labels`.
        base_loss (`torch.FloatTensor` of shape `()`, *optional*): the base model's own loss, with `labels`.
        head_losses (`torch.FloatTensor` of shape `(num_heads,)`, *optional*): cross-entropy of each head.
        logits (`torch.FloatTensor` of shape `(batch_size, target_length, vocab_size)`): the base model's p1.
        head_logits (`torch.FloatTensor` of shape `(batch_size, target_length, num_heads, vocab_size)`):
            head i at position t predicts the target token at position t + i + 1.
    """

    loss: torch.Tensor | None = None
    base_loss: torch.Tensor | None = None
    head_losses: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    head_logits: torch.Tensor | None = None


def decoder_ffn_width(config: Any) -> int:
    """The base decoder's feed-forward width, read from the standard transformers config attributes."""
    for name in ("decoder_ffn_dim", "d_ff", "ffn_dim", "intermediate_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"Cannot tell the decoder feed-forward width of a {type(config).__name__}; set "
        "BlockwiseConfig(head_hidden_size=...) explicitly"
    )


def base_signature(base_model: nn.Module) -> dict[str, Any]:
    """What heads must agree with: model type, width of the projected states, vocabulary size."""
    projection = base_model.get_output_embeddings()
    if projection is None or not hasattr(projection, "weight"):
        raise ValueError(f"{type(base_model).__name__} has no output projection to attach proposal heads to")
    vocab_size, hidden_size = projection.weight.shape
    return {
        "base_model_type": base_model.config.model_type,
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
    }


def check_heads_fit(config: BlockwiseConfig, base_model: nn.Module) -> None:
    """Raises a `ValueError` naming both sides when heads were made for a different kind of base."""
    actual = base_signature(base_model)
    mismatches = [
        f"{key}: heads expect {getattr(config, key)!r}, base has {value!r}"
        for key, value in actual.items()
        if getattr(config, key) is not None and getattr(config, key) != value
    ]
    if mismatches:
        raise ValueError(
            f"These proposal heads (made for base {config.base_model_name_or_path!r}) do not fit the base model "
            f"{getattr(base_model, 'name_or_path', '') or type(base_model).__name__!r}: " + "; ".join(mismatches)
        )


class BlockwiseHeadsModel(nn.Module):
    """A transformers seq2seq model wrapped, not forked, with k − 1 proposal heads (Stern et al. 2018).

    The base model is held unchanged; its next-token distribution p1 is used as is, so with a frozen base and
    exact acceptance `generate` returns exactly the base model's greedy output, only with fewer decoder calls.

    Args:
        base_model ([`PreTrainedModel`]): any `AutoModelForSeq2SeqLM` (T5, mT5, BART, mBART, Marian, Pegasus,
            M2M100/NLLB, ...).
        config ([`BlockwiseConfig`], *optional*): head settings; base-specific fields are filled in here.

    Example:

    ```python
    >>> from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    >>> from hf_blockwise import BlockwiseConfig, BlockwiseHeadsModel
    >>> base = AutoModelForSeq2SeqLM.from_pretrained("Helsinki-NLP/opus-mt-en-de")
    >>> model = BlockwiseHeadsModel(base, BlockwiseConfig(block_size=4))
    >>> out = model.generate(**tokenizer(["A dog runs."], return_tensors="pt"), max_new_tokens=64)
    ```
    """

    def __init__(self, base_model: PreTrainedModel, config: BlockwiseConfig | None = None) -> None:
        super().__init__()
        hf.encoder_decoder_only(base_model)
        config = BlockwiseConfig() if config is None else config
        check_heads_fit(config, base_model)
        signature = base_signature(base_model)
        self.blockwise_config = BlockwiseConfig.from_dict(
            {
                **config.to_dict(),
                **signature,
                "head_hidden_size": config.head_hidden_size or decoder_ffn_width(base_model.config),
                "base_model_name_or_path": config.base_model_name_or_path
                or getattr(base_model, "name_or_path", None)
                or None,
            }
        )
        self.base_model = base_model
        projection = base_model.get_output_embeddings().weight
        self.heads = BlockwiseHeads(
            signature["hidden_size"], self.blockwise_config.head_hidden_size, self.blockwise_config.num_heads
        )
        self.heads.to(device=projection.device, dtype=projection.dtype)

    @property
    def config(self):
        """The base model's config, as for PEFT's `PeftModel`; the heads' own is `blockwise_config`."""
        return self.base_model.config

    @property
    def device(self) -> torch.device:
        return self.base_model.device

    @property
    def generation_config(self):
        return self.base_model.generation_config

    def drafter(self) -> Drafter:
        """The [`HeadsDrafter`] that proposes tokens with this model's heads."""
        return HeadsDrafter(self)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BlockwiseHeadsOutput:
        """Teacher-forced pass of base and heads; with `labels`, the heads' cross-entropy (Stern §6).

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`).
            labels (`torch.LongTensor` of shape `(batch_size, target_length)`): -100 marks ignored positions.
        """
        with hf.capture_output_projection_input(self.base_model) as captured:
            outputs = self.base_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                labels=labels,
                return_dict=True,
                **kwargs,
            )
        head_logits = output_projection_logits(self.base_model, self.heads(captured[-1]))  # (B, T, k-1, V)
        loss = head_losses = None
        if labels is not None:
            head_losses = heads_cross_entropy(head_logits, labels)
            loss = head_losses.mean()
        return BlockwiseHeadsOutput(
            loss=loss,
            base_loss=outputs.loss,
            head_losses=head_losses,
            logits=outputs.logits,
            head_logits=head_logits,
        )

    @torch.no_grad()
    def generate(self, *args: Any, assistant: Any = _OWN_HEADS, acceptance: Any = None, **kwargs: Any):
        """The base model's `generate`, decoded blockwise with this model's heads.

        Takes every argument of transformers' `generate`. `assistant=None` runs the base model's own greedy
        `generate`; another [`Drafter`] replaces the heads. See [`blockwise_generate`] for the return value.
        """
        _check_batch_not_empty(args, kwargs)
        if assistant is None:
            return self.base_model.generate(*args, **kwargs)
        drafter = self.drafter() if assistant is _OWN_HEADS else assistant
        return self.base_model.generate(
            *args, custom_generate=blockwise_generate, assistant=drafter, acceptance=acceptance, **kwargs
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        base_model_name_or_path: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Writes `blockwise_config.json` and `blockwise_heads.safetensors` (head weights only), atomically.

        Args:
            save_directory: where to write.
            base_model_name_or_path (`str`, *optional*): base to record instead of the current one, e.g. `"."`
                when the base is saved into the same directory.
            dtype (`torch.dtype`, *optional*): store the head weights in this dtype (e.g. `torch.float16`).
        """
        os.makedirs(save_directory, exist_ok=True)
        tensors = {
            name: tensor.detach().to(dtype or tensor.dtype).contiguous().cpu()
            for name, tensor in self.heads.state_dict().items()
        }
        block_size = str(self.blockwise_config.block_size)
        atomic_write(
            os.path.join(save_directory, WEIGHTS_NAME),
            lambda path: save_file(tensors, path, metadata={"format": "pt", "block_size": block_size}),
        )
        config = self.blockwise_config
        if base_model_name_or_path is not None:
            config = dataclasses.replace(config, base_model_name_or_path=base_model_name_or_path)
        config.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(
        cls,
        heads_name_or_path: str | os.PathLike,
        base_model: PreTrainedModel | None = None,
        **base_model_kwargs: Any,
    ) -> BlockwiseHeadsModel:
        """Loads heads saved by [`save_pretrained`] and attaches them to a base model.

        Args:
            heads_name_or_path: local directory or hub repository holding the heads.
            base_model: the base to attach them to; by default the checkpoint named in the heads' config is
                loaded with `AutoModelForSeq2SeqLM.from_pretrained(name, **base_model_kwargs)`; a relative
                name is first looked up inside the heads directory.
        """
        config = BlockwiseConfig.from_json_file(_resolve(heads_name_or_path, CONFIG_NAME))
        if base_model is None:
            if config.base_model_name_or_path is None:
                raise ValueError(
                    f"{heads_name_or_path} names no base checkpoint (base_model_name_or_path is null); pass "
                    "base_model= explicitly"
                )
            base_model = AutoModelForSeq2SeqLM.from_pretrained(
                _base_location(heads_name_or_path, config.base_model_name_or_path), **base_model_kwargs
            )
        model = cls(base_model, config)
        model.heads.load_state_dict(_load_head_weights(_resolve(heads_name_or_path, WEIGHTS_NAME), model.heads))
        return model


def aligned_head_targets(head_logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs each head's logits with the labels it predicts: head i at position t predicts label t + i + 1.

    Args:
        head_logits (`torch.FloatTensor` of shape `(batch_size, target_length, num_heads, vocab_size)`).
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`), -100 where ignored.

    Returns:
        For head i: logits of shape `(batch_size, target_length - i - 1, vocab_size)` and labels of shape
        `(batch_size, target_length - i - 1)`.
    """
    length = labels.shape[1]
    return [(head_logits[:, : length - head - 1, head], labels[:, head + 1 :]) for head in range(head_logits.shape[2])]


def heads_cross_entropy(head_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each head against the labels it predicts, shape `(num_heads,)`."""
    losses = [
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        for logits, targets in aligned_head_targets(head_logits, labels)
    ]
    return torch.stack(losses)


def _base_location(heads_name_or_path: str | os.PathLike, base_name_or_path: str) -> str:
    """A relative base path is looked up beside the heads first, so a directory holding both (e.g. with
    `base_model_name_or_path="."`) can be moved or shipped as one piece."""
    beside_heads = os.path.join(heads_name_or_path, base_name_or_path)
    if not os.path.isabs(base_name_or_path) and os.path.isfile(os.path.join(beside_heads, "config.json")):
        return beside_heads
    return base_name_or_path


def _check_batch_not_empty(args: tuple, kwargs: dict[str, Any]) -> None:
    # The encoder would fail on an empty batch with an obscure reshape error before decoding starts.
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if isinstance(inputs, torch.Tensor) and inputs.shape[0] == 0:
        raise ValueError("generate was called with an empty batch (batch size 0)")


def _resolve(name_or_path: str | os.PathLike, filename: str) -> str:
    path = os.path.join(name_or_path, filename)
    if os.path.isdir(name_or_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{name_or_path} holds no {filename}; is it a directory written by save_pretrained?"
            )
        return path
    resolved = cached_file(str(name_or_path), filename)
    if resolved is None:
        raise FileNotFoundError(f"{name_or_path} holds no {filename}")
    return resolved


def _load_head_weights(path: str, heads: BlockwiseHeads) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"Cannot read head weights from {path}: {error}. The file is corrupt or truncated") from error
    expected = {name: tuple(tensor.shape) for name, tensor in heads.state_dict().items()}
    found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if found != expected:
        raise ValueError(f"Head weights in {path} do not match the config: expected {expected}, found {found}")
    return tensors

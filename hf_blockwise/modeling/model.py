"""`BlockwiseHeadsModel`: any transformers seq2seq model plus k − 1 proposal heads, saved like an adapter."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from hf_blockwise import boundary as hf
from hf_blockwise.boundary import (
    BaseModelWrapper,
    decoder_ffn_width,
    has_file,
    output_projection_logits,
    resolve_file,
    shortlist_projection,
)
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.drafters.heads import HeadsDrafter
from hf_blockwise.modeling.adapter import AdapterModelMixin, check_base_signature
from hf_blockwise.modeling.config import BlockwiseHeadsConfig
from hf_blockwise.modeling.heads import BlockwiseHeads, SequentialHeads
from hf_blockwise.modeling.shortlist import shortlist_ids
from hf_blockwise.quantization import warn_if_int8_base
from hf_blockwise.serialization import load_adapter_weights, read_adapter_weights, save_adapter

WEIGHTS_NAME = "blockwise_heads.safetensors"
# PEFT's own file names: a LoRA adapter on the base is stored beside the heads exactly as PEFT stores it.
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class BlockwiseHeadsOutput(ModelOutput):
    """Output of [`BlockwiseHeadsModel.forward`].

    Attributes:
        loss (`torch.FloatTensor` of shape `()`, *optional*): mean cross-entropy of the heads, with `labels`.
        base_loss (`torch.FloatTensor` of shape `()`, *optional*): the base model's own loss, with `labels`.
        head_losses (`torch.FloatTensor` of shape `(num_heads,)`, *optional*): cross-entropy of each head.
        head_accuracies (`torch.FloatTensor` of shape `(num_heads,)`, *optional*): top-1 accuracy of each head.
        logits (`torch.FloatTensor` of shape `(batch_size, target_length, vocab_size)`): the base model's p1.
        head_logits (`torch.FloatTensor` of shape `(batch_size, target_length, num_heads, vocab_size)`, *optional*):
            head i at position t predicts the target token at position t + i + 1. Computed only without `labels`:
            with them, each head is projected at its labelled positions only.
    """

    loss: torch.Tensor | None = None
    base_loss: torch.Tensor | None = None
    head_losses: torch.Tensor | None = None
    head_accuracies: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    head_logits: torch.Tensor | None = None


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


def check_heads_fit(config: BlockwiseHeadsConfig, base_model: nn.Module) -> None:
    """Raises a `ValueError` naming both sides when heads were made for a different kind of base."""
    check_base_signature(
        config,
        base_signature(base_model),
        "heads expect",
        f"These proposal heads (made for base {config.base_model_name_or_path!r}) do not fit the base model "
        f"{getattr(base_model, 'name_or_path', '') or type(base_model).__name__!r}",
    )


class BlockwiseHeadsModel(AdapterModelMixin, BaseModelWrapper):
    """A transformers seq2seq model wrapped, not forked, with k − 1 proposal heads (Stern et al. 2018).

    The base model is held unchanged; its next-token distribution p1 is used as is, so with a frozen base and
    exact acceptance `generate` returns exactly the base model's greedy output, only with fewer decoder calls.

    Args:
        base_model ([`PreTrainedModel`]): any `AutoModelForSeq2SeqLM` (T5, mT5, BART, mBART, Marian, Pegasus,
            M2M100/NLLB, ...).
        config ([`BlockwiseHeadsConfig`], *optional*): head settings; base-specific fields are filled in here.

    Example:

    ```python
    >>> from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    >>> from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel
    >>> base = AutoModelForSeq2SeqLM.from_pretrained("Helsinki-NLP/opus-mt-en-de")
    >>> model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4))
    >>> out = model.generate(**tokenizer(["A dog runs."], return_tensors="pt"), max_new_tokens=64)
    ```
    """

    config_class = BlockwiseHeadsConfig
    adapter_name = "proposal heads"
    check_fits = staticmethod(check_heads_fit)

    def __init__(self, base_model: PreTrainedModel, config: BlockwiseHeadsConfig | None = None) -> None:
        super().__init__()
        self.blockwise_config = self.filled_config(base_model, config)
        self.base_model = base_model
        projection = base_model.get_output_embeddings().weight
        token_embedding_size = None
        if self.blockwise_config.condition_on_token or self.blockwise_config.sequential:
            token_embedding_size = hf.decoder_input_embeddings(base_model).weight.shape[1]
        self.heads: BlockwiseHeads | SequentialHeads
        if self.blockwise_config.sequential:
            self.heads = SequentialHeads(
                self.blockwise_config.hidden_size,
                self.blockwise_config.head_hidden_size,
                self.blockwise_config.num_heads,
                token_embedding_size,
                self.blockwise_config.shortlist_size,
            )
        else:
            self.heads = BlockwiseHeads(
                self.blockwise_config.hidden_size,
                self.blockwise_config.head_hidden_size,
                self.blockwise_config.num_heads,
                self.blockwise_config.shortlist_size,
                token_embedding_size,
            )
        self.heads.to(device=projection.device, dtype=projection.dtype)

    @staticmethod
    def base_fields(config: BlockwiseHeadsConfig, base_model: nn.Module) -> dict[str, Any]:
        """The base's signature ([`base_signature`]) and the heads' width, by default the decoder's feed-forward
        width."""
        decoder_config = hf.decoder_config(base_model.config)
        return {
            **base_signature(base_model),
            "head_hidden_size": config.head_hidden_size or decoder_ffn_width(decoder_config),
        }

    def chosen_token_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """What token-conditioned heads read besides the state: the base decoder's input embedding of the token
        chosen from that state (`None` for heads that read the state only).

        Args:
            token_ids (`torch.LongTensor` of shape `(...)`): the chosen tokens.

        Returns:
            `torch.Tensor` of shape `(..., embedding_size)`, or `None`.
        """
        if not (self.blockwise_config.condition_on_token or self.blockwise_config.sequential):
            return None
        return hf.decoder_input_embeddings(self.base_model)(token_ids)

    def drafter(
        self,
        block_size: int | None = None,
        use_shortlist: bool = True,
        tree_nodes: int | None = None,
        tree_branching: int = 2,
    ) -> Drafter:
        """The [`HeadsDrafter`] that proposes tokens with this model's heads (the first `block_size - 1`): a chain, or
        with `tree_nodes` a tree of each head's `tree_branching` best (Medusa's trees, selected by confidence)."""
        return HeadsDrafter(self, block_size, use_shortlist, tree_nodes=tree_nodes, tree_branching=tree_branching)

    def set_shortlist(self, token_ids: Sequence[int] | torch.Tensor | None) -> None:
        """Restricts the heads' proposals to `token_ids` (e.g. [`frequent_tokens`] of the training targets).

        Drafting then projects the head states onto these rows of the output projection only, which is most of
        a drafting step's cost on a large vocabulary. Verification still uses the whole vocabulary, so exact
        decoding stays exact; only proposals of tokens outside the shortlist are lost. `None` removes it.
        The shortlist is saved with the heads.
        """
        if token_ids is None:
            self.heads.shortlist = None
            self.blockwise_config = dataclasses.replace(self.blockwise_config, shortlist_size=None)
            return
        ids = shortlist_ids(token_ids, self.blockwise_config.vocab_size)
        self.heads.register_buffer("shortlist", ids.to(self.base_model.get_output_embeddings().weight.device))
        self.blockwise_config = dataclasses.replace(self.blockwise_config, shortlist_size=int(ids.numel()))

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
            input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`): the source.
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
        # the token the base picks from each state: at inference, the last verified token (greedy's choice)
        chosen_ids = outputs.logits.detach().argmax(dim=-1)  # (B, T)
        if self.blockwise_config.sequential:
            head_states = self.heads(captured[-1], self._sequential_inputs(chosen_ids, labels))  # (B, T, k-1, d)
        else:
            chosen = self.chosen_token_embeddings(chosen_ids)  # (B, T, e) or None
            head_states = self.heads(captured[-1], token_embeddings=chosen)  # (B, T, k-1, d)
        if labels is None:
            head_logits = output_projection_logits(self.base_model, head_states)  # (B, T, k-1, V)
            return BlockwiseHeadsOutput(logits=outputs.logits, head_logits=head_logits)
        head_losses, head_accuracies = heads_cross_entropy(self.base_model, head_states, labels, self.heads.shortlist)
        return BlockwiseHeadsOutput(
            loss=head_losses.mean(),
            base_loss=outputs.loss,
            head_losses=head_losses,
            head_accuracies=head_accuracies,
            logits=outputs.logits,
        )

    def _sequential_inputs(self, chosen_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Teacher-forced inputs of sequential heads: at position t, the embeddings of t_0 (the base's choice at
        t) and of the tokens after it, t_j = label t + j (what the earlier heads should have drafted).

        Returns:
            `torch.Tensor` of shape `(batch_size, target_length, num_heads, embedding_size)`.
        """
        if labels is None:
            raise ValueError("Sequential heads are trained teacher-forced and need labels")
        length = labels.shape[1]
        tokens = [chosen_ids]
        for offset in range(1, self.blockwise_config.num_heads):
            shifted = labels[:, offset:].clamp(min=0)  # (B, T - offset)
            tokens.append(
                torch.cat([shifted, shifted.new_zeros(labels.shape[0], min(offset, length))], dim=1)[:, :length]
            )
        return hf.decoder_input_embeddings(self.base_model)(torch.stack(tokens, dim=2))

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        base_model_name_or_path: str | None = None,
        dtype: torch.dtype | None = None,
        include_base: bool = False,
    ) -> None:
        """Writes `blockwise_config.json` and `blockwise_heads.safetensors` (head weights only), atomically
        ([`save_adapter`]).

        When the base carries a PEFT adapter (LoRA training), the adapter is written beside the heads in PEFT's
        format (`adapter_config.json`, `adapter_model.safetensors`) and the config names the underlying base.

        Args:
            save_directory: where to write.
            base_model_name_or_path (`str`, *optional*): base to record instead of the current one.
            dtype (`torch.dtype`, *optional*): store the head weights in this dtype (e.g. `torch.float16`).
            include_base (`bool`, defaults to `False`): also write the base, in transformers' format, into the
                same directory and record it as `"."` (unless `base_model_name_or_path` says otherwise), with the
                fingerprint of its weights as they are now, so that the directory loads as one piece (a checkpoint
                of full fine-tuning).
        """
        if not include_base:
            warn_if_int8_base(self, "proposal heads")
        config = self.blockwise_config
        if include_base and base_model_name_or_path is None:
            base_model_name_or_path = "."
        if base_model_name_or_path is not None:
            config = dataclasses.replace(config, base_model_name_or_path=base_model_name_or_path)
        if include_base:  # the base saved beside the heads may have been trained since they were attached
            config = dataclasses.replace(config, base_fingerprint=hf.base_weights_fingerprint(self.base_model))
        # PEFT's `save_pretrained` writes only the adapter of a PEFT model, transformers' the whole model
        write_beside = [self.base_model.save_pretrained] if include_base or _is_peft_model(self.base_model) else []
        save_adapter(
            save_directory, config, WEIGHTS_NAME, self.heads.state_dict(), dtype,
            metadata={"format": "pt", "block_size": str(config.block_size)}, write_beside=write_beside,
        )  # fmt: skip

    def load_weights(self, heads_name_or_path: str | os.PathLike, include_base: bool = False) -> None:
        """Loads into this model, checked, the weights [`save_pretrained`] wrote: the heads, and the LoRA adapter
        when the base is a PEFT model (as during LoRA training); with `include_base`, the base saved beside them.

        Raises:
            ValueError: when a file is corrupt, or holds missing, unexpected or misshaped tensors (the message
                names the file).
        """
        load_adapter_weights(resolve_file(heads_name_or_path, WEIGHTS_NAME), self.heads, "Head")
        if _is_peft_model(self.base_model):
            _load_lora_weights(self.base_model, resolve_file(heads_name_or_path, ADAPTER_WEIGHTS_NAME))
        if include_base:
            self.base_model.load_state_dict(hf.load_encoder_decoder(heads_name_or_path).state_dict())

    @classmethod
    def attachable_base(cls, name_or_path: str | os.PathLike, base_model: nn.Module) -> nn.Module:
        """A PEFT adapter saved beside the heads (LoRA training) is loaded onto the base and merged, so decoding is
        exact with respect to the merged model; the base as given otherwise."""
        if not has_file(name_or_path, ADAPTER_CONFIG_NAME):
            return base_model
        from peft import PeftModel

        return PeftModel.from_pretrained(base_model, str(name_or_path)).merge_and_unload()


def heads_cross_entropy(
    base_model: nn.Module, head_states: torch.Tensor, labels: torch.Tensor, shortlist: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and top-1 accuracy of each head against the labels it predicts (Stern §6).

    Head i at position t predicts label t + i + 1. Each head is projected onto the vocabulary only at the
    positions whose label exists: the (tokens x vocabulary) logits dominate training memory, and padding and
    the last i + 1 positions of every row would otherwise be projected for nothing.

    With a `shortlist`, heads are scored as they draft: over the shortlist's rows of the output projection only
    (on a 16k vocabulary and 2,000 tokens, an eighth of the projection, which was most of a step with 7 heads). A
    label outside it adds no loss (no head can draft it) and counts as a miss in the accuracy.

    Args:
        head_states (`torch.FloatTensor` of shape `(batch_size, target_length, num_heads, hidden_size)`).
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`), -100 where ignored.
        shortlist (`torch.LongTensor` of shape `(shortlist_size,)`, *optional*): the token ids heads draft from.

    Returns:
        losses, accuracies: `torch.FloatTensor`s of shape `(num_heads,)`; accuracies carry no gradient.
    """
    length = labels.shape[1]
    projection, index = None, None
    if shortlist is not None:
        projection = shortlist_projection(base_model, shortlist)  # (S, d), (S,) or None
        vocab_size = base_model.get_output_embeddings().weight.shape[0]
        index = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
        index[shortlist] = torch.arange(shortlist.shape[0], device=labels.device)  # token id -> shortlist slot
    losses, accuracies = [], []
    for head in range(head_states.shape[2]):
        targets = labels[:, head + 1 :]  # (B, T-i-1)
        valid = targets != -100
        targets = targets[valid]  # (N,)
        if index is not None:
            targets = index[targets]  # shortlist slots, -1 outside it
        scored = targets >= 0
        if not bool(scored.any()):  # no label this head can draft: no signal, but keep the graph connected
            losses.append(head_states.sum() * 0.0)
            accuracies.append(torch.zeros((), device=labels.device))
            continue
        states = head_states[:, : length - head - 1, head][valid]  # (N, d)
        if projection is None:
            logits = output_projection_logits(base_model, states)  # (N, V)
        else:
            logits = nn.functional.linear(states, *projection)  # (N, S)
        losses.append(nn.functional.cross_entropy(logits[scored].float(), targets[scored]))
        accuracies.append((logits.detach().argmax(dim=-1) == targets).float().mean())
    return torch.stack(losses), torch.stack(accuracies)


def _is_peft_model(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _load_lora_weights(peft_model: nn.Module, path: str) -> None:
    """Loads a LoRA adapter saved in PEFT's format into the PEFT model it was saved from, checked."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    set_peft_model_state_dict(peft_model, read_adapter_weights(path, get_peft_model_state_dict(peft_model), "LoRA"))

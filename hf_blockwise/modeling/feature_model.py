"""`FeatureDrafterModel`: a seq2seq base plus a feature-level drafter (EAGLE-style), saved like an adapter."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from hf_blockwise import boundary as hf
from hf_blockwise.boundary import BaseModelWrapper, output_projection_logits, resolve_file
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.drafters.feature_block import AttentionMemory
from hf_blockwise.modeling.adapter import AdapterModelMixin, check_base_signature
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_layer import FeatureDrafterLayer, unrolled_mask
from hf_blockwise.modeling.shortlist import shortlist_ids
from hf_blockwise.quantization import warn_if_int8_base
from hf_blockwise.serialization import load_adapter_weights, save_adapter

FEATURE_DRAFTER_WEIGHTS_NAME = "feature_drafter.safetensors"


@dataclass
class FeatureDrafterOutput(ModelOutput):
    """Output of [`FeatureDrafterModel.forward`] with labels.

    Attributes:
        feature_losses (`torch.FloatTensor` of shape `(depth,)`): per unrolled drafting step, the smooth-L1
            distance of the predicted state to the base's, both divided by the base state's RMS.
        token_losses (`torch.FloatTensor` of shape `(depth,)`): per step, cross-entropy of the projected
            prediction against the base's greedy token.
        token_accuracies (`torch.FloatTensor` of shape `(depth,)`): per step, top-1 agreement with the base's
            greedy token (teacher-forced acceptance rate of the i-th draft); no gradient.
    """

    feature_losses: torch.Tensor | None = None
    token_losses: torch.Tensor | None = None
    token_accuracies: torch.Tensor | None = None


def drafter_signature(base_model: nn.Module) -> dict[str, Any]:
    """What a feature drafter must agree with: model type and the widths it reads and writes."""
    projection = base_model.get_output_embeddings()
    vocab_size, hidden_size = projection.weight.shape
    return {
        "base_model_type": base_model.config.model_type,
        "hidden_size": hidden_size,
        "embedding_size": hf.decoder_input_embeddings(base_model).weight.shape[1],
        "encoder_hidden_size": hf.encoder_hidden_size(base_model),
        "vocab_size": vocab_size,
    }


def check_drafter_fits(config: FeatureDrafterConfig, base_model: nn.Module) -> None:
    """Raises a `ValueError` naming both sides when the drafter was made for a different kind of base (a drafter
    naming another base checkpoint is warned about when it is loaded, by `boundary.adapter_base`)."""
    check_base_signature(
        config,
        drafter_signature(base_model),
        "drafter expects",
        f"This feature drafter (made for base {config.base_model_name_or_path!r}) does not fit the base model "
        f"{hf.model_name(base_model)!r}",
    )


class FeatureDrafterModel(AdapterModelMixin, BaseModelWrapper):
    """A transformers seq2seq model with a feature-level drafter: one decoder layer that reads the base's decoder
    state at its output projection and the embedding of the token chosen from it, cross-attends to the base's
    encoder output, and predicts the next state; the base's own output projection turns it into a draft.

    The base is held unchanged (its forward runs without gradients; `FeatureDrafterTrainer` also freezes it), so
    decoding with exact acceptance returns the base's greedy output.

    Args:
        base_model ([`PreTrainedModel`]): any `AutoModelForSeq2SeqLM` whose output projection is its
            `get_output_embeddings()`.
        config ([`FeatureDrafterConfig`], *optional*): drafter settings; base-specific fields are filled in here.

    Example:

    ```python
    >>> model = FeatureDrafterModel.from_pretrained("hf_blockwise/pretrained/multi30k-en-de/feature-drafter")
    >>> out = model.generate(**tokenizer(["A dog runs."], return_tensors="pt"), max_new_tokens=64)
    ```
    """

    config_class = FeatureDrafterConfig
    adapter_name = "feature drafter weights"
    check_fits = staticmethod(check_drafter_fits)

    def __init__(self, base_model: PreTrainedModel, config: FeatureDrafterConfig | None = None) -> None:
        super().__init__()
        self.feature_config = self.filled_config(base_model, config)
        self.base_model = base_model
        fc = self.feature_config
        self.layer = FeatureDrafterLayer(
            fc.hidden_size,
            fc.embedding_size,
            fc.num_attention_heads,
            fc.ffn_size,
            fc.encoder_hidden_size if fc.cross_attention else None,
            fc.shortlist_size,
        )
        projection = base_model.get_output_embeddings().weight
        self.layer.to(device=projection.device, dtype=projection.dtype)

    @staticmethod
    def base_fields(config: FeatureDrafterConfig, base_model: nn.Module) -> dict[str, Any]:
        """The base's signature ([`drafter_signature`]), and the layer's attention heads (by default one per 64
        state dimensions) and feed-forward width (by default the decoder's)."""
        signature = drafter_signature(base_model)
        return {
            **signature,
            "num_attention_heads": config.num_attention_heads or max(1, signature["hidden_size"] // 64),
            "ffn_size": config.ffn_size or hf.decoder_ffn_width(hf.decoder_config(base_model.config)),
        }

    def token_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The base decoder's input embeddings of `token_ids` (shape `(...)` -> `(..., embedding_size)`)."""
        return hf.decoder_input_embeddings(self.base_model)(token_ids)

    def drafter(
        self,
        block_size: int | None = None,
        threshold: float | str | None = "config",
        use_shortlist: bool = True,
        tree_nodes: int | None = None,
        tree_branching: int = 2,
    ) -> FeatureDrafter:
        """The [`FeatureDrafter`] that drafts with this model; `threshold="config"` takes the config's (none for a
        tree: `tree_nodes` drafts per row, expanded EAGLE-2's way with `tree_branching` candidates per node and as
        many nodes expanded per depth)."""
        threshold = self.feature_config.draft_threshold if threshold == "config" else threshold
        if tree_nodes is not None:
            threshold = None
        return FeatureDrafter(
            self, block_size=block_size, threshold=threshold, use_shortlist=use_shortlist, tree_nodes=tree_nodes,
            tree_branching=tree_branching, tree_frontier=tree_branching,
        )  # fmt: skip

    def set_shortlist(self, token_ids: torch.Tensor | None) -> None:
        """Restricts drafts to `token_ids` (e.g. [`frequent_tokens`] of the training targets); `None` removes it.
        Verification keeps the whole vocabulary, so the output does not change."""
        if token_ids is None:
            self.layer.shortlist = None
            self.feature_config = replace(self.feature_config, shortlist_size=None)
            return
        ids = shortlist_ids(token_ids, self.feature_config.vocab_size)
        self.layer.register_buffer("shortlist", ids.to(self.layer.out.weight.device))
        self.feature_config = replace(self.feature_config, shortlist_size=int(ids.numel()))

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> FeatureDrafterOutput:
        """Teacher-forced base pass, then `training_depth` unrolled drafting steps ("training-time test").

        Step 0 reads the base's true states; step i reads the states step i - 1 predicted, so the i-th draft
        of a decoding step is trained on what it sees at inference. Targets are the base's own next state and
        greedy token, so any target text works, and the base's own greedy outputs (self-distillation) match
        inference best.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): a text encoder's
                input; speech and vision encoders take theirs (`input_features`, `pixel_values`...) in `kwargs`.
            attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*): over the
                encoder's input; mapped onto its output positions for subsampling speech encoders.
            labels (`torch.LongTensor` of shape `(batch_size, target_length)`): -100 marks padding.
        """
        if labels is None:
            raise ValueError("FeatureDrafterModel.forward trains the drafter and needs labels")
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        states, greedy, encoder = self._teacher_forced_base(attention_mask, labels, kwargs)
        # position p's input pairs h_p with the token fed at p + 1 (the label at p), as at inference
        embedded = self.token_embeddings(labels.clamp(min=0))  # (B, T, e)
        valid = labels[:, 1:] != -100  # (B, T-1): position p's target state h_{p+1} and token exist
        return self._unrolled_losses(states, greedy, embedded, encoder, valid)

    def _teacher_forced_base(
        self, attention_mask: torch.Tensor | None, labels: torch.Tensor, base_kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMemory]:
        """The frozen base's teacher-forced pass: what the drafter reads and is trained to predict.

        Returns:
            states (`torch.Tensor` of shape `(batch_size, target_length, hidden_size)`): the base's decoder states
                at its output projection, in the drafter's dtype; h_p predicts token p + 1.
            greedy (`torch.LongTensor` of shape `(batch_size, target_length)`): the base's choice from each state.
            encoder ([`AttentionMemory`]): the drafter's cross-attention memory over the base's encoder output.
        """
        with torch.no_grad(), hf.capture_output_projection_input(self.base_model) as captured:
            outputs = self.base_model(attention_mask=attention_mask, labels=labels, return_dict=True, **base_kwargs)
        states = captured[-1].detach().to(self.layer.out.weight.dtype)
        greedy = outputs.logits.argmax(dim=-1)
        encoder_states = outputs.encoder_last_hidden_state
        encoder = self.layer.encoder_memory(
            encoder_states, hf.encoder_output_mask(self.base_model, encoder_states, attention_mask)
        )
        return states, greedy, encoder

    def _unrolled_losses(
        self,
        states: torch.Tensor,
        greedy: torch.Tensor,
        embedded: torch.Tensor,
        encoder: AttentionMemory,
        valid: torch.Tensor,
    ) -> FeatureDrafterOutput:
        """Losses of `training_depth` unrolled drafting steps: step 0 reads the base's `states`, step i the states
        step i - 1 predicted, one position back.

        Args:
            states (`torch.Tensor` of shape `(batch_size, target_length, hidden_size)`): the base's states.
            greedy (`torch.LongTensor` of shape `(batch_size, target_length)`): the base's greedy tokens.
            embedded (`torch.Tensor` of shape `(batch_size, target_length, embedding_size)`): the fed tokens.
            encoder ([`AttentionMemory`]): cross-attention memory over the encoder output.
            valid (`torch.BoolTensor` of shape `(batch_size, target_length - 1)`): positions whose target exists.
        """
        targets, target_tokens = states[:, 1:], greedy[:, 1:]
        scale = targets.float().pow(2).mean(dim=-1, keepdim=True).sqrt().clamp(min=1e-6)  # (B, T-1, 1)
        memories: list[AttentionMemory] = []
        read = states
        step_losses = []
        anchors = self.layer.inputs(states, embedded)  # (B, T, d): step 0's inputs
        for step in range(self.feature_config.training_depth):
            inputs = anchors if step == 0 else self.layer.inputs(read, embedded)  # (B, T, d)
            predicted, fresh = self._unrolled_step(inputs, memories, encoder, step)
            memories.append(fresh)
            step_valid = valid.clone()
            step_valid[:, :step] = False  # position p of step i needs a verified position p - i >= 0
            step_losses.append(self._step_losses(predicted[:, :-1], targets, scale, target_tokens, step_valid))
            # the next step reads, at p, the state this step predicted for p
            read = torch.cat([predicted.new_zeros(predicted[:, :1].shape), predicted[:, :-1]], dim=1)
        feature_losses, token_losses, accuracies = (torch.stack(column) for column in zip(*step_losses, strict=True))
        return FeatureDrafterOutput(
            feature_losses=feature_losses, token_losses=token_losses, token_accuracies=accuracies
        )

    def _unrolled_step(
        self, inputs: torch.Tensor, earlier: list[AttentionMemory], encoder: AttentionMemory, step: int
    ) -> tuple[torch.Tensor, AttentionMemory]:
        """One unrolled drafting step over every position at once.

        Args:
            inputs (`torch.Tensor` of shape `(batch_size, target_length, hidden_size)`): the layer's inputs (states
                and tokens fused, or mask inputs).
            earlier (`list[AttentionMemory]`): the self-attention memories of the steps before it.

        Returns:
            The predicted states (shape `(batch_size, target_length, hidden_size)`; at p, the prediction of
            h_{p+1}), and this step's own self-attention memory.
        """
        fresh, normed = self.layer.self_memory(inputs)
        memories = [*earlier, fresh]
        memory = AttentionMemory(
            torch.cat([m.keys for m in memories], dim=2),
            torch.cat([m.values for m in memories], dim=2),
            unrolled_mask(inputs.shape[1], step, inputs.device),
        )
        return self.layer(inputs, normed, memory, encoder), fresh

    def _step_losses(
        self,
        predicted: torch.Tensor,
        targets: torch.Tensor,
        scale: torch.Tensor,
        target_tokens: torch.Tensor,
        valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feature loss, token loss and accuracy of one unrolled step over its valid positions."""
        if not bool(valid.any()):  # targets too short for this step: keep the graph connected, no signal
            zero = predicted.sum() * 0.0
            return zero, zero, torch.zeros((), device=predicted.device)
        feature_loss = nn.functional.smooth_l1_loss(
            (predicted.float() / scale)[valid], (targets.float() / scale)[valid]
        )
        logits = output_projection_logits(self.base_model, predicted[valid].to(targets.dtype)).float()  # (N, V)
        token_loss = nn.functional.cross_entropy(logits, target_tokens[valid])
        accuracy = (logits.detach().argmax(dim=-1) == target_tokens[valid]).float().mean()
        return feature_loss, token_loss, accuracy

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        base_model_name_or_path: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Writes `feature_drafter_config.json` and `feature_drafter.safetensors` (the drafter's weights only),
        atomically ([`save_adapter`]).

        Args:
            base_model_name_or_path (`str`, *optional*): another base location to record (e.g. a hub name).
            dtype (`torch.dtype`, *optional*): store the weights in this dtype (e.g. `torch.float16`).
        """
        warn_if_int8_base(self, "feature drafter's weights")
        config = self.feature_config
        if base_model_name_or_path is not None:
            config = replace(config, base_model_name_or_path=base_model_name_or_path)
        save_adapter(
            save_directory, config, FEATURE_DRAFTER_WEIGHTS_NAME, self.layer.state_dict(), dtype, {"format": "pt"}
        )

    def load_weights(self, drafter_name_or_path: str | os.PathLike) -> None:
        """Loads into this model, checked, the drafter weights [`save_pretrained`] wrote.

        Raises:
            ValueError: when the file is corrupt, or holds missing, unexpected or misshaped tensors (the message
                names it).
        """
        load_adapter_weights(resolve_file(drafter_name_or_path, FEATURE_DRAFTER_WEIGHTS_NAME), self.layer, "Drafter")

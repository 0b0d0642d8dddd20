"""`FeatureDrafterTrainer`: trains the drafter of a [`FeatureDrafterModel`] with the base frozen."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_blockwise.boundary.trainer import AdapterCheckpointMixin
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.training.common import StepMetricsTrainer, check_trainer_inputs, with_pad_collator
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments


class FeatureDrafterTrainer(AdapterCheckpointMixin, StepMetricsTrainer):
    """Trains a feature drafter (EAGLE-style) on a frozen base: exact decoding by construction.

    - The loss is `feature_loss_weight * smooth-L1(states) + token_loss_weight * cross-entropy(greedy token)`,
      averaged over the unrolled drafting steps; per step, `step_{i}_accuracy` (teacher-forced top-1 agreement
      of the i-th draft with the base's greedy token) and the two losses are logged.
    - Checkpoints hold the drafter's weights only; `resume_from_checkpoint` restores them.
    - `evaluate` also decodes the evaluation set blockwise with the drafter and reports `mean_accepted` (and BLEU
      against the labels, given a tokenizer as `processing_class`).
    """

    def __init__(self, model: FeatureDrafterModel, args: FeatureDrafterTrainingArguments, **kwargs: Any) -> None:
        check_trainer_inputs("FeatureDrafterTrainer", model, FeatureDrafterModel, args, FeatureDrafterTrainingArguments)
        model.base_model.requires_grad_(False)
        model.layer.requires_grad_(True)
        kwargs = with_pad_collator(kwargs, model.base_model.config.pad_token_id)
        super().__init__(model=model, args=args, **kwargs)

    def training_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        # the frozen base must not run dropout: the drafter learns the states greedy decoding produces
        self.accelerator.unwrap_model(model).base_model.eval()
        outputs = model(**inputs)
        loss = (
            self.args.feature_loss_weight * outputs.feature_losses.mean()
            + self.args.token_loss_weight * outputs.token_losses.mean()
        )
        split = "train" if model.training else "eval"
        for step, (feature, token, accuracy) in enumerate(
            zip(
                outputs.feature_losses.tolist(), outputs.token_losses.tolist(), outputs.token_accuracies.tolist(),
                strict=True,
            )
        ):  # fmt: skip
            self.step_metrics.add(split, f"step_{step + 1}_feature_loss", feature)
            self.step_metrics.add(split, f"step_{step + 1}_token_loss", token)
            self.step_metrics.add(split, f"step_{step + 1}_accuracy", accuracy)
        return loss, outputs

    def save_adapter(self, model: FeatureDrafterModel, output_dir: str) -> None:
        model.save_pretrained(output_dir)

    def load_adapter(self, model: FeatureDrafterModel, checkpoint_dir: str) -> None:
        model.load_weights(checkpoint_dir)

"""`FeatureDrafterTrainer`: trains the drafter of a [`FeatureDrafterModel`] with the base frozen."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from hf_blockwise.boundary.trainer import TRAINING_ARGS_NAME
from hf_blockwise.modeling.config import FEATURE_DRAFTER_CONFIG_NAME
from hf_blockwise.modeling.feature_model import FEATURE_DRAFTER_WEIGHTS_NAME, FeatureDrafterModel
from hf_blockwise.training.common import Seq2SeqPadCollator, StepMetricsTrainer
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments


class FeatureDrafterTrainer(StepMetricsTrainer):
    """Trains a feature drafter (EAGLE-style) on a frozen base: exact decoding by construction.

    - The loss is `feature_loss_weight * smooth-L1(states) + token_loss_weight * cross-entropy(greedy token)`,
      averaged over the unrolled drafting steps; per step, `step_{i}_accuracy` (teacher-forced top-1 agreement
      of the i-th draft with the base's greedy token) and the two losses are logged.
    - Checkpoints hold the drafter's weights only; `resume_from_checkpoint` restores them.
    - `evaluate` also decodes the evaluation set blockwise with the drafter and reports `mean_accepted` (and BLEU
      against the labels, given a tokenizer as `processing_class`).
    """

    def __init__(self, model: FeatureDrafterModel, args: FeatureDrafterTrainingArguments, **kwargs: Any) -> None:
        if not isinstance(model, FeatureDrafterModel):
            raise TypeError(f"FeatureDrafterTrainer trains a FeatureDrafterModel, got {type(model).__name__}")
        if not isinstance(args, FeatureDrafterTrainingArguments):
            raise TypeError(f"FeatureDrafterTrainer takes FeatureDrafterTrainingArguments, got {type(args).__name__}")
        model.base_model.requires_grad_(False)
        model.layer.requires_grad_(True)
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = Seq2SeqPadCollator(model.base_model.config.pad_token_id)
        super().__init__(model=model, args=args, **kwargs)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
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
        return (loss, outputs) if return_outputs else loss

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model if model is None else model)
        if not os.path.isfile(os.path.join(resume_from_checkpoint, FEATURE_DRAFTER_CONFIG_NAME)):
            raise ValueError(
                f"{resume_from_checkpoint} is not a FeatureDrafterTrainer checkpoint (no {FEATURE_DRAFTER_CONFIG_NAME})"
            )
        model.layer.load_state_dict(load_file(os.path.join(resume_from_checkpoint, FEATURE_DRAFTER_WEIGHTS_NAME)))

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

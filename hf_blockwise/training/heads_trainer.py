"""`BlockwiseHeadsTrainer`: trains proposal heads (and optionally the base) with transformers' `Seq2SeqTrainer`."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from hf_blockwise.boundary.trainer import AdapterCheckpointMixin
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.training.common import StepMetricsTrainer, check_trainer_inputs, with_pad_collator
from hf_blockwise.training.heads_config import BlockwiseHeadsTrainingArguments


def _with_lora(base_model: nn.Module, args: BlockwiseHeadsTrainingArguments) -> nn.Module:
    """Wraps the (frozen) base in a PEFT LoRA model whose adapters alone are trainable."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_target_modules,
    )
    return get_peft_model(base_model, config)


class BlockwiseHeadsTrainer(AdapterCheckpointMixin, StepMetricsTrainer):
    """Trains the heads of a [`BlockwiseHeadsModel`] with the loss of Stern et al. §6.

    - `head_loss="mean"` or `"sampled"` (one head per minibatch); per-head loss and top-1 accuracy are logged
      as `head_{i}_loss` / `head_{i}_accuracy` (head i predicts i + 1 tokens ahead of p1's token).
    - `base_training="frozen"` (default) trains only the heads, and checkpoints hold only the heads;
      `"full"` fine-tunes the base too and checkpoints hold the base beside the heads; `"lora"` wraps the base
      in a PEFT LoRA model (`model.base_model` becomes a `PeftModel`) and checkpoints hold heads + adapter.
    - `evaluate` also decodes the evaluation set blockwise and reports `mean_accepted` and, given a tokenizer
      as `processing_class`, sacreBLEU against the labels.
    """

    def __init__(self, model: BlockwiseHeadsModel, args: BlockwiseHeadsTrainingArguments, **kwargs: Any) -> None:
        check_trainer_inputs("BlockwiseHeadsTrainer", model, BlockwiseHeadsModel, args, BlockwiseHeadsTrainingArguments)
        model.base_model.requires_grad_(args.base_training == "full")
        if args.base_training == "lora":
            model.base_model = _with_lora(model.base_model, args)
        model.heads.requires_grad_(True)
        kwargs = with_pad_collator(kwargs, model.base_model.config.pad_token_id)
        super().__init__(model=model, args=args, **kwargs)
        self._head_rng = random.Random(args.seed)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """transformers' optimizer, with the base's parameters moved into groups of their own at
        `base_learning_rate` when it is set (before the schedule is built, which scales every group's rate)."""
        optimizer = super().create_optimizer(model)
        if self.args.base_learning_rate is None:
            return optimizer
        base_parameters = {id(parameter) for parameter in self.model.base_model.parameters()}
        for group in list(optimizer.param_groups):
            moved = [parameter for parameter in group["params"] if id(parameter) in base_parameters]
            group["params"] = [parameter for parameter in group["params"] if id(parameter) not in base_parameters]
            if moved:
                settings = {key: value for key, value in group.items() if key != "params"}
                optimizer.add_param_group({**settings, "params": moved, "lr": self.args.base_learning_rate})
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
        return optimizer

    def training_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        if self.args.base_training == "frozen":
            # a frozen base must not run dropout: the heads learn from the states greedy decoding produces
            self.accelerator.unwrap_model(model).base_model.eval()
        outputs = model(**inputs)
        head_losses = outputs.head_losses  # (k-1,)
        if self.args.head_loss == "sampled" and model.training:
            loss = head_losses[self._head_rng.randrange(head_losses.shape[0])]
        else:
            loss = head_losses.mean()
        if self.args.base_training != "frozen":
            loss = loss + self.args.base_loss_weight * outputs.base_loss
        self._record(outputs, "train" if model.training else "eval")
        return loss, outputs

    @torch.no_grad()
    def _record(self, outputs: Any, split: str) -> None:
        for head, (loss, accuracy) in enumerate(
            zip(outputs.head_losses.tolist(), outputs.head_accuracies.tolist(), strict=True)
        ):
            self.step_metrics.add(split, f"head_{head + 1}_loss", loss)
            self.step_metrics.add(split, f"head_{head + 1}_accuracy", accuracy)
        if outputs.base_loss is not None:
            self.step_metrics.add(split, "base_loss", float(outputs.base_loss))

    def save_adapter(self, model: BlockwiseHeadsModel, output_dir: str) -> None:
        """Checkpoints hold the heads (and the LoRA adapter, or with `base_training="full"` the base beside them)."""
        model.save_pretrained(output_dir, include_base=self.args.base_training == "full")

    def load_adapter(self, model: BlockwiseHeadsModel, checkpoint_dir: str) -> None:
        model.load_weights(checkpoint_dir, include_base=self.args.base_training == "full")


# names before 0.2, kept for one release (with a FutureWarning)

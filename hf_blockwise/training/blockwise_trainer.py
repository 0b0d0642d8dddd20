"""`BlockwiseTrainer`: trains proposal heads (and optionally the base) with transformers' `Seq2SeqTrainer`."""

from __future__ import annotations

import os
import random
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForSeq2SeqLM

from hf_blockwise.boundary.trainer import TRAINING_ARGS_NAME
from hf_blockwise.modeling.config import CONFIG_NAME
from hf_blockwise.modeling.model import ADAPTER_WEIGHTS_NAME, WEIGHTS_NAME, BlockwiseHeadsModel
from hf_blockwise.training.blockwise_config import BlockwiseTrainingArguments
from hf_blockwise.training.common import Seq2SeqPadCollator, StepMetricsTrainer

# In a checkpoint written while the base is trained, the base sits beside the heads.
BASE_IN_CHECKPOINT = "."


def _with_lora(base_model: nn.Module, args: BlockwiseTrainingArguments) -> nn.Module:
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


class BlockwiseTrainer(StepMetricsTrainer):
    """Trains the heads of a [`BlockwiseHeadsModel`] with the loss of Stern et al. §6.

    - `head_loss="mean"` or `"sampled"` (one head per minibatch); per-head loss and top-1 accuracy are logged
      as `head_{i}_loss` / `head_{i}_accuracy` (head i predicts i + 1 tokens ahead of p1's token).
    - `base_training="frozen"` (default) trains only the heads, and checkpoints hold only the heads;
      `"full"` fine-tunes the base too and checkpoints hold the base beside the heads; `"lora"` wraps the base
      in a PEFT LoRA model (`model.base_model` becomes a `PeftModel`) and checkpoints hold heads + adapter.
    - `evaluate` also decodes the evaluation set blockwise and reports `mean_accepted` and, given a tokenizer
      as `processing_class`, sacreBLEU against the labels.
    """

    def __init__(self, model: BlockwiseHeadsModel, args: BlockwiseTrainingArguments, **kwargs: Any) -> None:
        if not isinstance(model, BlockwiseHeadsModel):
            raise TypeError(f"BlockwiseTrainer trains a BlockwiseHeadsModel, got {type(model).__name__}")
        if not isinstance(args, BlockwiseTrainingArguments):
            raise TypeError(f"BlockwiseTrainer takes BlockwiseTrainingArguments, got {type(args).__name__}")
        model.base_model.requires_grad_(args.base_training == "full")
        if args.base_training == "lora":
            model.base_model = _with_lora(model.base_model, args)
        model.heads.requires_grad_(True)
        if "data_collator" not in kwargs or kwargs["data_collator"] is None:
            kwargs["data_collator"] = Seq2SeqPadCollator(model.base_model.config.pad_token_id)
        super().__init__(model=model, args=args, **kwargs)
        self._head_rng = random.Random(args.seed)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        outputs = model(**inputs)
        head_losses = outputs.head_losses  # (k-1,)
        if self.args.head_loss == "sampled" and model.training:
            loss = head_losses[self._head_rng.randrange(head_losses.shape[0])]
        else:
            loss = head_losses.mean()
        if self.args.base_training != "frozen":
            loss = loss + self.args.base_loss_weight * outputs.base_loss
        self._record(outputs, "train" if model.training else "eval")
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _record(self, outputs: Any, split: str) -> None:
        for head, (loss, accuracy) in enumerate(
            zip(outputs.head_losses.tolist(), outputs.head_accuracies.tolist(), strict=True)
        ):
            self.step_metrics.add(split, f"head_{head + 1}_loss", loss)
            self.step_metrics.add(split, f"head_{head + 1}_accuracy", accuracy)
        if outputs.base_loss is not None:
            self.step_metrics.add(split, "base_loss", float(outputs.base_loss))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        model: BlockwiseHeadsModel = self.accelerator.unwrap_model(self.model)
        if self.args.base_training == "full":
            model.base_model.save_pretrained(output_dir)
            model.save_pretrained(output_dir, base_model_name_or_path=BASE_IN_CHECKPOINT)
        else:
            model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model if model is None else model)
        if not os.path.isfile(os.path.join(resume_from_checkpoint, CONFIG_NAME)):
            raise ValueError(f"{resume_from_checkpoint} is not a BlockwiseTrainer checkpoint (no {CONFIG_NAME})")
        model.heads.load_state_dict(load_file(os.path.join(resume_from_checkpoint, WEIGHTS_NAME)))
        if self.args.base_training == "lora":
            from peft import set_peft_model_state_dict

            adapter = load_file(os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS_NAME))
            set_peft_model_state_dict(model.base_model, adapter)
        if self.args.base_training == "full":
            trained_base = AutoModelForSeq2SeqLM.from_pretrained(resume_from_checkpoint)
            model.base_model.load_state_dict(trained_base.state_dict())

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

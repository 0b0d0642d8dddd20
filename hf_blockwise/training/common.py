"""What the trainers share: the padding collator, per-step metrics and the trainer base that logs them, the
evaluation decode, argument checks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_blockwise.evaluation.harness import measure


def check_eval_decoding(args: Seq2SeqTrainingArguments) -> None:
    """Validates the `eval_*` decoding fields shared by this package's training arguments."""
    for name in ("eval_max_new_tokens", "eval_decoding_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.eval_decoding_samples is not None and args.eval_decoding_samples < 1:
        raise ValueError(f"eval_decoding_samples must be >= 1 or None, got {args.eval_decoding_samples}")


def prepare_eval_decoding(args: Seq2SeqTrainingArguments) -> None:
    """Checks the `eval_*` decoding fields ([`check_eval_decoding`]) and sets what evaluation by decoding needs:
    `prediction_loss_only` (evaluation decodes for real instead of gathering the logits: (batch, length, heads,
    vocab) for heads) and `label_names`, by default `["labels"]`. Called by each `__post_init__` before the
    `Seq2SeqTrainingArguments` one."""
    check_eval_decoding(args)
    args.prediction_loss_only = True
    if args.label_names is None:
        args.label_names = ["labels"]


class Seq2SeqPadCollator:
    """Pads `input_ids`/`attention_mask` with the pad id and `labels` with -100; the base model derives its
    decoder inputs from the labels itself."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        def pad(key: str, value: int) -> torch.Tensor:
            rows = [list(feature[key]) for feature in features]
            width = max(len(row) for row in rows)
            return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)

        batch = {"input_ids": pad("input_ids", self.pad_token_id), "labels": pad("labels", -100)}
        batch["attention_mask"] = (
            pad("attention_mask", 0) if "attention_mask" in features[0] else (batch["input_ids"] != self.pad_token_id)
        ).long()
        return batch


def check_trainer_inputs(trainer: str, model: Any, model_class: type, args: Any, args_class: type) -> None:
    """`TypeError`s naming what `trainer` trains and takes when it is given another model or arguments class."""
    if not isinstance(model, model_class):
        raise TypeError(f"{trainer} trains a {model_class.__name__}, got {type(model).__name__}")
    if not isinstance(args, args_class):
        raise TypeError(f"{trainer} takes {args_class.__name__}, got {type(args).__name__}")


def with_pad_collator(trainer_kwargs: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """A trainer's keyword arguments with `data_collator`, when absent or `None`, set to [`Seq2SeqPadCollator`]."""
    if trainer_kwargs.get("data_collator") is not None:
        return trainer_kwargs
    return {**trainer_kwargs, "data_collator": Seq2SeqPadCollator(pad_token_id)}


class StepMetrics:
    """Metrics recorded at each training or evaluation step, averaged into the next `Trainer.log` call.

    A log call that carries `loss` is a training log and takes the training means; any other is an evaluation
    log and takes the evaluation means under an `eval_` prefix. Every trainer keeps one ([`StepMetricsTrainer`]).
    """

    def __init__(self) -> None:
        self._values: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def add(self, split: str, key: str, value: float) -> None:
        self._values[split][key].append(value)

    def pop_means(self, logs: dict[str, float]) -> dict[str, float]:
        """The means for the kind of log `logs` is, with their log names; forgets them."""
        split = "train" if "loss" in logs else "eval"
        prefix = "" if split == "train" else "eval_"
        means = {f"{prefix}{key}": sum(values) / len(values) for key, values in self._values[split].items() if values}
        self._values[split].clear()
        return means


def decode_for_evaluation(
    model: nn.Module,
    dataset,
    pad_token_id: int,
    batch_size: int,
    max_new_tokens: int,
    limit: int | None = None,
    tokenizer: Any = None,
    description: str = "blockwise eval",
    show_progress: bool = True,
    **generate_kwargs: Any,
) -> dict[str, float]:
    """Decodes (the first `limit` examples of) a tokenized dataset blockwise; mean accepted block, and BLEU
    against the labels when a tokenizer is given. The evaluation both trainers run, through the measurement
    harness ([`harness.measure`]: one mode, no reference, no warm-up).

    Args:
        model: what `generate` is called on (a `BlockwiseHeadsModel`, or a verifier given `custom_generate`
            and `assistant` in `generate_kwargs`); it must return `decoding_stats`.
        dataset: rows with `input_ids` (and `attention_mask`, `labels`).

    Returns:
        `{"mean_accepted": ...}`, plus `"bleu"` (sacreBLEU, detokenized) when `tokenizer` is given.
    """
    limit = len(dataset) if limit is None else min(limit, len(dataset))
    examples = [dataset[index] for index in range(limit)]
    collator = Seq2SeqPadCollator(pad_token_id)
    device = next(model.parameters()).device
    batches, labels = [], []
    for start in range(0, len(examples), batch_size):
        batch = collator(examples[start : start + batch_size])
        batches.append({key: batch[key].to(device) for key in ("input_ids", "attention_mask")})
        labels.append(batch["labels"].masked_fill(batch["labels"] == -100, pad_token_id))
    references = None
    if tokenizer is not None:
        references = [text for rows in labels for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]
    runners = {
        "blockwise": lambda batch, _: model.generate(
            **batch, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **generate_kwargs
        )
    }
    result = measure(
        runners, batches, pad_token_id=pad_token_id, tokenizer=tokenizer, references=references, warmup=False,
        progress=show_progress, description=description,
    )["blockwise"]  # fmt: skip
    if not result.accepted_steps:
        raise ValueError("decode_for_evaluation needs a generate that returns decoding_stats (blockwise decoding)")
    results = {"mean_accepted": result.mean_accepted}
    if result.bleu is not None:
        results["bleu"] = result.bleu
    return results


@torch.no_grad()
def decode_trainer_dataset(trainer: Any, dataset) -> dict[str, float]:
    """[`decode_for_evaluation`] as a trainer of this package runs it at `evaluate`: on the unwrapped model in eval
    mode (its training mode restored after), with the trainer's `eval_*` decoding settings and tokenizer."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    was_training = model.training
    model.eval()
    results = decode_for_evaluation(
        model,
        dataset,
        pad_token_id=model.base_model.config.pad_token_id,
        batch_size=trainer.args.eval_decoding_batch_size,
        max_new_tokens=trainer.args.eval_max_new_tokens,
        limit=trainer.args.eval_decoding_samples,
        tokenizer=trainer.processing_class,
        show_progress=trainer.is_world_process_zero(),
    )
    model.train(was_training)
    return results


class StepMetricsTrainer(Seq2SeqTrainer):
    """The base of this package's trainers: per-step metrics ([`StepMetrics`], filled by `compute_loss` through
    `self.step_metrics`) averaged into each log, and `evaluate` extended by [`evaluation_decoding`].
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_metrics = StepMetrics()

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """transformers' loss hook, once for this package's trainers: [`training_loss`], with the outputs when asked."""
        loss, outputs = self.training_loss(model, inputs)
        return (loss, outputs) if return_outputs else loss

    def training_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The loss of a batch and the model's outputs; each trainer defines it (and records its step metrics)."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_loss(model, inputs)")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(self.step_metrics.pop_means(logs))
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs):
        metrics = super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        decoding = {f"{metric_key_prefix}_{key}": value for key, value in self.evaluation_decoding(dataset).items()}
        if decoding:
            self.log(dict(decoding))
            metrics.update(decoding)
        return metrics

    def evaluation_decoding(self, dataset) -> dict[str, float]:
        """What `evaluate` adds from decoding `dataset`: by default [`decode_trainer_dataset`] (blockwise decoding
        with the trained model: `mean_accepted` and, given a tokenizer, `bleu`)."""
        return decode_trainer_dataset(self, dataset)

"""What the recipes share around their training, whatever the model:

- seeding and quiet transformers logging (`set_seed`, `quiet_transformers`);
- atomic saves, so that an interrupted recipe never leaves a half-written file (`atomic_write_json`,
  `atomic_torch_save`);
- resuming: the saved state of a custom training loop (`Progress`, `save_state`, `load_state`) and the newest
  checkpoint of a `Trainer` run (`last_checkpoint`), with the `TrainingArguments` every `Trainer`-based recipe
  sets the same way (`trainer_arguments`);
- shipping: a model in fp16 with its tokenizer (`ship_model`, `save_shipped_model`), a drafter inside its base's folder
  (`ship_drafter`), and the model card beside them (`write_model_card`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging as hf_logging

from hf_blockwise import BlockwiseHeadsModel
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.serialization import atomic_write, atomic_write_text

ArgumentsT = TypeVar("ArgumentsT", bound=TrainingArguments)


def save_shipped_model(model: PreTrainedModel, directory: str | os.PathLike) -> None:
    """Saves a model to ship in the repository: fp16 weights (half the size), a config that makes plain
    `from_pretrained` load it as float32 (fp16 is slow and erratic on CPUs), and a generation config that limits
    new tokens rather than the total length, so that `generate(max_new_tokens=...)` warns about nothing."""
    model.to(torch.float16).save_pretrained(directory)
    model.to(torch.float32)
    config_path = os.path.join(directory, "config.json")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["dtype"] = "float32"
    # a model saved after training says use_cache false; generate then still caches, but a user's plain forward
    # (and anything that reads the config) would not
    config["use_cache"] = True
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation_path):
        with open(generation_path, encoding="utf-8") as handle:
            generation = json.load(handle)
        if "max_length" in generation:
            generation["max_new_tokens"] = generation.pop("max_length")
        atomic_write_text(generation_path, json.dumps(generation, indent=2, sort_keys=True) + "\n")


def set_seed(seed: int) -> None:
    """Seed Python and torch RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' log warnings for a block.

    ``generate(max_new_tokens=...)`` on a model whose generation config sets ``max_length`` logs a
    "both have been set" warning on every call; ``max_new_tokens`` wins, which is what we want here.
    """
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


# ----------------------------------------------------------------------------------------------------------
# Atomic saves
# ----------------------------------------------------------------------------------------------------------


def atomic_write_json(path: str | os.PathLike, obj: Any, ensure_ascii: bool = True) -> None:
    """Write ``obj`` as indented JSON (and a final newline) to ``path`` atomically; ``ensure_ascii`` as in
    `json.dumps` (False writes non-ASCII characters as they are)."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=ensure_ascii) + "\n")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically."""
    atomic_write(path, lambda tmp_path: torch.save(obj, tmp_path))


# ----------------------------------------------------------------------------------------------------------
# Resuming a custom training loop
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """Where training stands; saved with the state so a restart continues exactly here."""

    step: int = 0
    epoch: int = 0  # 0-based index of the epoch in progress
    batch_in_epoch: int = 0  # batches of ``epoch`` already consumed
    train_seconds: float = 0.0  # wall time spent in training + evaluation, summed over runs
    epoch_loss_sum: float = 0.0
    epoch_tokens: int = 0


def save_state(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    progress: Progress,
    log: dict[str, Any],
) -> None:
    """Save everything needed to resume (model, optimizer, scheduler, progress, log, RNG states)."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": vars(progress).copy(),
        "log": log,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    atomic_torch_save(state, path)


def load_state(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[Progress, dict[str, Any]]:
    """Restore a state written by :func:`save_state`; returns the progress and the log."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(_as_tuple(state["python_rng"]))
    return Progress(**state["progress"]), state["log"]


def _as_tuple(obj: Any) -> Any:
    """Turn nested lists back into tuples (``random.setstate`` needs tuples)."""
    if isinstance(obj, list | tuple):
        return tuple(_as_tuple(x) for x in obj)
    return obj


# ----------------------------------------------------------------------------------------------------------
# Trainer-based recipes
# ----------------------------------------------------------------------------------------------------------


class TrainerFlags(Protocol):
    """The flags every `Trainer`-based recipe has (its arguments dataclass has these fields)."""

    out: str
    batch_size: int
    epochs: float
    max_steps: int
    lr: float
    warmup_steps: int


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` to resume from; None for a fresh run."""
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def trainer_arguments(arguments_class: type[ArgumentsT], flags: TrainerFlags, **settings: Any) -> ArgumentsT:
    """``arguments_class`` (a `TrainingArguments` subclass) as the recipes set it: output, batch size, epochs,
    steps and schedule from ``flags``; the last two checkpoints kept; no reporting; the CPU unless there is a
    GPU; seed 0. ``settings`` add the recipe's own (scheduler type, logging and save steps, ...)."""
    return arguments_class(
        output_dir=flags.out,
        per_device_train_batch_size=flags.batch_size,
        num_train_epochs=flags.epochs,
        max_steps=flags.max_steps,
        learning_rate=flags.lr,
        warmup_steps=flags.warmup_steps,
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        **settings,
    )


# ----------------------------------------------------------------------------------------------------------
# Shipping
# ----------------------------------------------------------------------------------------------------------


def write_model_card(directory: str | os.PathLike, text: str) -> None:
    """Write ``text`` as the folder's ``README.md`` (the model card), atomically."""
    atomic_write_text(os.path.join(directory, "README.md"), text)


def ship_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | ProcessorMixin, directory: str | os.PathLike
) -> None:
    """The model in fp16 (loaded back as float32, `save_shipped_model`) and its tokenizer (or processor) in
    ``directory``, for the package or a notebook."""
    os.makedirs(directory, exist_ok=True)
    save_shipped_model(model, directory)
    tokenizer.save_pretrained(directory)


def ship_drafter(drafter: BlockwiseHeadsModel | FeatureDrafterModel, directory: str | os.PathLike, card: str) -> None:
    """A drafter alone (heads or a feature drafter: only its own weights, in fp16) and its model card, in a
    subfolder of the shipped base, which its config names as ``..``."""
    drafter.save_pretrained(directory, base_model_name_or_path="..", dtype=torch.float16)
    write_model_card(directory, card)

"""A drafter for a user's own checkpoint, trained on the user's own text in one call (`hf-blockwise train`).

The steps, each resumable in the output folder:

1. **Self-distillation**: the model's own greedy outputs for the training lines, through the corpus job
   ([`generate_corpus`], `OUT/distilled.jsonl`): a drafter learns what *this* model does next, and greedy is what
   exact decoding verifies against.
2. **Training** with this package's trainers (base frozen, so decoding stays exact), checkpoints in
   `OUT/checkpoints`; `max_steps` and `max_minutes` bound it.
3. **Evaluation** on held-out lines of the same text: tokens per decoder call, identical outputs, speed against
   greedy (`OUT/train_summary.json`).
4. **The adapter** in `OUT` itself: `FeatureDrafterModel.from_pretrained(OUT, base_model=model)` or
   `BlockwiseHeadsModel.from_pretrained(OUT, base_model=model)` (its config names the model as given).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_blockwise.corpus import generate_corpus
from hf_blockwise.corpus.output import locked_output
from hf_blockwise.corpus.sources import texts_sha256
from hf_blockwise.evaluation import compare_to_greedy
from hf_blockwise.generation.capability import check_decoder
from hf_blockwise.loading import LoadedModel, load_model
from hf_blockwise.modeling.config import BlockwiseHeadsConfig, FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.modeling.shortlist import frequent_tokens
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments
from hf_blockwise.training.feature_trainer import FeatureDrafterTrainer
from hf_blockwise.training.heads_config import BlockwiseHeadsTrainingArguments
from hf_blockwise.training.heads_trainer import BlockwiseHeadsTrainer

KINDS = ("feature-drafter", "heads")
# fewer lines than one training batch teach a drafter nothing worth a run
MIN_TRAINING_LINES = 32
SETTINGS_FILE = "train_settings.json"
SUMMARY_FILE = "train_summary.json"
DISTILLED_FILE = "distilled.jsonl"


@dataclass(frozen=True)
class OwnDrafterOptions:
    """How [`train_own_drafter`] trains.

    Args:
        kind (`str`): `"feature-drafter"` (one decoder layer drafting the base's next states, EAGLE-style: the most
            tokens per call here) or `"heads"` (Stern et al.'s k - 1 proposal heads: cheaper to train and to run).
        block_size (`int`): k, the tokens a step may accept (drafts + 1).
        epochs (`float`): passes over the training lines. max_steps (`int`): stop after N steps (-1: no limit).
        max_minutes (`float`, *optional*): stop training after this many minutes (of this run), saving first.
        batch_size (`int`), learning_rate (`float`), save_steps (`int`): the trainer's.
        warmup_ratio (`float`): the share of the training steps over which the rate warms up linearly.
        eval_lines (`int`): lines held out (the last ones after a seeded shuffle) for the final evaluation.
        max_lines (`int`, *optional*): train on at most this many of the other lines (distilling them is the first
            cost: ~1,000 lines a minute for a 43M model on 2 CPU cores).
        shortlist (`int`): drafts come from the N most frequent tokens of the distilled outputs, where the
            vocabulary is over twice as large (drafting's projection is its largest cost on big vocabularies).
        max_new_tokens (`int`, *optional*): length limit of distillation and evaluation; default the checkpoint's
            `generation_config`.
        seed (`int`): the shuffle's and the trainer's seed.
    """

    kind: str = "feature-drafter"
    block_size: int = 4
    epochs: float = 2.0
    max_steps: int = -1
    max_minutes: float | None = None
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.05
    save_steps: int = 100
    eval_lines: int = 100
    max_lines: int | None = None
    shortlist: int = 2000
    max_new_tokens: int | None = None
    seed: int = 0

    def checked(self) -> OwnDrafterOptions:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.max_lines is not None and self.max_lines < MIN_TRAINING_LINES:
            raise ValueError(f"max_lines must be >= {MIN_TRAINING_LINES}, got {self.max_lines}")
        for name in ("block_size", "batch_size", "eval_lines", "shortlist", "save_steps"):
            if getattr(self, name) < (2 if name == "block_size" else 1):
                raise ValueError(f"{name} must be >= {2 if name == 'block_size' else 1}, got {getattr(self, name)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not self.epochs > 0 or (self.max_minutes is not None and not self.max_minutes > 0):
            raise ValueError(f"epochs and max_minutes must be > 0, got {self.epochs} and {self.max_minutes}")
        return self


@dataclass
class OwnDrafterReport:
    """What a [`train_own_drafter`] run made and measured (also `OUT/train_summary.json`)."""

    out: str
    kind: str
    training_lines: int
    eval_lines: int
    steps: int
    stopped_by: str
    tokens_per_call: float
    identical: int
    speedup: float
    seconds: float

    def summary(self) -> str:
        return (
            f"{self.kind} saved in {self.out} after {self.steps} steps on {self.training_lines} lines "
            f"({self.stopped_by}); on {self.eval_lines} held-out lines at batch 1: {self.tokens_per_call:.2f} tokens "
            f"per decoder call, {self.identical}/{self.eval_lines} identical to greedy, {self.speedup:.2f}x greedy "
            f"(eager); {self.seconds / 60:.1f} min in all"
        )


class TimeLimit(TrainerCallback):
    """Stops training (saving a checkpoint first) once `minutes` of this run's training have passed."""

    def __init__(self, minutes: float | None) -> None:
        self.deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self.reached = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.reached = True
            control.should_training_stop = True
            control.should_save = True
        return control


def train_own_drafter(
    model: str | os.PathLike,
    texts: Sequence[str],
    out: str | os.PathLike,
    options: OwnDrafterOptions | None = None,
    *,
    progress: bool = True,
) -> OwnDrafterReport:
    """Trains a drafter of `options.kind` for `model` on `texts` and saves it in `out` (module docstring).

    Args:
        model: a model directory or hub id (a text encoder-decoder the blockwise loop verifies exactly).
        texts: source-language lines (the kind of text the model will decode); blank ones are dropped.
        out: the output folder: new, or one an earlier run with the same model, text and options wrote (it
            resumes); another run's folder, or a folder a run is writing now, is refused.

    Raises:
        `ValueError`: too little text, a folder of another run or in use, a model whose encoder does not read text.
        [`UnsupportedModelError`]: a model the loop cannot verify exactly.
    """
    options = (options or OwnDrafterOptions()).checked()
    started = time.monotonic()
    train_texts, eval_texts = split_lines(texts, options.eval_lines, options.seed)
    train_texts = train_texts[: options.max_lines]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with locked_output(out / "train"):
        loaded = load_model(os.fspath(model))
        check_text_model(loaded, model)  # before the folder is claimed: a refused model leaves nothing behind
        claim_folder(out, _settings(model, texts, options))
        targets = distill(loaded, train_texts, out / DISTILLED_FILE, options, progress)
        drafter_model, steps, stopped_by = train_drafter(loaded, train_texts, targets, out, options, progress)
        drafter_model.save_pretrained(out, base_model_name_or_path=base_name(model, out))
        comparison = compare_to_greedy(
            drafter_model, loaded.tokenizer, eval_texts, assistant=drafter_model.drafter(), batch_size=1,
            max_new_tokens=options.max_new_tokens, progress=progress,
        )  # fmt: skip
        summary = comparison.summary()
        report = OwnDrafterReport(
            out=os.fspath(out), kind=options.kind, training_lines=len(train_texts), eval_lines=len(eval_texts),
            steps=steps, stopped_by=stopped_by, tokens_per_call=summary["mean_accepted"],
            identical=summary["identical"], speedup=summary["speedup"], seconds=time.monotonic() - started,
        )  # fmt: skip
        atomic_write_text(out / SUMMARY_FILE, json.dumps(dataclasses.asdict(report), indent=2) + "\n")
    return report


def split_lines(texts: Sequence[str], eval_lines: int, seed: int) -> tuple[list[str], list[str]]:
    """(training lines, held-out lines): the non-blank lines shuffled with `seed`, the last `eval_lines` held out.

    Raises:
        `ValueError` when fewer than `MIN_TRAINING_LINES` lines would be left to train on.
    """
    lines = [text for text in texts if text.strip()]
    if len(lines) < MIN_TRAINING_LINES + eval_lines:
        raise ValueError(
            f"too little text: {len(lines)} non-blank lines, and training needs at least {MIN_TRAINING_LINES} beside "
            f"the {eval_lines} held out for evaluation (give more lines, or hold out fewer with --eval-lines)"
        )
    random.Random(seed).shuffle(lines)
    return lines[:-eval_lines], lines[-eval_lines:]


def _settings(model: str | os.PathLike, texts: Sequence[str], options: OwnDrafterOptions) -> dict[str, Any]:
    """What makes a run: resuming with other settings would mix two runs' checkpoints. How long it trains is left
    out (`epochs`, `max_steps`, `max_minutes`): a resumed run may be given more."""
    length = {"epochs", "max_steps", "max_minutes"}
    recorded = {key: value for key, value in dataclasses.asdict(options).items() if key not in length}
    return {"model": os.fspath(model), "texts_sha256": texts_sha256(list(texts)), **recorded}


def claim_folder(out: Path, settings: dict[str, Any]) -> None:
    """Records `settings` in a new (or empty) folder; refuses a folder of another run or one holding other files."""
    path = out / SETTINGS_FILE
    if path.is_file():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(key for key in {*recorded, *settings} if recorded.get(key) != settings.get(key))
        if changed:
            raise ValueError(
                f"{out} holds a run with other settings ({', '.join(changed)} differ): choose another output folder, "
                "or run again with the same model, text and options to resume it"
            )
        return
    others = sorted(name for name in os.listdir(out) if not name.startswith("train.lock"))
    if others:
        raise ValueError(
            f"{out} is not empty ({', '.join(others[:3])}) and no drafter run wrote it: choose a new or empty folder"
        )
    atomic_write_text(path, json.dumps(settings, indent=2) + "\n")


def check_text_model(loaded: LoadedModel, model: str | os.PathLike) -> None:
    """Refuses, before any work, a model whose encoder reads no text or that the loop cannot verify exactly."""
    loaded.check_reads_text(os.fspath(model))
    check_decoder(loaded.base)


def distill(
    loaded: LoadedModel, texts: list[str], output: Path, options: OwnDrafterOptions, progress: bool
) -> list[str | None]:
    """The model's greedy output for each of `texts` (`None` where the source is too long for it), through the
    resumable corpus job."""
    generate_corpus(
        loaded, texts, output, drafter="none", batch_size=32, max_new_tokens=options.max_new_tokens,
        generate_kwargs={"num_beams": 1, "do_sample": False}, output_format="jsonl", on_long="skip",
        progress=progress,
    )  # fmt: skip
    with open(output, encoding="utf-8") as handle:
        return [json.loads(line)["output"] for line in handle]


def encoded_pairs(tokenizer: Any, sources: list[str], targets: list[str | None]) -> Dataset:
    """Tokenized (source, distilled output) pairs, unpadded (the trainers' collator pads)."""
    kept = [(source, target) for source, target in zip(sources, targets, strict=True) if target is not None]
    inputs = tokenizer([source for source, _ in kept], truncation=True)
    labels = tokenizer(text_target=[target for _, target in kept], truncation=True)
    return Dataset.from_dict(
        {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels["input_ids"]}
    )


def train_drafter(
    loaded: LoadedModel, sources: list[str], targets: list[str | None], out: Path, options: OwnDrafterOptions,
    progress: bool,
) -> tuple[nn.Module, int, str]:  # fmt: skip
    """Trains (or resumes) the drafter; returns it in eval mode, the steps done and what stopped training."""
    dataset = encoded_pairs(loaded.tokenizer, sources, targets)
    base = loaded.base
    shortlist = _shortlist(dataset, base, loaded.tokenizer, options)
    # warmup_steps below 1 is a ratio of the steps to transformers: a run cut to a few steps still reaches its rate
    settings = dict(
        output_dir=os.fspath(out / "checkpoints"), per_device_train_batch_size=options.batch_size,
        num_train_epochs=options.epochs, max_steps=options.max_steps, learning_rate=options.learning_rate,
        warmup_steps=options.warmup_ratio, save_steps=options.save_steps, save_total_limit=2, logging_steps=10,
        report_to=[], use_cpu=not torch.cuda.is_available(), seed=options.seed, disable_tqdm=not progress,
        train_sampling_strategy="group_by_length",
    )  # fmt: skip
    if options.kind == "heads":
        model: nn.Module = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=options.block_size))
        model.set_shortlist(shortlist)  # the heads are scored over their shortlist, as they draft
        trainer: Any = BlockwiseHeadsTrainer(
            model=model, args=BlockwiseHeadsTrainingArguments(lr_scheduler_type="linear", **settings),
            train_dataset=dataset,
        )  # fmt: skip
    else:
        model = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=options.block_size))
        trainer = FeatureDrafterTrainer(
            model=model, args=FeatureDrafterTrainingArguments(lr_scheduler_type="cosine", **settings),
            train_dataset=dataset,
        )  # fmt: skip
    clock = TimeLimit(options.max_minutes)
    trainer.add_callback(clock)
    checkpoints = out / "checkpoints"
    trainer.train(resume_from_checkpoint=get_last_checkpoint(checkpoints) if checkpoints.is_dir() else None)
    if options.kind == "feature-drafter":
        model.set_shortlist(shortlist)
    stopped_by = "time limit" if clock.reached else "max steps" if options.max_steps > 0 else "epochs"
    return model.eval(), trainer.state.global_step, stopped_by


def _shortlist(dataset: Dataset, base: nn.Module, tokenizer: Any, options: OwnDrafterOptions) -> torch.Tensor | None:
    vocab_size = base.get_output_embeddings().weight.shape[0]
    if vocab_size <= 2 * options.shortlist:
        return None
    return frequent_tokens(dataset["labels"], options.shortlist, always=[tokenizer.eos_token_id])


def base_name(model: str | os.PathLike, out: Path) -> str:
    """How the saved adapter names its base: `".."` when it sits in a subfolder of the model directory (as shipped
    drafters do), a local model's absolute path, or the hub id as given."""
    local = Path(model)
    if not local.is_dir():
        return os.fspath(model)
    if out.resolve().parent == local.resolve():
        return ".."
    return os.fspath(local.resolve())

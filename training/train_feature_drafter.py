"""Train a feature drafter (EAGLE-style, one decoder layer) for a frozen seq2seq base, and optionally ship it.

What it does:

1. Reads the self-distillation data made by ``training/distill_sources.py`` (the base's own greedy outputs over
   every source-language text in ``../shared/data``): the drafter learns what the *base* does next.
2. Trains a ``FeatureDrafterModel`` with ``FeatureDrafterTrainer`` (base frozen: exact decoding), unrolling
   ``--training-depth`` drafting steps ("training-time test"); resumes from the newest checkpoint in ``--out``.
3. Restricts drafts to the ``--shortlist`` most frequent target tokens (verification keeps the full vocabulary).
4. Reports, on ``--eval-sentences`` test sentences at batch 1: accepted tokens per call, identical rate, BLEU.
5. With ``--ship DIR``: writes the drafter (config + safetensors of its weights only, naming the base as
   ``..``, i.e. the shipped base directory it sits in) and a model card.

Exact commands (from the repository root; wall times in ``training/README.md``)::

    python training/train_feature_drafter.py --base hf_blockwise/pretrained/multi30k-en-de \
        --distilled checkpoints/distill-multi30k-en-de --out checkpoints/feature-multi30k \
        --epochs 1 --block-size 3 --ship hf_blockwise/pretrained/multi30k-en-de/feature-drafter

    python training/train_feature_drafter.py --base hf_blockwise/pretrained/gec-en \
        --distilled checkpoints/distill-gec-en-v2 --out checkpoints/feature-gec-v2 --task gec --epochs 1 \
        --block-size 3 --ship hf_blockwise/pretrained/gec-en/feature-drafter

    python training/train_feature_drafter.py --base hf_blockwise/pretrained/marian-base-en-de \
        --distilled checkpoints/distill-marian-base --out checkpoints/feature-marian-base --epochs 2 \
        --block-size 4 --bf16 true --save-steps 50 \
        --ship hf_blockwise/pretrained/marian-base-en-de/feature-drafter

Training further in a later session (checkpoints do not outlive one) starts from the shipped weights:
``--init-from hf_blockwise/pretrained/marian-base-en-de/feature-drafter`` with a fresh ``--out``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import frequent_tokens
from hf_blockwise.evaluation import compare_to_greedy
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.training.arguments import parse_dataclass_args
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments
from hf_blockwise.training.feature_trainer import FeatureDrafterTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import DATA_ROOT, encode_dataset, load_distilled, load_multi30k
from recipe_common import atomic_write_json, last_checkpoint, ship_drafter, trainer_arguments


@dataclass
class TrainFeatureDrafterArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    base: str = field(metadata={"help": "the frozen base checkpoint directory"})
    distilled: str = field(metadata={"help": "folder written by training/distill_sources.py for this base"})
    out: str = field(default="checkpoints/feature-drafter", metadata={"help": "output / checkpoint directory"})
    task: Literal["multi30k", "gec"] = field(
        default="multi30k", metadata={"help": "test set of the final report: Multi30k test_2016 or JFLEG dev"}
    )
    data_dir: str = field(default=str(DATA_ROOT), metadata={"help": "the shared data folder"})
    block_size: int = field(default=5, metadata={"help": "k recorded in the config (drafts per step + 1)"})
    draft_threshold: float | None = field(
        default=None, metadata={"help": "default per-row draft threshold recorded in the config (chosen by speed)"}
    )
    training_depth: int = field(default=4, metadata={"help": "unrolled drafting steps in training"})
    cross_attention: bool = field(default=True, metadata={"help": "the layer attends to the encoder output"})
    ffn_size: int | None = field(
        default=None, metadata={"help": "the layer's feed-forward width (None: the base decoder's); sets its cost"}
    )
    feature_loss_weight: float = field(default=1.0)
    token_loss_weight: float = field(default=0.5)
    epochs: float = field(default=2.0, metadata={"help": "training epochs"})
    max_steps: int = field(default=-1, metadata={"help": "stop early (smoke tests)"})
    batch_size: int = field(default=64, metadata={"help": "training batch size"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (warmup, then cosine decay)"})
    warmup_steps: int = field(default=100)
    logging_steps: int = field(default=50, metadata={"help": "log losses and per-step accuracies every N steps"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    bf16: bool = field(
        default=False,
        metadata={"help": "bfloat16 CPU autocast in training (~1.8x faster where the CPU has avx512_bf16 or AMX)"},
    )
    save_steps: int = field(default=200, metadata={"help": "checkpoint every N steps (resumable)"})
    train_sentences: int | None = field(default=None, metadata={"help": "use only the first N (smoke tests)"})
    eval_sentences: int = field(default=300, metadata={"help": "test sentences decoded at the end (batch 1)"})
    eval_steps: int = field(
        default=0,
        metadata={
            "help": "every N steps, decode --eval-decoding-sentences Multi30k val sentences with the drafter and log "
            "its tokens per decoder call (eval_mean_accepted) beside the teacher-forced accuracies: the training "
            "curve of scripts/drafter_curve.py; 0 never"
        },
    )
    eval_decoding_sentences: int = field(default=50, metadata={"help": "sentences of each --eval-steps decoding"})
    max_new_tokens: int = field(default=128)
    shortlist: int | None = field(default=2000, metadata={"help": "draft among the N most frequent target tokens"})
    ship: str | None = field(default=None, metadata={"help": "also write the drafter here (inside the base dir)"})
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "start from a saved drafter (the shipped one, to train it further across sessions: checkpoints "
            "do not outlive a session), its shape and config as saved; a checkpoint in --out still takes precedence"
        },
    )


def test_set(args: TrainFeatureDrafterArguments) -> tuple[list[str], list[str]]:
    """The first `eval_sentences` of Multi30k test_2016_flickr, or of JFLEG dev (reference 0)."""
    if args.task == "multi30k":
        sources, references = load_multi30k(str(Path(args.data_dir) / "multi30k"))["test"]
    else:
        jfleg = Path(args.data_dir) / "jfleg"
        sources = (jfleg / "dev.src").read_text(encoding="utf-8").splitlines()
        references = (jfleg / "dev.ref0").read_text(encoding="utf-8").splitlines()
    return sources[: args.eval_sentences], references[: args.eval_sentences]


def model_card(model: FeatureDrafterModel, results: dict) -> str:
    fc = model.feature_config
    return f"""# Feature drafter for `{results["base"]}`

Research artefact trained here by `training/distill_sources.py` and `training/train_feature_drafter.py` (exact
commands in their docstrings). One decoder layer (width {fc.hidden_size}, {fc.num_attention_heads} heads, FFN
{fc.ffn_size}, cross-attention {"on" if fc.cross_attention else "off"}) drafting the base's next decoder states,
trained with the base frozen on the base's own greedy outputs (self-distillation over the texts listed in
`training/README.md`; the data's licences apply: research use only).

- Teacher-forced top-1 agreement of drafts 1..{len(results["step_accuracies"])} with the base's greedy token:
  {" / ".join(f"{a:.2f}" for a in results["step_accuracies"])}.
- Exact decoding at batch 1, k = {results["block_size"]}, on the first {results["num_sentences"]} {results["test_set"]}
  sentences: {results["mean_accepted"]:.2f} tokens per decoder call; identical to greedy
  {results["identical"]}/{results["num_sentences"]}; {results["speedup"]:.2f}x greedy in that run.

Load: `FeatureDrafterModel.from_pretrained(this_dir)` (the base is the directory above), or
`FeatureDrafterModel.from_pretrained(this_dir, base_model=model)` with a base already loaded.
"""


def train(args: TrainFeatureDrafterArguments):
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.base, dtype=torch.float32)
    sources, targets = load_distilled(args.distilled)
    if args.train_sentences:
        sources, targets = sources[: args.train_sentences], targets[: args.train_sentences]
    train_dataset = encode_dataset(tokenizer, sources, targets)
    config = FeatureDrafterConfig(
        block_size=args.block_size,
        draft_threshold=args.draft_threshold,
        cross_attention=args.cross_attention,
        ffn_size=args.ffn_size,
        training_depth=args.training_depth,
        base_model_name_or_path=args.base,
    )
    if args.init_from:  # the saved drafter as it is (its own shape and config) on this base
        model = FeatureDrafterModel.from_pretrained(args.init_from, base_model=base)
    else:
        model = FeatureDrafterModel(base, config)
    training_args = trainer_arguments(
        FeatureDrafterTrainingArguments,
        args,
        lr_scheduler_type="cosine",
        feature_loss_weight=args.feature_loss_weight,
        token_loss_weight=args.token_loss_weight,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        bf16=args.bf16,
        **_evaluation_settings(args),
    )
    trainer = FeatureDrafterTrainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=_eval_dataset(args, tokenizer)
    )
    trainer.train(resume_from_checkpoint=last_checkpoint(args.out))
    accuracies = _last_step_accuracies(trainer.state.log_history)
    if args.shortlist:
        model.set_shortlist(frequent_tokens(train_dataset["labels"], args.shortlist, always=[tokenizer.eos_token_id]))
    model.save_pretrained(os.path.join(args.out, "final"))
    return model.eval(), tokenizer, accuracies


def _evaluation_settings(args: TrainFeatureDrafterArguments) -> dict:
    """Periodic evaluation (`--eval-steps`): decoding at batch 1, as the shipped drafter is measured."""
    if not args.eval_steps:
        return {}
    return {
        "eval_strategy": "steps", "eval_steps": args.eval_steps, "eval_decoding_batch_size": 1,
        "eval_decoding_samples": args.eval_decoding_sentences, "per_device_eval_batch_size": 64,
    }  # fmt: skip


def _eval_dataset(args: TrainFeatureDrafterArguments, tokenizer):
    """Multi30k val's first `--eval-decoding-sentences` pairs, for `--eval-steps` (none without it)."""
    if not args.eval_steps:
        return None
    sources, references = load_multi30k(str(Path(args.data_dir) / "multi30k"))["val"]
    count = args.eval_decoding_sentences
    return encode_dataset(tokenizer, sources[:count], references[:count])


def _last_step_accuracies(history: list[dict]) -> list[float]:
    """Per drafting step, the mean teacher-forced accuracy over the last five training logs."""
    logs = [entry for entry in history if "step_1_accuracy" in entry][-5:]
    if not logs:
        return []
    steps = sorted(int(key.split("_")[1]) for key in logs[-1] if key.endswith("_accuracy") and key.startswith("step_"))
    return [round(sum(entry[f"step_{step}_accuracy"] for entry in logs) / len(logs), 3) for step in steps]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(TrainFeatureDrafterArguments, argv, __doc__.split("\n", 1)[0])
    started = time.time()
    model, tokenizer, accuracies = train(args)
    sources, references = test_set(args)
    comparison = compare_to_greedy(
        model, tokenizer, sources, references, assistant=model.drafter(), batch_size=1,
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    results = {
        **comparison.summary(),
        "base": args.base,
        "test_set": "Multi30k test_2016_flickr" if args.task == "multi30k" else "JFLEG dev",
        "block_size": model.feature_config.block_size,
        "step_accuracies": accuracies,
        "epochs": args.epochs,
        "wall_time_s": round(time.time() - started, 1),
    }
    atomic_write_json(os.path.join(args.out, "feature_drafter_log.json"), results)
    print(json.dumps(results, indent=2))
    if args.ship:
        ship_drafter(model, args.ship, model_card(model, results))
        print(f"shipped to {args.ship}")


if __name__ == "__main__":
    main()

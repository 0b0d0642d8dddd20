"""Train a non-autoregressive drafter (GAD, Ge et al. §3.2) for the Multi30k en→de base, and optionally ship it.

What it does:

1. Loads the base (the verifier) and its tokenizer.
2. Targets: the base's own greedy outputs on the training sources (sequence-level distillation, decoded once
   with ``hf_blockwise.training.distill`` and cached as JSON lines; ``train_heads.py`` writes the same cache, pass it
   with ``--distilled-cache`` to skip the 6 minutes of decoding).
3. Builds the drafter from the verifier (``NARDrafterModel.from_verifier``: same architecture,
   ``--decoder-layers`` decoder layers, weights copied from the verifier, the tokenizer's unknown token as
   [MASK]) and trains it with ``NARDrafterTrainer``: random prefix, ``block_size - 1`` masked targets.
   Re-running resumes from the newest checkpoint in ``--out``.
4. Reports, on the first 300 sentences of test_2016_flickr at batch 1: mean accepted block, speed against
   greedy and identical outputs (exact acceptance).
5. With ``--ship DIR``: writes the drafter in fp16, relative to the verifier (only the weights training changed;
   ``NARDrafterModel.from_pretrained(DIR)`` rebuilds the rest from the verifier it names).

Exact command of the shipped drafter (from the repository root)::

    python training/train_nar_drafter.py --base hf_blockwise/pretrained/multi30k-en-de \
        --out checkpoints/nar-k8 --distilled-cache checkpoints/distilled-beam1.jsonl --block-size 8 \
        --decoder-layers 2 --freeze-encoder --epochs 2 --prefixes-per-example 4 --threads 2 \
        --ship hf_blockwise/pretrained/multi30k-en-de/nar-drafter

Wall time on a 2-core CPU (2 threads): about 29 minutes for the command above. ``<out>/nar_log.json`` records
``train_wall_time_s`` (training, summed over every resumed run: each checkpoint keeps the running total) and
``wall_time_s`` (this invocation).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, TrainerCallback

from hf_blockwise.evaluation import compare_to_greedy
from hf_blockwise.modeling.nar_model import NARDrafterModel
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.training.arguments import parse_dataclass_args
from hf_blockwise.training.distill import distill_texts
from hf_blockwise.training.nar_config import NARDrafterTrainingArguments
from hf_blockwise.training.nar_trainer import NARDrafterTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import MULTI30K_DIR, encode_dataset, load_multi30k
from recipe_common import atomic_write_json, last_checkpoint, trainer_arguments, write_model_card


@dataclass
class TrainNARDrafterArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    base: str = field(default="hf_blockwise/pretrained/multi30k-en-de", metadata={"help": "verifier checkpoint"})
    dataset: str = field(default=str(MULTI30K_DIR), metadata={"help": "Multi30k folder or hub name"})
    out: str = field(default="checkpoints/nar-k8", metadata={"help": "output / checkpoint directory"})
    distilled_cache: str | None = field(
        default=None, metadata={"help": "JSON-lines cache of greedy outputs (unset: in --out)"}
    )
    block_size: int = field(default=8, metadata={"help": "k: tokens per step, k - 1 drafts"})
    decoder_layers: int = field(default=1, metadata={"help": "decoder layers of the drafter"})
    encoder_layers: int | None = field(default=None, metadata={"help": "unset: the verifier's"})
    freeze_encoder: bool = field(default=False, metadata={"help": "train the decoder only"})
    epochs: float = field(default=4.0, metadata={"help": "training epochs"})
    prefixes_per_example: int = field(default=4, metadata={"help": "random prefixes per sentence per step"})
    max_steps: int = field(default=-1, metadata={"help": "stop early (smoke tests)"})
    batch_size: int = field(default=32, metadata={"help": "examples per batch (times prefixes per example)"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate (linear warmup and decay)"})
    warmup_steps: int = field(default=200, metadata={"help": "linear warmup steps"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    train_sentences: int | None = field(default=None, metadata={"help": "use only the first N (smoke tests)"})
    eval_sentences: int = field(default=300, metadata={"help": "test_2016_flickr sentences decoded at the end"})
    max_new_tokens: int = field(default=128, metadata={"help": "length limit of distillation and test"})
    ship: str | None = field(default=None, metadata={"help": "also write the drafter (fp16) here"})


def parse_args(argv: Sequence[str] | None = None) -> TrainNARDrafterArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `TrainNARDrafterArguments`."""
    return parse_dataclass_args(TrainNARDrafterArguments, argv, __doc__.split("\n", 1)[0])


# training seconds so far, stored in each checkpoint so a resumed run reports its whole training time
CLOCK_FILE = "training_clock.json"


class TrainingClock(TrainerCallback):
    """Training wall time summed over every run that led to the newest checkpoint."""

    def __init__(self, resume_from: str | None) -> None:
        self.previous_seconds = 0.0
        if resume_from is not None and os.path.isfile(os.path.join(resume_from, CLOCK_FILE)):
            with open(os.path.join(resume_from, CLOCK_FILE), encoding="utf-8") as handle:
                self.previous_seconds = float(json.load(handle)["train_seconds"])
        self.started = time.time()

    def seconds(self) -> float:
        return self.previous_seconds + time.time() - self.started

    def on_save(self, args, state, control, **kwargs) -> None:
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(checkpoint):
            text = json.dumps({"train_seconds": round(self.seconds(), 1)}) + "\n"
            atomic_write_text(os.path.join(checkpoint, CLOCK_FILE), text)


def train(args: TrainNARDrafterArguments):
    """Trains (or resumes) the drafter; returns it (eval mode), the verifier, tokenizer, data splits and the
    training seconds of every run so far."""
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    verifier = AutoModelForSeq2SeqLM.from_pretrained(args.base, dtype=torch.float32).eval()
    data = load_multi30k(args.dataset)
    sources, _references = data["train"]
    if args.train_sentences:
        sources = sources[: args.train_sentences]
    cache = args.distilled_cache or os.path.join(args.out, "distilled-beam1.jsonl")
    targets = distill_texts(verifier, tokenizer, sources, cache, batch_size=64, max_new_tokens=args.max_new_tokens)
    train_dataset = encode_dataset(tokenizer, sources, targets)

    mask_token_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.unk_token_id
    drafter = NARDrafterModel.from_verifier(
        verifier, mask_token_id=mask_token_id, block_size=args.block_size, decoder_layers=args.decoder_layers,
        encoder_layers=args.encoder_layers, verifier_name_or_path=args.base,
    )  # fmt: skip
    training_args = trainer_arguments(
        NARDrafterTrainingArguments,
        args,
        prefixes_per_example=args.prefixes_per_example,
        freeze_encoder=args.freeze_encoder,
        lr_scheduler_type="linear",
        logging_steps=50,
        save_steps=300,
    )
    resume_from = last_checkpoint(args.out)
    clock = TrainingClock(resume_from)
    trainer = NARDrafterTrainer(
        drafter, training_args, train_dataset=train_dataset, processing_class=tokenizer, callbacks=[clock]
    )
    trainer.train(resume_from_checkpoint=resume_from)
    drafter.model.eval()
    drafter.save_pretrained(os.path.join(args.out, "final"))
    return drafter, verifier, tokenizer, data, clock.seconds()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    drafter, verifier, tokenizer, data, train_seconds = train(args)
    test_sources, test_references = (split[: args.eval_sentences] for split in data["test"])
    comparison = compare_to_greedy(
        verifier, tokenizer, test_sources, test_references, assistant=drafter.drafter(verifier=verifier), batch_size=1,
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    results = {
        **comparison.summary(),
        "block_size": args.block_size,
        "decoder_layers": args.decoder_layers,
        "epochs": args.epochs,
        "prefixes_per_example": args.prefixes_per_example,
        "train_wall_time_s": round(train_seconds, 1),
        "wall_time_s": round(time.time() - started, 1),
    }
    atomic_write_json(os.path.join(args.out, "nar_log.json"), results)
    print(json.dumps(results, indent=2))
    if args.ship:
        # only the trained weights: the encoder and embeddings are the verifier's, rebuilt from it on loading
        drafter.save_pretrained(
            args.ship,
            dtype=torch.float16,
            relative_to=verifier,
            verifier_name_or_path=os.path.relpath(args.base, args.ship),
        )
        card = model_card(args, results, architecture=type(drafter.model).__name__)
        write_model_card(args.ship, card)
        print(f"shipped to {args.ship}")


def model_card(args: TrainNARDrafterArguments, results: dict, architecture: str) -> str:
    slower = " See `docs/results.md` for why it is slower than greedy on a CPU." if results["speedup"] < 1 else ""
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"a {os.cpu_count()}-core CPU"
    return f"""# nar-drafter: a non-autoregressive drafter (GAD) for {os.path.basename(os.path.normpath(args.base))}

Research artefact trained here by `training/train_nar_drafter.py` (exact command in its docstring).

- **What it is**: the verifier's own architecture ({architecture}) with {args.decoder_layers} decoder layers, its
  weights initialised from the verifier; given the source and the verified prefix followed by [MASK]
  placeholders it drafts the next {args.block_size - 1} tokens in one pass (Ge et al. 2022, §3.2). Saved relative
  to the verifier (`verifier_name_or_path` in `nar_drafter_config.json`): only the weights training changed are
  stored, in fp16; `NARDrafterModel.from_pretrained` rebuilds the rest from the verifier.
- **Data**: the verifier's greedy outputs on the Multi30k training sources (sequence-level distillation);
  Multi30k / Flickr30k terms, research use only, not for commercial use.
- **Training**: {args.epochs:g} epochs, {args.prefixes_per_example} random prefixes per sentence per step, encoder
  {"frozen" if args.freeze_encoder else "trained"}; {results["train_wall_time_s"] / 60:.1f} min on {machine}.
- **Decoding** (`generate(..., custom_generate=blockwise_generate, assistant=drafter)`, exact acceptance): on the
  first {results["num_sentences"]} sentences of test_2016_flickr at batch {results["batch_size"]}, identical to
  greedy: {results["identical"]}/{results["num_sentences"]}; mean accepted block {results["mean_accepted"]:.2f};
  wall-clock {results["speedup"]:.2f}x greedy in that run ({args.threads} CPU threads).{slower}
"""


if __name__ == "__main__":
    main()

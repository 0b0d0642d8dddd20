"""Train a feature drafter (EAGLE-style, one decoder layer that cross-attends to the audio encoder) for the speech
model of `train_speech.py`, with the base frozen, and check it is exact on the held-out utterances.

Targets are the base's own next decoder states and greedy tokens, teacher-forced on the reference transcripts, or
with `--distill-utterances N` on the base's own greedy transcripts of the first N training utterances
(self-distillation: the prefixes greedy decoding meets; cached in `--out`). Measured on the shipped base (held-out
WER 65.8%): references, 712 steps, 1.64 tokens per decoder call; self-distilled on 8,000 utterances, 250 steps,
1.36 (`training/README.md`). Audio gets the same noise as in the base's training. Checkpoints hold only the
drafter; re-running with the same `--out` resumes.

Exact command (from the repository root, after `train_speech.py`)::

    python training/train_speech_drafter.py --speech-out checkpoints/speech-en \
        --out checkpoints/speech-drafter-references --threads 2 --ship hf_blockwise/pretrained/speech-en/feature-drafter

Smoke test::

    python training/train_speech_drafter.py --speech-out /tmp/smoke_speech --out /tmp/smoke_speech_drafter \
        --max-steps 3 --eval-utterances 4

Wall time on the 2-core CPU: see `training/README.md`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from hf_blockwise import blockwise_generate, check_decoder
from hf_blockwise.evaluation.harness import DecoderCallCounter
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.shortlist import frequent_tokens
from hf_blockwise.training.arguments import parse_dataclass_args
from hf_blockwise.training.feature_config import FeatureDrafterTrainingArguments
from hf_blockwise.training.feature_trainer import FeatureDrafterTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_common import atomic_write_json, last_checkpoint, ship_drafter, trainer_arguments
from speech_data import SAMPLING_RATE, SpeechSplit
from train_speech import SpeechCollator, heldout_audio, transcribe


@dataclass
class TrainSpeechDrafterArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    speech_out: str = field(metadata={"help": "the --out folder of train_speech.py (model/ and speech/)"})
    out: str = field(default="checkpoints/speech-drafter", metadata={"help": "output / checkpoint directory"})
    block_size: int = field(default=5, metadata={"help": "k recorded in the config (drafts per step + 1)"})
    training_depth: int = field(default=4, metadata={"help": "unrolled drafting steps in training"})
    epochs: float = field(default=1.0)
    max_steps: int = field(default=-1, metadata={"help": "stop early (smoke tests)"})
    batch_size: int = field(default=32)
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (warmup, then cosine decay)"})
    warmup_steps: int = field(default=100)
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    eval_utterances: int = field(default=100, metadata={"help": "held-out utterances decoded at the end (batch 1)"})
    shortlist: int | None = field(default=1000, metadata={"help": "draft among the N most frequent tokens"})
    distill_utterances: int = field(
        default=0, metadata={"help": "train on the base's own transcripts of this many utterances (0: references)"}
    )
    ship: str | None = field(default=None, metadata={"help": "also write the drafter here (inside the model dir)"})


class DistilledSplit(torch.utils.data.Dataset):
    """Training utterances with the base's own greedy transcripts in place of the references."""

    def __init__(self, split: SpeechSplit, texts: Sequence[str]) -> None:
        self.split, self.texts = split, list(texts)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> tuple[Any, str]:
        return self.split[index][0], self.texts[index]


def distilled_split(
    base: WhisperForConditionalGeneration, processor: WhisperProcessor, split: SpeechSplit, count: int, cache: Path
) -> DistilledSplit:
    """The first `count` utterances of `split` with the base's greedy transcripts (of the clean audio; the collator
    adds noise in training), computed once and cached in `cache` (JSON list)."""
    if cache.is_file():
        texts = json.loads(cache.read_text(encoding="utf-8"))
        if len(texts) == count:
            return DistilledSplit(split, texts)
    texts = transcribe(base, processor, [split[index][0] for index in range(count)], batch_size=32)
    atomic_write_json(cache, texts)
    return DistilledSplit(split, texts)


def check_exact(model: FeatureDrafterModel, processor: WhisperProcessor, audio: Sequence) -> dict[str, float]:
    """Greedy and drafted transcripts of `audio` at batch 1: how many are identical and tokens per decoder call."""
    base = model.base_model
    check_decoder(base)  # the loop's once-per-model probe makes decoder calls of its own: not counted below
    identical, tokens, calls = 0, 0, 0
    counter = DecoderCallCounter(base)
    try:
        for samples in audio:
            features = processor(audio=samples, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
            greedy = base.generate(input_features=features)
            counter.reset()
            drafted = base.generate(
                input_features=features, custom_generate=blockwise_generate, assistant=model.drafter()
            )
            identical += int(torch.equal(greedy, drafted))
            tokens += greedy.shape[1]  # Whisper returns only the new tokens (the decoder prompt is dropped)
            calls += counter.calls
    finally:
        counter.close()
    return {"identical": identical, "utterances": len(audio), "tokens_per_call": round(tokens / max(calls, 1), 3)}


MODEL_CARD = """# Feature drafter for `speech-en`

Research artefact trained here by `training/train_speech_drafter.py` (command and wall time in `training/README.md`):
one decoder layer that reads the frozen speech model's last decoder states and cross-attends to its audio encoder's
output, trained for {steps} steps on the base's training utterances (teacher-forced on {prefixes}, the
base's own next states and greedy tokens as targets; the data's licences apply: research use only).

- Exact decoding at batch 1, k = {block_size}, on {utterances} held-out utterances: identical to greedy
  {identical}/{utterances}, {tokens_per_call:.2f} tokens per decoder call.

Load: `FeatureDrafterModel.from_pretrained(this_dir)` (the base is the directory above), or
`FeatureDrafterModel.from_pretrained(this_dir, base_model=model)`.
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(TrainSpeechDrafterArguments, argv, __doc__.split("\n", 1)[0])
    torch.set_num_threads(args.threads)
    started = time.time()
    speech = Path(args.speech_out)
    base = WhisperForConditionalGeneration.from_pretrained(speech / "model", dtype=torch.float32).eval()
    processor = WhisperProcessor.from_pretrained(speech / "model")
    train = SpeechSplit(speech / "speech", "train")
    if args.distill_utterances:
        count = min(args.distill_utterances, len(train))
        train = distilled_split(base, processor, train, count, Path(args.out) / "distilled.json")
    config = FeatureDrafterConfig(
        block_size=args.block_size, training_depth=args.training_depth, base_model_name_or_path=str(speech / "model")
    )
    model = FeatureDrafterModel(base, config)
    training_args = trainer_arguments(
        FeatureDrafterTrainingArguments, args, lr_scheduler_type="cosine", logging_steps=50, save_steps=200,
        remove_unused_columns=False,
    )  # fmt: skip
    collator = SpeechCollator(processor.feature_extractor, processor.tokenizer, seed=1, ctc=False)
    trainer = FeatureDrafterTrainer(model=model, args=training_args, train_dataset=train, data_collator=collator)
    trainer.train(resume_from_checkpoint=last_checkpoint(args.out))
    model.eval()
    if args.shortlist:
        texts = train.texts if isinstance(train, DistilledSplit) else [u.text for u in train.utterances]
        labels = [processor.tokenizer.encode(f" {text}", add_special_tokens=False) for text in texts]
        model.set_shortlist(frequent_tokens(labels, args.shortlist, always=[processor.tokenizer.eos_token_id]))
    model.save_pretrained(os.path.join(args.out, "final"))

    heldout = SpeechSplit(speech / "speech", "heldout")
    results = {
        **check_exact(model, processor, heldout_audio(heldout, seed=0)[: args.eval_utterances]),
        "block_size": args.block_size,
        "steps": trainer.state.global_step,
        "wall_time_s": round(time.time() - started, 1),
    }
    atomic_write_json(os.path.join(args.out, "speech_drafter_log.json"), results)
    print(json.dumps(results, indent=2))
    if args.ship:
        prefixes = (
            f"the base's own greedy transcripts of {len(train)} of them" if args.distill_utterances
            else "their reference transcripts"
        )  # fmt: skip
        ship_drafter(model, args.ship, MODEL_CARD.format(prefixes=prefixes, **results))  # fp16, naming the base as ".."
        print(f"shipped to {args.ship}")


if __name__ == "__main__":
    main()

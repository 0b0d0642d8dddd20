"""Train proposal heads on a frozen Multi30k en→de base with `BlockwiseHeadsTrainer`, and optionally ship them.

What it does:

1. Loads the base trained by ``training/train_base.py`` and its tokenizer.
2. Targets: ``--targets gold`` uses the German references; ``--targets distilled`` (default) uses the base's
   own outputs on the training sources (Stern §6.2), decoded once with ``hf_blockwise.training.distill`` and cached in
   ``<out>/distilled.jsonl`` (resumable). With a frozen base the heads must predict the base's *greedy* output,
   so the teacher decodes greedily by default (``--teacher-beams 1``).
3. Trains ``block_size - 1`` heads with the base frozen (lossless decoding) and resumes from the newest
   checkpoint in ``<out>`` when re-run.
4. Reports, on the first 300 sentences of test_2016_flickr: mean accepted block and sacreBLEU.
5. With ``--ship DIR``: writes base (fp16), heads (fp16), tokenizer and a model card into one directory that
   ``BlockwiseHeadsModel.from_pretrained(DIR)`` and ``hf-blockwise demo --model DIR`` load offline.

Exact command of the shipped heads (from the repository root; the base is the shipped one, which train_base.py
made; with ``--base checkpoints/base-multi30k`` it is the same model in fp32)::

    python training/train_heads.py --base hf_blockwise/pretrained/multi30k-en-de --out checkpoints/heads-k4-h256 \
        --block-size 4 --head-hidden-size 256 --epochs 3 --threads 2 --shortlist 2000 \
        --ship hf_blockwise/pretrained/multi30k-en-de

Heads beside the realistic base (``marian-base-en-de``; its distillation data from ``distill_sources.py``)::

    python training/train_heads.py --base hf_blockwise/pretrained/marian-base-en-de \
        --out checkpoints/heads-marian-base --distilled-dir checkpoints/distill-marian-base --block-size 4 \
        --head-hidden-size 256 --epochs 0.5 --threads 2 --shortlist 2000 --bf16 true --eval-sentences 100 \
        --ship-beside-base true

Stern et al.'s combined scoring and proposal model ("Both": the base fine-tuned together with k - 1 = 7 heads on its
own greedy outputs, the heads at ten times the base's rate, scored over their 2,000-token shortlist), shipped as
``marian-base-en-de-stern``::

    python training/train_heads.py --base hf_blockwise/pretrained/marian-base-en-de --out checkpoints/stern-k8 \
        --distilled-dir checkpoints/distill-marian-base-v4 --block-size 8 --head-hidden-size 256 \
        --base-training full --lr 1e-3 --base-lr 1e-4 --epochs 2 --warmup-steps 60 --threads 2 --shortlist 2000 \
        --eval-sentences 300 --eval-batch-size 1 --ship hf_blockwise/pretrained/marian-base-en-de-stern

Wall time on a 2-core CPU (2 threads): 29.4 min (distillation of 29k sentences about 6 min, 1,362 steps,
test decoding 1 min; the machine was partly busy with other work); ``<out>/heads_log.json`` records it
(``wall_time_s``). Result: mean accepted block 1.54 at batch 1 on the first 300 test_2016 sentences, 300/300
identical to greedy; teacher-forced top-1 accuracy of heads 1 / 2 / 3: 0.48 / 0.29 / 0.22.
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
from accelerate import PartialState
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel, frequent_tokens
from hf_blockwise.evaluation import compare_to_greedy
from hf_blockwise.training.arguments import parse_dataclass_args
from hf_blockwise.training.distill import distill_texts
from hf_blockwise.training.heads_config import BlockwiseHeadsTrainingArguments
from hf_blockwise.training.heads_trainer import BlockwiseHeadsTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import MULTI30K_DIR, encode_dataset, load_distilled, load_multi30k
from recipe_common import (
    atomic_write_json,
    last_checkpoint,
    ship_drafter,
    ship_model,
    trainer_arguments,
    write_model_card,
)
from text_seq2seq import bleu


@dataclass
class TrainHeadsArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    base: str = field(default="checkpoints/base-multi30k", metadata={"help": "base checkpoint directory"})
    dataset: str = field(default=str(MULTI30K_DIR), metadata={"help": "Multi30k folder or hub name"})
    out: str = field(default="checkpoints/heads-k4", metadata={"help": "output / checkpoint directory"})
    block_size: int = field(default=4, metadata={"help": "k: tokens per step, k - 1 heads"})
    head_hidden_size: int | None = field(default=None, metadata={"help": "hidden width per head"})
    condition_on_token: bool = field(
        default=False, metadata={"help": "heads also read the token the base chose (see config)"}
    )
    sequential: bool = field(
        default=False, metadata={"help": "Hydra-style sequential heads: head i reads the drafts of heads < i"}
    )
    distilled_dir: str | None = field(
        default=None,
        metadata={
            "help": "train on the self-distillation data of training/distill_sources.py (every source text in "
            "../shared/data) instead of distilling the Multi30k training sources"
        },
    )
    targets: Literal["gold", "distilled"] = field(
        default="distilled", metadata={"help": "gold: the references; distilled: the base's own outputs"}
    )
    teacher_beams: int = field(default=1, metadata={"help": "beam size of the distillation teacher"})
    distilled_cache: str | None = field(
        default=None, metadata={"help": "JSON-lines cache of teacher outputs (unset: in --out)"}
    )
    base_training: Literal["frozen", "full", "lora"] = field(
        default="frozen",
        metadata={"help": "'full' fine-tunes the base too, 'lora' trains LoRA adapters (q_proj, v_proj) on it"},
    )
    epochs: float = field(default=1.0, metadata={"help": "training epochs"})
    max_steps: int = field(default=-1, metadata={"help": "stop early (smoke tests)"})
    batch_size: int = field(default=64, metadata={"help": "training batch size per process"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (linear warmup and decay)"})
    base_lr: float | None = field(
        default=None,
        metadata={"help": "with --base-training full: the base's own peak learning rate (the heads keep --lr)"},
    )
    warmup_steps: int = field(default=100, metadata={"help": "linear warmup steps"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    bf16: bool = field(
        default=False,
        metadata={"help": "bfloat16 CPU autocast in training (~1.8x faster where the CPU has avx512_bf16 or AMX)"},
    )
    train_sentences: int | None = field(default=None, metadata={"help": "use only the first N (smoke tests)"})
    eval_sentences: int = field(default=300, metadata={"help": "test_2016_flickr sentences decoded at the end"})
    max_new_tokens: int = field(default=128, metadata={"help": "length limit of distillation and test"})
    eval_batch_size: int = field(default=1, metadata={"help": "batch size of the test decoding"})
    shortlist: int | None = field(
        default=None,
        metadata={
            "help": "restrict the heads' proposals, and their training loss, to the N most frequent target tokens "
            "(output unchanged)"
        },
    )
    ship: str | None = field(default=None, metadata={"help": "also write a self-contained shipped checkpoint here"})
    ship_heads: str | None = field(
        default=None, metadata={"help": "also write the heads alone here, naming the base as '..' (a subfolder)"}
    )
    ship_beside_base: bool = field(
        default=False,
        metadata={
            "help": "also write the heads alone into the --base directory itself, naming it '.' (a shipped base "
            "gains heads; its weights and model card are left as they are)"
        },
    )


def parse_args(argv: Sequence[str] | None = None) -> TrainHeadsArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `TrainHeadsArguments`."""
    return parse_dataclass_args(TrainHeadsArguments, argv, __doc__.split("\n", 1)[0])


def ship(model: BlockwiseHeadsModel, tokenizer, directory: str, results: dict) -> None:
    """Base and heads in fp16 (half the size; loaded back as fp32) with tokenizer and model card."""
    ship_model(model.base_model, tokenizer, directory)
    model.save_pretrained(directory, base_model_name_or_path=".", dtype=torch.float16)
    # a fully fine-tuned base is another model: its card compares it with the starting base (`main` measured both)
    card = combined_model_card(model, results) if results["base_training"] == "full" else model_card(model, results)
    write_model_card(directory, card)


def combined_model_card(model: BlockwiseHeadsModel, results: dict) -> str:
    """The card of a base fine-tuned together with its heads (Stern's "Both"): its greedy BLEU beside the
    starting base's, on the same sentences."""
    config = model.blockwise_config
    name = os.path.basename(os.path.normpath(results["ship"]))
    return f"""# {name}: Stern et al.'s combined scoring and proposal model

`{results["base"]}` fine-tuned together with {config.num_heads} proposal heads (block size k = {config.block_size},
hidden {config.head_hidden_size} each) on its own greedy outputs (`{results["distilled_dir"]}`), Stern et al. (2018)
§6's "Both" setting: distilled targets and a fine-tuned base. `training/train_heads.py` made it; the exact
command and wall time are in `training/README.md`.

- **Quality**: greedy BLEU on the first {results["num_sentences"]} sentences of Multi30k test_2016_flickr
  (sacreBLEU, cased, detokenized): **{results["greedy_bleu"]:.1f}**, against {results["starting_greedy_bleu"]:.1f} for
  the starting base on the same sentences.
- **Drafting**: mean accepted block at batch {results["batch_size"]}, eager: {results["mean_accepted"]:.2f} tokens per
  decoder call; identical to this model's own greedy: {results["identical"]}/{results["num_sentences"]}. The
  exact reference is this model's greedy `generate`, as for any model: the fine-tuning changed the base.
- **Data**: Multi30k task 1 (Flickr30k terms: research use only) and Europarl; not for commercial use.
- **Stored** in fp16 (base and heads); loaded as float32.
"""


def model_card(model: BlockwiseHeadsModel, results: dict) -> str:
    size = model.blockwise_config.shortlist_size
    shortlist = "" if size is None else f"; they propose among the {size} most frequent target tokens (shortlist)"
    return f"""# multi30k-en-de: a small Marian-style en→de model with blockwise proposal heads

Research artefact trained here from scratch by `training/train_base.py` and `training/train_heads.py`.

- **Data**: Multi30k task 1 (Flickr30k captions, en→de), 29,000 training pairs; licence: research use only
  (Flickr30k terms). Not for commercial use.
- **Base**: MarianMTModel, d_model 256, 3+3 layers, joint 8k BPE, greedy BLEU on the first
  {results["num_sentences"]} sentences of test_2016_flickr: {results["greedy_bleu"]:.1f} (sacreBLEU, cased,
  detokenized).
- **Heads**: block size k = {model.blockwise_config.block_size} ({model.blockwise_config.num_heads} heads, hidden
  {model.blockwise_config.head_hidden_size} each), trained with the base frozen on {results["targets"]} targets
  for {results["epochs"]:g} epochs{shortlist}.
- **Decoding**: lossless (exact acceptance): blockwise output = greedy output.
  Mean accepted block on the same sentences, decoded in batches of {results["batch_size"]}:
  {results["mean_accepted"]:.2f}; identical to greedy: {results["identical"]}/{results["num_sentences"]}; wall-clock
  {results["speedup"]:.2f}x greedy in that run ({torch.get_num_threads()} CPU threads).
- **Stored** in fp16; `hf-blockwise demo` loads it as fp32 and measures the speedup live.

Regenerate: see the commands in the docstrings of `training/train_base.py` and `training/train_heads.py`.
"""


def process_state() -> PartialState:
    """This process's place under `accelerate launch` (one CPU process per rank where there is no GPU).

    The state is shared by the whole process and its first creation decides the device, so it must agree with
    the trainer's `use_cpu` below.
    """
    return PartialState(cpu=not torch.cuda.is_available())


def save_final(model: BlockwiseHeadsModel, directory: str, base_training: str) -> None:
    """Heads (and a LoRA adapter) only; a fully fine-tuned base is saved beside them."""
    if base_training == "full":
        model.base_model.save_pretrained(directory)
        model.save_pretrained(directory, base_model_name_or_path=".")
    else:
        model.save_pretrained(directory)


def train(args: TrainHeadsArguments):
    """Trains (or resumes) heads as `args` say; returns the model (in eval mode), tokenizer and data splits."""
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.base, dtype=torch.float32)
    data = load_multi30k(args.dataset)
    sources, references = data["train"]
    if args.distilled_dir:
        sources, references = load_distilled(args.distilled_dir)
    if args.train_sentences:
        sources, references = sources[: args.train_sentences], references[: args.train_sentences]
    if args.distilled_dir:
        targets = references  # already the base's own greedy outputs
    elif args.targets == "distilled":
        cache = args.distilled_cache or os.path.join(args.out, f"distilled-beam{args.teacher_beams}.jsonl")
        # under `accelerate launch` the main process fills the cache, the others then read it
        with process_state().main_process_first():
            targets = distill_texts(
                base, tokenizer, sources, cache, batch_size=64, num_beams=args.teacher_beams,
                max_new_tokens=args.max_new_tokens,
            )  # fmt: skip
    else:
        targets = references
    train_dataset = encode_dataset(tokenizer, sources, targets)

    config = BlockwiseHeadsConfig(
        block_size=args.block_size,
        head_hidden_size=args.head_hidden_size,
        condition_on_token=args.condition_on_token,
        sequential=args.sequential,
        base_model_name_or_path=args.base,
    )
    model = BlockwiseHeadsModel(base, config)
    training_args = trainer_arguments(
        BlockwiseHeadsTrainingArguments,
        args,
        base_training=args.base_training,
        base_learning_rate=args.base_lr,
        lora_target_modules=["q_proj", "v_proj"] if args.base_training == "lora" else None,
        lr_scheduler_type="linear",
        # batches of similar source lengths: random batches of captions and Europarl sentences were two-thirds padding
        # (64 x 54 target positions for ~1,200 tokens), which a step pays for in full
        train_sampling_strategy="group_by_length",
        logging_steps=50,
        save_steps=100,
        bf16=args.bf16,
    )
    trainer = BlockwiseHeadsTrainer(
        model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer
    )
    if args.shortlist:
        # set before training: the heads are then trained as they draft, over the shortlist only (an eighth of a 16k
        # vocabulary's projection); verification keeps the whole vocabulary, so this only drops proposals of rare tokens
        model.set_shortlist(frequent_tokens(train_dataset["labels"], args.shortlist, always=[tokenizer.eos_token_id]))
    trainer.train(resume_from_checkpoint=last_checkpoint(args.out))
    if trainer.is_world_process_zero():
        save_final(model, os.path.join(args.out, "final"), args.base_training)
    return model.eval(), tokenizer, data


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    model, tokenizer, data = train(args)
    state = process_state()
    if not state.is_main_process:
        return
    test_sources, test_references = (split[: args.eval_sentences] for split in data["test"])
    comparison = compare_to_greedy(
        model,
        tokenizer,
        test_sources,
        test_references,
        assistant=model.drafter(),
        batch_size=args.eval_batch_size,
        max_new_tokens=args.max_new_tokens,
    )
    results = {
        **comparison.summary(),
        "targets": args.targets,
        "base_training": args.base_training,
        "block_size": args.block_size,
        "sequential": args.sequential,
        "distilled_dir": args.distilled_dir,
        "head_hidden_size": model.blockwise_config.head_hidden_size,
        "epochs": args.epochs,
        "shortlist_size": model.blockwise_config.shortlist_size,
        "world_size": state.num_processes,
        "wall_time_s": round(time.time() - started, 1),
    }
    if args.base_training == "full":  # the fine-tuned base's quality beside the starting base's
        starting = AutoModelForSeq2SeqLM.from_pretrained(args.base, dtype=torch.float32).eval()
        results["starting_greedy_bleu"] = bleu(
            starting, tokenizer, (test_sources, test_references), len(test_sources), batch_size=32
        )[0]
        results["base"], results["ship"] = args.base, args.ship or args.out
    atomic_write_json(os.path.join(args.out, "heads_log.json"), results)
    print(json.dumps(results, indent=2))
    if args.ship:
        ship(model, tokenizer, args.ship, results)
        print(f"shipped to {args.ship}")
    if args.ship_heads:
        ship_drafter(model, args.ship_heads, model_card(model, results))
        print(f"heads shipped to {args.ship_heads}")
    if args.ship_beside_base:
        # the heads' config and weights only (fp16), beside a base that is already shipped
        model.save_pretrained(args.base, base_model_name_or_path=".", dtype=torch.float16)
        print(f"heads shipped beside the base in {args.base}")


if __name__ == "__main__":
    main()

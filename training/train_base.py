"""Train a small Marian-style en→de translation model from scratch on Multi30k.

What it does:

1. Reads Multi30k en→de (train / val / test_2016_flickr) from the local folder ``../shared/data/multi30k``
   relative to the repository root (gzip text, one sentence per line), or, with
   ``--dataset bentrevett/multi30k``, from the Hugging Face Hub through ``datasets.load_dataset``.
2. Trains one joint en+de Metaspace BPE tokenizer (vocab 8000, ``<pad>``=0, ``</s>``=1, ``<unk>``=2) with the
   ``tokenizers`` library and saves it as a ``PreTrainedTokenizerFast`` that appends ``</s>`` to every input.
3. Builds a ``MarianMTModel`` from config (d_model 256, 3+3 layers, 4 heads, FFN 1024, tied embeddings) and
   trains it with plain PyTorch: AdamW, linear warmup + inverse-sqrt decay, label smoothing 0.1, batches of
   about 4k target tokens.
4. Saves a resumable training state (atomically) every ``--save-every`` steps and at the end of each epoch;
   re-running with the same ``--out`` resumes from it.
5. Evaluates greedy decoding with sacreBLEU on the first 300 validation sentences after each epoch and on the
   first 300 test_2016_flickr sentences at the end, then writes the model (safetensors), the tokenizer and
   ``training_log.json`` into ``--out``.

Exact command (from the repository root)::

    python training/train_base.py --out checkpoints/base-multi30k --epochs 8 --threads 2

Error-correction model (W&I+LOCNESS + FCE train, W&I dev for validation, JFLEG dev as test), in two steps; the
second adds synthetic learner errors on clean English (`training/synthetic_errors.py`) and is shipped for IAD::

    python training/train_base.py --task gec --out checkpoints/base-gec --epochs 3 --threads 2
    python training/train_base.py --task gec --out checkpoints/gec-synthetic --init-from checkpoints/base-gec \
        --synthetic gec_wi_tgt:40000 gec_fce_tgt:20000 multi30k_en:8000 europarl_en:10000 dialogsum_summary:6000 \
        --epochs 4 --lr 7e-4 --threads 2 --ship hf_blockwise/pretrained/gec-en

(measured: step 1, 1,543 s for 3 epochs; step 2, 3,320 s for 4 epochs, both partly sharing the CPU with other work.
After step 2, BLEU against the four JFLEG dev references 81.3 and against W&I dev 78.2, where copying the source
scores 82.4 and 80.2; after step 1, 68.4 and 64.4. The gec task ends by printing these scores, into
``training_log.json`` and the model card.)

The base of opus-mt-en-de's decoder size (6-layer decoder, d_model 512, 8 heads, FFN 2048, a 3-layer encoder, a 16k
vocabulary; Multi30k + Europarl train), shipped as ``hf_blockwise/pretrained/marian-base-en-de``: four epochs, then
a fifth in which the rate falls to 0 (resumed; 123 min in all here, test_2016 BLEU 36.1)::

    python training/train_base.py --task europarl-multi30k-en-de --out checkpoints/europarl-multi30k-en-de \
        --epochs 4 --threads 2 --vocab-size 16000 --d-model 512 --encoder-layers 3 --decoder-layers 6 \
        --attention-heads 8 --ffn-dim 2048 --bf16 --lr 7e-4 --warmup-steps 400 --save-every 150
    python training/train_base.py ... (the same flags) --epochs 5 --anneal-steps 1328 1660 \
        --ship hf_blockwise/pretrained/marian-base-en-de

Smoke test::

    python training/train_base.py --out /tmp/smoke_base --max-steps 30 --threads 1

Wall time on a 2-core CPU (2 threads): about 150 s per epoch with evaluation, 21 min for 8 epochs uncontended
(measured run: 33.5 min, one epoch slowed by a concurrent test run). Result: test_2016 BLEU 32.8 (first 300).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import sacrebleu
import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

from hf_blockwise.training.arguments import parse_dataclass_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import (
    DATA_ROOT,
    MULTI30K_DIR,
    Pairs,
    add_synthetic_errors,
    gec_dev_sets,
    load_europarl_multi30k,
    load_gec,
    load_multi30k,
)
from recipe_common import Progress, atomic_write_json, set_seed, ship_model, write_model_card
from text_seq2seq import EOS_ID, PAD_ID, bleu, encode_pairs, eval_loss, get_tokenizer, run_training, translate

STATE_FILE = "training_state.pt"
TEST_SPLIT = {
    "multi30k-en-de": "test_2016_flickr",
    "europarl-multi30k-en-de": "test_2016_flickr",
    "gec": "jfleg dev (reference 0)",
}
LOG_FILE = "training_log.json"


# ----------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TrainBaseArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    task: Literal["multi30k-en-de", "europarl-multi30k-en-de", "gec"] = field(
        default="multi30k-en-de",
        metadata={
            "help": "europarl-multi30k-en-de: Multi30k train + Europarl train, Multi30k val / test_2016, Europarl "
            "validation scored at the end; gec: error correction on W&I+LOCNESS + FCE train, W&I dev for "
            "validation, JFLEG dev as test"
        },
    )
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "multi30k-en-de: local Multi30k folder (unset: ../shared/data/multi30k from the repo root) or "
            "a Hub dataset id such as bentrevett/multi30k; gec: the folder holding gec_wi_locness/, gec_fce/, jfleg/"
        },
    )
    out: str = field(default="checkpoints/base-multi30k", metadata={"help": "output / checkpoint directory"})
    epochs: int = field(default=8, metadata={"help": "training epochs"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps in total"})
    seed: int = field(default=1234, metadata={"help": "seed of initialisation and batch order"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    max_tokens: int = field(default=4096, metadata={"help": "padded target tokens per batch"})
    max_len: int = field(default=128, metadata={"help": "truncate sentences to this many tokens"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=300, metadata={"help": "linear warmup steps before the inverse-sqrt decay"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the training loss"})
    clip_norm: float = field(default=1.0, metadata={"help": "gradient norm clipping (0: none)"})
    save_every: int = field(default=200, metadata={"help": "save the training state every N steps"})
    eval_sentences: int = field(default=300, metadata={"help": "sentences used for val / test BLEU"})
    eval_batch_size: int = field(default=32, metadata={"help": "batch size of the BLEU decoding"})
    vocab_size: int = field(default=8000, metadata={"help": "BPE vocabulary size"})
    d_model: int = field(default=256, metadata={"help": "model width (opus-mt: 512)"})
    encoder_layers: int = field(default=3, metadata={"help": "encoder layers (opus-mt: 6)"})
    decoder_layers: int = field(default=3, metadata={"help": "decoder layers (opus-mt: 6)"})
    attention_heads: int = field(default=4, metadata={"help": "attention heads of encoder and decoder (opus-mt: 8)"})
    ffn_dim: int = field(default=1024, metadata={"help": "feed-forward width of encoder and decoder (opus-mt: 2048)"})
    anneal_steps: list[int] = field(
        default_factory=list,
        metadata={
            "help": "START END: from step START the learning rate also falls linearly to 0 at step END (e.g. the "
            "last epoch of a resumed run)"
        },
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "train under CPU autocast to bfloat16 (float32 weights and optimizer); about 1.8x faster "
            "where the CPU has avx512_bf16 or AMX, slower where it has neither"
        },
    )
    synthetic: list[str] = field(
        default_factory=list,
        metadata={
            "help": "gec: also train on synthetic errors (training/synthetic_errors.py) made on these clean "
            "English corpora, each NAME:CAP, names as in training/distill_sources.py (e.g. gec_wi_tgt:20000)"
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={"help": "start from this model folder's weights and tokenizer (e.g. an earlier shipped model)"},
    )
    ship: str | None = field(
        default=None, metadata={"help": "also write the model (fp16), tokenizer and a model card here"}
    )


def parse_args(argv: Sequence[str] | None = None) -> TrainBaseArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `TrainBaseArguments`."""
    return parse_dataclass_args(TrainBaseArguments, argv, __doc__.split("\n", 1)[0])


def load_task(args: TrainBaseArguments) -> dict[str, Pairs]:
    """The train / val / test pairs of ``args.task``, with the synthetic pairs ``args.synthetic`` asks for."""
    if args.task != "gec" and args.synthetic:
        raise ValueError("--synthetic applies to --task gec only")
    if args.task == "europarl-multi30k-en-de":
        return load_europarl_multi30k(args.dataset or DATA_ROOT)
    if args.task == "multi30k-en-de":
        return load_multi30k(args.dataset or str(MULTI30K_DIR))
    data = load_gec(args.dataset or DATA_ROOT)
    add_synthetic_errors(data, args.dataset or DATA_ROOT, args.synthetic, args.seed)
    return data


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


def build_model(vocab_size: int, args: TrainBaseArguments) -> MarianMTModel:
    """Create a randomly initialised Marian model of the shape ``args`` gives, with greedy generation defaults."""
    config = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=args.d_model,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        encoder_attention_heads=args.attention_heads,
        decoder_attention_heads=args.attention_heads,
        encoder_ffn_dim=args.ffn_dim,
        decoder_ffn_dim=args.ffn_dim,
        max_position_embeddings=256,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        activation_function="swish",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        forced_eos_token_id=EOS_ID,
        decoder_start_token_id=PAD_ID,
        bos_token_id=None,
    )
    model = MarianMTModel(config)
    model.generation_config = GenerationConfig(
        num_beams=1,
        do_sample=False,
        max_length=128,
        # Marian convention: <pad> doubles as decoder start token and must never be generated.
        bad_words_ids=[[PAD_ID]],
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        forced_eos_token_id=EOS_ID,
        decoder_start_token_id=PAD_ID,
    )
    return model


def initial_model(
    args: TrainBaseArguments, out_dir: Path, train_pairs: Pairs
) -> tuple[MarianMTModel, PreTrainedTokenizerFast]:
    """A fresh model and tokenizer, or with ``--init-from`` those of an earlier model (same architecture)."""
    if args.init_from is None:
        tokenizer = get_tokenizer(out_dir, train_pairs, args.vocab_size)
        if len(tokenizer) > args.vocab_size:
            raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than --vocab-size {args.vocab_size}")
        return build_model(args.vocab_size, args), tokenizer
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    if not (out_dir / "tokenizer.json").exists():
        tokenizer.save_pretrained(out_dir)
    start = MarianMTModel.from_pretrained(args.init_from, dtype=torch.float32)
    model = build_model(start.config.vocab_size, args)
    model.load_state_dict(start.state_dict())  # raises, naming the keys, if the architecture differs
    print(f"starting from the weights and tokenizer of {args.init_from}")
    return model, tokenizer


# ----------------------------------------------------------------------------------------------------------
# Training and evaluation
# ----------------------------------------------------------------------------------------------------------


def train(
    args: TrainBaseArguments,
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    data: dict[str, Pairs],
    out_dir: Path,
) -> tuple[Progress, dict[str, Any]]:
    """Train (resuming if a state exists) until ``--epochs`` or ``--max-steps``, scoring each epoch on
    validation (loss, BLEU of the first ``--eval-sentences``); returns progress and log."""
    train_examples = encode_pairs(tokenizer, data["train"], args.max_len)
    val_examples = encode_pairs(tokenizer, data["val"], args.max_len)

    def evaluate() -> dict[str, float]:
        val_loss = eval_loss(model, val_examples, args.max_tokens, args.label_smoothing)
        val_bleu, _, _ = bleu(model, tokenizer, data["val"], args.eval_sentences, args.eval_batch_size)
        return {"val_loss": val_loss, f"val_bleu_first{args.eval_sentences}": val_bleu}

    return run_training(model, train_examples, args, out_dir / STATE_FILE, evaluate)


def finalize(
    args: TrainBaseArguments,
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    data: dict[str, Pairs],
    out_dir: Path,
    progress: Progress,
    log: dict[str, Any],
    extra_scores: dict[str, Any],
) -> None:
    """Test BLEU, then save the model (safetensors), tokenizer and ``training_log.json`` (with ``extra_scores``)."""
    t0 = time.perf_counter()
    score, signature, hyps = bleu(model, tokenizer, data["test"], args.eval_sentences, args.eval_batch_size)
    test_seconds = time.perf_counter() - t0
    print(f"{TEST_SPLIT[args.task]} BLEU (first {args.eval_sentences}, greedy): {score:.2f}  [{signature}]")
    for src, hyp in list(zip(data["test"][0], hyps, strict=False))[:3]:
        print(f"  {src}\n  -> {hyp}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log_out = {
        "args": asdict(args),
        "steps": progress.step,
        "epochs_completed": progress.epoch,
        "epochs": log["epochs"],
        "test": {
            "split": TEST_SPLIT[args.task],
            "n_sentences": len(hyps),
            "decoding": "greedy, batch 32, max_new_tokens 128",
            "bleu": score,
            "signature": signature,
            "eval_wall_time_s": test_seconds,
        },
        "scores": extra_scores,
        "train_wall_time_s": progress.train_seconds,
        "train_pairs": len(data["train"][0]),
        "threads": torch.get_num_threads(),
    }
    atomic_write_json(out_dir / LOG_FILE, log_out, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------
# Error-correction scores, entry point, shipping
# ----------------------------------------------------------------------------------------------------------


def gec_scores(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, data_root: str | Path, batch_size: int
) -> dict[str, Any]:
    """BLEU of the model's greedy output and of copying the source, on JFLEG dev (all 754, four references)
    and W&I+LOCNESS dev (all, one reference): the copy baseline tells whether the model corrects at all."""
    scores: dict[str, Any] = {}
    for name, (sources, refs) in gec_dev_sets(data_root).items():
        hyps = translate(model, tokenizer, sources, batch_size)
        scores[name] = {
            "sentences": len(sources),
            "bleu_model": sacrebleu.corpus_bleu(hyps, refs, force=True).score,
            "bleu_copy_source": sacrebleu.corpus_bleu(sources, refs, force=True).score,
        }
        print(f"{name}: {json.dumps(scores[name])}")
    return scores


def task_scores(
    args: TrainBaseArguments, model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, data: dict[str, Pairs]
) -> dict[str, Any]:
    """The scores a task reports beside its test BLEU: the error-correction dev sets against copying the source,
    or Europarl validation (greedy BLEU, all sentences and the first ``--eval-sentences``)."""
    if args.task == "gec":
        return gec_scores(model, tokenizer, args.dataset or DATA_ROOT, args.eval_batch_size)
    if "europarl_val" not in data:
        return {}
    sources, refs = data["europarl_val"]
    hyps = translate(model, tokenizer, sources, args.eval_batch_size)
    scores = {
        "europarl_validation": {
            "sentences": len(sources),
            "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            f"bleu_first{args.eval_sentences}": sacrebleu.corpus_bleu(
                hyps[: args.eval_sentences], [refs[: args.eval_sentences]]
            ).score,
        }
    }
    print(f"europarl validation: {json.dumps(scores['europarl_validation'])}")
    return scores


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: data → tokenizer → model → train (with resume) → evaluate → save."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    data = load_task(args)
    print({k: len(v[0]) for k, v in data.items()}, "sentence pairs")
    model, tokenizer = initial_model(args, out_dir, data["train"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MarianMTModel: {n_params / 1e6:.1f}M parameters, tokenizer vocab {len(tokenizer)}")

    progress, log = train(args, model, tokenizer, data, out_dir)
    extra = task_scores(args, model, tokenizer, data)
    finalize(args, model, tokenizer, data, out_dir, progress, log, extra)
    print(f"Saved model, tokenizer and {LOG_FILE} to {out_dir}")
    if args.ship:
        ship(model, tokenizer, args, out_dir)
        print(f"shipped to {args.ship}")


MODEL_CARDS = {
    "gec": """# gec-en: a small Marian-style grammatical error correction model (English)

Research artefact trained here by `training/train_base.py --task gec` (the exact commands are in
`training/README.md`).

- **Data**: W&I+LOCNESS (BEA-2019, train A+B+C) and CLC FCE v2.1 train, pairs of at most 60 words, plus
  synthetic learner errors (`training/synthetic_errors.py`) on clean English: {synthetic}
  ({train_pairs} pairs in all); licences: BEA-2019 / CLC FCE / JFLEG / DialogSum —
  **non-commercial research and education only**.
- **Model**: MarianMTModel, d_model 256, 3+3 layers, joint 8k BPE (source and target share the vocabulary,
  which input-guided aggressive decoding needs), {epochs} epochs{init_note}.
- **Quality**, greedy, sacreBLEU against copying the source unchanged (what a corrector must beat):

  | set | model | copy the source |
  |---|---|---|
  {score_rows}

  BLEU is a rough proxy for GEC (usually scored with GLEU / ERRANT F0.5). A model below the copy column
  still changes more correct text than it fixes; it is shipped to try input-guided decoding, not to
  correct text.
- **Use**: `hf-blockwise bench --model <this dir> --source-file ../shared/data/jfleg/dev.src --modes greedy iad`
  decodes it with input-guided drafts (`hf_blockwise.InputCopyDrafter`); the output is identical to greedy.
- **Stored** in fp16, loaded as float32 (`config.json` says so).
""",
}


EN_DE_CARD = """# marian-base-en-de: a Marian en→de model of opus-mt's decoder size

Research artefact trained here from scratch by `training/train_base.py --task europarl-multi30k-en-de` (the exact
command and its wall time are in `training/README.md`), to measure exact blockwise decoding on a model of the size
people deploy (opus-mt-en-de's decoder) rather than on the 7.7M `multi30k-en-de`.

- **Data**: Multi30k task 1 train (Flickr30k captions, 29,000 pairs; research use only, Flickr30k terms) and the
  first 20,000 lines of Europarl v7 de-en (no copyright restriction), {train_pairs} pairs in all. Because of
  Multi30k's terms: **research use only, not for commercial use**.
- **Model**: MarianMTModel, {params:.1f}M parameters: d_model {d_model}, {encoder_layers}-layer encoder (opus-mt has 6;
  fewer to save training time here), {decoder_layers}-layer decoder, {heads} heads, FFN {ffn}, as opus-mt-en-de's
  decoder; one shared {vocab}-piece SentencePiece-style vocabulary (Metaspace BPE, trained with `tokenizers` on both
  sides), tied embeddings and output projection; swish activations.
- **Training**: {epochs} epochs ({steps} steps of about 4k padded tokens), AdamW, peak lr {lr}, inverse-sqrt
  decay{anneal}, label smoothing 0.1, under bfloat16 CPU autocast with float32 weights; {hours:.1f} h on 2 CPU cores.
  Validation BLEU (Multi30k val, first {eval_n}) by epoch: {curve}.
- **Quality**, greedy, sacreBLEU (cased, detokenized):

  | set | BLEU |
  |---|---|
  | Multi30k test_2016_flickr, first {eval_n} | {test_bleu:.1f} |
  | `europarl_de_en/validation`, all {europarl_n} | {europarl_bleu:.1f} |
  | `europarl_de_en/validation`, first {eval_n} | {europarl_first:.1f} |

  The second set is news text, not parliament speeches: out of this model's domains, where it barely translates.
  Trained on 49k sentence pairs, it is far below opus-mt-en-de on real text; it exists to make the cost profile
  of decoding real (the same layers, widths and a 16k output projection), not to translate.
- **Stored** in fp16 ({size_mb:.0f} MB), loaded as float32 (`config.json` says so).
"""


def ship(model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, args: TrainBaseArguments, out_dir: Path) -> None:
    """The trained model in fp16 with its tokenizer and a model card, for the package or a notebook."""
    log = json.loads((out_dir / LOG_FILE).read_text())
    ship_model(model, tokenizer, args.ship)
    if args.task == "europarl-multi30k-en-de":
        write_model_card(args.ship, en_de_card(model, args, log))
    card = MODEL_CARDS.get(args.task)
    if card is not None:
        rows = [
            f"| {name} ({score['sentences']} sentences) | {score['bleu_model']:.1f} | {score['bleu_copy_source']:.1f} |"
            for name, score in log.get("scores", {}).items()
        ]
        text = card.format(
            train_pairs=log.get("train_pairs", "?"), epochs=log["epochs_completed"],
            synthetic=", ".join(args.synthetic) or "none",
            init_note=f", continuing from `{args.init_from}`" if args.init_from else "",
            score_rows="\n  ".join(rows),
        )  # fmt: skip
        write_model_card(args.ship, text)


def en_de_card(model: MarianMTModel, args: TrainBaseArguments, log: dict[str, Any]) -> str:
    """The model card of the ``europarl-multi30k-en-de`` task, filled from the training log."""
    europarl = log["scores"]["europarl_validation"]
    weights = Path(args.ship) / "model.safetensors"
    return EN_DE_CARD.format(
        train_pairs=f"{log['train_pairs']:,}", params=sum(p.numel() for p in model.parameters()) / 1e6,
        d_model=args.d_model, encoder_layers=args.encoder_layers, decoder_layers=args.decoder_layers,
        heads=args.attention_heads, ffn=args.ffn_dim, vocab=f"{args.vocab_size // 1000}k",
        epochs=log["epochs_completed"], steps=f"{log['steps']:,}", lr=args.lr,
        hours=log["train_wall_time_s"] / 3600, eval_n=args.eval_sentences, test_bleu=log["test"]["bleu"],
        europarl_n=europarl["sentences"], europarl_bleu=europarl["bleu"],
        europarl_first=europarl[f"bleu_first{args.eval_sentences}"], size_mb=weights.stat().st_size / 1e6,
        curve=" → ".join(f"{epoch[f'val_bleu_first{args.eval_sentences}']:.1f}" for epoch in log["epochs"]),
        anneal=(
            f", falling linearly to 0 from step {args.anneal_steps[0]:,} to {args.anneal_steps[1]:,}"
            if args.anneal_steps else ""
        ),
    )  # fmt: skip


if __name__ == "__main__":
    main()

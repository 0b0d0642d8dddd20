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

Smoke test::

    python training/train_base.py --out /tmp/smoke_base --max-steps 30 --threads 1

Wall time on a 2-core CPU (2 threads): about 150 s per epoch with evaluation, 21 min for 8 epochs uncontended
(measured run: 33.5 min, one epoch slowed by a concurrent test run). Result: test_2016 BLEU 32.8 (first 300).
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import sacrebleu
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from hf_blockwise.boundary import save_shipped_model
from hf_blockwise.serialization import atomic_write, atomic_write_text
from hf_blockwise.tools.arguments import parse_dataclass_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_sources import CORPORA, read_texts
from synthetic_errors import synthetic_pairs

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ROOT = REPO_ROOT.parent / "shared" / "data"
DEFAULT_DATA_DIR = DATA_ROOT / "multi30k"
GEC_MAX_WORDS = 60  # FCE lines are paragraphs; longer pairs would be truncated on both sides out of alignment

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
STATE_FILE = "training_state.pt"
TEST_SPLIT = {"multi30k-en-de": "test_2016_flickr", "gec": "jfleg dev (reference 0)"}
LOG_FILE = "training_log.json"

Pairs = tuple[list[str], list[str]]


@dataclass
class Example:
    """One tokenized sentence pair (both sides end with ``</s>``)."""

    src: list[int]
    tgt: list[int]


# ----------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TrainBaseArguments:
    """Command-line flags of this recipe; each field is ``--field-name`` (or ``--field_name``)."""

    task: Literal["multi30k-en-de", "gec"] = field(
        default="multi30k-en-de",
        metadata={
            "help": "gec: error correction on W&I+LOCNESS + FCE train, W&I dev for validation, JFLEG dev as test"
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


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def _clean(line: str) -> str:
    """Collapse runs of whitespace and strip the ends."""
    return " ".join(line.split())


def _read_gz_lines(path: Path) -> list[str]:
    """Read a gzip text file into a list of cleaned lines (trailing empty line dropped)."""
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [_clean(line) for line in lines]


def _read_local_split(data_dir: Path, prefix: str) -> Pairs:
    """Read one parallel split ``{prefix}.en.gz`` / ``{prefix}.de.gz`` from a local folder."""
    en = _read_gz_lines(data_dir / f"{prefix}.en.gz")
    de = _read_gz_lines(data_dir / f"{prefix}.de.gz")
    if len(en) != len(de):
        raise ValueError(f"{prefix}: {len(en)} English vs {len(de)} German lines")
    return en, de


def _read_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        return _read_gz_lines(path)
    return [_clean(line) for line in path.read_text(encoding="utf-8").splitlines()]


def load_gec(data_root: str | Path) -> dict[str, Pairs]:
    """Learner English → corrected English: W&I+LOCNESS train + FCE train (pairs of at most
    ``GEC_MAX_WORDS`` words), W&I+LOCNESS dev as validation, JFLEG dev (first reference) as test."""
    root = Path(data_root)
    if not (root / "gec_wi_locness").is_dir():
        raise FileNotFoundError(f"no gec_wi_locness/ under {root}; pass --dataset pointing at ../shared/data")
    sources, targets = [], []
    for folder, suffix in (("gec_wi_locness", ".gz"), ("gec_fce", ".gz")):
        for source, target in zip(
            _read_lines(root / folder / f"train.src{suffix}"), _read_lines(root / folder / f"train.tgt{suffix}"),
            strict=True,
        ):  # fmt: skip
            if source and target and max(len(source.split()), len(target.split())) <= GEC_MAX_WORDS:
                sources.append(source)
                targets.append(target)
    return {
        "train": (sources, targets),
        "val": (
            _read_lines(root / "gec_wi_locness" / "dev.src.gz"),
            _read_lines(root / "gec_wi_locness" / "dev.tgt.gz"),
        ),
        "test": (_read_lines(root / "jfleg" / "dev.src"), _read_lines(root / "jfleg" / "dev.ref0")),
    }


def add_synthetic_errors(data: dict[str, Pairs], data_root: str | Path, corpora: Sequence[str], seed: int) -> None:
    """Append to ``data["train"]`` corrupted → clean pairs made from clean English corpora (``NAME:CAP`` each)."""
    sources, targets = data["train"]
    for entry in corpora:
        name, _, cap = entry.partition(":")
        if name not in CORPORA or not cap.isdigit():
            raise ValueError(f"--synthetic entries are NAME:CAP with NAME in {sorted(CORPORA)}, got {entry!r}")
        relative, kind = CORPORA[name]
        texts = list(itertools.islice(read_texts(Path(data_root) / relative, kind), int(cap)))
        noisy, clean = synthetic_pairs(texts, seed=seed)
        changed = sum(a != b for a, b in zip(noisy, clean, strict=True))
        print(f"synthetic errors on {name}: {len(noisy)} pairs, {changed} changed")
        sources, targets = sources + noisy, targets + clean
    data["train"] = (sources, targets)


def load_task(args: TrainBaseArguments) -> dict[str, Pairs]:
    """The train / val / test pairs of ``args.task``, with the synthetic pairs ``args.synthetic`` asks for."""
    if args.task != "gec":
        if args.synthetic:
            raise ValueError("--synthetic applies to --task gec only")
        return load_multi30k(args.dataset or str(DEFAULT_DATA_DIR))
    data = load_gec(args.dataset or DATA_ROOT)
    add_synthetic_errors(data, args.dataset or DATA_ROOT, args.synthetic, args.seed)
    return data


def load_multi30k(dataset: str) -> dict[str, Pairs]:
    """Load train / val / test (2016 flickr) as (English, German) sentence lists."""
    data_dir = Path(dataset)
    if data_dir.is_dir():
        return {
            "train": _read_local_split(data_dir, "train"),
            "val": _read_local_split(data_dir, "val"),
            "test": _read_local_split(data_dir, "test_2016_flickr"),
        }
    if data_dir.is_absolute() or dataset.startswith("."):
        raise FileNotFoundError(f"no Multi30k folder at {dataset}; pass --dataset bentrevett/multi30k for the Hub")
    from datasets import load_dataset  # imported lazily: only needed for the Hub path

    ds = load_dataset(dataset)
    names = {"train": "train", "val": "validation", "test": "test"}
    return {
        key: ([_clean(s) for s in ds[split]["en"]], [_clean(s) for s in ds[split]["de"]])
        for key, split in names.items()
    }


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a joint Metaspace BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Metaspace keeps spaces as "▁" (exact, cased detokenization); punctuation gets its own pieces so that
    # "Hut," and "Hut" share a subword.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if [tok.token_to_id(t) for t in (PAD, EOS, UNK)] != [PAD_ID, EOS_ID, UNK_ID]:
        raise RuntimeError("special token ids are not <pad>=0, </s>=1, <unk>=2")
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, EOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )


def check_round_trip(tokenizer: PreTrainedTokenizerFast, sentences: Sequence[str]) -> None:
    """Raise if encode → decode(skip_special_tokens=True) does not give back the sentences exactly."""
    for sentence in sentences:
        ids = tokenizer(sentence)["input_ids"]
        if ids[-1] != EOS_ID:
            raise RuntimeError("the tokenizer does not append </s>")
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        if decoded != sentence:
            raise RuntimeError(f"tokenizer round trip failed: {sentence!r} -> {decoded!r}")


def get_tokenizer(out_dir: Path, train_pairs: Pairs, vocab_size: int) -> PreTrainedTokenizerFast:
    """Load the tokenizer from ``out_dir`` if present (resume), otherwise train and save it there."""
    if (out_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    else:
        en, de = train_pairs
        tokenizer = train_tokenizer(en + de, vocab_size)
        tokenizer.save_pretrained(out_dir)
    check_round_trip(tokenizer, train_pairs[0][:50] + train_pairs[1][:50])
    return tokenizer


def encode_pairs(tokenizer: PreTrainedTokenizerFast, pairs: Pairs, max_len: int) -> list[Example]:
    """Tokenize parallel sentences, truncating each side to ``max_len`` tokens (keeping ``</s>``)."""
    src = tokenizer(list(pairs[0]), truncation=True, max_length=max_len)["input_ids"]
    tgt = tokenizer(list(pairs[1]), truncation=True, max_length=max_len)["input_ids"]
    return [Example(s, t) for s, t in zip(src, tgt, strict=True)]


# ----------------------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------------------


def make_batches(examples: Sequence[Example], max_tokens: int, seed: int) -> list[list[int]]:
    """Group example indices into length-bucketed batches of at most ``max_tokens`` padded tokens per side.

    Deterministic given ``seed``: indices are shuffled, stably sorted by (target, source) length, cut into
    batches, and the batch order is shuffled again.
    """
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    order.sort(key=lambda i: (len(examples[i].tgt), len(examples[i].src)))
    batches: list[list[int]] = []
    current: list[int] = []
    max_src = max_tgt = 0
    for i in order:
        s, t = len(examples[i].src), len(examples[i].tgt)
        new_src, new_tgt = max(max_src, s), max(max_tgt, t)
        if current and (len(current) + 1) * max(new_src, new_tgt) > max_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], s, t
        current.append(i)
        max_src, max_tgt = new_src, new_tgt
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _pad(seqs: Sequence[list[int]], value: int) -> torch.Tensor:
    """Right-pad integer sequences into a LongTensor."""
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


def collate(examples: Sequence[Example], model: MarianMTModel) -> dict[str, torch.Tensor]:
    """Build model inputs; labels use -100 on padding, decoder inputs start with ``<pad>`` (Marian)."""
    input_ids = _pad([e.src for e in examples], PAD_ID)
    labels = _pad([e.tgt for e in examples], -100)
    return {
        "input_ids": input_ids,
        "attention_mask": input_ids.ne(PAD_ID).long(),
        "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels),
        "labels": labels,
    }


# ----------------------------------------------------------------------------------------------------------
# Model, optimizer, schedule
# ----------------------------------------------------------------------------------------------------------


def build_model(vocab_size: int) -> MarianMTModel:
    """Create a small randomly initialised Marian model with greedy generation defaults."""
    config = MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=256,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
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


def build_optimizer(model: MarianMTModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the (deduplicated) model parameters with transformer-style betas."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak LR over ``warmup_steps``, then inverse-square-root decay."""
    warmup = max(1, warmup_steps)

    def factor(step: int) -> float:
        step = max(1, step)
        return min(step / warmup, math.sqrt(warmup / step))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross entropy summed over non-padding target tokens, and the number of such tokens."""
    loss = F.cross_entropy(
        logits.view(-1, logits.size(-1)).float(),
        labels.view(-1),
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction="sum",
    )
    return loss, int(labels.ne(-100).sum())


# ----------------------------------------------------------------------------------------------------------
# Checkpointing
# ----------------------------------------------------------------------------------------------------------


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically."""
    atomic_write(path, lambda tmp_path: torch.save(obj, tmp_path))


def atomic_write_json(obj: Any, path: Path) -> None:
    """Write ``obj`` as indented UTF-8 JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


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
    model: MarianMTModel,
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
    model: MarianMTModel,
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
# Evaluation
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
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


@torch.no_grad()
def translate(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, sources: Sequence[str], batch_size: int
) -> list[str]:
    """Greedy-decode ``sources`` (max 128 new tokens) and return detokenized, cased hypotheses."""
    model.eval()
    hyps: list[str] = []
    for start in range(0, len(sources), batch_size):
        batch = tokenizer(list(sources[start : start + batch_size]), return_tensors="pt", padding=True)
        with _quiet_transformers():
            out = model.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=128)
        hyps.extend(tokenizer.batch_decode(out, skip_special_tokens=True))
    return hyps


def bleu(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, pairs: Pairs, n: int, batch_size: int
) -> tuple[float, str, list[str]]:
    """sacreBLEU of greedy translations of the first ``n`` sentences; returns (score, signature, hyps)."""
    sources, refs = pairs[0][:n], pairs[1][:n]
    hyps = translate(model, tokenizer, sources, batch_size)
    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(hyps, [refs])
    # Same number as sacrebleu.corpus_bleu(hyps, [refs]); the metric object also gives the signature.
    return result.score, str(metric.get_signature()), hyps


@torch.no_grad()
def eval_loss(model: MarianMTModel, examples: Sequence[Example], max_tokens: int, smoothing: float) -> float:
    """Per-token label-smoothed loss on ``examples`` (dropout off)."""
    model.eval()
    total, tokens = 0.0, 0
    for idx in make_batches(examples, max_tokens, seed=0):
        batch = collate([examples[i] for i in idx], model)
        labels = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits
        loss, n = smoothed_loss(logits, labels, smoothing)
        total, tokens = total + float(loss), tokens + n
    return total / max(1, tokens)


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------


def train_step(
    model: MarianMTModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, torch.Tensor],
    args: TrainBaseArguments,
) -> tuple[float, int]:
    """One optimizer step on one batch; returns (summed loss, target tokens)."""
    model.train()
    labels = batch.pop("labels")
    logits = model(**batch, use_cache=False).logits
    loss_sum, n_tokens = smoothed_loss(logits, labels, args.label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    (loss_sum / max(1, n_tokens)).backward()
    if args.clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
    optimizer.step()
    scheduler.step()
    return float(loss_sum.detach()), n_tokens


def iterate_epoch(examples: Sequence[Example], args: TrainBaseArguments, epoch: int, skip: int) -> Iterator[list[int]]:
    """Yield this epoch's batches (deterministic per seed and epoch), skipping the first ``skip``."""
    batches = make_batches(examples, args.max_tokens, seed=args.seed * 1000 + epoch)
    yield from batches[skip:]


def run_training(
    args: TrainBaseArguments,
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    data: dict[str, Pairs],
    out_dir: Path,
) -> tuple[Progress, dict[str, Any]]:
    """Train (resuming if a state exists) until ``--epochs`` or ``--max-steps``; returns progress and log."""
    train_examples = encode_pairs(tokenizer, data["train"], args.max_len)
    val_examples = encode_pairs(tokenizer, data["val"], args.max_len)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scheduler = build_scheduler(optimizer, args.warmup_steps)
    state_path = out_dir / STATE_FILE
    progress, log = Progress(), {"epochs": []}
    if state_path.exists():
        progress, log = load_state(state_path, model, optimizer, scheduler)
        print(
            f"Resuming from {state_path}: step {progress.step}, epoch {progress.epoch + 1}, "
            f"batch {progress.batch_in_epoch}"
        )

    def checkpoint() -> None:
        save_state(state_path, model, optimizer, scheduler, progress, log)

    while progress.epoch < args.epochs and not _done(progress, args):
        t0 = time.perf_counter()
        n_batches = len(make_batches(train_examples, args.max_tokens, seed=args.seed * 1000 + progress.epoch))
        bar = tqdm(
            iterate_epoch(train_examples, args, progress.epoch, progress.batch_in_epoch),
            total=n_batches,
            initial=progress.batch_in_epoch,
            desc=f"epoch {progress.epoch + 1}/{args.epochs}",
            dynamic_ncols=True,
        )
        for idx in bar:
            step_start = time.perf_counter()
            batch = collate([train_examples[i] for i in idx], model)
            loss_sum, n_tokens = train_step(model, optimizer, scheduler, batch, args)
            progress.step += 1
            progress.batch_in_epoch += 1
            progress.epoch_loss_sum += loss_sum
            progress.epoch_tokens += n_tokens
            tok_s = n_tokens / max(1e-9, time.perf_counter() - step_start)
            bar.set_postfix(
                loss=f"{loss_sum / max(1, n_tokens):.3f}",
                tok_s=f"{tok_s:.0f}",
                lr=f"{scheduler.get_last_lr()[0]:.2e}",
            )
            if _done(progress, args) or progress.step % args.save_every == 0:
                progress.train_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                checkpoint()
            if _done(progress, args):
                break
        bar.close()
        progress.train_seconds += time.perf_counter() - t0
        if progress.batch_in_epoch >= n_batches:
            finish_epoch(args, model, tokenizer, data, val_examples, progress, log)
            checkpoint()
    return progress, log


def _done(progress: Progress, args: TrainBaseArguments) -> bool:
    """True once ``--max-steps`` is reached."""
    return args.max_steps is not None and progress.step >= args.max_steps


def finish_epoch(
    args: TrainBaseArguments,
    model: MarianMTModel,
    tokenizer: PreTrainedTokenizerFast,
    data: dict[str, Pairs],
    val_examples: Sequence[Example],
    progress: Progress,
    log: dict[str, Any],
) -> None:
    """Evaluate on validation, append the epoch entry to the log and move ``progress`` to the next epoch."""
    t0 = time.perf_counter()
    val_loss = eval_loss(model, val_examples, args.max_tokens, args.label_smoothing)
    val_bleu, _, _ = bleu(model, tokenizer, data["val"], args.eval_sentences, args.eval_batch_size)
    progress.train_seconds += time.perf_counter() - t0
    entry = {
        "epoch": progress.epoch + 1,
        "step": progress.step,
        "train_loss": progress.epoch_loss_sum / max(1, progress.epoch_tokens),
        "val_loss": val_loss,
        f"val_bleu_first{args.eval_sentences}": val_bleu,
        "wall_time_s_cumulative": progress.train_seconds,
    }
    log["epochs"].append(entry)
    print(json.dumps(entry))
    progress.epoch += 1
    progress.batch_in_epoch = 0
    progress.epoch_loss_sum, progress.epoch_tokens = 0.0, 0


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
    atomic_write_json(log_out, out_dir / LOG_FILE)


def set_seed(seed: int) -> None:
    """Seed Python and torch RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)


def initial_model(
    args: TrainBaseArguments, out_dir: Path, train_pairs: Pairs
) -> tuple[MarianMTModel, PreTrainedTokenizerFast]:
    """A fresh model and tokenizer, or with ``--init-from`` those of an earlier model (same architecture)."""
    if args.init_from is None:
        tokenizer = get_tokenizer(out_dir, train_pairs, args.vocab_size)
        if len(tokenizer) > args.vocab_size:
            raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, more than --vocab-size {args.vocab_size}")
        return build_model(args.vocab_size), tokenizer
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    if not (out_dir / "tokenizer.json").exists():
        tokenizer.save_pretrained(out_dir)
    start = MarianMTModel.from_pretrained(args.init_from, dtype=torch.float32)
    model = build_model(start.config.vocab_size)
    model.load_state_dict(start.state_dict())  # raises, naming the keys, if the architecture differs
    print(f"starting from the weights and tokenizer of {args.init_from}")
    return model, tokenizer


def gec_scores(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, data_root: str | Path, batch_size: int
) -> dict[str, Any]:
    """BLEU of the model's greedy output and of copying the source, on JFLEG dev (all 754, four references)
    and W&I+LOCNESS dev (all, one reference): the copy baseline tells whether the model corrects at all."""
    root = Path(data_root)
    sets = {
        "jfleg_dev_4refs": (
            _read_lines(root / "jfleg" / "dev.src"), [_read_lines(root / "jfleg" / f"dev.ref{i}") for i in range(4)]
        ),
        "wi_locness_dev": (
            _read_lines(root / "gec_wi_locness" / "dev.src.gz"), [_read_lines(root / "gec_wi_locness" / "dev.tgt.gz")]
        ),
    }  # fmt: skip
    scores: dict[str, Any] = {}
    for name, (sources, refs) in sets.items():
        hyps = translate(model, tokenizer, sources, batch_size)
        scores[name] = {
            "sentences": len(sources),
            "bleu_model": sacrebleu.corpus_bleu(hyps, refs, force=True).score,
            "bleu_copy_source": sacrebleu.corpus_bleu(sources, refs, force=True).score,
        }
        print(f"{name}: {json.dumps(scores[name])}")
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

    progress, log = run_training(args, model, tokenizer, data, out_dir)
    extra = gec_scores(model, tokenizer, args.dataset or DATA_ROOT, args.eval_batch_size) if args.task == "gec" else {}
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


def ship(model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, args: TrainBaseArguments, out_dir: Path) -> None:
    """The trained model in fp16 with its tokenizer and a model card, for the package or a notebook."""
    log = json.loads((out_dir / LOG_FILE).read_text())
    ship_dir = Path(args.ship)
    ship_dir.mkdir(parents=True, exist_ok=True)
    save_shipped_model(model, ship_dir)  # fp16 on disk, loaded as float32
    tokenizer.save_pretrained(ship_dir)
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
        atomic_write_text(str(ship_dir / "README.md"), text)


if __name__ == "__main__":
    main()

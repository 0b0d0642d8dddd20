"""The pieces of a text-to-text model trained from scratch with a plain PyTorch loop (``train_base.py``):

- a joint Metaspace BPE tokenizer (``<pad>``=0, ``</s>``=1, ``<unk>``=2) that appends ``</s>`` and detokenizes
  exactly (`train_tokenizer`, `get_tokenizer`);
- tokenized pairs cut into length-bucketed batches of a token budget (`encode_pairs`, `make_batches`, `collate`);
- AdamW with linear warmup and inverse-square-root decay, label-smoothed loss, one optimizer step
  (`build_optimizer`, `build_scheduler`, `smoothed_loss`, `train_step`);
- evaluation: loss, greedy decoding and sacreBLEU (`eval_loss`, `translate`, `bleu`);
- the resumable training loop over all of these (`run_training`): its state is saved atomically every few steps
  and after each epoch, and a re-run continues from the batch where it stopped.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import sacrebleu
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import MarianMTModel, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import Pairs
from recipe_common import Progress, load_state, quiet_transformers, save_state

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclass
class Example:
    """One tokenized sentence pair (both sides end with ``</s>``)."""

    src: list[int]
    tgt: list[int]


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
# Optimizer, schedule, loss
# ----------------------------------------------------------------------------------------------------------


def build_optimizer(model: MarianMTModel, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the (deduplicated) model parameters with transformer-style betas."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, anneal: tuple[int, int] | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak LR over ``warmup_steps``, then inverse-square-root decay; with ``anneal`` =
    (start, end), the rate also falls linearly from its value at step ``start`` to 0 at step ``end`` (a run resumed
    with it ends on a cooled-down model, which the inverse-square-root decay alone never reaches)."""
    warmup = max(1, warmup_steps)
    if anneal is not None and (len(anneal) != 2 or not 0 <= anneal[0] < anneal[1]):
        raise ValueError(f"anneal steps must be 0 <= start < end, got {anneal}")

    def factor(step: int) -> float:
        step = max(1, step)
        rate = min(step / warmup, math.sqrt(warmup / step))
        if anneal is not None and step > anneal[0]:
            rate *= max(0.0, (anneal[1] - step) / (anneal[1] - anneal[0]))
        return rate

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross entropy summed over non-padding target tokens, and the number of such tokens.

    Args:
        logits: ``(batch, target_length, vocab)``.
        labels: ``(batch, target_length)``, -100 on padding.
        smoothing: label smoothing.
    """
    loss = F.cross_entropy(
        logits.view(-1, logits.size(-1)).float(),
        labels.view(-1),
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction="sum",
    )
    return loss, int(labels.ne(-100).sum())


def train_step(
    model: MarianMTModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, torch.Tensor],
    smoothing: float,
    clip_norm: float,
    bf16: bool = False,
) -> tuple[float, int]:
    """One optimizer step on one `collate` batch (per-token mean loss, gradient norm clipped to ``clip_norm``
    unless it is 0); returns (summed loss, target tokens). ``bf16`` runs the forward under CPU autocast to
    bfloat16 (float32 master weights and optimizer state; the loss is taken in float32)."""
    model.train()
    labels = batch.pop("labels")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(**batch, use_cache=False).logits
    loss_sum, n_tokens = smoothed_loss(logits, labels, smoothing)
    optimizer.zero_grad(set_to_none=True)
    (loss_sum / max(1, n_tokens)).backward()
    if clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    scheduler.step()
    return float(loss_sum.detach()), n_tokens


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


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


@torch.no_grad()
def translate(
    model: MarianMTModel, tokenizer: PreTrainedTokenizerFast, sources: Sequence[str], batch_size: int
) -> list[str]:
    """Greedy-decode ``sources`` (max 128 new tokens) and return detokenized, cased hypotheses."""
    model.eval()
    hyps: list[str] = []
    for start in range(0, len(sources), batch_size):
        batch = tokenizer(list(sources[start : start + batch_size]), return_tensors="pt", padding=True)
        with quiet_transformers():
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


# ----------------------------------------------------------------------------------------------------------
# Resumable training loop
# ----------------------------------------------------------------------------------------------------------


class LoopFlags(Protocol):
    """The flags `run_training` reads (fields of the recipe's arguments dataclass)."""

    epochs: int
    max_steps: int | None
    seed: int
    max_tokens: int
    lr: float
    warmup_steps: int
    weight_decay: float
    label_smoothing: float
    clip_norm: float
    save_every: int
    bf16: bool
    anneal_steps: list[int]


def run_training(
    model: MarianMTModel,
    train_examples: Sequence[Example],
    flags: LoopFlags,
    state_path: Path,
    evaluate: Callable[[], dict[str, float]],
) -> tuple[Progress, dict[str, Any]]:
    """Train (resuming from ``state_path`` if it exists) until ``flags.epochs`` or ``flags.max_steps``.

    The state is saved every ``flags.save_every`` steps, at ``max_steps`` and after each epoch. After each epoch,
    ``evaluate()`` gives the validation scores of the epoch's entry in the log (``log["epochs"]``), printed as
    one JSON line. Returns the progress and the log.
    """
    optimizer = build_optimizer(model, flags.lr, flags.weight_decay)
    anneal = tuple(flags.anneal_steps) if flags.anneal_steps else None
    scheduler = build_scheduler(optimizer, flags.warmup_steps, anneal)
    progress, log = Progress(), {"epochs": []}
    if state_path.exists():
        progress, log = load_state(state_path, model, optimizer, scheduler)
        print(
            f"Resuming from {state_path}: step {progress.step}, epoch {progress.epoch + 1}, "
            f"batch {progress.batch_in_epoch}"
        )

    def checkpoint() -> None:
        save_state(state_path, model, optimizer, scheduler, progress, log)

    while progress.epoch < flags.epochs and not _done(progress, flags):
        # this epoch's batches, the same on every run (seeded by seed and epoch), so that a resumed run skips
        # exactly the batches already trained on
        batches = make_batches(train_examples, flags.max_tokens, seed=flags.seed * 1000 + progress.epoch)
        _train_batches(model, optimizer, scheduler, train_examples, batches, progress, flags, checkpoint)
        if progress.batch_in_epoch >= len(batches):
            _finish_epoch(progress, log, evaluate)
            checkpoint()
    return progress, log


def _train_batches(
    model: MarianMTModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_examples: Sequence[Example],
    batches: list,
    progress: Progress,
    flags: LoopFlags,
    checkpoint: Callable[[], None],
) -> None:
    """One training step per batch of the epoch from ``progress.batch_in_epoch`` on, under a progress bar, until
    the epoch or ``flags.max_steps`` ends; ``checkpoint()`` every ``flags.save_every`` steps and at the end, with
    the training time counted into ``progress``."""
    t0 = time.perf_counter()
    bar = tqdm(
        batches[progress.batch_in_epoch :],
        total=len(batches),
        initial=progress.batch_in_epoch,
        desc=f"epoch {progress.epoch + 1}/{flags.epochs}",
        dynamic_ncols=True,
    )
    for idx in bar:
        step_start = time.perf_counter()
        batch = collate([train_examples[i] for i in idx], model)
        loss_sum, n_tokens = train_step(
            model, optimizer, scheduler, batch, flags.label_smoothing, flags.clip_norm, flags.bf16
        )
        progress.step += 1
        progress.batch_in_epoch += 1
        progress.epoch_loss_sum += loss_sum
        progress.epoch_tokens += n_tokens
        tok_s = n_tokens / max(1e-9, time.perf_counter() - step_start)
        bar.set_postfix(
            loss=f"{loss_sum / max(1, n_tokens):.3f}", tok_s=f"{tok_s:.0f}", lr=f"{scheduler.get_last_lr()[0]:.2e}"
        )
        if _done(progress, flags) or progress.step % flags.save_every == 0:
            progress.train_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint()
        if _done(progress, flags):
            break
    bar.close()
    progress.train_seconds += time.perf_counter() - t0


def _done(progress: Progress, flags: LoopFlags) -> bool:
    """True once ``--max-steps`` is reached."""
    return flags.max_steps is not None and progress.step >= flags.max_steps


def _finish_epoch(progress: Progress, log: dict[str, Any], evaluate: Callable[[], dict[str, float]]) -> None:
    """Evaluate, append the epoch entry to the log and move ``progress`` to the next epoch."""
    t0 = time.perf_counter()
    scores = evaluate()
    progress.train_seconds += time.perf_counter() - t0
    entry = {
        "epoch": progress.epoch + 1,
        "step": progress.step,
        "train_loss": progress.epoch_loss_sum / max(1, progress.epoch_tokens),
        **scores,
        "wall_time_s_cumulative": progress.train_seconds,
    }
    log["epochs"].append(entry)
    print(json.dumps(entry))
    progress.epoch += 1
    progress.batch_in_epoch = 0
    progress.epoch_loss_sum, progress.epoch_tokens = 0.0, 0

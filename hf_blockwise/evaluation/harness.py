"""One measurement harness: these modes on these batches — time them, compare them with a reference mode, score them.

Every loop of this package that times or compares decoding runs through [`measure`]: the benchmark
(`tools/bench/`), [`compare_to_greedy`] (`evaluation/compare.py`), `hf-blockwise demo` (`tools/cli/demo.py`) and the
trainers' evaluation decode (`training/common.py`). And one function, [`same_output`], says when two outputs are
identical: their *generated* tokens are equal, i.e. position 0 (the decoder start token, which is not generated
and is the pad token in Marian and T5) and every pad token are left out before comparing.

How [`measure`] runs:

- modes are interleaved per batch (batch 1 in every mode, then batch 2 in every mode, ...), in the order of
  `runners`, so that all modes share the machine's state, and each batch is timed once per mode (or the median
  of `repeats` timings);
- the first batch is decoded once in every mode before timing starts (`warmup`): first calls pay one-off
  allocation costs;
- decoder calls are counted by a forward hook on the decoder of each model in `count_forwards_of`, whatever the
  mode (transformers' generation modes report none themselves), plus the compiled calls the output reports in
  `decoding_stats.compiled_forwards` (compiled graphs run no hooks);
- accepted blocks come from `output.decoding_stats` where the output has them (blockwise decoding);
- each mode's rows are compared with its reference mode's rows of the same batch, and BLEU (and for speech, word
  error rate) is computed against `references` when a tokenizer and references are given.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_blockwise.evaluation.scores import word_error_rate

Batch = dict[str, torch.Tensor]
# A runner decodes one batch; it also gets the outputs of the modes that ran before it on the same batch (by
# mode name), so that a mode can build on another's output (the bench's `oracle` drafts greedy's output).
Runner = Callable[[Batch, Mapping[str, Any]], Any]


def generated_tokens(row: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """The tokens a decoder output row generated: without position 0 (the decoder start token) and pads.

    Args:
        row (`torch.LongTensor` of shape `(length,)`): one row of `generate`'s `sequences`.
        pad_token_id (`int`, *optional*): the pad id (right padding of shorter rows of a batch).

    Returns:
        `torch.LongTensor` of shape `(num_generated,)`.
    """
    row = row[1:]
    return row if pad_token_id is None else row[row != pad_token_id]


def same_output(a: torch.Tensor, b: torch.Tensor, pad_token_id: int | None) -> bool:
    """Whether two decoder output rows (each of shape `(length,)`) generated the same tokens: this package's
    one definition of "identical" (see [`generated_tokens`])."""
    return torch.equal(generated_tokens(a, pad_token_id).cpu(), generated_tokens(b, pad_token_id).cpu())


def sequences_of(output: Any) -> torch.Tensor:
    """`generate`'s token ids, shape `(batch_size, length)`, whether it returned a tensor or a dict-style output."""
    return output if isinstance(output, torch.Tensor) else output.sequences


@dataclass
class ModeResult:
    """What one mode did over all batches (of one batch size).

    Attributes:
        mode (`str`), batch_size (`int`): rows per batch (the first batch's).
        seconds (`float`): wall-clock time summed over batches (per batch: the median of the repeats).
        target_tokens (`int`): generated tokens ([`generated_tokens`]), summed over rows.
        words (`int`): whitespace-separated words of the decoded texts (0 without a tokenizer).
        decoder_forwards (`int`): decoder calls counted by the harness's hooks.
        identical (`int`): rows whose output equals the reference mode's ([`same_output`]).
        compared (`int`): rows compared with a reference mode (0 when there is none).
        sentences (`int`): rows decoded.
        accepted_sum (`float`), accepted_steps (`int`): tokens gained and (row, step) pairs still decoding, from
            `decoding_stats`.
        bleu (`float`, *optional*): sacreBLEU against the references.
        wer (`float`, *optional*): word error rate against the references (speech recognition; a fraction).
        speedup (`float`, *optional*): the baseline mode's seconds over this mode's.
        speedup_ceiling (`float`, *optional*): from the decoder cost curve, where known (set by the bench).
        texts (`list[str]`): decoded outputs. identical_rows (`list[bool]`): per row, whether it matched its
        reference. batch_seconds (`list[float]`): per batch, its time.
    """

    mode: str
    batch_size: int
    seconds: float = 0.0
    target_tokens: int = 0
    words: int = 0
    decoder_forwards: int = 0
    identical: int = 0
    sentences: int = 0
    accepted_sum: float = 0.0
    accepted_steps: int = 0
    bleu: float | None = None
    wer: float | None = None
    speedup: float | None = None
    speedup_ceiling: float | None = None
    compile_seconds: float | None = None
    compared: int = 0
    texts: list[str] = field(default_factory=list)
    identical_rows: list[bool] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)

    @property
    def mean_accepted(self) -> float | None:
        """Tokens gained per decoder call: from `decoding_stats` when the mode reports it; at batch size 1, tokens
        per counted decoder call; else `None` (a batched call of transformers' modes decodes many rows at once)."""
        if self.accepted_steps:
            return self.accepted_sum / self.accepted_steps
        if self.batch_size == 1 and self.decoder_forwards:
            return self.target_tokens / self.decoder_forwards
        return None

    def summary(self) -> dict[str, Any]:
        """Every figure, without the per-row and per-batch lists (for JSON reports)."""
        lists = ("texts", "identical_rows", "batch_seconds", "accepted_sum", "accepted_steps")
        figures = {key: value for key, value in asdict(self).items() if key not in lists}
        figures["tokens_per_second"] = self.target_tokens / self.seconds if self.seconds else None
        figures["words_per_second"] = self.words / self.seconds if self.seconds and self.texts else None
        figures["forwards_per_token"] = self.decoder_forwards / max(self.target_tokens, 1)
        figures["mean_accepted"] = self.mean_accepted
        figures["identical_rate"] = self.identical / self.compared if self.compared else None
        return figures


class DecoderCallCounter:
    """Counts the eager decoder forward passes of a model, whatever the decoding mode, by a forward hook on its
    decoder; compiled ones run no hooks, and blockwise decoding reports them in its `decoding_stats`.

    Attributes:
        calls (`int`): decoder passes since the last [`reset`].
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._hook_calls = 0
        self._handle = model.get_decoder().register_forward_hook(self._count)

    def _count(self, module: nn.Module, args: Any, output: Any) -> None:
        # traced into a compiled graph, the hook counts nothing: the output reports those calls
        if not torch.compiler.is_compiling():
            self._hook_calls += 1

    def reset(self) -> None:
        self._hook_calls = 0

    @property
    def calls(self) -> int:
        return self._hook_calls

    def close(self) -> None:
        self._handle.remove()


def _references_by_mode(runners: Mapping[str, Runner], reference: str | Mapping[str, str] | None) -> dict[str, str]:
    """Each mode's reference mode, checked to run before it (modes run in the order of `runners`)."""
    if reference is None:
        return {}
    pairs = {mode: reference for mode in runners} if isinstance(reference, str) else dict(reference)
    order = list(runners)
    for mode, expected in pairs.items():
        if mode in runners and (expected not in runners or order.index(expected) > order.index(mode)):
            raise ValueError(f"mode {mode!r} is compared with {expected!r}, which must be a mode that runs before it")
    return {mode: expected for mode, expected in pairs.items() if mode in runners}


def wall_clock() -> float:
    """`time.perf_counter()` once the GPU has finished what was queued (CUDA runs kernels asynchronously, so a
    timer read right after a call would stop before its work did); on a CPU, the counter alone."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_run(
    runner: Runner, batch: Batch, earlier: Mapping[str, Any], counters: Sequence[DecoderCallCounter], repeats: int
) -> tuple[Any, float, int]:
    """The output of the first run, the median time over `repeats` runs, and the first run's decoder calls (hooked
    ones, and compiled ones as its `decoding_stats` reports them)."""
    for counter in counters:
        counter.reset()
    output, times, forwards = None, [], 0
    for repeat in range(repeats):
        start = wall_clock()
        result = runner(batch, earlier)
        times.append(wall_clock() - start)
        if repeat == 0:
            stats = getattr(result, "decoding_stats", None)
            compiled = 0 if stats is None or not counters else stats.compiled_forwards
            output, forwards = result, sum(counter.calls for counter in counters) + compiled
    return output, statistics.median(times), forwards


def _record(result: ModeResult, output: Any, seconds: float, forwards: int, tokenizer: Any, pad_token_id) -> None:
    sequences = sequences_of(output)
    result.seconds += seconds
    result.batch_seconds.append(seconds)
    result.decoder_forwards += forwards
    result.sentences += sequences.shape[0]
    result.target_tokens += sum(int(generated_tokens(row, pad_token_id).numel()) for row in sequences)
    if tokenizer is not None:
        texts = tokenizer.batch_decode(sequences, skip_special_tokens=True)
        result.texts += texts
        result.words += sum(len(text.split()) for text in texts)
    stats = getattr(output, "decoding_stats", None)
    if stats is not None:
        steps = stats.accepted[stats.accepted > 0]  # (steps, B) -> rows still decoding at each step
        result.accepted_sum += float(steps.sum())
        result.accepted_steps += int(steps.numel())


def _compare(result: ModeResult, output: Any, expected: Any, pad_token_id: int | None) -> None:
    rows, expected_rows = sequences_of(output), sequences_of(expected)
    matches = [same_output(a, b, pad_token_id) for a, b in zip(rows, expected_rows, strict=True)]
    result.identical_rows += matches
    result.identical += sum(matches)
    result.compared += len(matches)


@torch.no_grad()
def measure(
    runners: Mapping[str, Runner],
    batches: Sequence[Batch],
    *,
    pad_token_id: int | None,
    reference: str | Mapping[str, str] | None = None,
    baseline: str | None = None,
    tokenizer: Any = None,
    references: Sequence[str] | None = None,
    word_error: bool = False,
    count_forwards_of: Sequence[nn.Module] = (),
    warmup: bool = True,
    repeats: int = 1,
    progress: bool = True,
    description: str = "decoding",
) -> dict[str, ModeResult]:
    """Decodes every batch in every mode, interleaved per batch; times, compares and scores each mode.

    Args:
        runners (`dict[str, Runner]`): mode name -> `runner(batch, earlier)`, which decodes `batch` (the keyword
            arguments of `generate`, e.g. `input_ids` and `attention_mask` of shape `(batch_size, source_length)`)
            and returns `generate`'s output (a tensor of shape `(batch_size, length)` or a dict-style output with
            `sequences`, and `decoding_stats` for blockwise decoding); `earlier` holds the outputs of the modes
            that ran before it on this batch. Modes run in this order.
        batches (`list[dict[str, torch.Tensor]]`): what to decode; row order defines the order of texts.
        pad_token_id (`int`, *optional*): pads are not generated tokens ([`generated_tokens`]).
        reference (`str` or `dict[str, str]`, *optional*): the mode every mode is compared with, or per mode its
            reference mode (modes missing from the dict are not compared); it must run before the modes compared
            with it. A reference compared with itself counts every row identical.
        baseline (`str`, *optional*): the mode speedups are relative to (default: `reference` when it is a `str`).
        tokenizer (*optional*): decodes texts (for words/s and BLEU).
        references (`list[str]`, *optional*): one reference text per row of all batches, for BLEU.
        word_error (`bool`): also score word error rate against `references` (speech recognition).
        count_forwards_of (`list[nn.Module]`): models whose decoder calls are counted (summed) for every mode.
        warmup (`bool`): decode the first batch in every mode once before timing.
        repeats (`int`): timings per batch and mode; the median counts (outputs and decoder calls: the first run).
        progress (`bool`), description (`str`): a tqdm bar over batches.

    Returns:
        `dict[str, ModeResult]` in the order of `runners`.
    """
    if not batches:
        raise ValueError("measure needs at least one batch")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    reference_of = _references_by_mode(runners, reference)
    baseline = baseline if baseline is not None else (reference if isinstance(reference, str) else None)
    batch_size = int(next(iter(batches[0].values())).shape[0])
    results = {mode: ModeResult(mode=mode, batch_size=batch_size) for mode in runners}
    if warmup:
        earlier: dict[str, Any] = {}
        for mode, runner in runners.items():
            earlier[mode] = runner(batches[0], earlier)
    bar = tqdm(batches, desc=description, disable=not progress)
    _decode_batches(runners, bar, results, reference_of, count_forwards_of, repeats, tokenizer, pad_token_id)
    _score(results.values(), results.get(baseline), references, word_error)
    return results


def _decode_batches(
    runners: Mapping[str, Runner],
    batches: Iterable[Batch],
    results: Mapping[str, ModeResult],
    reference_of: Mapping[str, str],
    count_forwards_of: Sequence[nn.Module],
    repeats: int,
    tokenizer: Any,
    pad_token_id: int | None,
) -> None:
    """Decodes every batch in every mode, interleaved per batch: records each output, its time and decoder calls
    in `results`, and compares it with its reference mode's output of the same batch."""
    counters = [DecoderCallCounter(model) for model in count_forwards_of]
    try:
        for batch in batches:
            earlier: dict[str, Any] = {}
            for mode, runner in runners.items():
                output, seconds, forwards = _timed_run(runner, batch, earlier, counters, repeats)
                earlier[mode] = output
                _record(results[mode], output, seconds, forwards, tokenizer, pad_token_id)
                if mode in reference_of:
                    _compare(results[mode], output, earlier[reference_of[mode]], pad_token_id)
    finally:
        for counter in counters:
            counter.close()


def _score(
    results: Sequence[ModeResult], baseline: ModeResult | None, references: Sequence[str] | None, word_error: bool
) -> None:
    for result in results:
        if baseline is not None and result.seconds:
            result.speedup = baseline.seconds / result.seconds
        if references is not None and result.texts:
            if len(references) != len(result.texts):
                raise ValueError(f"{len(result.texts)} outputs but {len(references)} references")
            import sacrebleu  # only where BLEU is scored: not on `import hf_blockwise`

            result.bleu = sacrebleu.corpus_bleu(result.texts, [list(references)], force=True).score
            if word_error:
                result.wer = word_error_rate(references, result.texts)

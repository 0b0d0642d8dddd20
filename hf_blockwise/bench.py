"""`hf-blockwise bench`: every decoding mode side by side, in one run, measured against transformers' greedy.

Each mode decodes the same sentences in the same batches; times are summed over batches (each batch timed
once, modes interleaved per batch so that they share the machine's state). Per mode: wall-clock ratio to
greedy, target tokens/s, words/s (Devlin 2017's metric; single-threaded with `--threads 1`), decoder forwards
per output token, mean accepted block, identical-to-greedy rate and BLEU against references.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .acceptance import GADPlusPlusAcceptance, TopKAcceptance
from .decoding import blockwise_generate
from .input_copy import InputCopyDrafter
from .serialization import atomic_write_text

MODE_NAMES = (
    "greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_full_vocab", "heads_top2", "iad", "gad",
    "gad_pp", "greedy_int8", "heads_int8", "iad_int8",
)  # fmt: skip
DEFAULT_MODES = ("greedy", "beam4", "prompt_lookup", "assisted", "heads", "heads_top2", "iad", "gad", "gad_pp")
# The CPU fast path, step by step (Devlin 2017, Table 1): blockwise heads drafting over the whole vocabulary,
# + the heads' vocabulary shortlist, + int8 matrix products (with int8 greedy as that step's exact reference).
FAST_PATH_MODES = ("greedy", "heads_full_vocab", "heads", "greedy_int8", "heads_int8")
BATCH_ONE_ONLY = {"prompt_lookup", "assisted"}  # transformers' assisted generation decodes one row at a time
INT8_MODES = {"greedy_int8", "heads_int8", "iad_int8"}


def reference_mode(mode: str) -> str:
    """The greedy mode whose output `mode` must reproduce: int8 modes are exact w.r.t. the int8 model."""
    return "greedy_int8" if mode in INT8_MODES else "greedy"


@dataclass
class BenchSetup:
    """What the modes decode with.

    Attributes:
        base: the transformers seq2seq model (greedy reference and verifier).
        heads_model: a [`BlockwiseHeadsModel`] around `base`, for the heads modes.
        assistant_model: a smaller transformers model for transformers' assisted generation.
        max_new_tokens (`int`): length limit of every mode.
        iad_max_draft_length (`int`): most source tokens the IAD modes draft per step.
        nar_drafter ([`NonAutoregressiveDrafter`], *optional*): the drafter of the GAD modes.
        gad_block_size (`int`, *optional*): tokens per GAD step (default: the drafter's trained block size).
        gad_top_beta (`int`), gad_tolerance (`float`): GAD++'s β and τ (mode `gad_pp`).
    """

    base: nn.Module
    tokenizer: Any
    heads_model: nn.Module | None = None
    assistant_model: nn.Module | None = None
    max_new_tokens: int = 128
    iad_max_draft_length: int = 32
    nar_drafter: Any = None
    gad_block_size: int | None = None
    gad_top_beta: int = 3
    gad_tolerance: float = 1.0

    def int8_copy(self) -> BenchSetup:
        """The same setup with int8 dynamically quantized copies of the base (and of the heads model's base)."""
        from .quantization import quantize_dynamic_int8

        source = self.heads_model if self.heads_model is not None else self.base
        quantized = quantize_dynamic_int8(copy.deepcopy(source))
        heads_model = quantized if self.heads_model is not None else None
        base = quantized.base_model if heads_model is not None else quantized
        return dataclasses.replace(self, base=base, heads_model=heads_model, assistant_model=None)


@dataclass
class ModeResult:
    """One mode at one batch size."""

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
    speedup: float | None = None
    speedup_ceiling: float | None = None  # from the decoder cost curve, where known
    texts: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        figures = {key: value for key, value in asdict(self).items() if key not in ("texts",)}
        figures["tokens_per_second"] = self.target_tokens / self.seconds if self.seconds else None
        figures["words_per_second"] = self.words / self.seconds if self.seconds else None
        figures["forwards_per_token"] = self.decoder_forwards / max(self.target_tokens, 1)
        if self.accepted_steps:
            figures["mean_accepted"] = self.accepted_sum / self.accepted_steps
        elif self.batch_size == 1:  # one row: tokens per decoder call
            figures["mean_accepted"] = self.target_tokens / max(self.decoder_forwards, 1)
        else:  # transformers' modes report no per-row steps, and a batched call decodes many rows at once
            figures["mean_accepted"] = None
        figures["identical_rate"] = self.identical / max(self.sentences, 1)
        for key in ("accepted_sum", "accepted_steps"):
            figures.pop(key)
        return figures


def available_modes(setup: BenchSetup, requested: Sequence[str]) -> list[str]:
    """The requested modes this setup can run, with a reason printed for each one left out."""
    modes = []
    for mode in requested:
        if mode not in MODE_NAMES:
            raise ValueError(f"Unknown mode {mode!r}; choose from {MODE_NAMES}")
        if mode.startswith("heads") and setup.heads_model is None:
            print(f"skipping {mode}: the model has no proposal heads")
        elif mode == "assisted" and setup.assistant_model is None:
            print("skipping assisted: pass --assistant-model")
        elif mode.startswith("gad") and setup.nar_drafter is None:
            print(f"skipping {mode}: pass --nar-drafter")
        elif mode == "iad" and not _shares_vocabulary(setup.base):
            print("skipping iad: source and target vocabularies differ")
        else:
            modes.append(mode)
    if "greedy_int8" not in modes and INT8_MODES & set(modes):
        modes.insert(0, "greedy_int8")
    if "greedy" not in modes:
        modes.insert(0, "greedy")
    # references first: each batch is decoded by the modes in this order, and others are compared with them
    return sorted(modes, key=lambda mode: mode not in ("greedy", "greedy_int8"))


def _shares_vocabulary(model: nn.Module) -> bool:
    from .input_copy import check_shared_vocabulary

    try:
        check_shared_vocabulary(model)
    except ValueError:
        return False
    return True


def mode_runner(mode: str, setup: BenchSetup) -> Callable[[dict[str, torch.Tensor]], Any]:
    """A function decoding one tokenized batch in `mode`; returns sequences or a dict-style output.

    For the int8 modes, `setup` is the quantized one ([`BenchSetup.int8_copy`]).
    """
    mode = mode.removesuffix("_int8")
    base, limit = setup.base, setup.max_new_tokens
    if mode == "greedy":
        return lambda batch: base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=limit)
    if mode == "beam4":
        return lambda batch: base.generate(**batch, do_sample=False, num_beams=4, max_new_tokens=limit)
    if mode == "prompt_lookup":
        return lambda batch: base.generate(**batch, do_sample=False, prompt_lookup_num_tokens=10, max_new_tokens=limit)
    if mode == "assisted":
        return lambda batch: base.generate(
            **batch, do_sample=False, assistant_model=setup.assistant_model, max_new_tokens=limit
        )
    if mode in ("heads", "heads_full_vocab", "heads_top2"):
        rule = TopKAcceptance(2) if mode == "heads_top2" else None
        drafter = setup.heads_model.drafter(use_shortlist=mode != "heads_full_vocab")
        return lambda batch: setup.heads_model.generate(
            **batch, assistant=drafter, acceptance=rule, max_new_tokens=limit, return_dict_in_generate=True
        )
    if mode == "iad":
        drafter = InputCopyDrafter(base, max_draft_length=setup.iad_max_draft_length)
        return lambda batch: base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=limit,
            return_dict_in_generate=True,
        )  # fmt: skip
    if mode in ("gad", "gad_pp"):
        from .nar_drafter import NonAutoregressiveDrafter

        nar = setup.nar_drafter
        drafter = NonAutoregressiveDrafter(nar.model, nar.config, block_size=setup.gad_block_size, verifier=base)
        rule = GADPlusPlusAcceptance(setup.gad_top_beta, setup.gad_tolerance) if mode == "gad_pp" else None
        return lambda batch: base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, acceptance=rule, max_new_tokens=limit,
            return_dict_in_generate=True,
        )  # fmt: skip
    raise ValueError(f"Unknown mode {mode!r}")


class DecoderCallCounter:
    """Counts decoder forward passes (a forward hook on the base's decoder), whatever the decoding mode."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        self._handle = model.get_decoder().register_forward_hook(self._count)

    def _count(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def _strip(row: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    row = row[1:]  # the decoder start token is not generated
    return row if pad_token_id is None else row[row != pad_token_id]


def run_bench(
    setup: BenchSetup,
    sources: Sequence[str],
    references: Sequence[str] | None,
    modes: Sequence[str],
    batch_sizes: Sequence[int],
    progress: bool = True,
    variants: dict[str, tuple[str, BenchSetup]] | None = None,
) -> list[ModeResult]:
    """Decodes `sources` in every mode at every batch size; returns one [`ModeResult`] per pair.

    Args:
        variants (`dict`, *optional*): more runs by name, each a mode with its own setup (e.g. a sweep over GAD's
            block size); they are timed beside the modes, batch by batch, and compared with the same greedy run.
    """
    if not sources:
        raise ValueError("The benchmark needs at least one source sentence")
    import sacrebleu

    modes = available_modes(setup, modes)
    int8_setup = setup.int8_copy() if INT8_MODES & set(modes) else None
    pad_token_id = setup.base.config.pad_token_id
    device = next(setup.base.parameters()).device
    results = []
    for batch_size in batch_sizes:
        batches = [
            setup.tokenizer(list(sources[start : start + batch_size]), return_tensors="pt", padding=True).to(device)
            for start in range(0, len(sources), batch_size)
        ]
        active = [mode for mode in modes if batch_size == 1 or mode not in BATCH_ONE_ONLY]
        runners = {mode: mode_runner(mode, int8_setup if mode in INT8_MODES else setup) for mode in active}
        for name, (mode, variant_setup) in (variants or {}).items():
            if name in runners:
                raise ValueError(f"variant name {name!r} is also a mode")
            runners[name] = mode_runner(mode, variant_setup)
            active.append(name)
        for runner in runners.values():
            runner(batches[0])  # warm-up
        by_mode = {mode: ModeResult(mode=mode, batch_size=batch_size) for mode in active}
        counters = [DecoderCallCounter(setup.base)]
        if int8_setup is not None:
            counters.append(DecoderCallCounter(int8_setup.base))
        try:
            for batch in tqdm(batches, desc=f"bench batch {batch_size}", disable=not progress):
                reference_rows: dict[str, list[torch.Tensor]] = {}
                for mode in active:
                    for counter in counters:
                        counter.calls = 0
                    start = time.perf_counter()
                    output = runners[mode](batch)
                    seconds = time.perf_counter() - start
                    forwards = sum(counter.calls for counter in counters)
                    _record(by_mode[mode], output, seconds, forwards, setup.tokenizer, pad_token_id)
                    rows = [_strip(row, pad_token_id) for row in _sequences(output)]
                    reference_rows.setdefault(mode, rows)
                    expected = reference_rows[reference_mode(mode)]
                    by_mode[mode].identical += sum(torch.equal(a, b) for a, b in zip(rows, expected, strict=True))
        finally:
            for counter in counters:
                counter.close()
        greedy_seconds = by_mode["greedy"].seconds
        for result in by_mode.values():
            result.speedup = greedy_seconds / result.seconds
            if references is not None:
                result.bleu = sacrebleu.corpus_bleu(result.texts, [list(references)]).score
            results.append(result)
    return results


def _sequences(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


def _record(result: ModeResult, output: Any, seconds: float, forwards: int, tokenizer, pad_token_id) -> None:
    sequences = _sequences(output)
    result.seconds += seconds
    result.decoder_forwards += forwards
    result.sentences += sequences.shape[0]
    texts = tokenizer.batch_decode(sequences, skip_special_tokens=True)
    result.texts += texts
    result.words += sum(len(text.split()) for text in texts)
    result.target_tokens += sum(int(_strip(row, pad_token_id).numel()) for row in sequences)
    stats = getattr(output, "decoding_stats", None)
    if stats is not None:
        steps = stats.accepted[stats.accepted > 0]
        result.accepted_sum += float(steps.sum())
        result.accepted_steps += int(steps.numel())


def markdown_table(results: Sequence[ModeResult], header: str) -> str:
    lines = [
        header,
        "",
        "| batch | mode | speedup vs greedy | ceiling | tokens/s | words/s | forwards/token | mean accepted "
        "| identical¹ | BLEU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        figures = result.summary()
        bleu = "" if result.bleu is None else f"{result.bleu:.2f}"
        ceiling = "" if result.speedup_ceiling is None else f"{result.speedup_ceiling:.2f}x"
        accepted = "" if figures["mean_accepted"] is None else f"{figures['mean_accepted']:.2f}"
        lines.append(
            f"| {result.batch_size} | {result.mode} | {result.speedup:.2f}x | {ceiling} | "
            f"{figures['tokens_per_second']:.0f} | "
            f"{figures['words_per_second']:.0f} | {figures['forwards_per_token']:.2f} | "
            f"{accepted} | {result.identical}/{result.sentences} | {bleu} |"
        )
    lines += [
        "",
        "¹ outputs equal, token for token, to greedy decoding of the same model (int8 modes: the int8 model)",
        "",
        "ceiling: `mean accepted · t(1) / t(k)` from the decoder cost curve (`--cost-curve`), for modes that feed k "
        "tokens every step: what the mode would reach if drafting and the loop cost nothing (GAD's drafter calls "
        "come on top)",
    ]
    return "\n".join(lines) + "\n"


def plot(results: Sequence[ModeResult], path: str) -> None:
    """Speedup and BLEU against mean accepted block (Stern's Figure 4 and Table 1 scatter), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed_axis, quality_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for result in results:
        figures = result.summary()
        label = f"{result.mode} (b={result.batch_size})"
        if figures["mean_accepted"] is None:
            continue
        speed_axis.scatter(figures["mean_accepted"], result.speedup, label=label)
        if result.bleu is not None:
            quality_axis.scatter(figures["mean_accepted"], result.bleu, label=label)
    speed_axis.set(xlabel="mean accepted block", ylabel="wall-clock speedup vs greedy", title="speed")
    quality_axis.set(xlabel="mean accepted block", ylabel="BLEU", title="quality")
    speed_axis.axhline(1.0, color="grey", linewidth=0.5)
    speed_axis.legend(fontsize=7)
    figure.tight_layout()
    temporary = f"{path}.tmp.png"
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    os.replace(temporary, path)


def write_report(results: Sequence[ModeResult], out_dir: str, header: str, settings: dict[str, Any]) -> None:
    """`bench.json`, `bench.md` and `bench.png` in `out_dir`, each written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    report = {"settings": settings, "results": [result.summary() for result in results]}
    atomic_write_text(os.path.join(out_dir, "bench.json"), json.dumps(report, indent=2) + "\n")
    atomic_write_text(os.path.join(out_dir, "bench.md"), markdown_table(results, header))
    plot(results, os.path.join(out_dir, "bench.png"))


def read_lines(path: str) -> list[str]:
    """One sentence per line, plain or gzip text."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [" ".join(line.split()) for line in handle.read().splitlines()]


@torch.no_grad()
def decoder_cost_curve(
    base: nn.Module, tokenizer, sentence: str, max_tokens: int = 32, prefix_length: int = 10, repeats: int = 20
) -> list[tuple[int, float]]:
    """Median time of one cached decoder forward that feeds n = 1..`max_tokens` new tokens.

    The cache first holds `prefix_length` tokens and the encoder output is computed once, as in decoding.
    The curve bounds what any drafter can gain: a step that feeds k tokens and keeps a of them is at most
    `a * t(1) / t(k)` times faster than greedy (see [`speedup_ceiling`]).
    """
    import statistics

    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    device = next(base.parameters()).device
    inputs = tokenizer([sentence], return_tensors="pt").to(device)
    encoder_outputs = base.get_encoder()(**inputs)
    start = torch.full((1, 1), base.config.decoder_start_token_id, device=device)
    prefix = torch.cat([start, torch.full((1, prefix_length - 1), base.config.eos_token_id, device=device)], dim=1)
    curve = []
    for num_tokens in range(1, max_tokens + 1):
        fed = torch.full((1, num_tokens), base.config.eos_token_id, device=device)
        times = []
        for _ in range(repeats):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            base(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], decoder_input_ids=prefix,
                 past_key_values=cache, use_cache=True)  # fmt: skip
            begin = time.perf_counter()
            base(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], decoder_input_ids=fed,
                 past_key_values=cache, use_cache=True)  # fmt: skip
            times.append(time.perf_counter() - begin)
        curve.append((num_tokens, statistics.median(times)))
    return curve


def speedup_ceiling(curve: Sequence[tuple[int, float]], mean_accepted: float, tokens_fed: int) -> float:
    """Best speedup over greedy for steps that feed `tokens_fed` tokens and gain `mean_accepted` on average,
    counting decoder forwards only: `mean_accepted * t(1) / t(tokens_fed)`."""
    times = dict(curve)
    return mean_accepted * times[1] / times[tokens_fed]


def plot_cost_curve(curve: Sequence[tuple[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, ceiling_axis) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [n for n, _ in curve]
    time_axis.plot(tokens, [1000 * t for _, t in curve], marker="o")
    time_axis.set(xlabel="tokens fed in one decoder call", ylabel="ms per call", title="decoder cost curve")
    for accepted in (1.5, 2.0, 3.0, 4.0):
        ceiling = [speedup_ceiling(curve, min(accepted, n), n) for n in tokens]
        ceiling_axis.plot(tokens, ceiling, label=f"mean accepted {accepted:g}")
    ceiling_axis.set(xlabel="block size k (tokens fed)", ylabel="speedup ceiling", title="a · t(1) / t(k)")
    ceiling_axis.axhline(1.0, color="grey", linewidth=0.5)
    ceiling_axis.legend(fontsize=7)
    figure.tight_layout()
    temporary = f"{path}.tmp.png"
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    os.replace(temporary, path)

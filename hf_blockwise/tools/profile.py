"""`hf-blockwise profile`: where decoding's time goes, on your model, in three questions.

- [`call_cost_rows`] (`profile calls`): one cached decoder call of 1..N tokens, batch 1, against the time its
  weights' bytes take to stream, from memory and from cache ([`bandwidth_gb_s`]), for float32 and int8, eager and
  compiled; [`profile_compiled_call`] adds `torch.profiler`'s table of one compiled int8 call and its time by part.
- [`step_phases`] (`profile step`): a blockwise decode's time per sentence split into verification, drafting,
  bookkeeping and `generate`'s fixed cost.
- [`divergences`] (`profile divergences`): where blockwise decoding departs from greedy decoding of the same
  weights, and the top-2 logit gap there (a floating-point near-tie is the only excuse).
- [`sampling_acceptance`] (`profile acceptance`): how often sampling keeps a drafter's first draft under the two
  exact constructions: speculative sampling's `min(1, p/q)` and the shared noise the loop ships.
"""

from __future__ import annotations

import collections
import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_blockwise import blockwise_generate, greedy_divergences, quantize_dynamic_int8
from hf_blockwise.drafters import feature_block, heads, trees
from hf_blockwise.drafters.base import Drafter, likely_candidates
from hf_blockwise.engine import CompileOptions, drop_compiled, registry
from hf_blockwise.evaluation.cost_curve import CAPTION, compiled_call, decoder_cost_curve
from hf_blockwise.evaluation.harness import wall_clock
from hf_blockwise.generation import loop, step
from hf_blockwise.quantization import Int8Linear

# "unmerged": the int8 engine without its merge of products that take the same rows (`merged_products`)
CALL_KINDS = ("float32 eager", "float32 compiled", "int8 eager", "int8 compiled", "int8 compiled unmerged")


def bandwidth_gb_s(megabytes: float, repeats: int = 10) -> float:
    """Bytes per second that summing a float32 tensor of `megabytes` streams (median of `repeats`): from memory for
    a tensor far larger than the last-level cache (400 MB), from cache for one that fits it (a few MB)."""
    tensor = torch.ones(int(megabytes * 2**20) // 4)
    tensor.sum()  # touched once: paged in, and in cache if it fits
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        tensor.sum()
        times.append(time.perf_counter() - begin)
    return tensor.numel() * 4 / statistics.median(times) / 1e9


def step_weight_bytes(base: nn.Module) -> int:
    """Bytes of the weights one decoder step reads: every projection of the decoder and the output projection, but
    the cross-attention's keys and values (computed once per call); int8 weights count 1 byte each."""
    total = 0
    decoder_modules = [*base.get_decoder().named_modules(), ("lm_head", base.get_output_embeddings())]
    for name, module in decoder_modules:
        if name.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj", "EncDecAttention.k", "EncDecAttention.v")):
            continue
        if isinstance(module, Int8Linear):  # its int8 weight, however laid out (a packed one holds padding)
            total += module.in_features * module.out_features
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


@dataclass(frozen=True)
class CallCostRow:
    """One kind of call's cost curve.

    Attributes:
        kind (`str`): one of `CALL_KINDS`.
        weight_bytes (`int`): what one call streams ([`step_weight_bytes`]).
        seconds (`list[float]`): the median call at 1..N tokens.
    """

    kind: str
    weight_bytes: int
    seconds: list[float]


def call_cost_rows(
    base: nn.Module,
    tokenizer: Any,
    kinds: Sequence[str] = CALL_KINDS,
    max_tokens: int = 8,
    repeats: int = 20,
    sentence: str = CAPTION,
    int8: nn.Module | None = None,
) -> list[CallCostRow]:
    """The cost curve of each kind of call ([`decoder_cost_curve`]); the int8 kinds time `int8`, a quantized copy of
    `base` (made here when not given)."""
    unknown = sorted(set(kinds) - set(CALL_KINDS))
    if unknown:
        raise ValueError(f"unknown call kinds {unknown}; the kinds are {list(CALL_KINDS)}")
    if int8 is None and any(kind.startswith("int8") for kind in kinds):
        int8 = quantize_dynamic_int8(copy.deepcopy(base))
    rows = []
    for kind in kinds:
        model = int8 if kind.startswith("int8") else base
        options = CompileOptions(merge_int8_products=not kind.endswith("unmerged"))
        curve = decoder_cost_curve(
            model,
            tokenizer,
            sentence,
            max_tokens=max_tokens,
            repeats=repeats,
            compiled="compiled" in kind,
            options=options,
        )
        rows.append(CallCostRow(kind, step_weight_bytes(model), [seconds for _, seconds in curve]))
    return rows


def call_cost_table(rows: Sequence[CallCostRow], from_memory: float, from_cache: float) -> str:
    """A Markdown table of the rows: each call in ms and as a multiple of its bytes' time from memory."""
    widths = len(rows[0].seconds) if rows else 0
    lines = [
        f"| call | weight bytes | bytes' time from memory ({from_memory:.0f} GB/s) / cache ({from_cache:.0f} GB/s) | "
        + " | ".join(f"{n} tok" for n in range(1, widths + 1))
        + " |",
        "|---|---|---|" + "---|" * widths,
    ]
    for row in rows:
        memory_ms, cache_ms = row.weight_bytes / from_memory / 1e6, row.weight_bytes / from_cache / 1e6
        cells = " | ".join(f"{1000 * seconds:.2f} ms ({1000 * seconds / memory_ms:.1f}x)" for seconds in row.seconds)
        lines.append(
            f"| {row.kind} | {row.weight_bytes / 1e6:.3g} MB | {memory_ms:.2f} / {cache_ms:.2f} ms | {cells} |"
        )
    return "\n".join(lines)


def profile_compiled_call(
    model: nn.Module, tokenizer: Any, calls: int = 20, width: int = 3
) -> tuple[str, dict[str, float]]:
    """`torch.profiler`'s table (ops by self time, grouped by input shapes) over `calls` compiled decoder calls of
    `width` tokens, batch 1, and the milliseconds one call spends in each part ([`call_time_parts`]).

    The graph is compiled here with inductor's kernel profiling (`cpp.enable_kernel_profile`), so that its own C++
    kernels are timed by name beside the operators it calls: `model`'s engine is dropped before and after, so that
    the profiled graph serves nothing else.
    """
    drop_compiled(model)
    try:
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
            call = compiled_call(model, tokenizer, width)
            for _ in range(3):  # warm: compiled, and the graphs' first runs done
                call()
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
            for _ in range(calls):
                call()
    finally:
        drop_compiled(model)
    table = profile.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40
    )
    return table, call_time_parts(profile.key_averages(), calls)


CALL_PARTS = ("int8 products", "the graph's own kernels", "inductor's Python between kernels", "dynamo", "other")


def call_time_parts(averages: Iterable[Any], calls: int) -> dict[str, float]:
    """Milliseconds per call in each of [`CALL_PARTS`], from `torch.profiler` averages (self CPU times) of a graph
    compiled with kernel profiling: the int8 products (hf_blockwise's kernel, `torch._int_mm`), the graph's C++
    kernels (`graph_*`), the self time of inductor's generated Python `call` (what runs between kernels), dynamo's
    frame (its cache lookup with the guards, the compiled region's entry, the pre-graph bytecode, AOT's wrapper) and
    the other operators (allocations, views)."""
    parts = dict.fromkeys(CALL_PARTS, 0.0)
    for event in averages:
        name = event.key
        if name.endswith("int8_mm") or name == "aten::_int_mm":
            part = "int8 products"
        elif name.startswith("graph_"):
            part = "the graph's own kernels"
        elif name.startswith("## Call CompiledFxGraph"):
            part = "inductor's Python between kernels"
        elif name.startswith(("TorchDynamo", "Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher")):
            part = "dynamo"
        else:
            part = "other"
        parts[part] += event.self_cpu_time_total / 1000 / calls
    return parts


def guard_cost(
    model: nn.Module,
    tokenizer: Any,
    widths: Sequence[int] = (1, 5),
    blocks: int = 15,
    calls: int = 40,
    options: CompileOptions | None = None,
) -> dict[int, tuple[float, float]]:
    """What dynamo's guards cost a compiled decoder call of each width (batch 1): blocks of `calls` calls with the
    guards checked, alternating with blocks under `set_stance(skip_guard_eval_unsafe=True)` (safe here: the same
    call again, its graph compiled), in one process so that both see the machine alike.

    Returns:
        `dict[int, tuple[float, float]]`: per width, the median call in ms with guards, and the median over the
        block pairs of the difference (ms): what the guards cost.
    """
    results = {}
    for width in widths:
        call = compiled_call(model, tokenizer, width, options=options)
        for _ in range(3):  # compiled, and the graph's first runs done
            call()
        checked, differences = [], []
        for _ in range(blocks):
            with_guards = _ms_per_call(call, calls)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                without = _ms_per_call(call, calls)
            checked.append(with_guards)
            differences.append(with_guards - without)
        results[width] = (statistics.median(checked), statistics.median(differences))
    return results


def _ms_per_call(call: Callable[[], None], calls: int) -> float:
    begin = wall_clock()
    for _ in range(calls):
        call()
    return 1000 * (wall_clock() - begin) / calls


@contextmanager
def _timing(totals: dict[str, float], drafter: Drafter | None, encoder: nn.Module) -> Iterator[None]:
    """Times into `totals` (seconds and call counts), while the block runs: the loop's step, its decoder forward, the
    drafter's `get_candidates`, the compiled
    objects' stale checks (`engine._kept`: the engine's and the drafting blocks' weight and module snapshots,
    compared once per `generate`; those made inside a step, a drafting block's on the first draft, apart) and the
    encoder's forward with the hooks before it (an int8 base's refresh of its int8 copies). Everything is put back
    after the block, raised or not."""

    in_step: list[bool] = [False]
    active: set[str] = set()  # a timed function called inside one of the same name

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if name in active:
                return function(*args, **kwargs)
            active.add(name)
            start, inside = time.perf_counter(), in_step[0]
            in_step[0] = inside or name == "step"
            try:
                return function(*args, **kwargs)
            finally:
                active.discard(name)
                in_step[0] = inside
                key = f"{name} in steps" if inside and name == "stale checks" else name
                totals[key] += time.perf_counter() - start
                totals[f"{name} calls"] += 1

        return run

    started: list[float] = []

    def encoder_starts(*_: Any) -> None:
        started.append(time.perf_counter())

    def encoder_ends(*_: Any) -> None:
        totals["encoder"] += time.perf_counter() - started.pop()

    originals = (loop.decode_step, step.run_decoder, registry._kept)
    loop.decode_step = timed("step", loop.decode_step)  # called through the modules' globals
    step.run_decoder = timed("verification", step.run_decoder)  # every step's, and the first call's
    registry._kept = timed("stale checks", registry._kept)
    hooks = [
        encoder.register_forward_pre_hook(encoder_starts, prepend=True),  # before the int8 refresh's hook
        encoder.register_forward_hook(encoder_ends, always_call=True),
    ]
    if drafter is not None:  # an attribute of the instance: this drafter only, whatever its class
        drafter.get_candidates = timed("drafting", drafter.get_candidates)  # type: ignore[method-assign]
    try:
        yield
    finally:
        loop.decode_step, step.run_decoder, registry._kept = originals
        for hook in hooks:
            hook.remove()
        if drafter is not None:
            del drafter.get_candidates


def step_phases(
    base: nn.Module,
    tokenizer: Any,
    sources: Sequence[str],
    drafter: Drafter | None,
    compiled: bool | CompileOptions,
    max_new_tokens: int = 128,
) -> dict[str, float]:
    """Milliseconds per sentence of each phase of blockwise greedy decoding at batch 1 (after an untimed warm-up over
    the same sentences, which also compiles), and of one verification call and one drafter call.

    Returns:
        `dict[str, float]`: `verification`, `drafting`, `bookkeeping` (the rest of each step: feed, scores,
        acceptance, stopping, advance), `generate (fixed)` (what a call spends outside its steps), `total`,
        `verification per call`, `drafting per call`; then `generate (fixed)` split: `encoder` (its forward and the
        hooks before it: an int8 base's refresh of its int8 copies), `engine check` (the compiled engine's stale
        checks, once per `generate`; 0 when eager) and `setup` (the rest: transformers' preparation, the loop's own,
        the tokenizer); and `block check`, a drafting block's stale checks (part of `drafting`: made on the first
        draft of each `generate`).
    """
    totals: dict[str, float] = collections.defaultdict(float)
    with torch.inference_mode(), _timing(totals, drafter, base.get_encoder()):
        for _run in ("warm-up", "timed"):
            totals.clear()
            start = time.perf_counter()
            for source in sources:
                base.generate(
                    **tokenizer(source, return_tensors="pt"), custom_generate=blockwise_generate,
                    assistant=drafter, blockwise_compile=compiled, max_new_tokens=max_new_tokens, num_beams=1,
                )  # fmt: skip
            total = time.perf_counter() - start
    phases = {
        "verification": totals["verification"],
        "drafting": totals["drafting"],
        "bookkeeping": totals["step"] - totals["verification"] - totals["drafting"],
        "generate (fixed)": total - totals["step"],
        "total": total,
    }
    fixed = {
        "encoder": totals["encoder"],
        "engine check": totals["stale checks"],
        "setup": phases["generate (fixed)"] - totals["encoder"] - totals["stale checks"],
        "block check": totals["stale checks in steps"],
    }
    per_sentence = {name: 1000 * seconds / len(sources) for name, seconds in phases.items()}
    per_call = {
        f"{name} per call": 1000 * totals[name] / totals[f"{name} calls"] if totals[f"{name} calls"] else float("nan")
        for name in ("verification", "drafting")
    }
    return {**per_sentence, **per_call, **{name: 1000 * seconds / len(sources) for name, seconds in fixed.items()}}


@dataclass(frozen=True)
class DivergenceReport:
    """What [`divergences`] found.

    Attributes:
        sentences (`int`): decoded.
        differing (`list[tuple[str, list]]`): each source whose blockwise output differs, with its
            [`greedy_divergences`] list: where it departs from transformers' greedy, the token's rank and gap.
        gaps (`list[float]`): the gaps at every departure, in float spacings of the scores, sorted.
    """

    sentences: int
    differing: list[tuple[str, list]]
    gaps: list[float]


def divergences(
    base: nn.Module,
    tokenizer: Any,
    sources: Sequence[str],
    drafter: Drafter,
    compiled: bool | CompileOptions,
    max_new_tokens: int = 128,
) -> DivergenceReport:
    """Decodes each source greedy and blockwise (batch 1; eager against transformers' greedy, or `compiled` through
    the engine against the engine's own greedy) and reports where they differ."""
    engine = {"custom_generate": blockwise_generate, "blockwise_compile": compiled}
    differing, gaps = [], []
    for source in sources:
        inputs = tokenizer([source], return_tensors="pt")
        if compiled:
            greedy = base.generate(**inputs, **engine, max_new_tokens=max_new_tokens)
        else:
            greedy = base.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
        blockwise = base.generate(**inputs, **engine, assistant=drafter, max_new_tokens=max_new_tokens, num_beams=1)
        if not torch.equal(greedy, blockwise):
            found = greedy_divergences(base, inputs, blockwise, max_new_tokens=max_new_tokens)
            differing.append((source, found))
            gaps += [divergence.gap_in_spacings for divergence in found]
    return DivergenceReport(len(sources), differing, sorted(gaps))


@dataclass(frozen=True)
class SamplingAcceptance:
    """What [`sampling_acceptance`] measured over the first draft of every drafting step of sampled decodes.

    Attributes:
        drafts (`int`): first drafts measured.
        speculative (`float`): the mean probability that speculative sampling keeps the draft, `sum(min(p, q))`
            (p: the model's warped distribution at the draft's position, q: the drafter's proposal distribution).
        shared_noise (`float`): the mean probability that shared noise keeps it: the drafter's and the model's
            Gumbel-max draws under the same noise agree (over `draws` noise draws per position).
        kept (`float`): the share of first drafts the decodes kept (each position's one draw: the run's own).
        tokens_per_call (`float`): the decodes' mean tokens per verification call.
    """

    drafts: int
    speculative: float
    shared_noise: float
    kept: float
    tokens_per_call: float


def sampling_acceptance(
    base: nn.Module,
    tokenizer: Any,
    sources: Sequence[str],
    drafter: Drafter,
    temperature: float,
    top_p: float,
    max_new_tokens: int = 128,
    draws: int = 256,
) -> SamplingAcceptance:
    """Samples each source (batch 1, eager drafting, seeded) with `drafter` and measures, at the first draft of every
    step (the one that follows the verified prefix), how likely each exact construction is to keep it.

    The drafter's proposal distribution q is what it draws a sampling call's chain token from
    ([`draw_among_likely`]): the softmax of its `SAMPLED_CANDIDATES` most likely logits over the temperature. The
    model's p is its warped distribution there, read from the decode's own `output_scores`.
    """
    records: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (position, draft, proposal ids (K,), q (K,))
    kept, speculative, shared, calls, tokens = [], [], [], 0, 0
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(), _first_drafts(drafter, records):
        for index, source in enumerate(sources):
            records.clear()
            torch.manual_seed(index)
            output = base.generate(
                **tokenizer(source, return_tensors="pt"), custom_generate=blockwise_generate, assistant=drafter,
                do_sample=True, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                num_beams=1, return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
            sequence, prompt = output.sequences[0].tolist(), output.sequences.shape[1] - len(output.scores)
            calls += output.decoding_stats.num_forwards
            tokens += len(output.scores)
            for position, draft, ids, proposal in records:
                warped = output.scores[position - prompt][0].float()  # (V,): the model's scores there
                kept.append(float(draft == sequence[position]))
                speculative.append(float(torch.minimum(warped.softmax(dim=-1)[ids], proposal).sum()))
                shared.append(_shared_noise_agreement(ids, proposal, warped, generator, draws))
    if not kept:
        raise ValueError("no draft was measured: the drafter drafted no chain (a drafter of trees, or no steps)")
    mean = statistics.fmean
    return SamplingAcceptance(len(kept), mean(speculative), mean(shared), mean(kept), tokens / calls)


def _shared_noise_agreement(
    ids: torch.Tensor, proposal: torch.Tensor, warped: torch.Tensor, generator: torch.Generator, draws: int
) -> float:
    """The share of `draws` Gumbel noises under which the drafter's draw (`argmax(log q + g)` over its proposal ids)
    and the model's (`argmax(warped + g)`) are the same token. Only tokens either can draw matter: the noise is
    drawn over their union.

    Args:
        ids (`torch.LongTensor` of shape `(K,)`), proposal (`torch.Tensor` of shape `(K,)`): q over those ids.
        warped (`torch.Tensor` of shape `(V,)`): the model's warped scores (`-inf` where the warpers removed a token).
    """
    union = torch.unique(torch.cat([ids, torch.isfinite(warped).nonzero().flatten()]))  # (U,)
    drafter_scores = torch.full((union.shape[0],), float("-inf"))
    drafter_scores[torch.searchsorted(union, ids)] = proposal.log()
    uniform = torch.rand((draws, union.shape[0]), generator=generator).clamp(min=1e-12)
    gumbel = -torch.log(-torch.log(uniform))  # (draws, U)
    same = (drafter_scores + gumbel).argmax(dim=-1) == (warped[union] + gumbel).argmax(dim=-1)
    return float(same.float().mean())


@contextmanager
def _first_drafts(drafter: Drafter, records: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """While open, appends to `records` each sampling step's first draft of an eager chain drafter (the draft that
    follows the verified prefix): its position, the token drafted, and the proposal it was drawn from (the ids and
    probabilities of [`draw_among_likely`]'s candidates), by wrapping `drafted_candidates` where the heads and the
    feature drafter's block call it. A draw is a first draft where its noise key is the one at the row's length."""
    steps: dict[str, torch.Tensor] = {}
    original_candidates = drafter.get_candidates

    def get_candidates(request: Any) -> Any:
        steps["lengths"] = request.lengths
        steps["keys"] = request.sampling.keys(request.lengths)  # (b,): the first drafts' noise keys
        return original_candidates(request)

    def recording(
        logits: torch.Tensor, token_ids: torch.Tensor | None, branching: int, keys: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        drafted = trees.drafted_candidates(logits, token_ids, branching, keys, temperature)
        if keys is not None and branching == 1:
            one_each = keys.dim() == 1  # heads draft every depth at once: (b, n); the first is depth 0
            first, first_logits = (keys, logits) if one_each else (keys[:, 0], logits[:, 0])
            draft = drafted[0][..., 0] if one_each else drafted[0][:, 0, 0]  # (b,)
            values, indices = likely_candidates(first_logits)  # (b, K): what the draft was drawn among
            ids = indices if token_ids is None else token_ids[indices]
            proposal = (values / temperature).softmax(dim=-1)
            for row in (first == steps["keys"]).nonzero().flatten().tolist():
                records.append((int(steps["lengths"][row]), int(draft[row]), ids[row], proposal[row]))
        return drafted

    drafter.get_candidates = get_candidates  # an instance attribute over the method, deleted below
    feature_block.drafted_candidates = heads.drafted_candidates = recording
    try:
        yield
    finally:
        del drafter.get_candidates
        feature_block.drafted_candidates = heads.drafted_candidates = trees.drafted_candidates

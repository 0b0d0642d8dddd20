"""What one decoder call costs in int8 against the time its weight bytes take to stream, beside float32.

    python scripts/int8_call_cost.py --threads 2

Loads the shipped `marian-base-en-de`, times one cached decoder call at 1..`--max-tokens` tokens (batch 1, median of
`--repeats`, widths interleaved; `decoder_cost_curve`) for the compiled float32 engine, the eager int8 model and the
compiled int8 engine, and divides by the streaming time of the bytes a call reads: the decoder's weights that every
step uses (self-attention, the cross-attention's query and output projections, feed-forward, output projection;
the cross-attention keys and values are computed once per call), at the bandwidth measured here by summing a
400 MB float32 tensor; then `torch.profiler`'s table over 20 compiled int8 calls of 3 tokens.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging

from hf_blockwise import quantize_dynamic_int8
from hf_blockwise.evaluation.cost_curve import decoder_cost_curve
from hf_blockwise.loading import REALISTIC_MODEL, load_model
from hf_blockwise.training.arguments import parse_dataclass_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_common import SENTENCE, compiled_call


@dataclass
class Int8CallCostArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=REALISTIC_MODEL, metadata={"help": "shipped model folder"})
    max_tokens: int = field(default=8, metadata={"help": "time calls of 1..N tokens"})
    repeats: int = field(default=40, metadata={"help": "timed rounds over the widths"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})


def bandwidth_gb_s(megabytes: int = 400, repeats: int = 10) -> float:
    """Bytes per second that a sum over a large float32 tensor streams (median of `repeats`)."""
    tensor = torch.ones(megabytes * 2**20 // 4)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        tensor.sum()
        times.append(time.perf_counter() - begin)
    return tensor.numel() * 4 / statistics.median(times) / 1e9


def step_weight_bytes(base: nn.Module) -> int:
    """Bytes of the weights one decoder step reads: every projection of the decoder and the output projection,
    but the cross-attention's keys and values (computed once per call); int8 weights count 1 byte each."""
    total = 0
    decoder_modules = [*base.get_decoder().named_modules(), ("lm_head", base.get_output_embeddings())]
    for name, module in decoder_modules:
        if name.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj", "EncDecAttention.k", "EncDecAttention.v")):
            continue
        weight = getattr(module, "weight_int8_t", None)
        if weight is None and isinstance(module, nn.Linear):
            weight = module.weight
        if weight is not None:
            total += weight.numel() * weight.element_size()
    return total


def profile_compiled_call(model: nn.Module, tokenizer, calls: int = 20, width: int = 3) -> str:
    """`torch.profiler`'s table (ops by self time) over `calls` compiled decoder calls of `width` tokens, batch 1,
    each after the cache is cropped back as the loop does."""
    call = compiled_call(model, tokenizer, width)
    for _ in range(3):  # warm: compiled, and the graphs' first runs done
        call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(calls):
            call()
    return profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(Int8CallCostArguments, argv, __doc__.split("\n", 1)[0])
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    base, tokenizer = loaded.base, loaded.tokenizer
    int8 = quantize_dynamic_int8(copy.deepcopy(base))
    gb_s = bandwidth_gb_s()
    print(f"{args.model}, batch 1, {args.threads} threads; streaming bandwidth measured here: {gb_s:.1f} GB/s")
    rows = {
        "float32 compiled": (base, True),
        "int8 eager": (int8, False),
        "int8 compiled": (int8, True),
    }
    widths = " | ".join(f"{n} tok" for n in range(1, args.max_tokens + 1))
    print(f"| call | weight bytes | bytes' time | {widths} |")
    print("|---|---|---|" + "---|" * args.max_tokens)
    for name, (model, compiled) in rows.items():
        curve = decoder_cost_curve(
            model, tokenizer, SENTENCE, max_tokens=args.max_tokens, repeats=args.repeats, compiled=compiled
        )
        weight_bytes = step_weight_bytes(model)
        floor_ms = weight_bytes / gb_s / 1e6
        cells = " | ".join(f"{1000 * seconds:.2f} ms ({1000 * seconds / floor_ms:.1f}x)" for _, seconds in curve)
        print(f"| {name} | {weight_bytes / 1e6:.1f} MB | {floor_ms:.2f} ms | {cells} |")
    print("\nWhere a compiled int8 call of 3 tokens spends its time (20 calls; divide by 20 for one):\n")
    print("```\n" + profile_compiled_call(int8, tokenizer) + "```")


if __name__ == "__main__":
    main()

"""What the compiled engine's stale-weight check costs, against what it guards: one compiled decoder call.

    python scripts/stale_weights_check.py --threads 2

Loads the shipped `marian-base-en-de`, compiles its engine, and times (medians) the check each compiled `generate`
call makes ([`WeightsSnapshot.matches`]) beside one compiled decoder call of one token and one compiled greedy
`generate` call of a caption, batch 1; then, on the model quantized to int8, the int8 copies' check (`refresh_int8`).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.utils import logging

from hf_blockwise import blockwise_generate
from hf_blockwise.engine import WeightsSnapshot
from hf_blockwise.loading import REALISTIC_MODEL, load_model
from hf_blockwise.quantization import quantize_dynamic_int8, refresh_int8
from hf_blockwise.training.arguments import parse_dataclass_args

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_common import SENTENCE, compiled_call


@dataclass
class StaleWeightsCheckArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=REALISTIC_MODEL, metadata={"help": "shipped model folder"})
    repeats: int = field(default=200, metadata={"help": "timed repeats of each"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})


def median_ms(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        function()
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(StaleWeightsCheckArguments, argv, __doc__.split("\n", 1)[0])
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    base, tokenizer = loaded.base, loaded.tokenizer
    one_call = compiled_call(base, tokenizer, width=1)
    one_call()  # compiles
    call = median_ms(one_call, args.repeats)
    inputs = tokenizer([SENTENCE], return_tensors="pt")
    sentence = median_ms(
        lambda: base.generate(**inputs, custom_generate=blockwise_generate, blockwise_compile=True, max_new_tokens=128),
        max(args.repeats // 20, 3),
    )  # fmt: skip
    snapshot = WeightsSnapshot(base)
    check = median_ms(lambda: snapshot.matches(base), args.repeats)
    sampled = snapshot.tensors.num_sampled
    print(f"{args.model}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters, {sampled} values sampled")
    print(
        f"stale-weight check (once per generate call) {check:.3f} ms; one compiled decoder call {call:.2f} ms "
        f"({check / call:.1%}); one compiled greedy generate call of a caption {sentence:.1f} ms "
        f"({check / sentence:.2%})"
    )
    quantize_dynamic_int8(base)  # the int8 copies' own check, run before every encoder forward of an int8 model
    refresh = median_ms(lambda: refresh_int8(base), args.repeats)
    print(f"int8 copies' check (refresh_int8, once per generate call of the int8 model) {refresh:.3f} ms")


if __name__ == "__main__":
    main()

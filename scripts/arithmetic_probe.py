"""The compiled engine's one-arithmetic probe on this machine: its verdict and what it costs.

    python scripts/arithmetic_probe.py --threads 2

Loads the shipped `marian-base-en-de` (float32, then int8), decodes one caption with the feature drafter through the
compiled engine at batch 1 and 3 (chains, then trees), and prints for each kind of decode the engine's verdict
(`CompiledDecoder.verdicts`: whether the graphs claim one arithmetic, whether the probe found it bitwise) and two
costs: the first probe's wall time (compiling the graphs it is the first to run included) and the probe again on
warm graphs (what it adds to a decode once the graphs exist), beside one drafted `generate` call of the caption.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from hf_blockwise import blockwise_generate, quantize_dynamic_int8
from hf_blockwise.engine import CompileOptions, compiled_decoder
from hf_blockwise.loading import REALISTIC_MODEL, DrafterOptions, build_drafter, load_model
from hf_blockwise.training.arguments import parse_dataclass_args

CAPTIONS = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Two young children are playing in the sand at the beach.",
    "A woman with a red umbrella walks down a busy street.",
]


@dataclass
class ArithmeticProbeArguments:
    """Command-line flags of this script; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(default=REALISTIC_MODEL, metadata={"help": "shipped model folder"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})


def probe_row(loaded, precision: str, rows: int, tree_nodes: int | None) -> str:
    """One table row: a drafted decode of `rows` captions (compiling and probing), then the probe timed warm."""
    options = DrafterOptions(tree_nodes=tree_nodes) if tree_nodes else None
    drafter = build_drafter("feature", loaded, options)
    inputs = loaded.tokenizer(CAPTIONS[:rows], return_tensors="pt", padding=True)
    kwargs = {"custom_generate": blockwise_generate, "blockwise_compile": True, "max_new_tokens": 64}
    loaded.base.generate(**inputs, assistant=drafter, **kwargs)  # compiles, probes
    begin = time.perf_counter()
    loaded.base.generate(**inputs, assistant=drafter, **kwargs)
    decode = time.perf_counter() - begin
    engine = compiled_decoder(loaded.base, CompileOptions())
    key = ("several rows" if rows > 1 else "one row", tree_nodes is not None)
    first = engine.verdicts[key]
    del engine.verdicts[key]  # probe again, on warm graphs
    begin = time.perf_counter()
    loaded.base.generate(**inputs, assistant=drafter, **kwargs)
    warm = time.perf_counter() - begin - decode
    verdict = engine.verdicts[key]
    shape = "chains" if tree_nodes is None else f"trees of {tree_nodes}"
    return (
        f"| {precision} | {rows} | {shape} | {verdict.claimed} | {verdict.bitwise} | {first.seconds:.1f} s | "
        f"{1000 * warm:.0f} ms | {1000 * decode:.0f} ms |"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_dataclass_args(ArithmeticProbeArguments, argv, __doc__.split("\n", 1)[0])
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    print("| model | rows | drafts | claimed | bitwise | first probe (compiling) | probe, warm | drafted decode |")
    print("|---|---|---|---|---|---|---|---|")
    for precision in ("float32", "int8"):
        loaded = load_model(args.model)
        if precision == "int8":
            quantize_dynamic_int8(loaded.base)
        for rows, tree_nodes in ((1, None), (3, None), (1, 10)):
            print(probe_row(loaded, precision, rows, tree_nodes), flush=True)


if __name__ == "__main__":
    main()

"""What the measurement scripts share (they run as `python scripts/NAME.py`, so this folder is on their path): a
caption to decode, one compiled decoder call over a prefilled cache, cropped back after each call as the loop
does, so that it can be timed or profiled alone, and the bench run through its command line (scripts drive the
bench as a user does: they import nothing from `hf_blockwise.tools`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.engine import CompileOptions, compiled_decoder

SENTENCE = "A man in a blue shirt is standing on a ladder cleaning windows."


@torch.no_grad()
def compiled_call(model: nn.Module, tokenizer: Any, width: int, sentence: str = SENTENCE) -> Callable[[], None]:
    """A function that runs one compiled decoder call of `width` tokens, batch 1, after the decoder start token
    (the engine built, the encoder run and the cache prefilled here), and crops the cache back; run it once to
    compile."""
    engine = compiled_decoder(model, CompileOptions())
    inputs = tokenizer([sentence], return_tensors="pt")
    forward_kwargs = {"encoder_outputs": model.get_encoder()(**inputs), "attention_mask": inputs["attention_mask"]}
    cache = engine.new_cache(64)
    engine.forward(torch.full((1, 1), model.config.decoder_start_token_id), cache, forward_kwargs, cache_length=0)
    fed = torch.full((1, width), model.config.eos_token_id)

    @torch.no_grad()
    def call() -> None:
        engine.forward(fed, cache, forward_kwargs, cache_length=1)
        hf.crop_cache(cache, 1)  # the next call writes at the same position

    return call


def bench_command(arguments: Sequence[str], out: str | os.PathLike) -> list[str]:
    """The command line of `hf-blockwise bench ARGUMENTS --out OUT`, with this interpreter."""
    return [sys.executable, "-m", "hf_blockwise.tools.cli", "bench", *arguments, "--out", os.fspath(out)]


def run_bench(arguments: Sequence[str], out: str | os.PathLike) -> dict[str, Any]:
    """Runs `hf-blockwise bench ARGUMENTS --out OUT` in a process of its own (its progress on stderr, its table
    left in `OUT/bench.md`) and returns its `bench.json`: `settings`, and `results` (one dict per mode and batch
    size, [`hf_blockwise.evaluation.ModeResult.summary`]); a failed run ends the script, naming the command."""
    command = bench_command(arguments, out)
    if subprocess.run(command, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        raise SystemExit(f"the bench failed: {' '.join(command)}")
    with open(os.path.join(out, "bench.json"), encoding="utf-8") as report:
        return json.load(report)

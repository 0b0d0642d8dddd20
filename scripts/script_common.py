"""What the measurement scripts share (they run as `python scripts/NAME.py`, so this folder is on their path): a
caption to decode, and one compiled decoder call over a prefilled cache, cropped back after each call as the loop
does, so that it can be timed or profiled alone."""

from __future__ import annotations

from collections.abc import Callable
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

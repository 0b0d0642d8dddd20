"""The decoder cost curve: the time of one cached decoder forward by tokens fed, eager or through the compiled
engine, and the speedup ceiling it implies for steps that feed the same number of tokens every time. The bench
(`hf-blockwise bench --cost-curve`) and `hf-blockwise profile calls` time with it; [`compiled_call`] is one compiled
call alone, to time or profile."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.engine import CompiledDecoder, CompileOptions, compiled_decoder
from hf_blockwise.evaluation.harness import wall_clock

CAPTION = "A man in a blue shirt is standing on a ladder cleaning windows."


@torch.no_grad()
def decoder_cost_curve(
    base: nn.Module,
    tokenizer: Any,
    sentence: str | Sequence[int],
    max_tokens: int = 32,
    prefix_length: int = 10,
    repeats: int = 20,
    compiled: bool = False,
    options: CompileOptions | None = None,
) -> list[tuple[int, float]]:
    """Median time of one cached decoder forward that feeds n = 1..`max_tokens` new tokens.

    The cache first holds `prefix_length` tokens and the encoder output is computed once, as in decoding. Each
    round times every n once (after one warm-up round), so that the widths share the machine's state.
    The curve bounds what any drafter can gain: a step that feeds k tokens and keeps a of them is at most
    `a * t(1) / t(k)` times faster than greedy (see [`speedup_ceiling`]).

    Args:
        sentence: the source, as text (tokenized with `tokenizer`) or as a list of token ids (`tokenizer` unused).
        compiled (`bool`): time the compiled engine's forward (`blockwise_compile=True`) instead of the eager one.
        options ([`CompileOptions`], *optional*): the compiled engine's options (the defaults by default).

    Returns:
        `list[tuple[int, float]]`: (tokens fed, seconds per call), for 1..`max_tokens`.
    """
    device = next(base.parameters()).device
    if isinstance(sentence, str):
        inputs = tokenizer([sentence], return_tensors="pt").to(device)
    else:
        input_ids = torch.tensor([list(sentence)], device=device)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    encoder_outputs = base.get_encoder()(**inputs)
    start = torch.full((1, 1), base.config.decoder_start_token_id, device=device)
    prefix = torch.cat([start, torch.full((1, prefix_length - 1), base.config.eos_token_id, device=device)], dim=1)
    engine = compiled_decoder(base, options or CompileOptions()) if compiled else None
    if compiled and engine is None:
        raise RuntimeError("the compiled cost curve needs torch.compile, which is unavailable here (see the warning)")
    times: dict[int, list[float]] = {num_tokens: [] for num_tokens in range(1, max_tokens + 1)}
    for repeat in range(repeats + 1):  # widths interleaved, so that a slow spell of the machine hits them all
        for num_tokens, timings in times.items():
            seconds = _time_cached_forward(base, encoder_outputs, inputs["attention_mask"], prefix, num_tokens, engine)
            if repeat > 0:  # the first round warms up
                timings.append(seconds)
    return [(num_tokens, statistics.median(timings)) for num_tokens, timings in times.items()]


def _time_cached_forward(
    base: nn.Module,
    encoder_outputs: Any,
    attention_mask: torch.Tensor,
    prefix: torch.Tensor,
    num_tokens: int,
    engine: CompiledDecoder | None = None,
) -> float:
    """Seconds of one decoder forward feeding `num_tokens` tokens (EOS ids) after `prefix` (already cached),
    eager or through `engine`."""
    forward_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": attention_mask}
    fed = torch.full((1, num_tokens), base.config.eos_token_id, device=prefix.device)
    if engine is None:
        cache = hf.new_decoder_cache()
        hf.decoder_forward(base, prefix, cache, forward_kwargs)
        begin = wall_clock()
        hf.decoder_forward(base, fed, cache, forward_kwargs)
        return wall_clock() - begin
    cache = engine.new_cache(prefix.shape[1] + num_tokens + 1)
    engine.forward(prefix, cache, forward_kwargs, cache_length=0)
    begin = wall_clock()
    engine.forward(fed, cache, forward_kwargs, cache_length=prefix.shape[1])
    return wall_clock() - begin


def speedup_ceiling(curve: Sequence[tuple[int, float]], mean_accepted: float, tokens_fed: int) -> float:
    """Best speedup over greedy for steps that feed `tokens_fed` tokens and gain `mean_accepted` on average,
    counting decoder forwards only: `mean_accepted * t(1) / t(tokens_fed)`."""
    times = dict(curve)
    return mean_accepted * times[1] / times[tokens_fed]


@torch.no_grad()
def compiled_call(
    model: nn.Module, tokenizer: Any, width: int, sentence: str = CAPTION, options: CompileOptions | None = None
) -> Callable[[], None]:
    """A function that runs one compiled decoder call of `width` tokens, batch 1, after the decoder start token
    (the engine built with `options`, the defaults by default; the encoder run and the cache prefilled here), and
    crops the cache back; run it once to compile."""
    engine = compiled_decoder(model, options or CompileOptions())
    if engine is None:
        raise RuntimeError("the compiled engine is unavailable here (see the warning): nothing to profile")
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

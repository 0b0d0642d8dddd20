"""One arithmetic for every call of a decode (the engine's contract, `engine.py`'s docstring).

Through the compiled engine a token's logits must not depend on how many tokens its call feeds: with int8 products
(exact int32 sums) and every call at least `MIN_FEED_WIDTH` columns wide over a cache of one capacity, a k-token
verification call computes bit for bit what k one-token calls compute, at batch 1 and 3. So every drafter
reproduces the int8 engine's greedy bitwise, by construction, not by luck at near-ties.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter, build_model, random_batch
from transformers import BartConfig, BartForConditionalGeneration
from zoo import _BART_LIKE, _FAIRSEQ_IDS

from hf_blockwise import blockwise_generate, quantize_dynamic_int8
from hf_blockwise import boundary as hf
from hf_blockwise.engine import MIN_FEED_WIDTH, CompileOptions, compiled_decoder

# three families of decoder: relative positions and RMS norm (T5), sinusoidal positions counted from non-pad tokens
# (M2M100), and learned positions with a layer norm after the embeddings in a BART of opus-mt's width (512, 8 heads
# of 64): at the zoo's width 32 the kernels give two rows what they give three, at 512 they do not (measured)
INT8_ARCHITECTURES = ("t5", "m2m100", "bart-512")
NUM_FED = 5  # a chain of 4 drafts after the pending token


def _model(name: str) -> torch.nn.Module:
    if name != "bart-512":
        return build_model(name)
    torch.manual_seed(0)
    options = {**_BART_LIKE, "d_model": 512, "encoder_attention_heads": 8, "decoder_attention_heads": 8}
    model = BartForConditionalGeneration(BartConfig(**options, **_FAIRSEQ_IDS)).eval()
    model.generation_config.max_length = 64
    return model


def _prefilled(engine, model, batch: dict, max_length: int):
    """A fresh cache of the engine with the decoder start token written (the eager first call), and the call's
    encoder kwargs."""
    encoder_outputs = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    forward_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": batch["attention_mask"]}
    start = torch.full((batch["input_ids"].shape[0], 1), model.generation_config.decoder_start_token_id)
    cache = engine.new_cache(max_length)
    engine.forward(start, cache, forward_kwargs, cache_length=0)
    return cache, forward_kwargs


def _chain_and_one_at_a_time(model, batch: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `tokens` (shape `(b, n)`) fed in one compiled call, and fed one token per call (the cache cropped
    back after each call's filler, as the loop does)."""
    engine = compiled_decoder(model, CompileOptions())
    with torch.no_grad():
        cache, forward_kwargs = _prefilled(engine, model, batch, max_length=32)
        together = engine.forward(tokens, cache, forward_kwargs, cache_length=1)[0]  # (b, n, V)
        cache, forward_kwargs = _prefilled(engine, model, batch, max_length=32)
        alone = []
        for column in range(tokens.shape[1]):
            alone.append(engine.forward(tokens[:, column : column + 1], cache, forward_kwargs, 1 + column)[0])
            hf.crop_cache(cache, 2 + column)
    return together, torch.cat(alone, dim=1)


@pytest.mark.parametrize("architecture", INT8_ARCHITECTURES)
def test_int8_calls_and_drafting_are_bitwise_those_of_one_token_calls(architecture: str) -> None:
    """A 5-token call against 5 one-token calls (logits, `torch.equal`), then (at opus-mt's width) drafts right most
    of the time and wrong sometimes, chains of 2-4: identical to the engine's greedy, with no near-tie allowance;
    batch 1 and 3 (rows finishing apart). One test per model, so that one worker compiles its graphs."""
    model = quantize_dynamic_int8(_model(architecture))
    for batch_size in (1, 3):
        batch = random_batch(model, batch_size, seed=batch_size)
        generator = torch.Generator().manual_seed(7)
        tokens = torch.randint(4, model.config.vocab_size, (batch_size, NUM_FED), generator=generator)
        together, alone = _chain_and_one_at_a_time(model, batch, tokens)
        assert torch.equal(together, alone), (batch_size, float((together - alone).abs().max()))
    if architecture != "bart-512":  # drafting on opus-mt's width; elsewhere it follows from the calls' equality
        return
    for batch_size, seed in ((1, 0), (3, 1)):
        batch = random_batch(model, batch_size, seed=seed)
        kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 20, "blockwise_compile": True}
        greedy = model.generate(**batch, **kwargs)
        for block_size, corruption in ((4, 0.0), (4, 0.3), (2, 0.5)):
            drafter = OracleDrafter(greedy, block_size=block_size, corruption=corruption, seed=seed)
            drafted = model.generate(**batch, assistant=drafter, **kwargs)
            assert torch.equal(drafted, greedy), (batch_size, block_size, corruption)


def test_float32_k_token_call_equals_one_token_calls_at_batch_1() -> None:
    """float32 products depend on the call's row count only below 3 rows or past one sgemm path (~13 rows, see
    `engine.py`): at batch 1 every call of a k <= 8 chain stays inside it, so float32 is bitwise there too."""
    model = _model("bart-512")
    batch = random_batch(model, 1, seed=4)
    tokens = torch.randint(4, model.config.vocab_size, (1, NUM_FED), generator=torch.Generator().manual_seed(3))
    together, alone = _chain_and_one_at_a_time(model, batch, tokens)
    assert torch.equal(together, alone), float((together - alone).abs().max())


def test_the_cache_capacity_does_not_depend_on_the_block_size() -> None:
    engine = compiled_decoder(build_model("bart"), CompileOptions())
    capacities = {hf.static_cache_capacity(engine.new_cache(40, block_size)) for block_size in (1, 2, 4, 8, 12)}
    assert len(capacities) == 1
    assert hf.static_cache_capacity(engine.new_cache(40, 60)) >= 40 + 60 + MIN_FEED_WIDTH

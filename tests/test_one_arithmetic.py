"""One arithmetic for every call of a decode (the engine's contract, `engine.py`'s docstring).

Through the compiled engine a token's logits must not depend on how many tokens its call feeds: with attention's
products in an order the graph owns (`fixed_order.py`) and int8 linears (exact int32 sums), a k-token verification
call computes bit for bit what k one-token calls compute, at batch 1 and 3, whatever the CPU's kernels do with
row counts. So every drafter reproduces the int8 engine's greedy bitwise, by construction, not by luck at near-ties.
The same assertions hold on every CPU this project meets (a Xeon and two AMD EPYCs): none rests on a kernel's
threshold. Where the contract is claimed, the engine's probe checks it on the machine and warns where it fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import OracleDrafter, build_model, random_batch
from near_ties import assert_greedy_up_to_near_ties
from transformers import BartConfig, BartForConditionalGeneration
from zoo import _BART_LIKE, _FAIRSEQ_IDS

from hf_blockwise import blockwise_generate, fixed_order, quantize_dynamic_int8
from hf_blockwise import boundary as hf
from hf_blockwise.corpus.decoding import encoder_outputs_by_row
from hf_blockwise.engine import MIN_FEED_WIDTH, CompileOptions, OneArithmeticWarning, compiled_decoder

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


def _chain_and_one_at_a_time(
    model, batch: dict, tokens: torch.Tensor, options: CompileOptions | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `tokens` (shape `(b, n)`) fed in one compiled call, and fed one token per call (the cache cropped
    back after each call's filler, as the loop does)."""
    engine = compiled_decoder(model, options or CompileOptions())
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
    """A 5-token call against 5 one-token calls (logits, `torch.equal`), at batch 3 (and 1 at opus-mt's width), then
    (at opus-mt's width) drafts right most of the time and wrong sometimes, chains of 2-4: identical to the engine's
    greedy, with no near-tie allowance; batch 1 and 3 (rows finishing apart), the engine's probe passing for every
    kind of decode. One test per model, so that one worker compiles its graphs."""
    model = quantize_dynamic_int8(_model(architecture))
    for batch_size in (1, 3) if architecture == "bart-512" else (3,):  # the batch-1 graph: once, at opus-mt's width
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
        # the engine's greedy is the eager int8 model's up to counted near-ties: a miscompile both share fails here
        assert_greedy_up_to_near_ties(
            model, batch, model.generate(**batch, max_new_tokens=20), greedy, max_new_tokens=20
        )
        for block_size, corruption in ((4, 0.0), (4, 0.3), (2, 0.5)):
            drafter = OracleDrafter(greedy, block_size=block_size, corruption=corruption, seed=seed)
            drafted = model.generate(**batch, assistant=drafter, **kwargs)
            assert torch.equal(drafted, greedy), (batch_size, block_size, corruption)
    # the probe ran for each kind of decode here, rows finishing apart (three rows left with one) included
    engine = compiled_decoder(model, CompileOptions())
    assert set(engine.verdicts) == {("one row", False), ("several rows", False), ("several rows, then one", False)}
    assert all(verdict.claimed and verdict.bitwise for verdict in engine.verdicts.values())
    assert engine.products().linear_kernels == "libraries"  # the GEMM template has no int8 product
    # each layer's q, k and v as one product, in each graph (the bits above are the merged graphs')
    graphs = len(engine._compiled.graph_products)
    assert engine.products().merged_int8 == 2 * model.config.decoder_layers * graphs


def test_an_int8_engine_with_a_compiled_first_call_drafts_its_greedy_bitwise() -> None:
    """With `compiled_prefill=True` a drafted decode's first call (the prompt and drafts) and greedy's (the prompt
    alone) run one compiled graph: drafts right most of the time and wrong sometimes reproduce the engine's greedy
    bitwise at batch 3, every forward is counted as compiled, the probe's comparison of the two first calls passes
    where the contract is claimed, rows encoded alone decode as at batch 1, and other batches compile no other
    graph."""
    model = quantize_dynamic_int8(_model("m2m100"))
    options = CompileOptions(compiled_prefill=True)
    batch = random_batch(model, 3, seed=5)
    kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 20, "blockwise_compile": options}
    greedy = model.generate(**batch, **kwargs)
    assert_greedy_up_to_near_ties(model, batch, model.generate(**batch, max_new_tokens=20), greedy, max_new_tokens=20)
    for block_size, corruption in ((4, 0.3), (3, 0.0)):
        drafter = OracleDrafter(greedy, block_size=block_size, corruption=corruption, seed=block_size)
        output = model.generate(**batch, assistant=drafter, return_dict_in_generate=True, **kwargs)
        assert torch.equal(output.sequences, greedy), (block_size, corruption)
        stats = output.decoding_stats
        assert stats.compiled_forwards == stats.num_forwards  # the first call is one of the engine's
    verdicts = compiled_decoder(model, options).verdicts
    assert ("several rows", False) in verdicts
    assert all(verdict.claimed and verdict.bitwise for verdict in verdicts.values()), verdicts
    # the rows encoded alone (the corpus job's int8 engine): each row decodes in the batch of three as alone, up to
    # counted near-ties (not bitwise yet: here a padded row's scores differ from its batch-1 scores by a float spacing
    # at a few steps); the same row three times, unpadded, is bitwise its batch of one (the probe's verdicts above)
    scored = {**kwargs, "output_scores": True, "return_dict_in_generate": True}
    encoded = encoder_outputs_by_row(model, batch["input_ids"], batch["attention_mask"])
    together = model.generate(**batch, encoder_outputs=encoded, **scored)
    assert_greedy_up_to_near_ties(model, batch, greedy, together.sequences, max_new_tokens=20)
    for row, mask in enumerate(batch["attention_mask"].bool()):
        ids = batch["input_ids"][row, mask][None]
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **scored)
        length = alone.sequences.shape[1]
        single = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        assert_greedy_up_to_near_ties(model, single, alone.sequences, together.sequences[row : row + 1, :length])
        if row == 0:
            repeated = model.generate(**{name: value.repeat(3, 1) for name, value in single.items()}, **scored)
            assert all(torch.equal(repeated.scores[t][2], alone.scores[t][0]) for t in range(len(alone.scores)))
    # other sources, lengths and acceptance compile no other graph, whatever the widths (the first call is padded as
    # the others are) and source lengths
    engine = compiled_decoder(model, options)
    graphs = len(engine._prefill.graph_products), len(engine._compiled.graph_products)
    other = random_batch(model, 2, seed=6, max_source_length=13)
    other_kwargs = {**kwargs, "max_new_tokens": 30}
    other_greedy = model.generate(**other, **other_kwargs)
    drafter = OracleDrafter(other_greedy, block_size=3, corruption=0.2, seed=3)
    assert torch.equal(model.generate(**other, assistant=drafter, **other_kwargs), other_greedy)
    assert (len(engine._prefill.graph_products), len(engine._compiled.graph_products)) == graphs


def test_float32_with_fixed_order_linears_is_bitwise() -> None:
    """float32 `linear`s in the graph's own loops (`fixed_order_linears=True`): a float32 k-token call computes what
    one-token calls compute too, here at batch 3; every float product of the graph is owned."""
    model = _model("bart-512")
    options = CompileOptions(fixed_order_linears=True)
    for batch_size in (3,):  # the batch-1 graph's arithmetic is the same code: the int8 test checks it
        batch = random_batch(model, batch_size, seed=4)
        generator = torch.Generator().manual_seed(3)
        tokens = torch.randint(4, model.config.vocab_size, (batch_size, NUM_FED), generator=generator)
        together, alone = _chain_and_one_at_a_time(model, batch, tokens, options)
        assert torch.equal(together, alone), (batch_size, float((together - alone).abs().max()))
    assert compiled_decoder(model, options).products().library == {}


def test_a_float32_engine_leaves_its_linears_to_the_gemm_template_and_claims_nothing() -> None:
    """The graph pass owns attention in every engine, float32 `linear`s only when asked: a float32 engine with
    its linears on inductor's GEMM template (the default, for the batch-1 graph) or the libraries (a batch's graph)
    makes no bitwise claim (its probe warns of nothing: the docs say float32 is exact up to near-ties). The int8
    engines' claims and verdicts, on oneDNN: `test_int8_calls_and_drafting_are_bitwise_...`."""
    kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 8, "blockwise_compile": True}
    model = build_model("bart")
    batch = random_batch(model, 1, seed=0)
    greedy = model.generate(**batch, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OneArithmeticWarning)
        model.generate(**batch, assistant=OracleDrafter(greedy, block_size=3, corruption=0.5), **kwargs)
    model.generate(**random_batch(model, 3, seed=1), **kwargs)  # a batch: its graph keeps the libraries' linears
    engine = compiled_decoder(model, CompileOptions())
    products = engine.products()
    assert "attention" in products.owned and set(products.library) == {"linear"}
    assert products.linear_kernels == "template, libraries"  # the batch-1 graph's, then the batch's
    assert not engine.owns_products() and not engine.verdicts[("one row", False)].claimed


def test_the_probe_catches_an_arithmetic_that_depends_on_the_width(monkeypatch) -> None:
    """Mutation check: attention whose bits depend on how many queries a call feeds (a scale of 1 + 1e-6 x width)
    must fail the probe, with one warning that names the comparison, and the engine's verdict says so."""

    attention = fixed_order.fixed_order_attention

    def width_dependent(query, key, value, *args, **kwargs):
        return attention(query, key, value, *args, **kwargs) * (1 + 1e-6 * query.shape[-2])

    monkeypatch.setattr(fixed_order, "fixed_order_attention", width_dependent)
    model = quantize_dynamic_int8(build_model("bart", seed=1))
    batch = random_batch(model, 1, seed=0)
    kwargs = {"custom_generate": blockwise_generate, "max_new_tokens": 8, "blockwise_compile": True}
    drafter = OracleDrafter(model.generate(**batch, **kwargs), block_size=3)
    with pytest.warns(OneArithmeticWarning, match="3-token call against one-token calls") as caught:
        model.generate(**batch, assistant=drafter, **kwargs)
        model.generate(**batch, assistant=drafter, **kwargs)  # once per engine
    assert len([warning for warning in caught if warning.category is OneArithmeticWarning]) == 1
    verdict = compiled_decoder(model, CompileOptions()).verdicts[("one row", False)]
    assert verdict.claimed and not verdict.bitwise and "max |logit difference|" in verdict.difference


def test_the_cache_capacity_does_not_depend_on_the_block_size() -> None:
    engine = compiled_decoder(build_model("bart"), CompileOptions())
    capacities = {hf.static_cache_capacity(engine.new_cache(40, block_size)) for block_size in (1, 2, 4, 8, 12)}
    assert len(capacities) == 1
    assert hf.static_cache_capacity(engine.new_cache(40, 60)) >= 40 + 60 + MIN_FEED_WIDTH

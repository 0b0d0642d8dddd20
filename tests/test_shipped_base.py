"""The shipped realistic base (`hf_blockwise/pretrained/marian-base-en-de`, opus-mt-en-de's decoder shape): it
loads as float32 with caching on, and the loop reproduces its greedy output, alone and with drafts that are right
(its own greedy output) or partly wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import BlockwiseHeadsModel, ReferenceDrafter, blockwise_generate

MODEL_DIR = Path(__file__).resolve().parents[1] / "hf_blockwise" / "pretrained" / "marian-base-en-de"
SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "We must ensure that the Commission presents its proposal before the end of the year.",
    "Two dogs play in the snow.",
]


@pytest.fixture(scope="module")
def shipped() -> tuple[torch.nn.Module, AutoTokenizer]:
    return AutoModelForSeq2SeqLM.from_pretrained(MODEL_DIR).eval(), AutoTokenizer.from_pretrained(MODEL_DIR)


def test_it_has_opus_mt_decoder_shape_and_loads_as_float32(shipped) -> None:
    model, tokenizer = shipped
    config = model.config
    assert model.dtype == torch.float32 and config.use_cache
    assert (config.d_model, config.decoder_layers, config.decoder_attention_heads, config.decoder_ffn_dim) == (
        512, 6, 8, 2048,
    )  # fmt: skip
    assert len(tokenizer) >= 16000
    assert model.generation_config.max_new_tokens is not None


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_loop_reproduces_its_greedy_output(shipped, batch_size: int) -> None:
    model, tokenizer = shipped
    batch = tokenizer(SENTENCES[:batch_size], return_tensors="pt", padding=True)
    greedy = model.generate(**batch)
    assert torch.equal(model.generate(**batch, custom_generate=blockwise_generate), greedy)
    corrupted = greedy.clone()
    corrupted[:, 3::4] = 5  # every fourth draft wrong
    for reference in (greedy, corrupted):
        drafter = ReferenceDrafter(reference, block_size=4)
        output = model.generate(**batch, custom_generate=blockwise_generate, assistant=drafter)
        assert torch.equal(output, greedy)


STERN_DIR = MODEL_DIR.parent / "marian-base-en-de-stern"


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_combined_model_drafts_its_own_greedy_output_with_its_heads(batch_size: int) -> None:
    """Stern's combined scoring and proposal model (the base fine-tuned with its heads, shipped in one folder): its
    heads' drafts give its own greedy output, more than one token per decoder call."""
    model = BlockwiseHeadsModel.from_pretrained(STERN_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(STERN_DIR)
    assert model.blockwise_config.block_size == 8 and model.blockwise_config.shortlist_size == 2000
    batch = tokenizer(SENTENCES[:batch_size], return_tensors="pt", padding=True)
    greedy = model.base_model.generate(**batch)
    output = model.base_model.generate(
        **batch, custom_generate=blockwise_generate, assistant=model.drafter(), return_dict_in_generate=True
    )
    assert torch.equal(output.sequences, greedy)
    assert output.decoding_stats.mean_accepted > 1.5  # tokens per row and decoder call (the first pass drafts none)

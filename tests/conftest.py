"""Tiny seq2seq models of every supported architecture, built from configs in code (no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_blockwise import Drafter, DraftRequest, Drafts

VOCAB_SIZE = 64
# Large initial weights make tiny random models produce varied, non-repetitive outputs.
_BART_LIKE = dict(
    vocab_size=VOCAB_SIZE,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=128,
    init_std=0.35,
    dropout=0.0,
    attention_dropout=0.0,
)
_T5_LIKE = dict(
    vocab_size=VOCAB_SIZE,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    initializer_factor=6.0,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)


def _bart_family(config_class, model_class, **special) -> Callable[[], PreTrainedModel]:
    return lambda: model_class(config_class(**_BART_LIKE, **special))


ARCHITECTURES: dict[str, Callable[[], PreTrainedModel]] = {
    "t5": lambda: T5ForConditionalGeneration(T5Config(**_T5_LIKE)),
    "mt5": lambda: MT5ForConditionalGeneration(
        MT5Config(**_T5_LIKE, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    ),
    "bart": _bart_family(
        BartConfig, BartForConditionalGeneration, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None,
    ),
    "mbart": _bart_family(
        MBartConfig, MBartForConditionalGeneration, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    ),
    "marian": _bart_family(
        MarianConfig, MarianMTModel, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        forced_eos_token_id=None,
    ),
    "pegasus": _bart_family(
        PegasusConfig, PegasusForConditionalGeneration, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, forced_eos_token_id=None,
    ),
    "m2m100": _bart_family(
        M2M100Config, M2M100ForConditionalGeneration, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None,
    ),
}  # fmt: skip


def build_model(architecture: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = ARCHITECTURES[architecture]().eval()
    # Some configs carry generation defaults (e.g. Marian's bad_words_ids); tests state their own.
    model.generation_config.bad_words_ids = None
    model.generation_config.max_length = 64
    return model


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {name: build_model(name) for name in ARCHITECTURES}


def random_batch(model: PreTrainedModel, batch_size: int, seed: int, max_source_length: int = 12) -> dict:
    """Random source ids of mixed lengths, right-padded, with the attention mask."""
    generator = torch.Generator().manual_seed(seed)
    special = {getattr(model.config, name, None) for name in ("pad_token_id", "eos_token_id", "bos_token_id")}
    ids = torch.randint(3, VOCAB_SIZE, (batch_size, max_source_length), generator=generator)
    for token in special:
        if token is not None:
            ids[ids == token] = 3 + token
    lengths = torch.randint(3, max_source_length + 1, (batch_size,), generator=generator)
    lengths[0] = max_source_length
    mask = (torch.arange(max_source_length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    return {"input_ids": ids, "attention_mask": mask}


@dataclass
class OracleDrafter(Drafter):
    """Proposes a known greedy output, with a fraction of tokens corrupted, to drive acceptance per row.

    Attributes:
        reference (`torch.LongTensor` of shape `(batch_size, length)`): the greedy output to propose.
        block_size (`int`): k.
        corruption (`float`): probability that a proposed token is replaced by a wrong one.
        seed (`int`): makes the corruption pattern reproducible.
    """

    reference: torch.Tensor
    block_size: int
    corruption: float = 0.0
    seed: int = 0

    def get_candidates(self, request: DraftRequest) -> Drafts:
        num = self.block_size - 1
        width = self.reference.shape[1]
        positions = request.lengths[:, None] + torch.arange(num)  # (B, num)
        tokens = self.reference.gather(1, positions.clamp(max=width - 1))
        generator = torch.Generator().manual_seed(self.seed + int(request.lengths.sum()))
        corrupt = torch.rand(tokens.shape, generator=generator) < self.corruption
        tokens = torch.where(corrupt, (tokens + 1) % VOCAB_SIZE, tokens)
        lengths = (width - request.lengths).clamp(min=0, max=num)
        return Drafts(tokens=tokens, lengths=lengths)


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (`w3` … `w63`), for tests that need text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB_SIZE)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")

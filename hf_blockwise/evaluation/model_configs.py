"""Randomly initialised models with the shapes of real translation and text-to-text models, written in code.

`hf-blockwise bench --model-config NAME` times greedy decoding, the blockwise loop without a drafter and the
`oracle` drafter on these (no download, no tokenizer: random source ids), which shows what the decoding loop costs
and can gain on models of realistic size. Shapes (as in each model's hub `config.json`):

| name | hub model | class | d_model | layers (enc+dec) | heads | ffn | vocabulary |
|---|---|---|---|---|---|---|---|
| `opus-mt-en-de` | `Helsinki-NLP/opus-mt-en-de` | Marian | 512 | 6+6 | 8 | 2048 | 58101 |
| `t5-base` | `t5-base` | T5 | 768 | 12+12 | 12 | 3072 | 32128 |
| `bart-large` | `facebook/bart-large` | BART | 1024 | 12+12 | 16 | 4096 | 50265 |
| `nllb-200-distilled-600M` | `facebook/nllb-200-distilled-600M` | M2M100 | 1024 | 12+12 | 16 | 4096 | 256206 |

Random weights make a greedy output meaningless but not its cost, which depends on the shapes and on the number of
tokens generated. To keep that number fixed, every model's generation config suppresses its EOS and pad tokens
(`suppress_tokens`): greedy decoding never stops early and every sentence generates exactly `max_new_tokens`
tokens, in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    PretrainedConfig,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)


@dataclass(frozen=True)
class Shape:
    """The sizes of a transformer encoder-decoder (the same for encoder and decoder).

    Attributes:
        d_model (`int`), layers (`int`): per stack, heads (`int`), ffn (`int`): feed-forward width,
        vocab_size (`int`).
    """

    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab_size: int


# what `--tiny-model-config` shrinks every shape to (tests)
TINY_SHAPE = Shape(d_model=32, layers=2, heads=2, ffn=64, vocab_size=128)


def marian_config(shape: Shape) -> MarianConfig:
    """`Helsinki-NLP/opus-mt-*` (Marian): pad is the last id and the decoder start; EOS is 0."""
    pad = shape.vocab_size - 1
    return MarianConfig(
        vocab_size=shape.vocab_size, decoder_vocab_size=shape.vocab_size, d_model=shape.d_model,
        encoder_layers=shape.layers, decoder_layers=shape.layers, encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn, decoder_ffn_dim=shape.ffn,
        max_position_embeddings=512, activation_function="swish", scale_embedding=True, pad_token_id=pad,
        eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0, share_encoder_decoder_embeddings=True,
    )  # fmt: skip


def t5_config(shape: Shape) -> T5Config:
    """`t5-base` (T5): relative position buckets, ReLU feed-forward, tied embeddings; pad 0 is the decoder start."""
    return T5Config(
        vocab_size=shape.vocab_size, d_model=shape.d_model, d_kv=shape.d_model // shape.heads, d_ff=shape.ffn,
        num_layers=shape.layers, num_decoder_layers=shape.layers, num_heads=shape.heads,
        relative_attention_num_buckets=32, feed_forward_proj="relu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip


def bart_config(shape: Shape) -> BartConfig:
    """`facebook/bart-large` (BART): learned positions, GELU; bos 0, pad 1, EOS 2 (also the decoder start)."""
    return BartConfig(
        vocab_size=shape.vocab_size, d_model=shape.d_model, encoder_layers=shape.layers, decoder_layers=shape.layers,
        encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn, max_position_embeddings=1024, activation_function="gelu", scale_embedding=False,
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
    )  # fmt: skip


def m2m100_config(shape: Shape) -> M2M100Config:
    """`facebook/nllb-200-distilled-600M` (M2M100): sinusoidal positions, ReLU, scaled and tied embeddings."""
    return M2M100Config(
        vocab_size=shape.vocab_size, d_model=shape.d_model, encoder_layers=shape.layers, decoder_layers=shape.layers,
        encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads, encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn, max_position_embeddings=1024, activation_function="relu", scale_embedding=True,
        bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """One named model shape: where it comes from, its sizes, how to build its config, and its model class."""

    hub_name: str
    shape: Shape
    make_config: Callable[[Shape], PretrainedConfig]
    model_class: type[PreTrainedModel]


MODEL_CONFIGS: dict[str, ModelSpec] = {
    "opus-mt-en-de": ModelSpec(
        "Helsinki-NLP/opus-mt-en-de", Shape(512, 6, 8, 2048, 58101), marian_config, MarianMTModel
    ),
    "t5-base": ModelSpec("t5-base", Shape(768, 12, 12, 3072, 32128), t5_config, T5ForConditionalGeneration),
    "bart-large": ModelSpec(
        "facebook/bart-large", Shape(1024, 12, 16, 4096, 50265), bart_config, BartForConditionalGeneration
    ),
    "nllb-200-distilled-600M": ModelSpec(
        "facebook/nllb-200-distilled-600M", Shape(1024, 12, 16, 4096, 256206), m2m100_config,
        M2M100ForConditionalGeneration,
    ),
}  # fmt: skip


def resolve_name(name: str) -> str:
    """The key of [`MODEL_CONFIGS`] for a short name or a hub name (`facebook/bart-large` -> `bart-large`)."""
    for key, spec in MODEL_CONFIGS.items():
        if name in (key, spec.hub_name):
            return key
    raise ValueError(f"Unknown model config {name!r}; choose from {', '.join(MODEL_CONFIGS)}")


def build_config(name: str, tiny: bool = False) -> PretrainedConfig:
    """The config of model `name` (or, with `tiny`, of a model of its architecture with [`TINY_SHAPE`])."""
    spec = MODEL_CONFIGS[resolve_name(name)]
    return spec.make_config(TINY_SHAPE if tiny else spec.shape)


def generation_config(config: PretrainedConfig) -> GenerationConfig:
    """Plain greedy decoding that never stops early: EOS and pad are suppressed (see the module docstring)."""
    return GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id, bos_token_id=getattr(config, "bos_token_id", None),
        pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id,
        suppress_tokens=sorted({config.eos_token_id, config.pad_token_id}),
    )  # fmt: skip


def build_model(
    name: str, tiny: bool = False, seed: int = 0, device: torch.device | str | None = None
) -> PreTrainedModel:
    """A randomly initialised model of `name`'s shape (fp32, eval mode), with [`generation_config`].

    Args:
        name (`str`): a key of [`MODEL_CONFIGS`] or its hub name.
        tiny (`bool`): build the architecture with [`TINY_SHAPE`] instead (fast; for tests).
        seed (`int`): seeds the initialisation.
        device (*optional*): where to create the weights; `"meta"` builds the module structure without memory.
    """
    config = build_config(name, tiny)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = MODEL_CONFIGS[resolve_name(name)].model_class(config)
    model.generation_config = generation_config(config)
    return model.to(torch.float32).eval()


def random_sources(config: PretrainedConfig, count: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    """`count` random sources of `length` token ids, each ending with EOS as a tokenizer would end it.

    Ids are drawn from `4 .. vocab_size - 2`, which leaves out the special tokens of every model above (ids 0-3,
    and Marian's pad, the last id).
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size - 1, (count, length - 1), generator=generator)
    return [[*row.tolist(), config.eos_token_id] for row in ids]

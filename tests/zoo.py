"""A zoo of tiny text-to-text seq2seq models: every architecture `AutoModelForSeq2SeqLM` can build small.

Each entry of `ARCHITECTURES` builds a fresh, randomly initialised model from a config written here (no
downloads): vocabulary `VOCAB_SIZE`, width ~32, 2 layers a side, dropout 0, and an initialisation scale large
enough that greedy decoding of a random source gives varied tokens rather than one token repeated. Every
entry sets its pad, eos and decoder start ids below 3, so that the random sources of `conftest.random_batch`
(ids 3 … 63) never contain them.

Notes per architecture (the reasons behind the non-obvious settings):

* Generation defaults that change greedy output are switched off, as the original seven entries do:
  `forced_bos_token_id` / `forced_eos_token_id` (BART family, PLBART, Pegasus-X, FSMT, Blenderbot),
  Blenderbot's `encoder_no_repeat_ngram_size=3` and Marian's `bad_words_ids` (the latter cleared in
  `conftest.build_model`).
* T5 family, as transformers 5.23 builds it: MT5Config and UMT5Config force `tie_word_embeddings=True` (so the
  original `mt5` entry's `tie_word_embeddings=False` has no effect); T5Config and LongT5Config keep the weights
  tied too but read `tie_word_embeddings=False` as "no d_model ** -0.5 rescale of the decoder output"
  (`scale_decoder_outputs`); Switch Transformers honours it (untied here, so no rescale).
* `switch_transformers` and `nllb-moe` are mixture-of-experts models. Switch drops tokens beyond
  `expert_capacity` *per sequence and per forward*, so a block of more than `expert_capacity` decoder tokens
  routed to one expert is not computed as token-by-token decoding would; the capacity kept here (64) is the
  released checkpoints' value. NLLB-MoE's capacity in eval mode is `moe_eval_capacity_token_fraction` times the
  tokens of the forward (1.0: nothing is dropped).
* SeamlessM4T's config carries `max_new_tokens=256` into the generation config, where it would override a
  `max_length`; it is set to `None` here. FSMT's config carries `num_beams=5` (set to 1) and `max_length=200`.
* `t5gemma` gives its decoder the layer types `("sliding_attention", "full_attention")` with
  `sliding_window=8`, so outputs longer than the window exercise the sliding-window cache layers
  (`DynamicSlidingWindowLayer`). Its logits are soft-capped (`final_logit_softcapping`) after the projection.
* `fsmt` has separate source and target vocabularies, both `VOCAB_SIZE` here (`config.vocab_size` maps to the
  target one).
* `prophetnet` predicts `ngram` future tokens in training; generate uses the main stream only.
* `encoder-decoder` is a BERT2BERT `EncoderDecoderModel`; BERT has no eos of its own, so pad/eos/decoder start
  are set on the `EncoderDecoderConfig` (and on both BERT configs).
* `led`, `pegasus_x`, `longt5` and `bigbird_pegasus` have long-input *encoders*; their decoders are ordinary.
  BigBird-Pegasus uses `attention_type="original_full"` (block-sparse falls back to it, with a warning, on
  inputs this short).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BigBirdPegasusConfig,
    BigBirdPegasusForConditionalGeneration,
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    BlenderbotSmallConfig,
    BlenderbotSmallForConditionalGeneration,
    EncoderDecoderConfig,
    EncoderDecoderModel,
    FSMTConfig,
    FSMTForConditionalGeneration,
    LEDConfig,
    LEDForConditionalGeneration,
    LongT5Config,
    LongT5ForConditionalGeneration,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    MvpConfig,
    MvpForConditionalGeneration,
    NllbMoeConfig,
    NllbMoeForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    PegasusXConfig,
    PegasusXForConditionalGeneration,
    PLBartConfig,
    PLBartForConditionalGeneration,
    PreTrainedModel,
    ProphetNetConfig,
    ProphetNetForConditionalGeneration,
    SeamlessM4TConfig,
    SeamlessM4TForTextToText,
    SeamlessM4Tv2Config,
    SeamlessM4Tv2ForTextToText,
    SiglipVisionConfig,
    SwitchTransformersConfig,
    SwitchTransformersForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    T5Gemma2Config,
    T5Gemma2DecoderConfig,
    T5Gemma2EncoderConfig,
    T5Gemma2ForConditionalGeneration,
    T5Gemma2TextConfig,
    T5GemmaConfig,
    T5GemmaForConditionalGeneration,
    T5GemmaModuleConfig,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

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
# pad 1, bos 0, eos 2, decoder start 2: the fairseq convention of BART, mBART, M2M100, LED, MVP, PLBART, NLLB.
_FAIRSEQ_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
# The eos of Blenderbot (2) starts nothing; its decoder starts from bos (1) and pads with 0.
_BLENDERBOT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _bart_family(config_class, model_class, **special) -> Callable[[], PreTrainedModel]:
    return lambda: model_class(config_class(**_BART_LIKE, **special))


def _bart_variant(config_class, model_class, **changes) -> Callable[[], PreTrainedModel]:
    """A BART-like model whose options differ from `_BART_LIKE` (e.g. a smaller `init_std`, untied embeddings)."""
    return lambda: model_class(config_class(**{**_BART_LIKE, **changes}))


def _without(options: dict, *names: str) -> dict:
    return {key: value for key, value in options.items() if key not in names}


def _led() -> PreTrainedModel:
    options = {**_without(_BART_LIKE, "max_position_embeddings"), "init_std": 0.15}
    config = LEDConfig(
        **options, **_FAIRSEQ_IDS, max_encoder_position_embeddings=128, max_decoder_position_embeddings=128,
        attention_window=4, tie_word_embeddings=False,
    )  # fmt: skip
    return LEDForConditionalGeneration(config)


def _pegasus_x() -> PreTrainedModel:
    config = PegasusXConfig(
        **{**_BART_LIKE, "init_std": 0.15}, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        forced_eos_token_id=None, num_global_tokens=4, block_size=4, tie_word_embeddings=False,
    )  # fmt: skip
    return PegasusXForConditionalGeneration(config)


def _nllb_moe() -> PreTrainedModel:
    config = NllbMoeConfig(
        **{**_BART_LIKE, "init_std": 0.15}, **_FAIRSEQ_IDS, num_experts=8, expert_capacity=64,
        encoder_sparse_step=2, decoder_sparse_step=1, moe_token_dropout=0.0, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return NllbMoeForConditionalGeneration(config)


def _fsmt() -> PreTrainedModel:
    options = {**_without(_BART_LIKE, "vocab_size"), "init_std": 0.12}
    config = FSMTConfig(
        **options, langs=["en", "de"], src_vocab_size=VOCAB_SIZE, tgt_vocab_size=VOCAB_SIZE, **_FAIRSEQ_IDS,
        forced_eos_token_id=None, num_beams=1,
    )  # fmt: skip
    return FSMTForConditionalGeneration(config)


def _prophetnet() -> PreTrainedModel:
    config = ProphetNetConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, encoder_ffn_dim=48, decoder_ffn_dim=48, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
        max_position_embeddings=128, ngram=2, num_buckets=8, relative_max_distance=32, init_std=0.15, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    return ProphetNetForConditionalGeneration(config)


# T5Gemma's decoder alternates a sliding-window layer (window 8) with a full-attention one.
T5GEMMA_DECODER_LAYER_TYPES = ("sliding_attention", "full_attention")
T5GEMMA_SLIDING_WINDOW = 8
_GEMMA_MODULE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=128,
    sliding_window=T5GEMMA_SLIDING_WINDOW, initializer_range=2.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip
_GEMMA_IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2)


def _t5gemma() -> PreTrainedModel:
    config = T5GemmaConfig(
        encoder=T5GemmaModuleConfig(**_GEMMA_MODULE, layer_types=["full_attention", "sliding_attention"]),
        decoder=T5GemmaModuleConfig(**_GEMMA_MODULE, layer_types=list(T5GEMMA_DECODER_LAYER_TYPES)),
        vocab_size=VOCAB_SIZE, initializer_range=2.0, tie_word_embeddings=False, **_GEMMA_IDS,
    )  # fmt: skip
    return T5GemmaForConditionalGeneration(config)


def _t5gemma2() -> PreTrainedModel:
    # The vision tower is built (tiny) but never used: text-only inputs carry no pixel_values. The image,
    # begin- and end-of-image ids are ordinary vocabulary entries; the end-of-image one has its own embedding.
    encoder = T5Gemma2EncoderConfig(
        text_config=T5Gemma2TextConfig(**_GEMMA_MODULE, layer_types=["full_attention", "sliding_attention"]),
        vision_config=SiglipVisionConfig(
            hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8,
            patch_size=4,
        ),
        mm_tokens_per_image=4, boi_token_index=61, eoi_token_index=62, image_token_index=63,
    )  # fmt: skip
    decoder = T5Gemma2DecoderConfig(**_GEMMA_MODULE, layer_types=list(T5GEMMA_DECODER_LAYER_TYPES))
    config = T5Gemma2Config(
        encoder=encoder, decoder=decoder, image_token_index=63, initializer_range=2.0, tie_word_embeddings=False,
        **_GEMMA_IDS,
    )  # fmt: skip
    return T5Gemma2ForConditionalGeneration(config)


_SEAMLESS = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=128, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
    initializer_range=0.15, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    decoder_start_token_id=1, max_new_tokens=None,
    # The speech and text-to-unit parts are not built by the *ForTextToText classes; kept tiny regardless.
    speech_encoder_layers=1, speech_encoder_attention_heads=4, speech_encoder_intermediate_size=48,
    t2u_vocab_size=16, t2u_encoder_layers=1, t2u_decoder_layers=1, t2u_encoder_ffn_dim=48, t2u_decoder_ffn_dim=48,
    t2u_encoder_attention_heads=4, t2u_decoder_attention_heads=4, unit_hifi_gan_vocab_size=16, unit_embed_dim=32,
)  # fmt: skip


def _bert2bert() -> PreTrainedModel:
    bert = dict(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**bert), BertConfig(**bert, is_decoder=True, add_cross_attention=True)
    )
    config.decoder_start_token_id = 2
    config.pad_token_id = 0
    config.eos_token_id = 1
    return EncoderDecoderModel(config=config)


ARCHITECTURES: dict[str, Callable[[], PreTrainedModel]] = {
    # The original seven.
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
    # T5 relatives.
    # UMT5 always ties its embeddings and rescales the decoder output by d_model ** -0.5 (its config forces
    # tie_word_embeddings=True); more position buckets than T5's 8 vary its output.
    "umt5": lambda: UMT5ForConditionalGeneration(
        UMT5Config(**{**_T5_LIKE, "initializer_factor": 4.0, "relative_attention_num_buckets": 32})
    ),
    "longt5": lambda: LongT5ForConditionalGeneration(
        LongT5Config(
            **{**_T5_LIKE, "initializer_factor": 3.0}, feed_forward_proj="gated-gelu", encoder_attention_type="local",
            local_radius=4,
        )
    ),
    "switch_transformers": lambda: SwitchTransformersForConditionalGeneration(
        SwitchTransformersConfig(
            **{**_T5_LIKE, "initializer_factor": 6.0}, tie_word_embeddings=False, num_experts=4,
            expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, router_jitter_noise=0.0,
        )
    ),
    # BART relatives. Post-layer-norm ones with tied embeddings tend to repeat one token; untied, a smaller
    # init_std gives varied outputs.
    "plbart": _bart_variant(
        PLBartConfig, PLBartForConditionalGeneration, **_FAIRSEQ_IDS, forced_eos_token_id=None, init_std=0.15,
        tie_word_embeddings=False,
    ),
    "mvp": _bart_variant(
        MvpConfig, MvpForConditionalGeneration, **_FAIRSEQ_IDS, forced_eos_token_id=None, init_std=0.15,
        tie_word_embeddings=False,
    ),
    "blenderbot": _bart_variant(
        BlenderbotConfig, BlenderbotForConditionalGeneration, **_BLENDERBOT_IDS, forced_eos_token_id=None,
        encoder_no_repeat_ngram_size=0, init_std=0.5,
    ),
    "blenderbot-small": _bart_variant(
        BlenderbotSmallConfig, BlenderbotSmallForConditionalGeneration, **_BLENDERBOT_IDS,
        forced_eos_token_id=None, init_std=0.1, tie_word_embeddings=False,
    ),
    "bigbird_pegasus": _bart_variant(
        BigBirdPegasusConfig, BigBirdPegasusForConditionalGeneration, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, decoder_start_token_id=2, attention_type="original_full", tie_word_embeddings=False,
    ),
    "led": _led,
    "pegasus_x": _pegasus_x,
    "nllb-moe": _nllb_moe,
    "fsmt": _fsmt,
    "seamless_m4t": lambda: SeamlessM4TForTextToText(SeamlessM4TConfig(**_SEAMLESS)),
    "seamless_m4t_v2": lambda: SeamlessM4Tv2ForTextToText(SeamlessM4Tv2Config(**_SEAMLESS)),
    # Other designs.
    "prophetnet": _prophetnet,
    "t5gemma": _t5gemma,
    "t5gemma2": _t5gemma2,
    "encoder-decoder": _bert2bert,
}  # fmt: skip

"""A zoo of tiny speech and vision encoder-decoders: what `generate` serves beyond text-to-text (issue 19).

Each entry builds a fresh, randomly initialised model from a config written here (no downloads) and random
encoder inputs of its modality, with padded rows where the model takes an attention mask. Vocabulary 64, widths
24-32, 2 layers a side, large initial weights (as in `zoo.py`) so that greedy outputs vary; pad 1, eos 0, decoder
start 2 (Whisper: 64 text tokens, then its own special and timestamp tokens, see below). Whisper comes with a
feature extractor and a tokenizer built in code, for the automatic-speech-recognition pipeline.

Notes per entry:

* `whisper`: a multilingual Whisper laid out like the released checkpoints: 64 text tokens, then `<|endoftext|>`
  (eos and pad), `<|startoftranscript|>` (decoder start), three languages, the tasks, `<|startofprev|>`,
  `<|notimestamps|>` and one timestamp token per 0.02 s of the window (`WHISPER_TOKENS`), with the generation config
  fields Whisper's `generate` reads for languages, tasks, prompts and timestamps. Its window is 1 s: input features
  span exactly `2 * max_source_positions` = 100 frames of 10 ms (the encoder's two convolutions, the second of
  stride 2), what `whisper_feature_extractor()` makes of 16 kHz audio. `suppress_tokens` / `begin_suppress_tokens`
  are emptied (the tiny vocabulary has none of the real ones). Whisper's `generate` detects the language when none
  is given (a decoder forward on the start token), returns the tokens after its decoder prompt, and decodes the
  window in several segments when the output holds consecutive timestamp tokens (the random model emits them
  even after `<|notimestamps|>`).
* `speech_to_text`: log-mel frames with an attention mask (padded rows), subsampled 4x by two convolutions.
* `vision_trocr` / `vision_bert`: `VisionEncoderDecoderModel` with a ViT encoder (width 32) and a TrOCR decoder of
  another width (24: the model projects the encoder output) or a BERT decoder with cross-attention.
* `speech_bert`: `SpeechEncoderDecoderModel`, a wav2vec2 encoder over raw samples and a BERT decoder.
* `pix2struct`: flattened patches (row and column, 1-based, then `patch_size ** 2 * channels` values) with a patch
  mask; padded patches are all zeros, as its image processor pads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    BertConfig,
    Pix2StructConfig,
    Pix2StructForConditionalGeneration,
    PreTrainedModel,
    Speech2TextConfig,
    Speech2TextForConditionalGeneration,
    SpeechEncoderDecoderConfig,
    SpeechEncoderDecoderModel,
    TrOCRConfig,
    VisionEncoderDecoderConfig,
    VisionEncoderDecoderModel,
    ViTConfig,
    Wav2Vec2Config,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)
from zoo import VOCAB_SIZE

# VOCAB_SIZE from zoo.py: conftest's OracleDrafter corrupts drafts within it
_IDS = dict(pad_token_id=1, bos_token_id=2, eos_token_id=0, decoder_start_token_id=2)
_SEQ2SEQ = dict(
    vocab_size=VOCAB_SIZE, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, init_std=1.0, dropout=0.0, **_IDS,
)  # fmt: skip
_VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64)  # fmt: skip
_BERT_DECODER = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, is_decoder=True, add_cross_attention=True, initializer_range=0.5,
                     pad_token_id=1)  # fmt: skip


@dataclass(frozen=True)
class MediaEntry:
    """A tiny model and how to make its encoder inputs.

    Attributes:
        build (`Callable[[], PreTrainedModel]`).
        inputs (`Callable[[int, torch.Generator], dict]`): encoder inputs for a batch size.
    """

    build: Callable[[], PreTrainedModel]
    inputs: Callable[[int, torch.Generator], dict]


def _padded_mask(batch_size: int, length: int, generator: torch.Generator, minimum: int) -> torch.Tensor:
    """Row 0 full, the others of random lengths from `minimum` up."""
    lengths = torch.randint(minimum, length + 1, (batch_size,), generator=generator)
    lengths[0] = length
    return (torch.arange(length)[None, :] < lengths[:, None]).long()


def _with_ids(config):
    config.pad_token_id, config.decoder_start_token_id, config.eos_token_id = 1, 2, 0
    return config


# Whisper's special tokens follow the text vocabulary, in the released checkpoints' order; then the timestamps
# <|0.00|> ... <|1.00|>, one per 0.02 s (two input frames) of the 1 s window.
WHISPER_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|fr|>", "<|translate|>", "<|transcribe|>",
    "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
)  # fmt: skip
WHISPER_TOKENS = {token: VOCAB_SIZE + i for i, token in enumerate(WHISPER_SPECIAL_TOKENS)}
WHISPER_TIMESTAMPS = tuple(f"<|{i * 0.02:.2f}|>" for i in range(51))
WHISPER_SAMPLING_RATE, WHISPER_WINDOW_SECONDS = 16000, 1


def _whisper() -> PreTrainedModel:
    ids = WHISPER_TOKENS
    eos, start = ids["<|endoftext|>"], ids["<|startoftranscript|>"]  # eos is also pad, as in the checkpoints
    seq2seq = {**_SEQ2SEQ, "vocab_size": VOCAB_SIZE + len(WHISPER_SPECIAL_TOKENS) + len(WHISPER_TIMESTAMPS)}
    seq2seq.update(pad_token_id=eos, bos_token_id=eos, eos_token_id=eos, decoder_start_token_id=start)
    config = WhisperConfig(
        num_mel_bins=8, max_source_positions=50, max_target_positions=64, suppress_tokens=[],
        begin_suppress_tokens=[], **seq2seq,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config)
    generation = model.generation_config
    generation.is_multilingual = True
    generation.lang_to_id = {token: ids[token] for token in ("<|en|>", "<|de|>", "<|fr|>")}
    generation.task_to_id = {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]}
    generation.no_timestamps_token_id = ids["<|notimestamps|>"]
    generation.prev_sot_token_id = ids["<|startofprev|>"]
    generation.max_initial_timestamp_index = 25  # at most 0.5 s into the window, as the checkpoints' 50 of 30 s is 1 s
    return model


def whisper_feature_extractor() -> WhisperFeatureExtractor:
    """Log-mel features of the tiny Whisper's 1 s window: 8 mel bins, 100 frames of 10 ms at 16 kHz."""
    return WhisperFeatureExtractor(
        feature_size=8, sampling_rate=WHISPER_SAMPLING_RATE, hop_length=160, chunk_length=WHISPER_WINDOW_SECONDS
    )


def whisper_tokenizer() -> WhisperTokenizer:
    """A byte-level BPE tokenizer over the tiny Whisper's vocabulary: one printable character per text token (no
    merges), then `WHISPER_SPECIAL_TOKENS` and `WHISPER_TIMESTAMPS` at their model ids."""
    vocab = {chr(ord("!") + i): i for i in range(VOCAB_SIZE)}  # "!" ... "`": printable ASCII, byte-level as they are
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[], extra_special_tokens=list(WHISPER_SPECIAL_TOKENS[1:]))
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.add_tokens(list(WHISPER_TIMESTAMPS))
    assert [tokenizer.convert_tokens_to_ids(t) for t in WHISPER_SPECIAL_TOKENS] == list(WHISPER_TOKENS.values())
    return tokenizer


def _speech_to_text() -> PreTrainedModel:
    config = Speech2TextConfig(
        input_feat_per_channel=8, input_channels=1, conv_channels=16, conv_kernel_sizes=[5, 5], num_conv_layers=2,
        max_source_positions=64, max_target_positions=64, **_SEQ2SEQ,
    )  # fmt: skip
    return Speech2TextForConditionalGeneration(config)


def _speech_to_text_inputs(batch_size: int, generator: torch.Generator) -> dict:
    mask = _padded_mask(batch_size, 24, generator, minimum=8)
    features = torch.randn(batch_size, 24, 8, generator=generator) * mask[:, :, None]
    return {"input_features": features, "attention_mask": mask}


def _vision(decoder) -> Callable[[], PreTrainedModel]:
    def build() -> PreTrainedModel:
        config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(**_VIT), decoder)
        return VisionEncoderDecoderModel(_with_ids(config))

    return build


def _speech_bert() -> PreTrainedModel:
    encoder = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, BertConfig(**_BERT_DECODER))
    return SpeechEncoderDecoderModel(_with_ids(config))


def _pix2struct() -> PreTrainedModel:
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                initializer_factor=3.0, pad_token_id=1, eos_token_id=0, decoder_start_token_id=2)  # fmt: skip
    vision = dict(hidden_size=32, patch_embed_hidden_size=48, d_ff=64, d_kv=16, num_hidden_layers=2,
                  num_attention_heads=2, patch_size=4, num_channels=3)  # fmt: skip
    config = Pix2StructConfig(text_config=text, vision_config=vision, pad_token_id=1, decoder_start_token_id=2)
    return Pix2StructForConditionalGeneration(config)


def _pix2struct_inputs(batch_size: int, generator: torch.Generator) -> dict:
    mask = _padded_mask(batch_size, 12, generator, minimum=5)
    index = torch.arange(12)
    coordinates = torch.stack([index // 4 + 1, index % 4 + 1], dim=-1).float().expand(batch_size, 12, 2)  # row, column
    values = torch.randn(batch_size, 12, 4 * 4 * 3, generator=generator)
    return {"flattened_patches": torch.cat([coordinates, values], dim=-1) * mask[:, :, None], "attention_mask": mask}


MEDIA_ARCHITECTURES: dict[str, MediaEntry] = {
    "whisper": MediaEntry(_whisper, lambda b, g: {"input_features": torch.randn(b, 8, 100, generator=g)}),
    "speech_to_text": MediaEntry(_speech_to_text, _speech_to_text_inputs),
    "vision_trocr": MediaEntry(
        _vision(
            TrOCRConfig(
                vocab_size=VOCAB_SIZE,
                d_model=24,
                decoder_layers=2,
                decoder_attention_heads=2,
                decoder_ffn_dim=48,
                max_position_embeddings=64,
                init_std=0.5,
                **_IDS,
            )
        ),
        lambda b, g: {"pixel_values": torch.randn(b, 3, 16, 16, generator=g)},
    ),
    "vision_bert": MediaEntry(
        _vision(BertConfig(**_BERT_DECODER)), lambda b, g: {"pixel_values": torch.randn(b, 3, 16, 16, generator=g)}
    ),
    "speech_bert": MediaEntry(_speech_bert, lambda b, g: {"input_values": torch.randn(b, 800, generator=g)}),
    "pix2struct": MediaEntry(_pix2struct, _pix2struct_inputs),
}


def build_media_model(name: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = MEDIA_ARCHITECTURES[name].build().eval()
    model.generation_config.max_length = 64
    return model


def media_batch(name: str, batch_size: int, seed: int) -> dict:
    return MEDIA_ARCHITECTURES[name].inputs(batch_size, torch.Generator().manual_seed(seed))

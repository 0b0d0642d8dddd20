"""CTranslate2, the engine a CPU user would pick instead, as a bench mode: convert a transformers model and decode
greedily with it, returning `generate`-style token ids so the harness compares it with transformers' greedy.

All contact with CTranslate2 lives here (optional extra: `pip install -e .[ctranslate2]`).

One documented adaptation, for Marian models. CTranslate2's Marian converter assumes opus-mt's layout: `<pad>` is
the *last* vocabulary entry, which it drops, and the decoder starts from a zero vector instead of the `<pad>`
embedding (`start_from_zero_embedding`). This project's recipes put `<pad>` at id 0 (the stock converter then fails
on a vocabulary of the wrong size), and with tied embeddings the `<pad>` row is not zero. So Marian models are
converted with [`PadKeepingMarianLoader`]: the vocabulary stays as it is, the decoder starts from the real
`<pad>` embedding as transformers' does, and `<pad>` is kept from being generated the way `generate` keeps it
(`bad_words_ids` become CTranslate2's `suppress_sequences`). Other architectures would use the stock converter,
which reads config fields that transformers 5 removed, so the bench converts Marian models only
(`CONVERTED_MODEL_TYPES`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import ctranslate2
import torch
from ctranslate2.converters import Converter, TransformersConverter
from ctranslate2.converters.transformers import BartLoader, MarianMTLoader
from torch import nn

from hf_blockwise.evaluation.harness import Batch, Runner

# the architectures this module converts and tests (`convert` on any other is refused by the bench up front: the
# stock converters of CTranslate2 4.x read config fields that transformers 5 removed, e.g. BART's normalize_before)
CONVERTED_MODEL_TYPES = ("marian",)


class PadKeepingMarianLoader(MarianMTLoader):
    """CTranslate2's Marian loader without its opus-mt assumptions: keeps every vocabulary entry (`<pad>`
    included, wherever it is) and starts the decoder from the decoder start token's real embedding."""

    def get_model_spec(self, model: nn.Module) -> Any:
        model.config.normalize_before = False
        model.config.normalize_embedding = False
        return BartLoader.get_model_spec(self, model)  # without the parent's removal of the last row

    def set_config(self, config: Any, model: nn.Module, tokenizer: Any) -> None:
        config.eos_token = tokenizer.eos_token
        config.unk_token = tokenizer.unk_token
        config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)

    def set_decoder(self, spec: Any, decoder: nn.Module) -> None:
        BartLoader.set_decoder(self, spec, decoder)  # start_from_zero_embedding stays off

    def get_vocabulary(self, model: nn.Module, tokenizer: Any) -> list[str]:
        return BartLoader.get_vocabulary(self, model, tokenizer)  # `<pad>` is not popped


class _MarianConverter(Converter):
    """Converts an in-memory Marian model with [`PadKeepingMarianLoader`]."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        self._model, self._tokenizer = model, tokenizer

    def _load(self) -> Any:
        return PadKeepingMarianLoader()(self._model, self._tokenizer)


class _InMemoryConverter(TransformersConverter):
    """CTranslate2's transformers converter fed an in-memory model and tokenizer (its config read from a folder)."""

    def __init__(self, config_dir: str, model: nn.Module, tokenizer: Any) -> None:
        super().__init__(config_dir)
        self._model, self._tokenizer = model, tokenizer

    def load_model(self, model_class: Any, model_name_or_path: str, **kwargs: Any) -> nn.Module:
        return self._model

    def load_tokenizer(self, tokenizer_class: Any, model_name_or_path: str, **kwargs: Any) -> Any:
        return self._tokenizer


def convert(model: nn.Module, tokenizer: Any, output_dir: str) -> str:
    """Converts a transformers seq2seq model (in memory, converted in float32) into a CTranslate2 model folder.

    Args:
        model: the model (left unchanged: a copy is converted).
        tokenizer: its tokenizer (the converter reads the vocabulary and special tokens).
        output_dir: where the CTranslate2 model is written (`output_dir/model`).

    Returns:
        The CTranslate2 model folder.
    """
    copied = copy.deepcopy(model).float().eval()
    model_dir = os.path.join(output_dir, "model")
    if copied.config.model_type == "marian":
        _MarianConverter(copied, tokenizer).convert(model_dir, force=True)
        return model_dir
    config_dir = os.path.join(output_dir, "transformers-config")
    copied.config.save_pretrained(config_dir)
    _InMemoryConverter(config_dir, copied, tokenizer).convert(model_dir, force=True)
    return model_dir


def load_translator(model_dir: str, compute_type: str, threads: int, device: str = "cpu") -> ctranslate2.Translator:
    """A translator over a converted model, `compute_type` "float32" or "int8" (weights quantized at load), with
    `threads` threads (one translation at a time, as the bench decodes)."""
    return ctranslate2.Translator(model_dir, device=device, compute_type=compute_type, intra_threads=threads)


def greedy_runner(
    translator: ctranslate2.Translator, tokenizer: Any, base: nn.Module, limit: int, beam_size: int = 1
) -> Runner:
    """A bench runner: CTranslate2 greedy search (with `beam_size > 1`, its beam search: its own, whose length
    normalization and stopping are not transformers') on a tokenized batch, returned as `generate` would return it.

    Returns:
        `runner(batch, earlier)` giving a `torch.LongTensor` of shape `(batch_size, length)`: the decoder start
        token, the generated tokens (ending with the end token when the row stopped on it) and right padding.
    """
    start = base.generation_config.decoder_start_token_id
    pad = base.config.pad_token_id
    # what `generate` never emits (Marian: `<pad>`, its decoder start token), as token strings
    suppressed = [tokenizer.convert_ids_to_tokens(ids) for ids in base.generation_config.bad_words_ids or []] or None

    def run(batch: Batch, earlier: Any) -> torch.Tensor:
        sources = [
            tokenizer.convert_ids_to_tokens(ids[mask.bool()].tolist())
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        results = translator.translate_batch(
            sources, beam_size=beam_size, max_decoding_length=limit, min_decoding_length=0, return_end_token=True,
            suppress_sequences=suppressed,
        )  # fmt: skip
        rows = [[start, *tokenizer.convert_tokens_to_ids(result.hypotheses[0])] for result in results]
        width = max(len(row) for row in rows)
        return torch.tensor([row + [pad] * (width - len(row)) for row in rows])

    return run

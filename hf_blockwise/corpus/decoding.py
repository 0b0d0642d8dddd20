"""Decoding a corpus's sources: one chunk in sorted batches ([`decode_chunk`]) through the loop, each batch one
`generate` call ([`decode_batch`]), with an int8 engine's rows encoded alone ([`encoder_outputs_by_row`]); what the
corpus job (`job.py`) and Ray Data's predictor (`ray_data.py`) share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from hf_blockwise import boundary as hf
from hf_blockwise.corpus.planning import plan_batches
from hf_blockwise.drafters.base import Drafter
from hf_blockwise.engine import CompileOptions
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.loading import LoadedModel
from hf_blockwise.quantization import is_int8


@dataclass(frozen=True)
class DecodedRow:
    """One source's output: `text`, and what it cost (`new_tokens`, `decoder_calls`); `skipped` names why a source
    was not decoded (then `text` is empty)."""

    text: str
    new_tokens: int = 0
    decoder_calls: int = 0
    skipped: str | None = None


def decode_batch(
    loaded: LoadedModel,
    drafter: Drafter | None,
    ids: Sequence[list[int]],
    generate_kwargs: dict[str, Any],
    compile: bool,
) -> list[DecodedRow]:
    """Decodes one batch of tokenized sources through the loop.

    Args:
        ids: each source's token ids (special tokens included), unpadded.

    Returns:
        `list[DecodedRow]`, one per source, in the order of `ids`.
    """
    batch = loaded.tokenizer.pad({"input_ids": list(ids)}, return_tensors="pt").to(loaded.base.device)
    # a long run: on CPU each batch's first decoder call is compiled too (a second graph, paid once per run)
    options = CompileOptions(compiled_prefill=loaded.base.device.type == "cpu") if compile else None
    if batch_invariant(loaded, compile) and len(ids) > 1:
        batch["encoder_outputs"] = encoder_outputs_by_row(loaded.base, batch["input_ids"], batch["attention_mask"])
    output = loaded.base.generate(
        **batch, custom_generate=blockwise_generate, assistant=drafter, blockwise_compile=options,
        return_dict_in_generate=True, **generate_kwargs,
    )  # fmt: skip
    texts = loaded.tokenizer.batch_decode(output.sequences, skip_special_tokens=True)
    accepted = output.decoding_stats.accepted  # (iterations, rows): tokens each row gained at each decoder call
    new_tokens, calls = accepted.sum(dim=0).tolist(), (accepted > 0).sum(dim=0).tolist()
    return [
        DecodedRow(text=text, new_tokens=int(tokens), decoder_calls=int(count))
        for text, tokens, count in zip(texts, new_tokens, calls, strict=True)
    ]


def batch_invariant(loaded: LoadedModel, compile: bool) -> bool:
    """Whether the job encodes each row of a batch alone ([`encoder_outputs_by_row`]): for an int8 base through the
    compiled engine on CPU, whose decoder calls (the first one compiled too) compute each row as in a batch of one
    (int8 products are integers, the graphs own attention's order, masked slots add exact zeros), so that the padded
    batch's encoder is what would still tie a row's tokens to its batch. Not yet bitwise: a padded row's scores may
    differ from its batch-1 scores by a float spacing (the same tokens on every model tested). A float32 batch's
    linears stay with library kernels, whose sums depend on the rows: there the encoder is left batched."""
    return compile and loaded.base.device.type == "cpu" and is_int8(loaded.base)


def encoder_outputs_by_row(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> BaseModelOutput:
    """The encoder's output for a padded batch with each row encoded alone, unpadded, and put back at its positions
    (zeros at the padding, which the mask hides): a row's states are those of a batch of one. The encoder of a padded
    batch sums each row's attention over the batch's length, so its states (and, at near-ties, an int8 model's
    tokens) would depend on the longest row beside it (measured on marian-base-en-de in int8: 82 of 96 Europarl
    sentences decoded at batch 16 as at batch 1; 96 of 96 with the rows encoded alone).

    Args:
        input_ids, attention_mask (`torch.LongTensor` of shape `(batch_size, length)`): the padded batch.

    Returns:
        `BaseModelOutput` whose `last_hidden_state` has shape `(batch_size, length, hidden_size)`.
    """
    encoder, kept = model.get_encoder(), attention_mask.bool()
    states = [  # each as generate encodes a batch of one: its ids and a mask of ones
        encoder(input_ids=ids[mask][None], attention_mask=row_mask[mask][None]).last_hidden_state[0]
        for ids, row_mask, mask in zip(input_ids, attention_mask, kept, strict=True)
    ]
    padded = states[0].new_zeros((*input_ids.shape, states[0].shape[-1]))  # (b, length, d)
    for index, state in enumerate(states):
        padded[index, kept[index]] = state
    return BaseModelOutput(last_hidden_state=padded)


class ChunkSettings(Protocol):
    """What [`decode_chunk`] reads of a run's settings ([`CorpusSettings`] has it; so has a Ray Data predictor's):
    `input` (where the sources come from, named in refusals), `batch_size`, `max_batch_tokens`, `on_long` and
    `compile`."""

    input: str
    batch_size: int
    max_batch_tokens: int | None
    on_long: str
    compile: bool


def decode_chunk(
    loaded: LoadedModel,
    drafter: Drafter | None,
    texts: Sequence[str],
    settings: ChunkSettings,
    generate_kwargs: dict[str, Any],
    first_line: int = 1,
) -> list[DecodedRow]:
    """One chunk of sources, decoded in sorted batches and put back in input order; too long sources are skipped
    or refused (`settings.on_long`, the refusal naming the source's line of the input: `first_line` is the chunk's
    first, from 1). A blank source (empty or whitespace only) gives a blank output without being decoded, as
    CTranslate2 and Marian do: a model fed only its end-of-sequence token would still say something."""
    encoded = loaded.tokenizer(list(texts))["input_ids"]
    limit = hf.encoder_position_limit(loaded.base)  # None: relative or growing positions (T5, NLLB)
    rows: list[DecodedRow | None] = [None] * len(texts)
    decodable = []
    for index, ids in enumerate(encoded):
        if not texts[index].strip():
            rows[index] = DecodedRow(text="")
        elif limit is not None and len(ids) > limit:
            reason = f"the source has {len(ids)} tokens; the model has positions for {limit}"
            if settings.on_long == "fail":
                raise ValueError(_too_long(settings.input, first_line + index, texts[index], reason))
            rows[index] = DecodedRow(text="", skipped=reason)
        else:
            decodable.append(index)
    lengths = [len(encoded[index]) for index in decodable]
    for planned in plan_batches(lengths, settings.batch_size, settings.max_batch_tokens):
        members = [decodable[position] for position in planned]
        decoded = decode_batch(loaded, drafter, [encoded[i] for i in members], generate_kwargs, settings.compile)
        for index, row in zip(members, decoded, strict=True):
            rows[index] = row
    return rows  # type: ignore[return-value]  # every index is filled above


def _too_long(where: str, line: int, text: str, reason: str) -> str:
    """The refusal of a source too long for the model: the input, the source's line there (its record, for JSONL
    and datasets), how it starts, and what to do."""
    start = text[:40] + ("..." if len(text) > 40 else "")
    return (
        f"line {line} of {where} ({len(text)} characters, starting {start!r}) is too long: {reason}. Shorten or split "
        "it, or pass --on-long skip / on_long='skip' to skip such lines (their output line is empty)"
    )


def output_text(row: DecodedRow) -> str:
    """A row's output as a text output line holds it (without the newline): line breaks inside become spaces, so
    that line n stays source n."""
    return " ".join(row.text.splitlines())

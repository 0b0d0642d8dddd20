"""Input-guided aggressive decoding (IAD, Ge et al. 2022, §3.1 and Algorithm 1): the source is the draft.

When the output is mostly a copy of the input (grammatical error correction, simplification, post-editing),
the rest of the source after the point where output and source last agree is an excellent draft. After a
draft is rejected, Ge's Algorithm 1 decodes one verified token at a time until the output's last tokens match a
*unique* substring of the source again; drafting then resumes right after that match. With `realign=True` this
drafter also drafts right after the edit, from where the source resumes: the source after the output's last
anchor, past what the edit replaced or deleted.

transformers' prompt lookup searches only the decoder's own tokens, so for an encoder-decoder model it never
copies from the source; this drafter does, for any seq2seq model whose encoder and decoder share a vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts

# Ge's sentinel o_0 = x_0: the decoder start token and a mark in front of the source match each other only,
# so the very first step drafts the whole source. A negative id cannot collide with a real token.
_SENTINEL = -1


def sentinel_source(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The source with Ge's start sentinel in front and padding marked as the sentinel too.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`).
        attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).

    Returns:
        source (`torch.LongTensor` of shape `(batch_size, source_length + 1)`) and its valid lengths
        (`(batch_size,)`), sentinel included. Left padding is moved out of the way: real tokens come first.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    # stable sort puts each row's real tokens first, in order, whichever side the tokenizer padded
    order = torch.sort((~mask).long(), dim=1, stable=True).indices
    tokens = torch.where(mask, input_ids, _SENTINEL).gather(1, order)
    sentinel = torch.full_like(tokens[:, :1], _SENTINEL)
    return torch.cat([sentinel, tokens], dim=1), mask.sum(dim=1) + 1


def unique_anchor(
    source: torch.Tensor, source_lengths: torch.Tensor, output: torch.Tensor, lengths: torch.Tensor, max_ngram: int
) -> torch.Tensor:
    """Per row, the source position where the output's shortest suffix occurring exactly once in the source ends.

    The suffix grows one token at a time (n = 1 .. `max_ngram`) while it occurs more than once; a row whose suffix
    occurs nowhere, or still more than once at `max_ngram`, gets -1.

    Args:
        source (`torch.LongTensor` of shape `(batch_size, source_length)`): from [`sentinel_source`].
        source_lengths (`torch.LongTensor` of shape `(batch_size,)`).
        output (`torch.LongTensor` of shape `(batch_size, buffer_length)`): verified tokens, position 0 the sentinel.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): how much of `output` is searched.
        max_ngram (`int`): longest suffix tried.

    Returns:
        `torch.LongTensor` of shape `(batch_size,)`.
    """
    batch_size, source_length = source.shape
    positions = torch.arange(source_length, device=source.device)  # (S,)
    candidates = positions[None, :] < source_lengths[:, None]  # (B, S): source positions a suffix may end at
    anchor = torch.full((batch_size,), -1, dtype=torch.long, device=source.device)
    undecided = torch.ones(batch_size, dtype=torch.bool, device=source.device)
    for n in range(1, max_ngram + 1):
        has_token = lengths - n >= 0  # (B,)
        output_token = output.gather(1, (lengths - n).clamp(min=0)[:, None])  # (B, 1)
        source_token = source.gather(1, (positions - n + 1).clamp(min=0).expand(batch_size, -1))  # (B, S)
        candidates = candidates & (source_token == output_token) & (positions >= n - 1) & has_token[:, None]
        count = candidates.sum(dim=1)  # (B,)
        unique = undecided & (count == 1)
        anchor = torch.where(unique, candidates.long().argmax(dim=1), anchor)
        undecided = undecided & (count > 1) & has_token
        if not bool(undecided.any()):
            break
    return anchor


def realign_after_edit(
    source: torch.Tensor,
    source_lengths: torch.Tensor,
    output: torch.Tensor,
    lengths: torch.Tensor,
    max_ngram: int,
    lookahead: int = 3,
) -> torch.Tensor:
    """Per row, where the source resumes after an edit that ends the output: the anchor of the output without its
    last token, moved past the source token(s) that last token stands for; -1 where that shorter output has no
    unique anchor either.

    The last token t is matched against the next `lookahead` source tokens: found at the j-th, the model deleted
    j - 1 source tokens; not found, it replaced one (the commonest learner edit). Either way this is only a draft:
    verification decides.

    Returns:
        `torch.LongTensor` of shape `(batch_size,)`: the source position t stands for, or -1.
    """
    before = unique_anchor(source, source_lengths, output, lengths - 1, max_ngram)  # (B,)
    last = output.gather(1, (lengths - 1).clamp(min=0)[:, None])  # (B, 1)
    ahead = before[:, None] + 1 + torch.arange(lookahead, device=source.device)  # (B, L)
    found = (source.gather(1, ahead.clamp(max=source.shape[1] - 1)) == last) & (ahead < source_lengths[:, None])
    skipped = torch.where(found.any(dim=1), found.long().argmax(dim=1) + 1, 1)  # (B,): source tokens t covers
    return torch.where((before >= 0) & (lengths >= 2), before + skipped, -1)


def input_copy_drafts(
    source: torch.Tensor,
    source_lengths: torch.Tensor,
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    num_drafts: int,
    max_ngram: int,
    realign: bool = True,
) -> Drafts:
    """For each row, the source tokens after the unique source occurrence of the output's shortest matching suffix
    ([`unique_anchor`]); with `realign`, a row without one drafts from where the source resumes after the edit that
    ends its output ([`realign_after_edit`]) instead of decoding one token at a time until it re-anchors.

    Args:
        source (`torch.LongTensor` of shape `(batch_size, source_length)`): from [`sentinel_source`].
        source_lengths (`torch.LongTensor` of shape `(batch_size,)`).
        sequences (`torch.LongTensor` of shape `(batch_size, buffer_length)`): verified output tokens; position 0
            is the decoder start token.
        lengths (`torch.LongTensor` of shape `(batch_size,)`).
        num_drafts (`int`): most tokens to draft per row.
        max_ngram (`int`): longest suffix tried.
        realign (`bool`): draft after an edit too.

    Returns:
        [`Drafts`] with `tokens` of shape `(batch_size, num_drafts)`.
    """
    source_length = source.shape[1]
    output = sequences.clone()
    output[:, 0] = _SENTINEL
    anchor = unique_anchor(source, source_lengths, output, lengths, max_ngram)  # (B,)
    if realign:
        resumed = realign_after_edit(source, source_lengths, output, lengths, max_ngram)
        anchor = torch.where(anchor >= 0, anchor, resumed)
    start = anchor + 1  # (B,): first source position after the match
    offsets = torch.arange(num_drafts, device=source.device)
    tokens = source.gather(1, (start[:, None] + offsets).clamp(max=source_length - 1))  # (B, D)
    available = torch.where(anchor >= 0, source_lengths - start, 0).clamp(0, num_drafts)
    tokens = torch.where(offsets < available[:, None], tokens, 0)
    return Drafts(tokens=tokens, lengths=available)


class InputCopyDrafter(Drafter):
    """Drafts by copying the source (input-guided aggressive decoding, Ge et al. 2022 §3.1).

    With exact acceptance the output equals greedy decoding. The loop always appends the verifier's own
    token after the accepted drafts, so a bifurcation always exists (Ge's end sentinel) and every step gains
    at least one token.

    Args:
        model: the seq2seq model that will verify; its encoder and decoder must share a vocabulary.
        max_draft_length (`int`, defaults to 32): most source tokens drafted per step (Ge drafts the whole
            rest of the source; a cap bounds the width of one verification pass).
        max_ngram (`int`, defaults to 8): longest output suffix searched in the source to re-anchor.
        realign (`bool`, defaults to `False`): after an edit, draft at once from where the source resumes
            ([`realign_after_edit`]) instead of waiting, as Ge's Algorithm 1 does, until the output's suffix matches
            the source uniquely again. On JFLEG dev with the shipped gec-en it cut decoder calls by 10% (9.7 tokens
            per call against 8.8) but ran 3% slower: the realigned drafts that fail make wider calls.
    """

    def __init__(self, model: nn.Module, max_draft_length: int = 32, max_ngram: int = 8, realign: bool = False) -> None:
        if max_draft_length < 1 or max_ngram < 1:
            raise ValueError(f"max_draft_length and max_ngram must be >= 1, got {max_draft_length}, {max_ngram}")

        hf.check_model_argument("InputCopyDrafter(model)", model)
        hf.check_shared_vocabulary(hf.unwrap_base(model))
        self.block_size = max_draft_length + 1
        self.max_ngram = max_ngram
        self.realign = realign

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        """The source with Ge's sentinel, built once per `generate` call."""
        if encoder_input_ids is None or encoder_input_ids.is_floating_point():
            raise ValueError(
                "InputCopyDrafter needs the source token ids; call generate with input_ids (not inputs_embeds)"
            )
        return sentinel_source(encoder_input_ids, encoder_attention_mask)

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        """The source and its lengths for `rows`, as new tensors (values: the rule of `drafters/base.py`)."""
        source, source_lengths = drafter_state
        return source.index_select(0, rows), source_lengths.index_select(0, rows)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        source, source_lengths = request.drafter_state
        drafts = input_copy_drafts(
            source, source_lengths, request.sequences, request.lengths, self.block_size - 1, self.max_ngram,
            realign=self.realign,
        )  # fmt: skip
        # the verification pass is as wide as its widest row: trim to the longest draft any row can use
        width = int(torch.minimum(drafts.lengths, request.max_drafts).max())
        return Drafts(tokens=drafts.tokens[:, :width], lengths=drafts.lengths)

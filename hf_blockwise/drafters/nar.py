"""A non-autoregressive drafter (generalized aggressive decoding, GAD: Ge et al. 2022, §3.2).

A small seq2seq model reads the source and the verified prefix followed by [MASK] placeholders, and predicts
the next `block_size - 1` tokens in one pass; the verifier then checks them like any other drafts. It is an
ordinary transformers seq2seq model (its own encoder, a shallow decoder); that model, its config and its
persistence are `modeling/nar_model.py`'s ([`NARDrafterModel`]), and this module reads it through [`NARModel`].

Its decoder is causal, as transformers' decoders are: a mask attends to the prefix and to the masks before it,
which carry nothing but their position, so each draft is predicted from source and prefix alone (the NAR
factorisation). A welcome side effect: the drafts of a shorter block are the first drafts of a longer one, so
one drafter trained for k tokens serves every block size up to k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts


class NARModel(Protocol):
    """What [`NonAutoregressiveDrafter`] reads of a drafter model; [`NARDrafterModel`] is one.

    The drafter owns drafting and nothing of the model: weights, config and persistence stay with the model
    (`modeling/`), which imports this module, not the other way round.

    Attributes:
        model (`nn.Module`): a transformers seq2seq model over the verifier's vocabulary, trained to fill masks
            with the next tokens.
        nar_config: its `mask_token_id` and the `block_size` it was trained for ([`NARDrafterConfig`]).
    """

    model: nn.Module
    nar_config: Any


@dataclass
class NARDraftState:
    """What the drafter keeps for one `generate` call: its encoder's output and its decoder's cache, updated and
    narrowed in place (the rule of `drafters/base.py`).

    Attributes:
        encoder_outputs: the drafter encoder's output for the batch's sources.
        attention_mask (`torch.LongTensor` of shape `(batch_size, source_length)`, *optional*).
        cache (`EncoderDecoderCache`, *optional*): the drafter decoder's keys and values (cross-attention ones
            computed once); `None` when the drafter recomputes the prefix each step.
        verified_in_cache (`int`): leading cache positions that held verified tokens in every row when they
            were computed; the rest (masks, drafts since rejected) is cropped before the next step.
    """

    encoder_outputs: Any
    attention_mask: torch.Tensor | None
    cache: Any = None
    verified_in_cache: int = 0


def nar_decoder_inputs(
    sequences: torch.Tensor, lengths: torch.Tensor, num_drafts: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's verified tokens followed by masks, and the positions whose outputs are the drafts.

    Args:
        sequences (`torch.LongTensor` of shape `(batch_size, buffer_length)`): verified tokens, decoder start
            first, right-padded.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): verified tokens per row.
        num_drafts (`int`): drafts per row.

    Returns:
        decoder_input_ids (`torch.LongTensor` of shape `(batch_size, max_length + num_drafts - 1)`): masks after
            each row's tokens; a shorter row's extra masks come after its own, where causal attention hides them.
        draft_positions (`torch.LongTensor` of shape `(batch_size, num_drafts)`): the last verified position,
            then the masks; the output at each predicts the next token.
    """
    width = int(lengths.max()) + num_drafts - 1
    columns = torch.arange(width, device=sequences.device)  # (W,)
    tokens = sequences[:, columns.clamp(max=sequences.shape[1] - 1)]  # (B, W)
    decoder_input_ids = torch.where(columns < lengths[:, None], tokens, mask_token_id)
    draft_positions = lengths[:, None] - 1 + torch.arange(num_drafts, device=sequences.device)  # (B, D)
    return decoder_input_ids, draft_positions


def reusable_cache_length(lengths: torch.Tensor, verified_when_cached: int) -> int:
    """How many leading decoder positions the drafter may keep from its cache.

    A cached position is reusable only if it held a verified token in every row when it was computed (earlier
    it may have been a mask or a rejected draft), and each row's last verified token must be fed again, since
    its output is that row's first draft.

    Args:
        lengths (`torch.LongTensor` of shape `(batch_size,)`): verified tokens per row now.
        verified_when_cached (`int`): leading positions that were verified in every row when last cached.
    """
    return max(min(verified_when_cached, int(lengths.min()) - 1), 0)


def check_same_vocabulary(drafter_model: nn.Module, verifier: nn.Module) -> None:
    """Raises a `ValueError` unless drafter and verifier score the same vocabulary and start decoding alike."""

    verifier = hf.unwrap_base(verifier)
    drafter_rows = drafter_model.get_output_embeddings().weight.shape[0]
    verifier_rows = verifier.get_output_embeddings().weight.shape[0]
    if drafter_rows != verifier_rows:
        raise ValueError(
            f"The drafter's vocabulary has {drafter_rows} tokens but the verifier's has {verifier_rows}: drafts "
            "would be token ids of another vocabulary. Train the drafter with the verifier's tokenizer."
        )
    starts = (drafter_model.config.decoder_start_token_id, verifier.config.decoder_start_token_id)
    if starts[0] != starts[1]:
        raise ValueError(
            f"The drafter starts decoding with token {starts[0]} but the verifier with {starts[1]}; the drafter "
            "reads the verifier's output, which begins with the verifier's start token"
        )


class NonAutoregressiveDrafter(Drafter):
    """Drafts `block_size - 1` tokens per step with one pass of a small seq2seq model (GAD, Ge et al. §3.2).

    With [`ExactAcceptance`] the output equals the verifier's greedy output; with [`GADPlusPlusAcceptance`] it
    is GAD++ (§3.2.3). The drafter's encoder runs once per `generate` call ([`prepare`]); each step runs its
    decoder over the verified prefix and the masks (no cache: the prefix is short and rows advance unevenly).

    Args:
        model ([`NARModel`], e.g. a [`NARDrafterModel`]): the seq2seq model that drafts (`model.model`), trained
            to fill masks with the next tokens ([`NARDrafterTrainer`]), and its config (`model.nar_config`).
        block_size (`int`, *optional*): tokens per step (2 <= block_size <= `nar_config.block_size`); defaults
            to the trained one.
        verifier (`nn.Module`, *optional*): when given, checked for a matching vocabulary and start token.
        use_cache (`bool`, defaults to `True`): keep the drafter decoder's keys and values of verified tokens
            from step to step within a `generate` call; `False` recomputes the whole prefix every step (the
            drafts are the same).
    """

    def __init__(
        self,
        model: NARModel,
        block_size: int | None = None,
        verifier: nn.Module | None = None,
        use_cache: bool = True,
    ) -> None:
        if not hasattr(model, "nar_config") or not isinstance(getattr(model, "model", None), nn.Module):
            raise TypeError(
                "NonAutoregressiveDrafter takes a NARDrafterModel (NARDrafterModel.from_pretrained(path) or "
                f".from_verifier(base, ...)), got {type(model).__name__}"
            )
        config = model.nar_config
        model = model.model
        hf.encoder_decoder_only(model)
        block_size = config.block_size if block_size is None else block_size
        if not 2 <= block_size <= config.block_size:
            raise ValueError(
                f"block_size must be between 2 and the drafter's trained block size {config.block_size}, "
                f"got {block_size}"
            )
        vocab_rows = model.get_output_embeddings().weight.shape[0]
        if config.mask_token_id >= vocab_rows:
            raise ValueError(f"mask_token_id {config.mask_token_id} is outside the vocabulary of {vocab_rows} tokens")
        if verifier is not None:
            check_same_vocabulary(model, verifier)
        self.model = model
        self.config = config
        self.block_size = block_size
        self.use_cache = use_cache

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        if encoder_input_ids is None or encoder_input_ids.is_floating_point():
            raise ValueError(
                "NonAutoregressiveDrafter encodes the source itself and needs its token ids; call generate with "
                "input_ids (not inputs_embeds)"
            )
        if self.model.training:  # the caller's model: its mode is theirs to set, as for the verifier
            raise ValueError(
                f"NonAutoregressiveDrafter's model ({type(self.model).__name__}) is in training mode, where dropout "
                "makes its drafts random; call .eval() on it (e.g. after Trainer.train()) before generate"
            )
        with torch.no_grad():
            encoder_outputs = self.model.get_encoder()(
                input_ids=encoder_input_ids, attention_mask=encoder_attention_mask, return_dict=True
            )
        cache = hf.new_decoder_cache() if self.use_cache else None
        return NARDraftState(encoder_outputs=encoder_outputs, attention_mask=encoder_attention_mask, cache=cache)

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        """Narrows the per-call state to `rows` in place and returns it (the rule of `drafters/base.py`)."""
        state = drafter_state
        if state.cache is not None:
            hf.select_cache_rows(state.cache, rows)
        selected = hf.select_forward_rows(
            {"encoder_outputs": state.encoder_outputs, "attention_mask": state.attention_mask}, rows
        )
        state.encoder_outputs, state.attention_mask = selected["encoder_outputs"], selected["attention_mask"]
        return state

    def get_candidates(self, request: DraftRequest) -> Drafts:
        state = request.drafter_state
        if not isinstance(state, NARDraftState):
            raise ValueError("NonAutoregressiveDrafter.get_candidates needs the state its prepare() returned")
        num_drafts = self.block_size - 1
        decoder_input_ids, positions = nar_decoder_inputs(
            request.sequences, request.lengths, num_drafts, self.config.mask_token_id
        )  # (B, W), (B, D)
        start = 0
        if state.cache is not None:
            start = reusable_cache_length(request.lengths, state.verified_in_cache)
            hf.crop_cache(state.cache, start)
            state.verified_in_cache = int(request.lengths.min())
        positions = positions - start  # (B, D), into the fed columns; start < every row's length
        with torch.no_grad(), hf.project_columns(self.model, positions):
            logits = self.model(
                encoder_outputs=state.encoder_outputs,
                attention_mask=state.attention_mask,
                decoder_input_ids=decoder_input_ids[:, start:],
                use_cache=state.cache is not None,
                return_dict=True,
                **{hf.cache_argument(self.model): state.cache},
            ).logits  # (B, D, V)
        logits[..., self.config.mask_token_id] = torch.finfo(logits.dtype).min
        tokens = logits.argmax(dim=-1)  # (B, D)
        lengths = torch.full((tokens.shape[0],), num_drafts, dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens, lengths=lengths)

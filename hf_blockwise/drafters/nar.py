"""A non-autoregressive drafter (generalized aggressive decoding, GAD: Ge et al. 2022, §3.2).

A small seq2seq model reads the source and the verified prefix followed by [MASK] placeholders, and predicts
the next `block_size - 1` tokens in one pass; the verifier then checks them like any other drafts. It is an
ordinary transformers seq2seq model (its own encoder, a shallow decoder), so it is saved, loaded and trained
with transformers' own machinery; only a small JSON file (`nar_drafter_config.json`) says which token is the
mask and how many tokens it was trained to draft.

Its decoder is causal, as transformers' decoders are: a mask attends to the prefix and to the masks before it,
which carry nothing but their position, so each draft is predicted from source and prefix alone (the NAR
factorisation). A welcome side effect: the drafts of a shorter block are the first drafts of a longer one, so
one drafter trained for k tokens serves every block size up to k.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedModel

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts
from hf_blockwise.serialization import JsonConfigMixin, atomic_write, atomic_write_text

NAR_CONFIG_NAME = "nar_drafter_config.json"
# a drafter saved relative to its verifier: only the weights that differ from the verifier's
CHANGED_WEIGHTS_NAME = "nar_drafter_weights.safetensors"

# How configs name their layer counts (encoder, decoder): BART, mBART, Marian, Pegasus, M2M100/NLLB; T5, mT5.
_LAYER_COUNT_ATTRIBUTES = (("encoder_layers", "decoder_layers"), ("num_layers", "num_decoder_layers"))


@dataclass
class NARDrafterConfig(JsonConfigMixin):
    """What turns a seq2seq model into a non-autoregressive drafter.

    Args:
        mask_token_id (`int`): the placeholder fed where drafts are to be predicted; a token the drafter never
            needs to output (the tokenizer's mask token, or its unknown token when it has none).
        block_size (`int`, defaults to 8): k: tokens per step including the verifier's own, so the drafter
            predicts `block_size - 1` tokens from the prefix and `block_size - 2` masks.
        verifier_name_or_path (`str`, *optional*): the model whose outputs the drafter was trained on.
    """

    mask_token_id: int
    block_size: int = 8
    verifier_name_or_path: str | None = None

    file_name: ClassVar[str] = NAR_CONFIG_NAME

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be a non-negative int, got {self.mask_token_id!r}")
        if self.verifier_name_or_path is not None and not isinstance(self.verifier_name_or_path, str):
            raise ValueError(f"verifier_name_or_path must be a string or None, got {self.verifier_name_or_path!r}")


@dataclass
class NARDraftState:
    """What the drafter keeps for one `generate` call: its encoder's output and its decoder's cache.

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


def _layer_count_attributes(config: Any) -> tuple[str, str]:
    for names in _LAYER_COUNT_ATTRIBUTES:
        if all(name in config.to_dict() for name in names):
            return names
    raise ValueError(
        f"{type(config).__name__} names its layer counts in none of the known ways {_LAYER_COUNT_ATTRIBUTES}; "
        "build the drafter model yourself and pass it to NonAutoregressiveDrafter(model, config)"
    )


class NonAutoregressiveDrafter(Drafter):
    """Drafts `block_size - 1` tokens per step with one pass of a small seq2seq model (GAD, Ge et al. §3.2).

    With [`ExactAcceptance`] the output equals the verifier's greedy output; with [`GADPlusPlusAcceptance`] it
    is GAD++ (§3.2.3). The drafter's encoder runs once per `generate` call ([`prepare`]); each step runs its
    decoder over the verified prefix and the masks (no cache: the prefix is short and rows advance unevenly).

    Args:
        model ([`PreTrainedModel`]): a seq2seq model over the verifier's vocabulary, trained to fill masks with
            the next tokens ([`NARDrafterTrainer`]).
        config ([`NARDrafterConfig`]): its mask token and trained block size.
        block_size (`int`, *optional*): tokens per step (2 <= block_size <= `config.block_size`); defaults to
            the trained one.
        verifier (`nn.Module`, *optional*): when given, checked for a matching vocabulary and start token.
        use_cache (`bool`, defaults to `True`): keep the drafter decoder's keys and values of verified tokens
            from step to step within a `generate` call; `False` recomputes the whole prefix every step (the
            drafts are the same).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: NARDrafterConfig,
        block_size: int | None = None,
        verifier: nn.Module | None = None,
        use_cache: bool = True,
    ) -> None:
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

    @classmethod
    def from_verifier(
        cls,
        verifier: nn.Module,
        mask_token_id: int,
        block_size: int = 8,
        decoder_layers: int = 1,
        encoder_layers: int | None = None,
        verifier_name_or_path: str | None = None,
    ) -> NonAutoregressiveDrafter:
        """A drafter of the verifier's architecture with fewer layers, initialised from the verifier's weights.

        The drafter then starts with the verifier's embeddings, encoder and lowest decoder layers, and training
        only has to teach it to read masks. Layers are taken from the bottom of each stack.

        Args:
            verifier: the seq2seq model (or [`BlockwiseHeadsModel`]) whose greedy output is to be drafted.
            mask_token_id (`int`): see [`NARDrafterConfig`].
            decoder_layers (`int`, defaults to 1), encoder_layers (`int`, *optional*): layer counts of the
                drafter; `None` keeps the verifier's encoder depth.
        """

        base = hf.unwrap_base(verifier)
        config = copy.deepcopy(base.config)
        encoder_name, decoder_name = _layer_count_attributes(config)
        depths = {encoder_name: encoder_layers, decoder_name: decoder_layers}
        for name, depth in depths.items():
            available = getattr(config, name)
            if depth is not None and not 1 <= depth <= available:
                raise ValueError(f"{name} of the drafter must be between 1 and the verifier's {available}, got {depth}")
            if depth is not None:
                setattr(config, name, depth)
        model = AutoModelForSeq2SeqLM.from_config(config)
        missing, _unused_deeper_layers = model.load_state_dict(base.state_dict(), strict=False)
        if missing:
            raise ValueError(f"Could not initialise the drafter from the verifier; missing weights {missing[:5]}")
        model.to(device=base.device, dtype=base.dtype)
        model.generation_config = copy.deepcopy(base.generation_config)
        nar_config = NARDrafterConfig(
            mask_token_id=mask_token_id, block_size=block_size, verifier_name_or_path=verifier_name_or_path
        )
        return cls(model, nar_config, verifier=base)

    def prepare(self, encoder_input_ids: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None) -> Any:
        if encoder_input_ids is None or encoder_input_ids.is_floating_point():
            raise ValueError(
                "NonAutoregressiveDrafter encodes the source itself and needs its token ids; call generate with "
                "input_ids (not inputs_embeds)"
            )
        # dropout would make the drafts random: a drafter handed back by a Trainer may still be in train mode
        self.model.eval()
        with torch.no_grad():
            encoder_outputs = self.model.get_encoder()(
                input_ids=encoder_input_ids, attention_mask=encoder_attention_mask, return_dict=True
            )
        cache = hf.new_decoder_cache() if self.use_cache else None
        return NARDraftState(encoder_outputs=encoder_outputs, attention_mask=encoder_attention_mask, cache=cache)

    def select_rows(self, drafter_state: Any, rows: torch.Tensor) -> Any:
        state = drafter_state
        if state.cache is not None:
            hf.select_cache_rows(state.cache, rows)
        selected = hf.select_forward_rows(
            {"encoder_outputs": state.encoder_outputs, "attention_mask": state.attention_mask}, rows
        )
        return NARDraftState(
            encoder_outputs=selected["encoder_outputs"],
            attention_mask=selected["attention_mask"],
            cache=state.cache,
            verified_in_cache=state.verified_in_cache,
        )

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
                past_key_values=state.cache,
                use_cache=state.cache is not None,
                return_dict=True,
            ).logits  # (B, D, V)
        logits[..., self.config.mask_token_id] = torch.finfo(logits.dtype).min
        tokens = logits.argmax(dim=-1)  # (B, D)
        lengths = torch.full((tokens.shape[0],), num_drafts, dtype=torch.long, device=tokens.device)
        return Drafts(tokens=tokens, lengths=lengths)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        dtype: torch.dtype | None = None,
        relative_to: nn.Module | None = None,
        verifier_name_or_path: str | None = None,
    ) -> None:
        """Writes the drafter into `save_directory`, atomically file by file, `nar_drafter_config.json` last.

        By default the whole model is written in transformers' format. With `relative_to=verifier`, only the
        weights that differ from the verifier's are written (`nar_drafter_weights.safetensors`, beside the
        drafter's `config.json`), as PEFT saves adapters: a drafter made by [`from_verifier`] and trained with
        a frozen encoder then takes a fraction of the space, and loading rebuilds it from the verifier.

        Args:
            dtype (`torch.dtype`, *optional*): store the weights in this dtype (e.g. `torch.float16`).
            relative_to (`nn.Module`, *optional*): the verifier the drafter was made from.
            verifier_name_or_path (`str`, *optional*): the verifier to record in the config (a path relative to
                `save_directory`, such as `".."`, is looked up there first); required to load a relative save
                without passing `verifier=`.
        """
        save_directory = os.fspath(save_directory)
        os.makedirs(save_directory, exist_ok=True)
        if relative_to is None:
            self._save_whole_model(save_directory, dtype)
        else:
            self._save_changed_weights(save_directory, dtype, relative_to)
        config = self.config
        if verifier_name_or_path is not None:
            config = dataclasses.replace(config, verifier_name_or_path=verifier_name_or_path)
        config.save_pretrained(save_directory)

    def _save_whole_model(self, save_directory: str, dtype: torch.dtype | None) -> None:
        # transformers writes several files: stage them, then move each in with an atomic rename
        model = self.model if dtype is None else copy.deepcopy(self.model).to(dtype)
        staging = tempfile.mkdtemp(prefix=".nar-drafter.", dir=save_directory)
        try:
            model.save_pretrained(staging)
            for name in sorted(os.listdir(staging)):
                os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _save_changed_weights(self, save_directory: str, dtype: torch.dtype | None, verifier: nn.Module) -> None:

        reference = hf.unwrap_base(verifier).state_dict()
        tensors = {}
        for name, tensor in self.model.state_dict().items():
            same = name in reference and reference[name].shape == tensor.shape
            if not (same and torch.equal(reference[name].to(tensor.device, tensor.dtype), tensor)):
                stored = tensor.detach().to(dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)
                tensors[name] = stored.contiguous().cpu().clone()
        atomic_write_text(os.path.join(save_directory, "config.json"), self.model.config.to_json_string())
        atomic_write(
            os.path.join(save_directory, CHANGED_WEIGHTS_NAME),
            lambda path: save_file(tensors, path, metadata={"format": "pt", "relative_to": "verifier"}),
        )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        block_size: int | None = None,
        verifier: nn.Module | None = None,
        use_cache: bool = True,
        **model_kwargs: Any,
    ) -> NonAutoregressiveDrafter:
        """Loads a drafter written by [`save_pretrained`] (a local directory or a hub repository).

        Args:
            block_size (`int`, *optional*): draft fewer tokens than trained for.
            verifier (`nn.Module`, *optional*): checked for a matching vocabulary; a drafter saved relative to
                its verifier is rebuilt from it (by default from the config's `verifier_name_or_path`).
            use_cache (`bool`, defaults to `True`): see [`NonAutoregressiveDrafter`].
            model_kwargs: passed to `from_pretrained` of the model (and of the verifier it loads, if any).
        """

        config = NARDrafterConfig.from_json_file(hf.resolve_file(name_or_path, NAR_CONFIG_NAME))
        if not hf.has_file(name_or_path, CHANGED_WEIGHTS_NAME):
            model = AutoModelForSeq2SeqLM.from_pretrained(name_or_path, **model_kwargs)
            return cls(model, config, block_size=block_size, verifier=verifier, use_cache=use_cache)
        if verifier is None:
            if config.verifier_name_or_path is None:
                raise ValueError(
                    f"{name_or_path} holds only the weights that differ from its verifier and names no verifier; "
                    "pass verifier="
                )
            location = hf.base_location(name_or_path, config.verifier_name_or_path)
            hf.check_local_path(location, "the recorded verifier (pass verifier= to attach one)")
            verifier = AutoModelForSeq2SeqLM.from_pretrained(location, **model_kwargs)
        model = _rebuild_from_verifier(
            AutoConfig.from_pretrained(name_or_path), verifier, hf.resolve_file(name_or_path, CHANGED_WEIGHTS_NAME)
        )
        return cls(model, config, block_size=block_size, verifier=verifier, use_cache=use_cache)


def _rebuild_from_verifier(model_config: Any, verifier: nn.Module, weights_path: str) -> PreTrainedModel:
    """The drafter model: the verifier's weights where the drafter kept them, the saved ones elsewhere."""

    base = hf.unwrap_base(verifier)
    try:
        changed = load_file(weights_path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"Cannot read drafter weights from {weights_path}: {error}; the file is corrupt") from error
    model = AutoModelForSeq2SeqLM.from_config(model_config)
    check_same_vocabulary(model, base)
    expected = model.state_dict()
    unknown = sorted(set(changed) - set(expected))
    if unknown:
        raise ValueError(f"{weights_path} holds weights the drafter does not have: {unknown[:5]}")
    missing, _unused_deeper_layers = model.load_state_dict(base.state_dict(), strict=False)
    still_missing = sorted(set(missing) - set(changed))
    if still_missing:
        raise ValueError(f"Neither the verifier nor {weights_path} provides {still_missing[:5]}: wrong verifier?")
    for name, tensor in changed.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{name} in {weights_path} has shape {tuple(tensor.shape)}, the drafter expects "
                f"{tuple(expected[name].shape)}: wrong verifier or corrupt file"
            )
    model.load_state_dict(changed, strict=False)
    return model.to(device=base.device, dtype=base.dtype).eval()

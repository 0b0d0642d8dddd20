"""Loading a model directory with everything it ships: the base (with heads when it has some), its tokenizer or
feature extractor, and the drafters kept beside it (`feature-drafter/`, `nar-drafter/`, `sequential-heads/`), for
the bench, the demo and the corpus job alike."""

from __future__ import annotations

import os

import torch
from transformers import AutoFeatureExtractor, AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.nar import NAR_CONFIG_NAME, NonAutoregressiveDrafter
from hf_blockwise.modeling.config import CONFIG_NAME, FEATURE_DRAFTER_CONFIG_NAME
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.modeling.model import BlockwiseHeadsModel
from hf_blockwise.tools.bench import BenchSetup

# where a model directory keeps its other drafters, if it ships them
NAR_DRAFTER_SUBDIR = "nar-drafter"
FEATURE_DRAFTER_SUBDIR = "feature-drafter"
SEQUENTIAL_HEADS_SUBDIR = "sequential-heads"


def load_for_bench(
    model_path: str,
    assistant_path: str | None,
    max_new_tokens: int,
    iad_max_draft_length: int = 32,
    nar_drafter_path: str | None = None,
    feature_drafter_path: str | None = None,
    sequential_heads_path: str | None = None,
) -> BenchSetup:
    """The bench's setup from a model directory: base (with heads if it has some), tokenizer, assistant model,
    NAR drafter, feature drafter and sequential heads (`<model>/nar-drafter`, `<model>/feature-drafter`,
    `<model>/sequential-heads` when present and none is given)."""
    for what, path in (
        ("--model", model_path), ("--assistant-model", assistant_path), ("--nar-drafter", nar_drafter_path),
        ("--feature-drafter", feature_drafter_path), ("--sequential-heads", sequential_heads_path),
    ):  # fmt: skip
        if path is not None:
            hf.check_local_path(path, what)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    heads_model = None
    if os.path.isfile(os.path.join(model_path, CONFIG_NAME)):
        heads_model = BlockwiseHeadsModel.from_pretrained(model_path, dtype=torch.float32).eval()
        base = heads_model.base_model
    else:
        base = hf.load_encoder_decoder(model_path, dtype=torch.float32).eval()
    # speech encoders read features of audio (Whisper's log-mel frames), made by the checkpoint's feature extractor
    feature_extractor = (
        None if hf.encoder_input_name(base) == "input_ids" else AutoFeatureExtractor.from_pretrained(model_path)
    )
    assistant = None
    if assistant_path is not None and os.path.isfile(os.path.join(assistant_path, NAR_CONFIG_NAME)):
        # a drafter is a small seq2seq model of the same vocabulary; fed no masks, its output at the last
        # verified position is an autoregressive next-token prediction, which is all an assistant model makes
        drafter = NonAutoregressiveDrafter.from_pretrained(assistant_path, verifier=base, dtype=torch.float32)
        assistant = drafter.model.eval()
    elif assistant_path is not None:
        assistant = AutoModelForSeq2SeqLM.from_pretrained(assistant_path, dtype=torch.float32).eval()
    shipped_drafter = os.path.join(model_path, NAR_DRAFTER_SUBDIR)
    if nar_drafter_path is None and os.path.isfile(os.path.join(shipped_drafter, NAR_CONFIG_NAME)):
        nar_drafter_path = shipped_drafter
    nar_drafter = None
    if nar_drafter_path is not None:
        nar_drafter = NonAutoregressiveDrafter.from_pretrained(nar_drafter_path, verifier=base, dtype=torch.float32)
    feature_drafter_path = feature_drafter_path or shipped_drafter_path(
        model_path, FEATURE_DRAFTER_SUBDIR, FEATURE_DRAFTER_CONFIG_NAME
    )
    feature_model = None
    if feature_drafter_path is not None:
        feature_model = FeatureDrafterModel.from_pretrained(feature_drafter_path, base_model=base).eval()
    sequential_heads_path = sequential_heads_path or shipped_drafter_path(
        model_path, SEQUENTIAL_HEADS_SUBDIR, CONFIG_NAME
    )
    sequential_heads_model = None
    if sequential_heads_path is not None:
        sequential_heads_model = BlockwiseHeadsModel.from_pretrained(sequential_heads_path, base_model=base).eval()
    return BenchSetup(
        base=base, tokenizer=tokenizer, heads_model=heads_model, assistant_model=assistant,
        max_new_tokens=max_new_tokens, iad_max_draft_length=iad_max_draft_length, nar_drafter=nar_drafter,
        feature_model=feature_model, sequential_heads_model=sequential_heads_model,
        feature_extractor=feature_extractor,
    )  # fmt: skip


def shipped_drafter_path(model_path: str, subdir: str, config_name: str) -> str | None:
    """`<model_path>/<subdir>` when it holds a saved drafter (its `config_name`), else `None`."""
    path = os.path.join(model_path, subdir)
    return path if os.path.isfile(os.path.join(path, config_name)) else None

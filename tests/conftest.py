"""Tiny seq2seq models of every supported architecture, built from configs in code (no downloads)."""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from near_ties import NEAR_TIE_BUDGET, TALLY
from transformers import PreTrainedModel
from zoo import ARCHITECTURES as ALL_ARCHITECTURES
from zoo import VOCAB_SIZE

from hf_blockwise import DraftRequest, Drafts
from hf_blockwise.drafters.oracle import ReferenceDrafter

# Tiny models: one thread avoids the cost of splitting microscopic matrix products (many times faster here).
torch.set_num_threads(1)

# The architectures the full exactness matrix runs on (T5, mT5, BART, mBART, Marian, Pegasus, M2M100); every
# other zoo entry runs the lighter all-architecture suite (tests/test_every_architecture.py).
CORE_ARCHITECTURES = ("t5", "mt5", "bart", "mbart", "marian", "pegasus", "m2m100")
ARCHITECTURES = {name: ALL_ARCHITECTURES[name] for name in CORE_ARCHITECTURES}
# Decoders that cannot verify several tokens in one cached pass exactly: blockwise decoding refuses them.
REFUSED_ARCHITECTURES = ("fsmt", "prophetnet")


def build_model(architecture: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = ALL_ARCHITECTURES[architecture]().eval()
    # Some configs carry generation defaults (e.g. Marian's bad_words_ids); tests state their own.
    model.generation_config.bad_words_ids = None
    model.generation_config.max_length = 64
    return model


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, PreTrainedModel]:
    return {name: build_model(name) for name in ARCHITECTURES}


@pytest.fixture(scope="session")
def greedy_of(tiny_models) -> Callable[..., torch.Tensor]:
    """transformers' greedy output of a tiny model on `random_batch(model, batch_size, seed)`, computed once per
    worker for each (architecture, batch, generate arguments): the exactness matrix compares many drafters and
    rules with one reference. A copy each time, so that no test can change another's reference."""
    outputs: dict[str, torch.Tensor] = {}

    def greedy(architecture: str, batch_size: int, seed: int, **kwargs: Any) -> torch.Tensor:
        key = repr((architecture, batch_size, seed, sorted(kwargs.items())))
        if key not in outputs:
            model = tiny_models[architecture]
            batch = random_batch(model, batch_size, seed)
            outputs[key] = model.generate(**batch, do_sample=False, num_beams=1, **kwargs)
        return outputs[key].clone()

    return greedy


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


class OracleDrafter(ReferenceDrafter):
    """Proposes a known greedy output, with a fraction of tokens corrupted, to drive acceptance per row.

    Args:
        reference (`torch.LongTensor` of shape `(batch_size, length)`): the greedy output to propose.
        block_size (`int`): k.
        corruption (`float`): probability that a proposed token is replaced by a wrong one.
        seed (`int`): makes the corruption pattern reproducible.
    """

    def __init__(self, reference: torch.Tensor, block_size: int, corruption: float = 0.0, seed: int = 0) -> None:
        super().__init__(reference, block_size)
        self.corruption = corruption
        self.seed = seed

    def get_candidates(self, request: DraftRequest) -> Drafts:
        drafts = super().get_candidates(request)
        generator = torch.Generator().manual_seed(self.seed + int(request.lengths.sum()))
        corrupt = torch.rand(drafts.tokens.shape, generator=generator) < self.corruption
        return Drafts(
            tokens=torch.where(corrupt, (drafts.tokens + 1) % VOCAB_SIZE, drafts.tokens), lengths=drafts.lengths
        )


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary (`w3` … `w63`), for tests that need text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB_SIZE)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def save_with_random_heads(
    directory: Path, architecture: str = "marian", generation: dict | None = None, **save_kwargs
) -> PreTrainedModel:
    """A tiny model saved in `directory` with a word tokenizer and random (often wrong) proposal heads, k = 3, whose
    config names the base as "."; `generation` sets its generation_config first (default: no `max_length`, so the
    checkpoint's length comes from transformers' defaults). Returns the base, for drafters saved beside it."""
    from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel

    base = build_model(architecture, seed=3)
    for name, value in (generation or {"max_length": None}).items():
        setattr(base.generation_config, name, value)
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    torch.nn.init.normal_(model.heads.down.weight, std=1.0)
    base.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    model.save_pretrained(directory, base_model_name_or_path=".", **save_kwargs)
    return base


def random_sources(count: int, seed: int) -> list[str]:
    """`count` sources of 1 to 14 words of the tiny vocabulary (`w3` ... `w63`), for the corpus tests."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randint(1, 14))) for _ in range(count)]


def save_corpus_model(directory: Path) -> Path:
    """A tiny Marian with a word tokenizer, random proposal heads (often wrong) and an untrained feature drafter,
    saved in `directory` (returned): what the corpus job's tests decode with."""
    from hf_blockwise import FeatureDrafterConfig, FeatureDrafterModel

    base = save_with_random_heads(directory)
    FeatureDrafterModel(base, FeatureDrafterConfig(block_size=4)).save_pretrained(
        directory / "feature-drafter", base_model_name_or_path=".."
    )
    return directory


TRAINING = Path(__file__).resolve().parent.parent / "training"


def load_recipe_module(name: str) -> ModuleType:
    """A module of `training/` (recipes are scripts that import their neighbours by name, not a package)."""
    if str(TRAINING) not in sys.path:
        sys.path.insert(0, str(TRAINING))
    return importlib.import_module(name)


# --- the near-tie tally (tests/near_ties.py): each xdist worker hands its count to the controller, which prints it
# and fails the run past the budget


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["near_ties"] = (TALLY.comparisons, TALLY.allowed)
        return
    if len(TALLY.allowed) > NEAR_TIE_BUDGET and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    comparisons, allowed = node.workeroutput.get("near_ties", (0, []))
    TALLY.add(comparisons, allowed)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if getattr(config, "workeroutput", None) is not None:
        return
    terminalreporter.write_line(TALLY.summary())
    for where, row, position, spacings in TALLY.allowed:
        terminalreporter.write_line(f"  {where}: row {row}, position {position}, {spacings:.1f} float spacings")
    if len(TALLY.allowed) > NEAR_TIE_BUDGET:
        terminalreporter.write_line(
            f"FAILED: {len(TALLY.allowed)} near-ties allowed, over the suite's budget of {NEAR_TIE_BUDGET} "
            "(tests/near_ties.py)",
            red=True,
        )

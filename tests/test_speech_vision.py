"""Speech and vision encoder-decoders (issue 19): Whisper, Speech2Text, `VisionEncoderDecoderModel` (TrOCR and BERT
decoders), `SpeechEncoderDecoderModel` and Pix2Struct, decoded exactly by the loop with every model drafter at
batch sizes 1, 4 and 9, with `input_features` / `input_values` / `pixel_values` / `flattened_patches` as inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import OracleDrafter
from zoo_media import MEDIA_ARCHITECTURES, build_media_model, media_batch

from hf_blockwise import BlockwiseConfig, BlockwiseHeadsModel, blockwise_generate, check_decoder
from hf_blockwise import boundary as hf
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel

# use_cache: Pix2Struct's text config defaults to False, which blockwise decoding refuses (tested below)
GREEDY = {"do_sample": False, "num_beams": 1, "use_cache": True}


@pytest.fixture(scope="module")
def media_models() -> dict:
    return {name: build_media_model(name) for name in MEDIA_ARCHITECTURES}


def _reference(model, greedy: torch.Tensor) -> torch.Tensor:
    """Greedy's tokens from the decoder start on: Whisper's generate returns them without its decoder prompt."""
    start = model.generation_config.decoder_start_token_id
    if bool((greedy[:, 0] == start).all()):
        return greedy
    return torch.cat([torch.full_like(greedy[:, :1], start), greedy], dim=1)


class _CallCounter:
    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.get_decoder().register_forward_hook(self._count)

    def _count(self, *args) -> None:
        self.calls += 1


def _drafters(model, greedy: torch.Tensor, seed: int):
    yield "noisy_oracle", model, OracleDrafter(_reference(model, greedy), block_size=4, corruption=0.25, seed=seed)
    heads = BlockwiseHeadsModel(model, BlockwiseConfig(block_size=3, condition_on_token=True))
    torch.manual_seed(seed)
    torch.nn.init.normal_(heads.heads.down.weight, std=1.0)
    yield "heads", model, heads.drafter()
    feature = FeatureDrafterModel(model, FeatureDrafterConfig(block_size=4, training_depth=2)).eval()
    yield "feature", model, feature.drafter()


@pytest.mark.parametrize("architecture", list(MEDIA_ARCHITECTURES))
def test_speech_and_vision_models_are_exact_with_every_drafter(media_models, architecture: str) -> None:
    model = media_models[architecture]
    check_decoder(model)  # the capability probe runs on random encoder states of the encoder's width
    for batch_size, seed in ((1, 0), (4, 1), (9, 2)):
        batch = media_batch(architecture, batch_size, seed)
        greedy = model.generate(**batch, max_new_tokens=16, **GREEDY)
        if batch_size > 1:
            assert len(set(greedy.flatten().tolist())) > 5, "the tiny model should produce varied tokens"
        for name, _, drafter in _drafters(model, greedy, seed):
            counter = _CallCounter(model)
            try:
                drafted = model.generate(
                    **batch, max_new_tokens=16, custom_generate=blockwise_generate, assistant=drafter, **GREEDY
                )
            finally:
                counter.handle.remove()
            assert torch.equal(drafted, greedy), (architecture, batch_size, name)
            if name == "noisy_oracle" and batch_size == 1:  # drafts were accepted: fewer calls than tokens
                assert counter.calls < greedy.shape[1] - 1, (architecture, counter.calls)


@pytest.mark.parametrize("architecture", ["whisper", "vision_trocr", "speech_to_text"])
def test_processors_and_stopping_on_speech_and_vision(media_models, architecture: str) -> None:
    model = media_models[architecture]
    batch = media_batch(architecture, 5, seed=3)
    kwargs = {"max_new_tokens": 20, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 6}
    greedy = model.generate(**batch, **kwargs, **GREEDY)
    drafter = OracleDrafter(_reference(model, greedy), block_size=5, corruption=0.3, seed=3)
    drafted = model.generate(**batch, **kwargs, custom_generate=blockwise_generate, assistant=drafter, **GREEDY)
    assert torch.equal(drafted, greedy)


def test_encoder_input_names_come_from_the_models(media_models) -> None:
    names = {name: hf.encoder_input_name(model) for name, model in media_models.items()}
    assert names == {
        "whisper": "input_features", "speech_to_text": "input_features", "vision_trocr": "pixel_values",
        "vision_bert": "pixel_values", "speech_bert": "input_values", "pix2struct": "flattened_patches",
    }  # fmt: skip


def test_a_config_without_the_cache_is_refused_clearly(media_models) -> None:
    model = media_models["pix2struct"]
    batch = media_batch("pix2struct", 2, seed=4)
    with pytest.raises(ValueError, match=r"use_cache=False is not supported.*pass use_cache=True"):
        model.generate(**batch, max_new_tokens=8, custom_generate=blockwise_generate)
    plain = model.generate(**batch, max_new_tokens=8)  # its own generate still works
    assert plain.shape[0] == 2

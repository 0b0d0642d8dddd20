"""Speech and vision encoder-decoders (issue 19): Whisper, Speech2Text, `VisionEncoderDecoderModel` (TrOCR and BERT
decoders), `SpeechEncoderDecoderModel` and Pix2Struct, decoded exactly by the loop with every model drafter at
batch sizes 1, 4 and 9, with `input_features` / `input_values` / `pixel_values` / `flattened_patches` as inputs;
Whisper's own `generate` options (language and task tokens, `prompt_ids`, timestamps, long-form audio) and the
automatic-speech-recognition and image-text-to-text pipelines as clients of the loop.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from conftest import OracleDrafter, word_tokenizer
from PIL import Image
from transformers import DonutProcessor, ViTImageProcessorPil, pipeline
from transformers.generation.utils import GenerationMixin
from zoo_media import (
    MEDIA_ARCHITECTURES,
    WHISPER_SAMPLING_RATE,
    WHISPER_TOKENS,
    build_media_model,
    media_batch,
    whisper_feature_extractor,
    whisper_tokenizer,
)

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel, blockwise_generate, check_decoder, speed_up
from hf_blockwise import boundary as hf
from hf_blockwise.evaluation.harness import DecoderCallCounter
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel

# use_cache: Pix2Struct's text config defaults to False, which blockwise decoding refuses (tested below)
GREEDY = {"do_sample": False, "num_beams": 1, "use_cache": True}


@pytest.fixture(scope="module")
def media_models() -> dict:
    return {name: build_media_model(name) for name in MEDIA_ARCHITECTURES}


def _recording_greedy_search(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
    searches: list | None = None, **model_kwargs,
):  # fmt: skip
    """transformers' own greedy search, as a `custom_generate` that appends each search's whole decoder sequence
    (decoder prompt included) to `searches`: Whisper's `generate` runs one search per segment of audio and returns
    only the tokens after its decoder prompt (start, language, task, `prompt_ids`)."""
    output = GenerationMixin._sample(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
    )
    searches.append(output if isinstance(output, torch.Tensor) else output.sequences)
    return output


def _greedy_searches(model, inputs: dict, **kwargs) -> list[torch.Tensor]:
    searches: list[torch.Tensor] = []
    model.generate(**inputs, **kwargs, **GREEDY, custom_generate=_recording_greedy_search, searches=searches)
    return searches


class _ReplayingOracle(OracleDrafter):
    """A noisy `OracleDrafter` over the greedy searches that one `generate` call (or pipeline call) runs, in their
    order: each search proposes the next recorded decoder sequence."""

    def __init__(self, searches: list[torch.Tensor], block_size: int, corruption: float, seed: int) -> None:
        super().__init__(searches[0], block_size, corruption, seed)
        self.searches = list(searches)
        self.next_search = 0

    def prepare(self, encoder_input_ids, encoder_attention_mask):
        self.reference = self.searches[min(self.next_search, len(self.searches) - 1)]
        self.next_search += 1
        return super().prepare(encoder_input_ids, encoder_attention_mask)


def _counting_calls(model, call, *args, **kwargs):
    """`call(*args, **kwargs)`'s result, and how many forwards of `model`'s decoder it made."""
    counter = DecoderCallCounter(model)
    counter.reset()  # compiled calls the model's engine made before are not this call's
    try:
        return call(*args, **kwargs), counter.calls
    finally:
        counter.close()


def _feature_drafter(model):
    return FeatureDrafterModel(model, FeatureDrafterConfig(block_size=4, training_depth=2)).eval().drafter()


def _drafters(model, searches: list[torch.Tensor], seed: int):
    yield "noisy_oracle", model, _ReplayingOracle(searches, block_size=4, corruption=0.25, seed=seed)
    heads = BlockwiseHeadsModel(model, BlockwiseHeadsConfig(block_size=3, condition_on_token=True))
    torch.manual_seed(seed)
    torch.nn.init.normal_(heads.heads.down.weight, std=1.0)
    yield "heads", model, heads.drafter()
    yield "feature", model, _feature_drafter(model)


@pytest.mark.parametrize("architecture", list(MEDIA_ARCHITECTURES))
def test_speech_and_vision_models_are_exact_with_every_drafter(media_models, architecture: str) -> None:
    model = media_models[architecture]
    check_decoder(model)  # the capability probe runs on random encoder states of the encoder's width
    for batch_size, seed in ((1, 0), (4, 1), (9, 2)):
        batch = media_batch(architecture, batch_size, seed)
        greedy, greedy_calls = _counting_calls(model, model.generate, **batch, max_new_tokens=16, **GREEDY)
        if batch_size > 1:
            assert len(set(greedy.flatten().tolist())) > 5, "the tiny model should produce varied tokens"
        for name, _, drafter in _drafters(model, _greedy_searches(model, batch, max_new_tokens=16), seed):
            drafted, calls = _counting_calls(
                model, model.generate, **batch, max_new_tokens=16, custom_generate=blockwise_generate,
                assistant=drafter, **GREEDY,
            )  # fmt: skip
            assert torch.equal(drafted, greedy), (architecture, batch_size, name)
            if name == "noisy_oracle" and batch_size == 1:  # drafts were accepted: fewer decoder calls than greedy's
                assert calls < greedy_calls, (architecture, calls, greedy_calls)


@pytest.mark.parametrize("architecture", ["whisper", "vision_trocr", "speech_to_text"])
def test_processors_and_stopping_on_speech_and_vision(media_models, architecture: str) -> None:
    model = media_models[architecture]
    batch = media_batch(architecture, 5, seed=3)
    kwargs = {"max_new_tokens": 20, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 6}
    greedy = model.generate(**batch, **kwargs, **GREEDY)
    drafter = _ReplayingOracle(_greedy_searches(model, batch, **kwargs), block_size=5, corruption=0.3, seed=3)
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


# --- Whisper's own generate underneath the loop ------------------------------------------------------------------


def _clips(seconds: list[float], seed: int) -> list[np.ndarray]:
    """Random audio (white noise) of the given lengths at the tiny Whisper's sampling rate."""
    generator = np.random.default_rng(seed)
    return [generator.standard_normal(int(s * WHISPER_SAMPLING_RATE)).astype(np.float32) for s in seconds]


def _audio(seconds: list[float], seed: int, long_form: bool = False) -> dict:
    """Log-mel features of random audio clips as Whisper's feature extractor makes them: padded to the 1 s window
    with an attention mask, or (`long_form`) to the longest clip."""
    padding = {"truncation": False, "padding": "longest"} if long_form else {}
    features = whisper_feature_extractor()(
        _clips(seconds, seed), sampling_rate=WHISPER_SAMPLING_RATE, return_tensors="pt", return_attention_mask=True,
        **padding,
    )  # fmt: skip
    return dict(features)


def _run_probes(model) -> None:
    """The loop's once-per-model probes (decoder capability; whether the decoder reads a frame mask, for Whisper and
    vision models, which read none) make decoder forwards of their own on first use: run before counting them."""
    check_decoder(model)
    hf.decoder_reads_frame_mask(model, 4, 2)


def _assert_same_output(drafted, greedy, what) -> None:
    if isinstance(greedy, torch.Tensor):
        assert torch.equal(drafted, greedy), what
    else:  # return_dict_in_generate: the whole sequences of the search, decoder prompt included
        assert torch.equal(drafted["sequences"], greedy["sequences"]), what


def _assert_exact_with_drafters(model, inputs: dict, seed: int, **kwargs) -> None:
    """Noisy oracle and feature drafter give the model's greedy output; the oracle's drafts are accepted."""
    _run_probes(model)
    greedy, greedy_calls = _counting_calls(model, model.generate, **inputs, **kwargs, **GREEDY)
    oracle = _ReplayingOracle(_greedy_searches(model, inputs, **kwargs), block_size=4, corruption=0.25, seed=seed)
    for name, drafter in (("noisy_oracle", oracle), ("feature", _feature_drafter(model))):
        drafted, calls = _counting_calls(
            model, model.generate, **inputs, **kwargs, custom_generate=blockwise_generate, assistant=drafter, **GREEDY
        )
        _assert_same_output(drafted, greedy, (name, kwargs))
        if name == "noisy_oracle":
            assert calls < greedy_calls, (kwargs, calls, greedy_calls)


_PROMPT = torch.tensor([WHISPER_TOKENS["<|startofprev|>"], 5, 6, 7])  # as WhisperProcessor.get_prompt_ids makes it

WHISPER_OPTIONS = {
    "language_translate": {"language": "de", "task": "translate"},
    "language_per_row": {"language": ["fr", "de", "en", "fr"]},
    "detected_language_transcribe": {"task": "transcribe"},
    "prompt_ids": {"language": "en", "prompt_ids": _PROMPT},
    "timestamps": {"language": "fr", "return_timestamps": True},
    "return_dict": {"language": "de", "return_dict_in_generate": True},
    "segments": {"return_timestamps": True, "return_segments": True},
    "temperature_zero_first": {"temperature": (0.0, 0.2, 0.4)},  # without fallback thresholds: greedy at 0.0
}


@pytest.mark.parametrize("option", list(WHISPER_OPTIONS))
def test_whisper_generate_options_are_exact(media_models, option: str) -> None:
    model = media_models["whisper"]
    for batch_size, seed in ((1, 0), (4, 1)):
        inputs = _audio([1.0, 0.4, 0.7, 0.25][:batch_size], seed)  # short clips padded to the window, with a mask
        kwargs = dict(WHISPER_OPTIONS[option], max_new_tokens=12)
        if isinstance(kwargs.get("language"), list):
            kwargs["language"] = kwargs["language"][:batch_size]
        _assert_exact_with_drafters(model, inputs, seed, **kwargs)


def test_whisper_long_form_is_exact_segment_by_segment(media_models) -> None:
    """Audio longer than the window: Whisper's generate decodes it window by window (each an ordinary greedy search,
    rows leaving the batch as their audio ends), which the loop decodes exactly."""
    model = media_models["whisper"]
    inputs = _audio([2.6, 1.7], seed=5, long_form=True)
    assert inputs["input_features"].shape[-1] > 2 * model.config.max_source_positions
    _assert_exact_with_drafters(model, inputs, seed=5, max_new_tokens=12, return_timestamps=True)
    _assert_exact_with_drafters(model, {"input_features": inputs["input_features"][:1]}, seed=6, max_new_tokens=12)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"condition_on_prev_tokens": True, "return_timestamps": True}, r"condition_on_prev_tokens=True"),
    ],
)
def test_whisper_modes_that_are_not_greedy_are_refused(media_models, options: dict, message: str) -> None:
    model = media_models["whisper"]
    inputs = _audio([2.6, 0.8], seed=7, long_form=True)  # long form: the segment loop with its fallback
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, **options, max_new_tokens=8, custom_generate=blockwise_generate)
    plain = model.generate(**inputs, **options, max_new_tokens=8)  # its own generate still works
    assert plain.shape[0] == 2


def _transcripts(tokens: torch.Tensor, pad_token_id: int) -> list[list[int]]:
    """Each row's tokens without the padding after it (rows of a batch end at different lengths)."""
    return [[token for token in row.tolist() if token != pad_token_id] for row in tokens]


def _scoring_greedy_search(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
    scores: list | None = None, **model_kwargs,
):  # fmt: skip
    """transformers' greedy search as a `custom_generate` that appends its per-step scores to `scores` (Whisper's
    short-form `generate` with `return_dict_in_generate` returns fewer rows than it decodes in transformers 5.23)."""
    config = copy.copy(generation_config)
    config.output_scores = config.return_dict_in_generate = True
    output = GenerationMixin._sample(
        model, input_ids, logits_processor, stopping_criteria, config, synced_gpus, streamer, **model_kwargs
    )
    scores.append((output.sequences, output.scores))
    return output.sequences


def _average_logprobs(model, inputs: dict, **kwargs) -> torch.Tensor:
    """Each row's average log-probability of its first window's greedy tokens, as Whisper's fallback computes it for
    `logprob_threshold` (no row ends early here: checked)."""
    searches: list = []
    model.generate(**inputs, **kwargs, max_new_tokens=12, custom_generate=_scoring_greedy_search, scores=searches)
    sequences, step_scores = searches[0]  # the first search decodes every row's first window
    assert sequences.shape[0] == inputs["input_features"].shape[0]
    scores = torch.stack(step_scores, dim=1)  # (b, T, V)
    tokens = sequences[:, -scores.shape[1] :]
    assert not (tokens == model.generation_config.eos_token_id).any(), "every row decodes its 12 tokens"
    return scores.log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1).mean(dim=1)  # (b,)


def _recording_search(
    model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, streamer=None,
    search=None, searches: list | None = None, **model_kwargs,
):  # fmt: skip
    """`search` (transformers' `_sample`, or the loop) as a `custom_generate` that appends each search's mode and
    whole decoder sequences to `searches`: Whisper's fallback runs one search per window and temperature."""
    output = search(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
    )
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    searches.append((generation_config.do_sample, generation_config.temperature, sequences))
    return output


def _fallback(model, inputs: dict, kwargs: dict, search) -> tuple[list[list[int]], list]:
    """Whisper's fallback with `search` decoding each window, under one seed: the transcripts and the searches."""
    searches: list = []
    torch.manual_seed(3)
    tokens = model.generate(**inputs, **kwargs, custom_generate=_recording_search, search=search, searches=searches)
    return _transcripts(tokens, model.generation_config.pad_token_id), searches


@pytest.mark.parametrize("form", ["short", "long"])
def test_whisper_temperature_fallback_decodes_greedy_windows_as_transformers_and_samples_alike_drafted(
    media_models, form: str
) -> None:
    """Whisper's fallback (`temperature=(0.0, 3.0)`, `logprob_threshold` read from the scores the loop keeps, with
    a compression-ratio threshold no window crosses): the first greedy search and the rows that fall back after it
    are transformers'; the sampled windows (another noise than transformers' stream, so the windows after them
    differ) are the same tokens with drafts as without under one seed."""
    model = media_models["whisper"]
    drafter = _feature_drafter(model)  # built before seeding: it draws its weights
    if form == "short":  # the tiny Whisper's segment loop runs a second window for some rows
        inputs, extra = _audio([1.0, 0.4, 0.7, 0.25], seed=1), {}
    else:
        inputs, extra = _audio([2.6, 1.7, 1.2], seed=5, long_form=True), {"return_timestamps": True}
    logprobs = _average_logprobs(model, inputs, **extra)
    ordered = logprobs.sort().values
    widest = int((ordered[1:] - ordered[:-1]).argmax())
    assert float(ordered[widest + 1] - ordered[widest]) > 1e-3, "a threshold between rows, far from both"
    threshold = float(ordered[widest : widest + 2].mean())  # the rows below it fall back
    kwargs = {"temperature": (0.0, 3.0), "logprob_threshold": threshold, "compression_ratio_threshold": 1e9,
              "max_new_tokens": 12, **extra}  # fmt: skip
    _, expected = _fallback(model, inputs, kwargs, GenerationMixin._sample)
    undrafted, searches = _fallback(model, inputs, kwargs, blockwise_generate)
    drafted, _ = _fallback(model, inputs, kwargs, functools.partial(blockwise_generate, assistant=drafter))
    assert undrafted == drafted
    (greedy, _, first), (sampled, temperature, fallen) = searches[:2]
    assert (greedy, sampled, temperature) == (False, True, 3.0)
    assert torch.equal(first, expected[0][2])  # the first window of every row: transformers' greedy tokens
    assert fallen.shape[0] == int((logprobs < threshold).sum()) == expected[1][2].shape[0]
    assert expected[1][:2] == (True, 3.0)


def test_whisper_beams_are_its_own_beam_search(media_models) -> None:
    """Whisper's generate with beams (short and long form, its segment loop) through the beam loop: its own output."""
    model = media_models["whisper"]
    for inputs in (_audio([0.8, 0.5], seed=14), _audio([2.6, 0.8], seed=15, long_form=True)):
        expected = model.generate(**inputs, num_beams=2, max_new_tokens=8)
        assert torch.equal(model.generate(**inputs, num_beams=2, max_new_tokens=8, custom_generate=blockwise_generate),
                           expected)  # fmt: skip


def test_word_level_timestamps_are_refused() -> None:
    model = build_media_model("whisper")  # a model of its own: this option switches Whisper to eager attention
    model.generation_config.alignment_heads = [[1, 0]]
    inputs = _audio([0.8, 0.5], seed=8)
    options = {"return_token_timestamps": True, "return_timestamps": True, "max_new_tokens": 8, **GREEDY}
    with pytest.raises(ValueError, match=r"return_token_timestamps=True \(word-level timestamps"):
        model.generate(**inputs, **options, custom_generate=blockwise_generate)
    assert "token_timestamps" in model.generate(**inputs, **options)


def test_whether_the_decoder_reads_a_frame_mask_is_probed(media_models) -> None:
    """Whisper's decoder attends to every encoder position (its audio is padded to the window), so the drafters get no
    encoder mask; Speech2Text maps its frame mask onto the encoder output and masks the padded positions."""
    whisper, speech_to_text = media_models["whisper"], media_models["speech_to_text"]
    assert not hf.decoder_reads_frame_mask(whisper, 100, 50)
    assert hf.decoder_reads_frame_mask(speech_to_text, 24, 6)
    states = torch.zeros(2, 50, 32)
    assert hf.encoder_output_mask(whisper, states, torch.ones(2, 100, dtype=torch.long)) is None


def test_a_padded_decoder_prompt_is_refused_and_an_unpadded_mask_is_dropped(media_models) -> None:
    model = media_models["speech_to_text"]
    batch = media_batch("speech_to_text", 2, seed=8)
    prompt = torch.tensor([[2, 5, 6], [2, 7, 8]])
    kwargs = {"decoder_input_ids": prompt, "max_new_tokens": 8, **GREEDY}
    greedy = model.generate(**batch, **kwargs)
    unpadded = model.generate(
        **batch, **kwargs, decoder_attention_mask=torch.ones_like(prompt), custom_generate=blockwise_generate
    )
    assert torch.equal(unpadded, greedy)
    with pytest.raises(ValueError, match="decoder_attention_mask with padding"):
        model.generate(
            **batch, **kwargs, decoder_attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
            custom_generate=blockwise_generate,
        )  # fmt: skip


# --- Pipelines as clients ---------------------------------------------------------------------------------------


def _pipeline_outputs_match(pipe, make_inputs, generate_kwargs: dict, seed: int, **call_kwargs) -> list:
    """The pipeline's output with drafting (noisy oracle, feature drafter) equals its output without; the oracle's
    drafts are accepted. `make_inputs()` gives the pipeline's inputs afresh for each run (a generator is used up)."""
    model = pipe.model

    def run(kwargs: dict) -> list:
        return list(pipe(make_inputs(), generate_kwargs=kwargs, **call_kwargs))

    _run_probes(model)
    greedy, greedy_calls = _counting_calls(model, run, generate_kwargs)
    searches: list[torch.Tensor] = []
    assert run({**generate_kwargs, "custom_generate": _recording_greedy_search, "searches": searches}) == greedy
    oracle = _ReplayingOracle(searches, block_size=4, corruption=0.25, seed=seed)
    for name, drafter in (("noisy_oracle", oracle), ("feature", _feature_drafter(model))):
        drafting = {**generate_kwargs, "custom_generate": blockwise_generate, "assistant": drafter}
        drafted, calls = _counting_calls(model, run, drafting)
        assert drafted == greedy, (name, call_kwargs)
        if name == "noisy_oracle":
            assert calls < greedy_calls, (call_kwargs, calls, greedy_calls)
    return greedy


@pytest.fixture(scope="module")
def speech_recognizer(media_models):
    return pipeline(
        "automatic-speech-recognition", model=media_models["whisper"], tokenizer=whisper_tokenizer(),
        feature_extractor=whisper_feature_extractor(),
    )  # fmt: skip


# The pipeline adds num_beams=5 and max_new_tokens=256 (more than the tiny Whisper's 64 positions) unless told
PIPELINE_GREEDY = {"do_sample": False, "num_beams": 1, "max_new_tokens": 12}


SHORT_CLIPS, LONG_CLIPS = [1.0, 0.4, 0.7, 0.25, 0.9], [2.6, 0.4, 1.7]  # seconds; the window is 1 s


@pytest.mark.parametrize(
    "seconds, call_kwargs, generate_kwargs",
    [
        (SHORT_CLIPS, {"batch_size": 2}, {"language": "de"}),
        (SHORT_CLIPS, {"batch_size": 2, "return_timestamps": True}, {}),
        (LONG_CLIPS, {"batch_size": 3, "chunk_length_s": 1.0}, {}),  # the pipeline's chunks of the window, batched
        (LONG_CLIPS, {"batch_size": 2, "chunk_length_s": 1.0, "return_timestamps": True}, {"task": "transcribe"}),
        # unbatched: batched, transformers 5.23's pipeline fails by itself on these two
        (LONG_CLIPS, {"return_timestamps": True}, {}),  # Whisper's own long-form decoding
        (SHORT_CLIPS[:3], {"return_language": True, "return_timestamps": True}, {}),
    ],
)
def test_speech_recognition_pipeline_is_exact(
    speech_recognizer, seconds: list[float], call_kwargs: dict, generate_kwargs: dict
) -> None:
    clips = _clips(seconds, seed=9)
    outputs = _pipeline_outputs_match(
        speech_recognizer, lambda: clips, {**PIPELINE_GREEDY, **generate_kwargs}, seed=9, **call_kwargs
    )
    assert len({output["text"] for output in outputs}) == len(outputs), "the tiny Whisper should transcribe variedly"


def test_a_sped_up_whisper_runs_its_pipeline_through_the_loop_until_restored(speech_recognizer) -> None:
    """`speed_up(model, drafter)` once: the pipeline built on the model drafts with no generate_kwargs of its own."""
    model, clips = speech_recognizer.model, _clips(SHORT_CLIPS, seed=12)

    def run(kwargs: dict) -> list:
        return list(speech_recognizer(clips, generate_kwargs=kwargs, batch_size=2))

    _run_probes(model)
    greedy, greedy_calls = _counting_calls(model, run, PIPELINE_GREEDY)
    searches: list[torch.Tensor] = []
    run({**PIPELINE_GREEDY, "custom_generate": _recording_greedy_search, "searches": searches})
    with speed_up(model, _ReplayingOracle(searches, block_size=4, corruption=0.25, seed=12), compile=False):
        drafted, calls = _counting_calls(model, run, PIPELINE_GREEDY)
    assert drafted == greedy and calls < greedy_calls
    assert _counting_calls(model, run, PIPELINE_GREEDY) == (greedy, greedy_calls)  # restored


def test_speech_recognition_pipeline_default_beams_run_through_the_beam_loop(speech_recognizer) -> None:
    """The pipeline adds num_beams=5: through the blockwise beam loop, the transcripts of transformers' beam search."""
    clips = _clips([0.5, 0.8, 0.3], seed=10)
    expected = speech_recognizer(clips, generate_kwargs={"max_new_tokens": 12})
    drafting = {"max_new_tokens": 12, "custom_generate": blockwise_generate}
    assert speech_recognizer(clips, generate_kwargs=drafting) == expected
    assert len({output["text"] for output in expected}) == len(expected), "the tiny Whisper should vary"


def test_speech_recognition_pipeline_runs_the_temperature_fallback(speech_recognizer) -> None:
    """The pipeline with Whisper's fallback options: thresholds no transcript crosses give transformers' transcripts;
    thresholds every one crosses sample at the last temperature, the same transcripts with drafts as without."""
    clips = _clips(SHORT_CLIPS, seed=11)
    fallback = {**PIPELINE_GREEDY, "temperature": (0.0, 1.0)}
    never = {**fallback, "compression_ratio_threshold": 1e9, "logprob_threshold": -1e9}
    expected = speech_recognizer(clips, generate_kwargs=never, batch_size=2)
    assert speech_recognizer(clips, generate_kwargs={**never, "custom_generate": blockwise_generate},
                             batch_size=2) == expected  # fmt: skip
    always = {**fallback, "compression_ratio_threshold": 0.0, "custom_generate": blockwise_generate}
    drafter = _feature_drafter(speech_recognizer.model)  # built before seeding: it draws its weights
    sampled = []
    for generate_kwargs in (always, {**always, "assistant": drafter}):
        torch.manual_seed(4)
        sampled.append(speech_recognizer(clips, generate_kwargs=generate_kwargs, batch_size=2))
    assert sampled[0] == sampled[1]
    assert sampled[0] != expected


def test_image_text_to_text_pipeline_is_exact(media_models) -> None:
    """`image-to-text` is gone in transformers 5 (it redirects to `image-text-to-text`). A `VisionEncoderDecoderModel`
    takes the text as its decoder prompt: `DonutProcessor` gives it as `input_ids` (and as `labels`)."""
    image_processor = ViTImageProcessorPil(size={"height": 16, "width": 16})
    processor = DonutProcessor(image_processor=image_processor, tokenizer=word_tokenizer())
    captioner = pipeline("image-text-to-text", model=media_models["vision_trocr"], processor=processor)
    generator = np.random.default_rng(11)
    images = [Image.fromarray(generator.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)) for i in range(5)]
    prompts = ["w5"] * len(images)
    # lists of images and texts: one input, one generate call over all of them
    outputs = _pipeline_outputs_match(captioner, lambda: images, PIPELINE_GREEDY, seed=11, text=prompts)
    assert len({output["generated_text"] for output in outputs}) > 2
    # one input per image, batched by the pipeline
    batched = _pipeline_outputs_match(
        captioner, lambda: ({"images": image, "text": "w5"} for image in images), PIPELINE_GREEDY, seed=12,
        batch_size=2,
    )  # fmt: skip
    assert [output for [output] in batched] == outputs

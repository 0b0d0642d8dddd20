"""Speech tools (issue 19): WAV and audio-folder reading, word error rate, `hf-blockwise demo --task asr` and
`hf-blockwise bench --audio-folder` on a tiny Whisper saved with its processor, feature drafter and clips, the
speech recipe's pieces (without espeak-ng), and the Whisper notebook.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_notebooks import run_notebook, text_output
from transformers import TrainingArguments, WhisperFeatureExtractor, WhisperProcessor
from zoo_media import WHISPER_SAMPLING_RATE, build_media_model, whisper_feature_extractor, whisper_tokenizer

from hf_blockwise import boundary as hf
from hf_blockwise.audio import read_audio_folder, read_wav, write_wav
from hf_blockwise.evaluation.scores import normalize_words, word_error_rate
from hf_blockwise.modeling.config import FeatureDrafterConfig
from hf_blockwise.modeling.feature_model import FeatureDrafterModel
from hf_blockwise.tools.cli import main


def _speech_recipe():
    """`training/train_speech.py` as a module (recipes are scripts that import their neighbours by name)."""
    training = str(Path(__file__).resolve().parents[1] / "training")
    if training not in sys.path:
        sys.path.insert(0, training)
    return importlib.import_module("train_speech")


def _clip(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    time = np.arange(int(seconds * WHISPER_SAMPLING_RATE)) / WHISPER_SAMPLING_RATE
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 800) * time) + 0.05 * rng.standard_normal(len(time))).astype(
        np.float32
    )


@pytest.fixture(scope="module")
def tiny_whisper_dir(tmp_path_factory) -> Path:
    """A tiny Whisper saved like a checkpoint: model, processor, `feature-drafter/` and `clips/` with transcripts."""
    folder = tmp_path_factory.mktemp("tiny-whisper")
    model = build_media_model("whisper")
    model.save_pretrained(folder)
    WhisperProcessor(feature_extractor=whisper_feature_extractor(), tokenizer=whisper_tokenizer()).save_pretrained(
        folder
    )
    feature = FeatureDrafterModel(model, FeatureDrafterConfig(block_size=3, base_model_name_or_path=str(folder)))
    feature.save_pretrained(folder / "feature-drafter")
    clips = folder / "clips"
    clips.mkdir()
    rows = ["file_name,transcription"]
    for index, seconds in enumerate((0.5, 0.8, 0.3, 0.9)):
        write_wav(clips / f"clip{index}.wav", _clip(seconds, index), WHISPER_SAMPLING_RATE)
        rows.append(f"clip{index}.wav,a b c {index}")
    (clips / "metadata.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def test_wav_round_trip_and_resampling(tmp_path) -> None:
    samples = _clip(0.5, 0)
    write_wav(tmp_path / "a.wav", samples, 16000)
    read = read_wav(tmp_path / "a.wav", 16000)
    assert read.shape == samples.shape and np.abs(read - samples).max() < 1e-4  # 16-bit quantization only
    resampled = read_wav(tmp_path / "a.wav", 8000)
    assert resampled.shape == (4000,)
    with pytest.raises(ValueError, match=r"only 16-bit PCM \.wav files.*ffmpeg"):
        read_wav(tmp_path / "a.mp3", 16000)


def test_audio_folder_layout_and_its_errors(tmp_path) -> None:
    write_wav(tmp_path / "x.wav", _clip(0.2, 1), 16000)
    write_wav(tmp_path / "y.wav", _clip(0.2, 2), 16000)
    bare = read_audio_folder(tmp_path)
    assert [example.path.name for example in bare] == ["x.wav", "y.wav"] and bare[0].transcript is None
    (tmp_path / "metadata.csv").write_text("file_name,text\ny.wav,hello there\n", encoding="utf-8")
    assert [(e.path.name, e.transcript) for e in read_audio_folder(tmp_path)] == [("y.wav", "hello there")]
    (tmp_path / "metadata.csv").write_text("file_name,speaker\ny.wav,ann\n", encoding="utf-8")
    with pytest.raises(ValueError, match="needs a file_name column and one of"):
        read_audio_folder(tmp_path)
    (tmp_path / "metadata.csv").write_text("file_name,transcription\nz.wav,missing\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="names files that are not there"):
        read_audio_folder(tmp_path)


def test_word_error_rate() -> None:
    assert normalize_words("A man, walking!") == ["a", "man", "walking"]
    assert word_error_rate(["a man is walking"], ["A man is walking."]) == 0.0
    # one substitution, one deletion over 4 + 2 reference words
    assert word_error_rate(["a man is walking", "two dogs"], ["a man was walking", "two"]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        word_error_rate(["a", "b"], ["a"])


def test_adapters_load_speech_bases_through_their_auto_class(tiny_whisper_dir) -> None:
    assert type(hf.load_encoder_decoder(tiny_whisper_dir)).__name__ == "WhisperForConditionalGeneration"
    feature = FeatureDrafterModel.from_pretrained(tiny_whisper_dir / "feature-drafter")
    assert type(feature.base_model).__name__ == "WhisperForConditionalGeneration"


def test_asr_demo_prints_identical_transcripts(tiny_whisper_dir, capsys) -> None:
    status = main(["demo", "--task", "asr", "--model", str(tiny_whisper_dir), "--repeats", "1", "--no-compile",
                   "--max-new-tokens", "12"])  # fmt: skip
    output = capsys.readouterr().out
    assert status == 0, output
    assert "identical outputs: 4/4" in output and "clip2.wav (a b c 2)" in output
    status = main(["demo", "--task", "asr", "--model", str(tiny_whisper_dir), "--repeats", "1", "--no-compile",
                   "--max-new-tokens", "12", "--num-beams", "2"])  # fmt: skip
    output = capsys.readouterr().out
    assert status == 0 and "beam 2:" in output and "identical outputs: 4/4" in output, output
    with pytest.raises(SystemExit):
        main(["demo", "--task", "asr", "--int8"])
    with pytest.raises(SystemExit):  # no model at that path: a usage error naming it, not a traceback
        main(["demo", "--task", "asr", "--model", str(tiny_whisper_dir / "missing")])
    assert "no speech model at" in capsys.readouterr().err


def test_the_shipped_speech_model_demo_runs_offline(capsys) -> None:
    """`hf-blockwise demo --task asr` on the shipped model, its feature drafter and clips: identical transcripts."""
    assert main(["demo", "--task", "asr", "--repeats", "1", "--no-compile"]) == 0
    output = capsys.readouterr().out
    assert "identical outputs: 4/4" in output and "feature drafter, k=" in output and "speedup" in output


def test_bench_reads_an_audio_folder_and_reports_wer(tiny_whisper_dir, tmp_path, capsys) -> None:
    out = tmp_path / "bench"
    status = main([
        "bench", "--model", str(tiny_whisper_dir), "--audio-folder", str(tiny_whisper_dir / "clips"), "--modes",
        "greedy", "feature", "oracle", "ct2", "--batch-sizes", "1", "3", "--max-new-tokens", "12", "--out", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0
    assert "skipping ct2: the bench runs CTranslate2 on text inputs only" in printed
    report = json.loads((out / "bench.json").read_text())
    rows = {(row["batch_size"], row["mode"]): row for row in report["results"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in ("greedy", "feature", "oracle_k4")}
    for row in rows.values():
        assert row["identical"] == row["compared"] == 4, row
        assert row["wer"] is not None and row["wer"] >= 0.5  # a random model does not transcribe
    assert "WER" in (out / "bench.md").read_text()
    with pytest.raises(SystemExit, match="pass --audio-folder"):
        main(["bench", "--model", str(tiny_whisper_dir), "--out", str(tmp_path / "x")])


def test_speech_recipe_pieces_train_a_step(tmp_path) -> None:
    """Tokenizer, model and collator of `training/train_speech.py` (espeak-ng is only needed for the audio)."""
    recipe = _speech_recipe()
    texts = ["a man is walking", "two dogs play in the snow", "a woman reads a book"] * 5
    tokenizer = recipe.build_tokenizer(texts, vocab_size=300, folder=tmp_path / "processor")
    assert tokenizer.decode(tokenizer.encode(" two dogs", add_special_tokens=False)) == " two dogs"
    args = recipe.TrainSpeechArguments(d_model=64, encoder_layers=1, decoder_layers=1, window_seconds=1)
    model = recipe.build_model(args, tokenizer)
    assert model.config.max_source_positions == 25  # 1 s of 20 ms hops, halved by the second convolution
    extractor = WhisperFeatureExtractor(feature_size=80, hop_length=320, chunk_length=1)
    collator = recipe.SpeechCollator(extractor, tokenizer)
    batch = collator([(_clip(0.4, 0), texts[0]), (_clip(0.3, 1), texts[1])])
    assert batch["input_features"].shape == (2, 80, 50)
    notimestamps = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    assert batch["labels"][0, 0] == notimestamps and batch["labels"][0, -1] == -100  # row 0 is the shorter text
    assert batch["labels"][1, -1] == tokenizer.eos_token_id
    characters = recipe.CTC_ALPHABET
    assert batch["ctc_lengths"].tolist() == [len(texts[0]), len(texts[1])]
    assert "".join(characters[i] for i in batch["ctc_targets"][: len(texts[0])]) == texts[0]
    model.ctc_head = torch.nn.Linear(64, len(characters) + 1)
    arguments = TrainingArguments(tmp_path / "t", report_to=[])
    trainer = recipe.CTCAuxiliaryTrainer(model=model, args=arguments, ctc_weight=1.0)
    model.eval()  # no SpecAugment, which masks the features in place
    plain = model(input_features=batch["input_features"], labels=batch["labels"]).loss
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    assert torch.isfinite(loss) and loss > plain  # the CTC term is added


def test_whisper_notebook_runs(tiny_whisper_dir, tmp_path) -> None:
    notebook = run_notebook(
        "whisper_feature_drafter.ipynb",
        {
            "MODEL_NAME": str(tiny_whisper_dir),
            "DATASET": str(tiny_whisper_dir / "clips"),
            "TRAIN_EXAMPLES": 2,
            "EVAL_EXAMPLES": 2,
            "MAX_STEPS": 2,
            "BATCH_SIZE": 2,
            "OUTPUT_DIR": str(tmp_path / "run"),
        },
        tmp_path,
    )
    output = text_output(notebook)
    assert "identical transcripts: 2/2" in output
    assert "reloaded drafter exact: True" in output
    assert (tmp_path / "run" / "final" / "feature_drafter_config.json").is_file()

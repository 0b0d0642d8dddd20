"""Audio for the speech demo and bench: 16-bit PCM WAV files and folders of them with transcripts (the `audiofolder`
layout of `datasets`). Word error rate is scored in [`hf_blockwise.evaluation.scores`].

WAV is read and written with the standard library's `wave`, so no audio package is needed; other formats are an
error that says how to convert them.
"""

from __future__ import annotations

import csv
import os
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_blockwise.serialization import atomic_write

TRANSCRIPT_COLUMNS = ("transcription", "text", "sentence", "transcript")


def read_wav(path: str | os.PathLike, sampling_rate: int) -> np.ndarray:
    """Mono float32 samples in [-1, 1] of a 16-bit PCM WAV file, resampled to `sampling_rate`.

    Returns:
        `np.ndarray` of shape `(samples,)`. Stereo is averaged to mono.
    """
    path = Path(path)
    if path.suffix.lower() != ".wav":
        raise ValueError(f"{path}: only 16-bit PCM .wav files are read; convert with `ffmpeg -i {path.name} out.wav`")
    with wave.open(str(path), "rb") as handle:
        if handle.getsampwidth() != 2:
            raise ValueError(f"{path}: {8 * handle.getsampwidth()}-bit samples; only 16-bit PCM is read")
        rate, channels = handle.getframerate(), handle.getnchannels()
        samples = np.frombuffer(handle.readframes(handle.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != sampling_rate:
        # imported here: scipy.signal costs ~0.4 s to import, and every CLI start loads this module
        from scipy.signal import resample_poly

        divisor = np.gcd(rate, sampling_rate)
        samples = resample_poly(samples, sampling_rate // divisor, rate // divisor).astype(np.float32)
    return samples


def write_wav(path: str | os.PathLike, samples: np.ndarray, sampling_rate: int) -> None:
    """Writes mono float samples in [-1, 1] as a 16-bit PCM WAV file, atomically."""
    pcm = (np.clip(samples, -1.0, 32767 / 32768) * 32768).astype(np.int16)

    def write(tmp_path: str) -> None:
        with wave.open(tmp_path, "wb") as handle:
            handle.setnchannels(1)
            handle.setsampwidth(2)
            handle.setframerate(sampling_rate)
            handle.writeframes(pcm.tobytes())

    atomic_write(path, write)


@dataclass(frozen=True)
class AudioExample:
    """One audio file and its reference transcript (`None` when the folder has none)."""

    path: Path
    transcript: str | None


def read_audio_folder(folder: str | os.PathLike) -> list[AudioExample]:
    """The `.wav` files of `folder`, with transcripts from its `metadata.csv` when there is one.

    `metadata.csv` follows `datasets`' audiofolder layout: a `file_name` column and a transcript column named
    `transcription`, `text`, `sentence` or `transcript`. Without it the files are read in name order with no
    references (the bench then reports no WER).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no audio folder at {folder}")
    metadata = folder / "metadata.csv"
    if not metadata.is_file():
        files = sorted(folder.glob("*.wav"))
        if not files:
            raise ValueError(f"{folder} has no .wav files and no metadata.csv")
        return [AudioExample(path, None) for path in files]
    with metadata.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns = set(rows[0]) if rows else set()
    column = next((name for name in TRANSCRIPT_COLUMNS if name in columns), None)
    if "file_name" not in columns or column is None:
        raise ValueError(
            f"{metadata} needs a file_name column and one of {list(TRANSCRIPT_COLUMNS)}; it has {sorted(columns)}"
        )
    examples = [AudioExample(folder / row["file_name"], row[column]) for row in rows]
    missing = [str(example.path) for example in examples if not example.path.is_file()]
    if missing:
        raise FileNotFoundError(f"{metadata} names files that are not there: {missing[:3]}")
    return examples

"""Synthetic English speech for the speech recipe (`train_speech.py`): espeak-ng speaks sentences from the shared data
sets with varied voices, rates and pitch; noise is added when batches are made.

espeak-ng is a system program: `apt-get install espeak-ng` (Debian/Ubuntu) or `brew install espeak-ng`. Its
22,050 Hz output is resampled to 16 kHz (`scipy.signal.resample_poly`). A voice is an accent (`en-us`, `en-gb`...)
with a variant (`m3`, `f2`, `klatt`...); held-out utterances use variants never heard in training, and sentences
from the corpora's dev splits.

Each split is stored as one int16 array of all utterances back to back (`<split>.audio.npy`), their offsets
(`<split>.offsets.npy`) and one JSON line per utterance (`<split>.jsonl`: text, voice, rate, pitch), each file
written atomically, so an interrupted synthesis restarts cleanly.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly
from tqdm.auto import tqdm

from hf_blockwise.serialization import atomic_write, atomic_write_text

SAMPLING_RATE = 16_000
ESPEAK_RATE = 22_050
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029")
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "f1", "f2", "f3", "f4", "klatt", "klatt2", "klatt4", "Andy", "Annie")
HELDOUT_VARIANTS = ("m6", "m7", "f5", "klatt3")
# held-out sentences come from the dev splits: never in training
DEV_FILES = {
    "multi30k_en": ("multi30k/val.en.gz", "text"),
    "europarl_en": ("europarl_de_en/validation.en", "text"),
    "gec_wi_tgt": ("gec_wi_locness/dev.tgt.gz", "text"),
    "bible_en": ("bible_kjv_asv/dev.src", "bible"),
    "dialogsum_summary": ("dialogsum/dialogsum.dev.jsonl.gz", "summary"),
}
_NOT_SPOKEN = re.compile(r"[^a-z' ]+")


def normalize_transcript(text: str) -> str:
    """Lower case, letters, apostrophes and single spaces: what the model learns to write, and what WER compares."""
    return " ".join(_NOT_SPOKEN.sub(" ", text.lower().replace("’", "'")).split())


def speakable(text: str, min_words: int, max_words: int) -> str | None:
    """The normalized sentence, or `None` when it has digits (espeak reads them as words) or the wrong length."""
    if any(character.isdigit() for character in text):
        return None
    normalized = normalize_transcript(text)
    return normalized if min_words <= len(normalized.split()) <= max_words else None


@dataclass(frozen=True)
class Utterance:
    """One sentence and how it is spoken."""

    text: str
    voice: str
    rate: int  # words per minute
    pitch: int  # 0-99
    gap: int  # extra pause between words, in 10 ms units


def plan_utterances(texts: Sequence[str], variants: Sequence[str], seed: int) -> list[Utterance]:
    """A random voice, rate and pitch for each text."""
    rng = random.Random(seed)
    return [
        Utterance(
            text=text,
            voice=f"{rng.choice(ACCENTS)}+{rng.choice(variants)}",
            rate=rng.randint(140, 195),
            pitch=rng.randint(25, 75),
            gap=rng.choice((0, 0, 0, 1, 2)),
        )
        for text in texts
    ]


def speak(utterance: Utterance) -> np.ndarray:
    """16 kHz int16 samples of the utterance. Raises `RuntimeError` with espeak-ng's message if it fails."""
    command = ["espeak-ng", "-v", utterance.voice, "-s", str(utterance.rate), "-p", str(utterance.pitch)]
    command += ["-g", str(utterance.gap), "--stdout", utterance.text]
    result = subprocess.run(command, capture_output=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"espeak-ng failed on {utterance}: {result.stderr.decode(errors='replace')}")
    # a WAV streamed to stdout has a 44-byte header whose length fields are placeholders: read past it
    samples = np.frombuffer(result.stdout[44:], dtype=np.int16).astype(np.float32)
    resampled = resample_poly(samples, SAMPLING_RATE // 50, ESPEAK_RATE // 50)  # 320 / 441
    return np.clip(resampled, -32768, 32767).astype(np.int16)


def _speak_all(utterances: Sequence[Utterance]) -> list[np.ndarray]:
    return [speak(utterance) for utterance in utterances]


def synthesize_split(
    folder: Path, split: str, utterances: Sequence[Utterance], max_seconds: float, workers: int = 2
) -> int:
    """Speaks `utterances` into `folder/<split>.*`, dropping those longer than `max_seconds`; returns how many were
    kept. Does nothing when the split is already there."""
    if (folder / f"{split}.jsonl").is_file():
        return sum(1 for _ in (folder / f"{split}.jsonl").open(encoding="utf-8"))
    if shutil.which("espeak-ng") is None:
        raise FileNotFoundError("espeak-ng is not installed: `apt-get install espeak-ng` (or `brew install espeak-ng`)")
    chunks = [list(utterances[start : start + 200]) for start in range(0, len(utterances), 200)]
    kept: list[tuple[Utterance, np.ndarray]] = []
    with ProcessPoolExecutor(workers) as pool, tqdm(total=len(utterances), desc=f"speaking {split}") as bar:
        for chunk, audios in zip(chunks, pool.map(_speak_all, chunks), strict=True):
            kept += [(u, a) for u, a in zip(chunk, audios, strict=True) if len(a) <= max_seconds * SAMPLING_RATE]
            bar.update(len(chunk))
    offsets = np.cumsum([0] + [len(audio) for _, audio in kept]).astype(np.int64)
    for name, array in (("audio", np.concatenate([audio for _, audio in kept])), ("offsets", offsets)):
        atomic_write(folder / f"{split}.{name}.npy", lambda tmp_path, array=array: _save_npy(tmp_path, array))
    lines = [json.dumps(asdict(utterance)) for utterance, _ in kept]
    atomic_write_text(folder / f"{split}.jsonl", "\n".join(lines) + "\n")  # last: marks the split as done
    return len(kept)


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a file handle: np.save on a path would append ".npy"
        np.save(handle, array)


class SpeechSplit:
    """A synthesized split, memory-mapped: `split[i]` is (float32 samples in [-1, 1], text)."""

    def __init__(self, folder: Path, split: str) -> None:
        self.audio = np.load(folder / f"{split}.audio.npy", mmap_mode="r")
        self.offsets = np.load(folder / f"{split}.offsets.npy")
        with (folder / f"{split}.jsonl").open(encoding="utf-8") as handle:
            self.utterances = [Utterance(**json.loads(line)) for line in handle]

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, index: int) -> tuple[np.ndarray, str]:
        samples = self.audio[self.offsets[index] : self.offsets[index + 1]].astype(np.float32) / 32768.0
        return samples, self.utterances[index].text


def add_noise(samples: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """White or brown noise at `snr_db` below the signal's power."""
    noise = rng.standard_normal(len(samples)).astype(np.float32)
    if rng.random() < 0.5:  # brown: low-frequency rumble
        noise = np.cumsum(noise)
        noise -= np.linspace(noise[0], noise[-1], len(noise), dtype=np.float32)
    power = float(np.mean(samples**2)) + 1e-10
    noise *= np.sqrt(power / (float(np.mean(noise**2)) + 1e-10) / 10 ** (snr_db / 10))
    return samples + noise

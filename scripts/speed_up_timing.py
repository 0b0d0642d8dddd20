"""`speed_up(model, drafter)` on the shipped multi30k-en-de with its feature drafter: the first sped-up `generate`'s
time (it compiles) and the steady state on 30 Multi30k test_2016 captions decoded one at a time, against plain
`generate`, 2 threads; writes docs/bench/speed-up-multi30k/report.txt. From the repository root:
`python scripts/speed_up_timing.py` (the CPU's name is added by hand where `platform` gives none)."""

from __future__ import annotations

import platform
import time

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_blockwise import FeatureDrafterModel, speed_up
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.text_files import read_lines

PATH = "hf_blockwise/pretrained/multi30k-en-de"
CAPTIONS = "../shared/data/multi30k/test_2016_flickr.en.gz"
REPORT = "docs/bench/speed-up-multi30k/report.txt"


def main() -> None:
    torch.set_num_threads(2)
    captions = read_lines(CAPTIONS)[:30]  # as the bench reads its sources
    tokenizer, model = AutoTokenizer.from_pretrained(PATH), AutoModelForSeq2SeqLM.from_pretrained(PATH)

    def decode_all() -> tuple[float, list[torch.Tensor]]:
        started = time.perf_counter()
        outputs = [model.generate(**tokenizer([caption], return_tensors="pt")) for caption in captions]
        return time.perf_counter() - started, outputs

    decode_all()  # warm-up
    plain_seconds, plain = decode_all()
    speed_up(model, FeatureDrafterModel.from_pretrained(f"{PATH}/feature-drafter", base_model=model))
    started = time.perf_counter()
    model.generate(**tokenizer([captions[0]], return_tensors="pt"))  # compiles
    first = time.perf_counter() - started
    fast_seconds, fast = decode_all()
    same = sum(torch.equal(a, b) for a, b in zip(plain, fast, strict=True))
    report = (
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 2 threads\n"
        f"{PATH}: first sped-up generate {first:.1f} s; 30 captions one at a time: plain generate "
        f"{plain_seconds:.2f} s, sped up {fast_seconds:.2f} s ({plain_seconds / fast_seconds:.2f}x), identical "
        f"{same}/30\n"
    )
    print(report, end="")
    atomic_write_text(REPORT, report)


if __name__ == "__main__":
    main()

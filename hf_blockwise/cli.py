"""`hf-blockwise` console script."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

DEMO_SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two children are playing in the sand at the beach.",
    "A woman with a red hat is riding a bicycle down the street.",
    "A group of people are sitting around a table outside.",
    "A black dog is running through the grass.",
    "A young girl is climbing a rock wall.",
]

SHIPPED_MODEL = os.path.join(os.path.dirname(__file__), "pretrained", "multi30k-en-de")


def _median_seconds(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_demo(
    model_path: str, sentences: Sequence[str], repeats: int, threads: int | None, max_new_tokens: int = 128
) -> int:
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from .modeling import BlockwiseHeadsModel

    transformers_logging.set_verbosity_error()  # the demo's own output is the point
    if threads:
        torch.set_num_threads(threads)
    if not os.path.isdir(model_path):
        raise SystemExit(f"No checkpoint at {model_path}: pass --model DIR holding a base model, heads and tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # stored in fp16 to stay small; CPU matmuls are fast in fp32
    model = BlockwiseHeadsModel.from_pretrained(model_path, dtype=torch.float32).eval()
    base = model.base_model
    block_size = model.blockwise_config.block_size
    print(f"model: {model_path} (block size k={block_size}), {torch.get_num_threads()} threads, batch 1")

    greedy_outputs, blockwise_outputs, accepted = [], [], []
    greedy_time = blockwise_time = 0.0
    for sentence in sentences:
        inputs = tokenizer([sentence], return_tensors="pt")
        greedy = base.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, return_dict_in_generate=True)
        greedy_outputs.append(greedy)
        blockwise_outputs.append(output.sequences)
        accepted.append(output.decoding_stats.accepted)
        greedy_time += _median_seconds(
            lambda inputs=inputs: base.generate(**inputs, max_new_tokens=max_new_tokens), repeats
        )
        blockwise_time += _median_seconds(
            lambda inputs=inputs: model.generate(**inputs, max_new_tokens=max_new_tokens), repeats
        )

    identical = 0
    for sentence, greedy, blockwise in zip(sentences, greedy_outputs, blockwise_outputs, strict=True):
        same = torch.equal(greedy, blockwise)
        identical += same
        print(f"\nsource:    {sentence}")
        print(f"greedy:    {tokenizer.decode(greedy[0], skip_special_tokens=True)}")
        print(f"blockwise: {tokenizer.decode(blockwise[0], skip_special_tokens=True)}   [identical: {same}]")
    all_accepted = torch.cat([steps.flatten() for steps in accepted])
    mean_accepted = float(all_accepted[all_accepted > 0].float().mean())
    print(f"\nidentical outputs: {identical}/{len(sentences)}")
    print(f"mean accepted block: {mean_accepted:.2f} tokens per decoder call")
    print(
        f"time (sum of per-sentence medians over {repeats} runs): greedy {greedy_time:.3f}s, "
        f"blockwise {blockwise_time:.3f}s, speedup {greedy_time / blockwise_time:.2f}x"
    )
    return 0 if identical == len(sentences) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-blockwise", description="Exact blockwise parallel decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="translate a few sentences, greedy and blockwise side by side")
    demo.add_argument("--model", default=SHIPPED_MODEL, help="directory with base model, heads and tokenizer")
    demo.add_argument("--repeats", type=int, default=5, help="timing runs per sentence (median is reported)")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    demo.add_argument("sentences", nargs="*", help="English sentences to translate (default: built-in examples)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args.model, args.sentences or DEMO_SENTENCES, args.repeats, args.threads, args.max_new_tokens)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

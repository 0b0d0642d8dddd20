"""`hf-blockwise` console script."""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    model_path: str,
    sentences: Sequence[str],
    repeats: int,
    threads: int | None,
    max_new_tokens: int = 128,
    int8: bool = False,
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
    if int8:
        from .quantization import quantize_dynamic_int8

        quantize_dynamic_int8(model)  # greedy below is then the int8 model's greedy too
    base = model.base_model
    block_size = model.blockwise_config.block_size
    precision = "int8" if int8 else "fp32"
    print(f"model: {model_path} (block size k={block_size}, {precision}), {torch.get_num_threads()} threads, batch 1")

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


# where a model directory keeps its non-autoregressive drafter, if it ships one
NAR_DRAFTER_SUBDIR = "nar-drafter"


def load_for_bench(
    model_path: str,
    assistant_path: str | None,
    max_new_tokens: int,
    iad_max_draft_length: int = 32,
    nar_drafter_path: str | None = None,
):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from .bench import BenchSetup
    from .config import CONFIG_NAME
    from .modeling import BlockwiseHeadsModel
    from .nar_drafter import NAR_CONFIG_NAME, NonAutoregressiveDrafter

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    heads_model = None
    if os.path.isfile(os.path.join(model_path, CONFIG_NAME)):
        heads_model = BlockwiseHeadsModel.from_pretrained(model_path, dtype=torch.float32).eval()
        base = heads_model.base_model
    else:
        base = AutoModelForSeq2SeqLM.from_pretrained(model_path, dtype=torch.float32).eval()
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
    return BenchSetup(
        base=base, tokenizer=tokenizer, heads_model=heads_model, assistant_model=assistant,
        max_new_tokens=max_new_tokens, iad_max_draft_length=iad_max_draft_length, nar_drafter=nar_drafter,
    )  # fmt: skip


def run_bench_command(args: argparse.Namespace) -> int:
    from transformers.utils import logging as transformers_logging

    from .bench import DEFAULT_MODES, FAST_PATH_MODES, read_lines, run_bench, speedup_ceiling, write_report

    transformers_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sentences = min(args.sentences or 16, 16)
    if args.source_file:
        sources = read_lines(args.source_file)
        references = read_lines(args.reference_file) if args.reference_file else None
    else:
        sources, references = list(DEMO_SENTENCES), None
    if references is not None and len(references) != len(sources):
        raise SystemExit(f"{len(sources)} source lines but {len(references)} reference lines")
    if args.sentences:
        sources = sources[: args.sentences]
        references = references[: args.sentences] if references is not None else None
    setup = load_for_bench(
        args.model, args.assistant_model, args.max_new_tokens, args.iad_max_draft_length, args.nar_drafter
    )
    setup = dataclasses.replace(
        setup, gad_block_size=args.gad_block_size, gad_top_beta=args.gad_top_beta, gad_tolerance=args.gad_tolerance
    )
    curve = write_cost_curve(setup, sources[0], args.out) if args.cost_curve else None
    modes = args.modes or list(FAST_PATH_MODES if args.fast_path else DEFAULT_MODES)
    results = run_bench(setup, sources, references, modes, args.batch_sizes)
    if curve is not None:
        # modes whose every step feeds the same number of tokens; IAD's width follows the source, so it has none
        widths = {}
        if setup.heads_model is not None:
            widths["heads"] = setup.heads_model.blockwise_config.block_size
        if setup.nar_drafter is not None:
            widths["gad"] = setup.gad_block_size or setup.nar_drafter.block_size
        for result in results:
            family = "gad" if result.mode.startswith("gad") else result.mode.split("_")[0]
            if family in widths and result.batch_size == 1:
                mean_accepted = result.summary()["mean_accepted"]
                result.speedup_ceiling = speedup_ceiling(curve, mean_accepted, widths[family])
    settings = {
        "model": args.model,
        "nar_drafter": args.nar_drafter,
        "gad_block_size": args.gad_block_size,
        "gad_top_beta": args.gad_top_beta,
        "gad_tolerance": args.gad_tolerance,
        "source_file": args.source_file,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "batch_sizes": args.batch_sizes,
        "max_new_tokens": args.max_new_tokens,
        "device": str(next(setup.base.parameters()).device),
    }
    header = (
        f"# hf-blockwise bench: {os.path.basename(os.path.normpath(args.model))}, {len(sources)} sentences, "
        f"{settings['threads']} threads, {settings['device']}"
    )
    write_report(results, args.out, header, settings)
    with open(os.path.join(args.out, "bench.md"), encoding="utf-8") as report:
        print(report.read())
    return 0


def write_cost_curve(setup, sentence: str, out_dir: str) -> list[tuple[int, float]]:
    from .bench import decoder_cost_curve, plot_cost_curve
    from .serialization import atomic_write_text

    curve = decoder_cost_curve(setup.base, setup.tokenizer, sentence)
    os.makedirs(out_dir, exist_ok=True)
    report = {"sentence": sentence, "threads": torch.get_num_threads(), "ms_per_call": {n: 1000 * t for n, t in curve}}
    atomic_write_text(os.path.join(out_dir, "cost_curve.json"), json.dumps(report, indent=2) + "\n")
    plot_cost_curve(curve, os.path.join(out_dir, "cost_curve.png"))
    print("decoder cost curve (ms per call by tokens fed): " + ", ".join(f"{n}: {1000 * t:.2f}" for n, t in curve[:8]))
    return curve


def main(argv: Sequence[str] | None = None) -> int:
    from .bench import DEFAULT_MODES, FAST_PATH_MODES, MODE_NAMES

    parser = argparse.ArgumentParser(prog="hf-blockwise", description="Exact blockwise parallel decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="translate a few sentences, greedy and blockwise side by side")
    demo.add_argument("--model", default=SHIPPED_MODEL, help="directory with base model, heads and tokenizer")
    demo.add_argument("--repeats", type=int, default=5, help="timing runs per sentence (median is reported)")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    demo.add_argument("--int8", action="store_true", help="quantize the base to int8 first (CPU; both modes)")
    demo.add_argument("sentences", nargs="*", help="English sentences to translate (default: built-in examples)")
    bench = commands.add_parser("bench", help="every decoding mode side by side, measured against greedy")
    bench.add_argument("--model", default=SHIPPED_MODEL, help="seq2seq model directory, with or without heads")
    bench.add_argument(
        "--assistant-model",
        default=None,
        help="small seq2seq model for transformers' assisted generation (a NAR drafter directory works too)",
    )
    bench.add_argument("--source-file", default=None, help="one source per line (.gz allowed); default: demo")
    bench.add_argument("--reference-file", default=None, help="references for BLEU, line by line")
    bench.add_argument("--sentences", type=int, default=None, help="use the first N sources")
    bench.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    bench.add_argument(
        "--modes", nargs="+", default=None, choices=MODE_NAMES, help="default: " + " ".join(DEFAULT_MODES)
    )
    bench.add_argument(
        "--fast-path",
        action="store_true",
        help="the CPU fast path step by step: " + ", then ".join(FAST_PATH_MODES) + " (int8 needs a CPU)",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--iad-max-draft-length", type=int, default=32, help="source tokens IAD drafts per step")
    bench.add_argument(
        "--nar-drafter",
        default=None,
        help=f"non-autoregressive drafter for the gad modes (default: <model>/{NAR_DRAFTER_SUBDIR} if present)",
    )
    bench.add_argument("--gad-block-size", type=int, default=None, help="tokens per GAD step (default: trained)")
    bench.add_argument("--gad-top-beta", type=int, default=3, help="GAD++ top-beta")
    bench.add_argument("--gad-tolerance", type=float, default=1.0, help="GAD++ log-likelihood tolerance tau")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 = Devlin's words/s)")
    bench.add_argument("--out", default="bench", help="directory for bench.json, bench.md, bench.png")
    bench.add_argument("--quick", action="store_true", help="at most 16 sentences: a run of about a minute")
    bench.add_argument("--cost-curve", action="store_true", help="also time one decoder call for 1..32 tokens")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "demo":
        sentences = args.sentences or DEMO_SENTENCES
        return run_demo(args.model, sentences, args.repeats, args.threads, args.max_new_tokens, args.int8)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

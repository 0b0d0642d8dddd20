"""GAD and GAD++ sweeps over block size k, top-β and tolerance τ (the shapes of Ge et al.'s Tables 5–7).

Every setting decodes the same sentences at batch 1 beside one greedy run, batch by batch, so each speedup
is a ratio measured in the same run. Writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` into ``--out``.

Command behind ``docs/bench/gad-sweep`` (from the repository root, 6 minutes on a 2-core CPU)::

    python scripts/gad_sweep.py --model hf_blockwise/pretrained/multi30k-en-de \
        --source-file ../shared/data/multi30k/test_2016_flickr.en.gz \
        --reference-file ../shared/data/multi30k/test_2016_flickr.de.gz --sentences 300 --threads 2 \
        --out docs/bench/gad-sweep
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise.evaluation import ModeResult
from hf_blockwise.loading import load_model
from hf_blockwise.serialization import atomic_write, atomic_write_text
from hf_blockwise.text_files import read_lines
from hf_blockwise.tools.bench import BenchSetup, run_bench
from hf_blockwise.training.arguments import parse_dataclass_args


@dataclass
class GADSweepArguments:
    """Command-line flags of the sweep; each field is ``--field-name`` (or ``--field_name``)."""

    model: str = field(
        default="hf_blockwise/pretrained/multi30k-en-de", metadata={"help": "the verifier (a shipped model folder)"}
    )
    nar_drafter: str | None = field(default=None, metadata={"help": "unset: <model>/nar-drafter"})
    source_file: str = field(kw_only=True, metadata={"help": "source sentences, one per line (.gz: gzip)"})
    reference_file: str | None = field(default=None, metadata={"help": "references for BLEU, one per line"})
    sentences: int = field(default=300, metadata={"help": "decode the first N sentences"})
    block_sizes: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6, 8], metadata={"help": "exact GAD's k"})
    betas: list[int] = field(default_factory=lambda: [1, 2, 3, 5], metadata={"help": "GAD++ top-β (τ fixed)"})
    taus: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 3.0], metadata={"help": "GAD++ τ (β fixed)"})
    gad_pp_block_size: int | None = field(
        default=None, metadata={"help": "k of the GAD++ runs (unset: the largest of --block-sizes)"}
    )
    fixed_beta: int = field(default=3, metadata={"help": "GAD++ top-β while τ varies"})
    fixed_tau: float = field(default=2.0, metadata={"help": "GAD++ τ while β varies"})
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads"})
    max_new_tokens: int = field(default=128, metadata={"help": "length limit of every decoding"})
    out: str = field(default="docs/bench/gad-sweep", metadata={"help": "folder for sweep.json, sweep.md, sweep.png"})


def parse_args(argv: Sequence[str] | None = None) -> GADSweepArguments:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into `GADSweepArguments`."""
    return parse_dataclass_args(GADSweepArguments, argv, __doc__.split("\n", 1)[0])


def variants(setup, block_sizes, pp_block_size, betas, taus, fixed_beta, fixed_tau) -> dict:
    """Exact GAD at each block size, then GAD++ over β (τ fixed) and over τ (β fixed), by run name."""
    runs = {f"gad k={k}": ("gad", dataclasses.replace(setup, gad_block_size=k)) for k in block_sizes}
    loose = [(beta, fixed_tau) for beta in betas] + [(fixed_beta, tau) for tau in taus]
    for beta, tau in loose:
        name = f"gad++ k={pp_block_size} β={beta} τ={tau:g}"
        loose_setup = dataclasses.replace(setup, gad_block_size=pp_block_size, gad_top_beta=beta, gad_tolerance=tau)
        runs.setdefault(name, ("gad_pp", loose_setup))
    return runs


def table(results: Sequence[ModeResult]) -> str:
    lines = [
        "| run | speedup vs greedy | mean accepted | decoder calls / token | identical to greedy | BLEU |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        figures = result.summary()
        bleu = "" if result.bleu is None else f"{result.bleu:.2f}"
        lines.append(
            f"| {result.mode} | {result.speedup:.2f}x | {figures['mean_accepted']:.2f} | "
            f"{figures['forwards_per_token']:.2f} | {result.identical}/{result.sentences} | {bleu} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[ModeResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = [r for r in results if r.mode.startswith("gad k=")]
    loose = [r for r in results if r.mode.startswith("gad++")]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ks = [int(r.mode.split("=")[1]) for r in exact]
    axes[0].plot(ks, [r.speedup for r in exact], "o-", label="speedup vs greedy")
    axes[0].plot(ks, [r.summary()["mean_accepted"] for r in exact], "s--", label="mean accepted")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_xlabel("block size k (exact GAD)")
    axes[0].legend()
    axes[1].scatter([r.speedup for r in loose], [r.bleu for r in loose])
    for result in loose:
        axes[1].annotate(result.mode.split(" ", 2)[2], (result.speedup, result.bleu), fontsize=7)
    greedy = next(r for r in results if r.mode == "greedy")
    axes[1].axhline(greedy.bleu, color="grey", linewidth=0.8, label="greedy BLEU")
    axes[1].set_xlabel("speedup vs greedy (GAD++)")
    axes[1].set_ylabel("BLEU")
    axes[1].legend()
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    transformers_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    sources = read_lines(args.source_file)[: args.sentences]
    references = read_lines(args.reference_file)[: args.sentences] if args.reference_file else None
    setup = BenchSetup(load_model(args.model, nar_drafter_path=args.nar_drafter), args.max_new_tokens)
    if setup.loaded.nar_model is None:
        raise SystemExit(f"{args.model} ships no nar-drafter; pass --nar-drafter")
    pp_block_size = args.gad_pp_block_size or max(args.block_sizes)
    runs = variants(setup, args.block_sizes, pp_block_size, args.betas, args.taus, args.fixed_beta, args.fixed_tau)
    results = run_bench(setup, sources, references, ["greedy"], [1], variants=runs)
    os.makedirs(args.out, exist_ok=True)
    settings = {
        "model": args.model,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "batch_size": 1,
        "device": str(next(setup.loaded.base.parameters()).device),
        "drafter_block_size": setup.loaded.nar_model.nar_config.block_size,
    }
    report = {"settings": settings, "results": [result.summary() for result in results]}
    atomic_write_text(os.path.join(args.out, "sweep.json"), json.dumps(report, indent=2) + "\n")
    header = (
        f"# GAD / GAD++ sweep: {os.path.basename(os.path.normpath(args.model))}, {len(sources)} sentences, batch 1, "
        f"{settings['threads']} threads, {settings['device']}\n\nRegenerate: `python scripts/gad_sweep.py` "
        "(command in its docstring).\n\n"
    )
    atomic_write_text(os.path.join(args.out, "sweep.md"), header + table(results))
    plot(results, os.path.join(args.out, "sweep.png"))
    print(header + table(results))


if __name__ == "__main__":
    main()

"""GAD and GAD++ sweeps over block size k, top-β and tolerance τ (the shapes of Ge et al.'s Tables 5–7).

Every setting is a mode of one bench run (`gad_k<k>`, `gad_pp_k<k>_beta<β>_tau<τ>`: the same sentences at batch 1
beside one greedy run, batch by batch), so each speedup is a ratio measured in the same run. Writes ``sweep.json``,
``sweep.md`` and ``sweep.png`` into ``--out``, and the bench's own report into ``--out``/bench.

Command behind ``docs/bench/gad-sweep`` (from the repository root, 6 minutes on a 2-core CPU)::

    python scripts/gad_sweep.py --model hf_blockwise/pretrained/multi30k-en-de \
        --source-file ../shared/data/multi30k/test_2016_flickr.en.gz \
        --reference-file ../shared/data/multi30k/test_2016_flickr.de.gz --sentences 300 --threads 2 \
        --out docs/bench/gad-sweep
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from script_common import run_bench

from hf_blockwise.serialization import atomic_write, atomic_write_text
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


def sweep_modes(block_sizes, pp_block_size, betas, taus, fixed_beta, fixed_tau) -> list[str]:
    """The bench modes of the sweep: exact GAD at each block size, then GAD++ over β (τ fixed) and over τ (β fixed)."""
    modes = [f"gad_k{k}" for k in block_sizes]
    for beta, tau in [(beta, fixed_tau) for beta in betas] + [(fixed_beta, tau) for tau in taus]:
        mode = f"gad_pp_k{pp_block_size}_beta{beta}_tau{tau:g}"
        modes += [] if mode in modes else [mode]
    return modes


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| run | speedup vs greedy | mean accepted | decoder calls / token | identical to greedy | BLEU |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        bleu = "" if result["bleu"] is None else f"{result['bleu']:.2f}"
        lines.append(
            f"| {result['mode']} | {result['speedup']:.2f}x | {result['mean_accepted']:.2f} | "
            f"{result['forwards_per_token']:.2f} | {result['identical']}/{result['sentences']} | {bleu} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = [r for r in results if r["mode"].startswith("gad_k")]
    loose = [r for r in results if r["mode"].startswith("gad_pp")]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ks = [int(r["mode"].removeprefix("gad_k")) for r in exact]
    axes[0].plot(ks, [r["speedup"] for r in exact], "o-", label="speedup vs greedy")
    axes[0].plot(ks, [r["mean_accepted"] for r in exact], "s--", label="mean accepted")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_xlabel("block size k (exact GAD)")
    axes[0].legend()
    axes[1].scatter([r["speedup"] for r in loose], [r["bleu"] for r in loose])
    for result in loose:
        label = result["mode"].split("_", 3)[3]  # beta<β>_tau<τ>
        axes[1].annotate(label, (result["speedup"], result["bleu"]), fontsize=7)
    greedy = next(r for r in results if r["mode"] == "greedy")
    axes[1].axhline(greedy["bleu"], color="grey", linewidth=0.8, label="greedy BLEU")
    axes[1].set_xlabel("speedup vs greedy (GAD++)")
    axes[1].set_ylabel("BLEU")
    axes[1].legend()
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    pp_block_size = args.gad_pp_block_size or max(args.block_sizes)
    modes = sweep_modes(args.block_sizes, pp_block_size, args.betas, args.taus, args.fixed_beta, args.fixed_tau)
    arguments = ["--model", args.model, "--source-file", args.source_file, "--sentences", str(args.sentences)]
    arguments += ["--reference-file", args.reference_file] if args.reference_file else []
    arguments += ["--nar-drafter", args.nar_drafter] if args.nar_drafter else []
    arguments += ["--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens), "--batch-sizes", "1"]
    report = run_bench([*arguments, "--modes", "greedy", *modes], os.path.join(args.out, "bench"))
    results, settings = report["results"], report["settings"]
    atomic_write_text(os.path.join(args.out, "sweep.json"), json.dumps(report, indent=2) + "\n")
    header = (
        f"# GAD / GAD++ sweep: {os.path.basename(os.path.normpath(args.model))}, {settings['sentences']} sentences, "
        f"batch 1, {settings['threads']} threads, {settings['device']}\n\nRegenerate: `python scripts/gad_sweep.py` "
        "(command in its docstring).\n\n"
    )
    atomic_write_text(os.path.join(args.out, "sweep.md"), header + table(results))
    plot(results, os.path.join(args.out, "sweep.png"))
    print(header + table(results))


if __name__ == "__main__":
    main()

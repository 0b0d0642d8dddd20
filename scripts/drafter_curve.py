"""The feature drafter's training curve: teacher-forced accuracy and tokens per decoder call against training time.

Reads the `trainer_state.json` of a `training/train_feature_drafter.py` run with `--eval-steps` (its last checkpoint
holds the whole history) and writes a table and a plot: each logged step's per-depth accuracies, and at each
evaluation the tokens per decoder call of exact decoding on Multi30k val (batch 1, eager). Minutes are the run's own
(`train_runtime / global_step` per step, evaluation excluded), offset by `--minutes-before` for a run that continued
a drafter trained before (`--init-from`).

    python scripts/drafter_curve.py --state checkpoints/feature-marian-base-v2/checkpoint-700/trainer_state.json \
        --minutes-before 55 --out docs/bench/drafter-curve
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

from hf_blockwise.serialization import atomic_write_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_curve(state_path: Path, seconds_per_step: float | None) -> tuple[list[dict], list[dict], float]:
    """(training logs with accuracies, evaluation logs with tokens per call, minutes per step: the run's own
    `train_runtime / global_step` when the state has it, a checkpoint's does not, else `seconds_per_step`)."""
    state = json.loads(state_path.read_text(encoding="utf-8"))
    history = state["log_history"]
    runtime = next((entry["train_runtime"] for entry in history if "train_runtime" in entry), None)
    if runtime is not None:
        seconds_per_step = runtime / state["global_step"]
    if seconds_per_step is None:
        raise ValueError(f"{state_path} records no train_runtime (a checkpoint's state): pass --seconds-per-step")
    accuracy_logs = [entry for entry in history if "step_1_accuracy" in entry]
    evaluations = [entry for entry in history if "eval_mean_accepted" in entry]
    return accuracy_logs, evaluations, seconds_per_step / 60


def write_curve(state_path: Path, out: Path, minutes_before: float, seconds_per_step: float | None = None) -> str:
    """Writes `drafter_curve.md` and `drafter_curve.png` into `out`; returns the table."""
    accuracy_logs, evaluations, minutes_per_step = read_curve(state_path, seconds_per_step)
    names = [key for key in accuracy_logs[-1] if key.startswith("step_") and key.endswith("_accuracy")]
    depths = sorted(int(key.split("_")[1]) for key in names)
    minutes = [minutes_before + entry["step"] * minutes_per_step for entry in accuracy_logs]
    eval_minutes = [minutes_before + entry["step"] * minutes_per_step for entry in evaluations]
    out.mkdir(parents=True, exist_ok=True)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for depth in depths:
        left.plot(minutes, [entry[f"step_{depth}_accuracy"] for entry in accuracy_logs], label=f"draft {depth}")
    left.set(xlabel="training minutes (2-core CPU)", ylabel="teacher-forced accuracy", title="accuracy per draft")
    left.legend()
    right.plot(eval_minutes, [entry["eval_mean_accepted"] for entry in evaluations], marker="o")
    right.set(xlabel="training minutes (2-core CPU)", ylabel="tokens per decoder call", title="Multi30k val, batch 1")
    figure.tight_layout()
    figure.savefig(out / "drafter_curve.png", dpi=100)
    header = "| minutes | step | " + " | ".join(f"draft {depth}" for depth in depths) + " | tokens per call |"
    rows = [header, "|---" * (len(depths) + 3) + "|"]
    by_step = {entry["step"]: entry["eval_mean_accepted"] for entry in evaluations}
    for minute, entry in zip(minutes, accuracy_logs, strict=True):
        accepted = by_step.get(entry["step"])
        cells = " | ".join(f"{entry[f'step_{depth}_accuracy']:.3f}" for depth in depths)
        rows.append(f"| {minute:.1f} | {entry['step']} | {cells} | {'' if accepted is None else f'{accepted:.2f}'} |")
    table = "\n".join(rows) + "\n\n![training curve](drafter_curve.png)\n"
    atomic_write_text(out / "drafter_curve.md", table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--state", type=Path, required=True, help="trainer_state.json of the run")
    parser.add_argument("--out", type=Path, required=True, help="folder for drafter_curve.md and .png")
    parser.add_argument("--minutes-before", type=float, default=0.0, help="training time of the drafter it continued")
    parser.add_argument("--seconds-per-step", type=float, help="for a state without train_runtime (a checkpoint's)")
    args = parser.parse_args()
    print(write_curve(args.state, args.out, args.minutes_before, args.seconds_per_step))


if __name__ == "__main__":
    main()

"""The bench's report: a Markdown table, the JSON figures, and plots (speedup and BLEU against mean accepted block;
the decoder cost curve), each file written atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from hf_blockwise.evaluation.cost_curve import speedup_ceiling
from hf_blockwise.evaluation.harness import ModeResult
from hf_blockwise.serialization import atomic_write, atomic_write_text


def _format(value: float | None, pattern: str) -> str:
    return "" if value is None else pattern.format(value)


def _table_cells(result: ModeResult) -> dict[str, str]:
    figures = result.summary()
    return {
        "batch": str(result.batch_size),
        "mode": result.mode,
        "speedup vs greedy": _format(result.speedup, "{:.2f}x"),
        "ceiling": _format(result.speedup_ceiling, "{:.2f}x"),
        "tokens/s": _format(figures["tokens_per_second"], "{:.0f}"),
        "words/s": _format(figures["words_per_second"], "{:.0f}"),
        "forwards/token": _format(figures["forwards_per_token"] if result.decoder_forwards else None, "{:.2f}"),
        "mean accepted": _format(figures["mean_accepted"], "{:.2f}"),
        "identical¹": f"{result.identical}/{result.compared}" if result.compared else "",
        "BLEU": _format(result.bleu, "{:.2f}"),
        "WER": _format(None if result.wer is None else 100 * result.wer, "{:.1f}%"),
    }


def markdown_table(results: Sequence[ModeResult], header: str) -> str:
    """The results as a Markdown table under `header`; columns empty in every row are left out."""
    rows = [_table_cells(result) for result in results]
    columns = [column for column in rows[0] if any(row[column] for row in rows)] if rows else []
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[column] for column in columns) + " |" for row in rows]
    if "identical¹" in columns:
        lines += [
            "",
            "¹ generated tokens equal, token for token, to greedy decoding of the same model (int8 modes: the int8 "
            "model; `ct2*`: transformers' float32 greedy, which another engine need not match; `*_b<N>` modes: "
            "transformers' beam search of N beams, `beam<N>`, itself compared with greedy; `*_sample` modes: the "
            "loop's undrafted sampling under the same seed, `loop_sample` or through the engine "
            "`greedy_compiled_sample`; transformers' own sampling is another random stream, compared with nothing); "
            "`oracle_k*` must be 100%",
        ]
    if "ceiling" in columns:
        lines += [
            "",
            "ceiling: `mean accepted · t(1) / t(k)` from the decoder cost curve (`--cost-curve`), for modes that "
            "feed k tokens every step: what the mode would reach if drafting and the loop cost nothing (GAD's "
            "drafter calls come on top)",
        ]
    return "\n".join(lines) + "\n"


def mode_colours(modes: Sequence[str]) -> dict[str, Any]:
    """One distinct colour per mode: a qualitative colormap (tab20's ten dark colours, then its ten light ones), or
    evenly spaced hues beyond 20."""
    import matplotlib

    names = list(dict.fromkeys(modes))
    if len(names) <= 20:
        tab20 = matplotlib.colormaps["tab20"].colors
        palette = tab20[0::2] + tab20[1::2]  # the dark ones are tab10's colours
    else:
        palette = [matplotlib.colormaps["hsv"](index / len(names)) for index in range(len(names))]
    return {name: palette[index] for index, name in enumerate(names)}


def plot(results: Sequence[ModeResult], path: str) -> bool:
    """Speedup (and BLEU, given references) against mean accepted block (Stern's Figure 4 and Table 1 scatter),
    one PNG; one colour per mode, one marker per batch size. Panels without data are left out.

    Returns:
        `bool`: whether anything was plotted (no file is written otherwise).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [result for result in results if result.mean_accepted is not None and result.speedup is not None]
    panels = [("speed", "wall-clock speedup vs greedy", lambda result: result.speedup)]
    if any(result.bleu is not None for result in plotted):
        panels.append(("quality", "BLEU", lambda result: result.bleu))
    if not plotted:
        return False
    colours = mode_colours([result.mode for result in plotted])
    markers = dict(zip(dict.fromkeys(result.batch_size for result in plotted), "osD^v<>pPX*", strict=False))
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 4), squeeze=False)
    for axis, (title, label, value) in zip(axes[0], panels, strict=True):
        for result in plotted:
            if value(result) is not None:
                axis.scatter(
                    result.mean_accepted, value(result), color=colours[result.mode],
                    marker=markers.get(result.batch_size, "o"), label=f"{result.mode} (b={result.batch_size})",
                )  # fmt: skip
        axis.set(xlabel="mean accepted block", ylabel=label, title=title)
    axes[0][0].axhline(1.0, color="grey", linewidth=0.5)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)
    return True


def write_report(results: Sequence[ModeResult], out_dir: str, header: str, settings: dict[str, Any]) -> list[str]:
    """`bench.json`, `bench.md` and `bench.png` (when there is anything to plot) in `out_dir`, each written
    atomically; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    report = {"settings": settings, "results": [result.summary() for result in results]}
    paths = [os.path.join(out_dir, name) for name in ("bench.json", "bench.md", "bench.png")]
    atomic_write_text(paths[0], json.dumps(report, indent=2) + "\n")
    atomic_write_text(paths[1], markdown_table(results, header))
    if not plot(results, paths[2]):
        print("no plot: no mode reports a mean accepted block")
        paths.pop()
    return paths


def plot_cost_curve(
    curve: Sequence[tuple[int, float]], path: str, compiled: Sequence[tuple[int, float]] | None = None
) -> None:
    """The decoder cost curve (eager, and compiled when given) and the speedup ceilings the eager one implies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, ceiling_axis) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [n for n, _ in curve]
    time_axis.plot(tokens, [1000 * t for _, t in curve], marker="o", label="eager")
    if compiled is not None:
        time_axis.plot([n for n, _ in compiled], [1000 * t for _, t in compiled], marker="s", label="compiled")
        time_axis.legend(fontsize=7)
    time_axis.set(xlabel="tokens fed in one decoder call", ylabel="ms per call", title="decoder cost curve")
    accepted_levels = (1.5, 2.0, 3.0, 4.0)
    colours = mode_colours([str(accepted) for accepted in accepted_levels])
    for accepted in accepted_levels:
        ceiling = [speedup_ceiling(curve, min(accepted, n), n) for n in tokens]
        ceiling_axis.plot(tokens, ceiling, label=f"mean accepted {accepted:g}", color=colours[str(accepted)])
    ceiling_axis.set(xlabel="block size k (tokens fed)", ylabel="speedup ceiling", title="a · t(1) / t(k)")
    ceiling_axis.axhline(1.0, color="grey", linewidth=0.5)
    ceiling_axis.legend(fontsize=7)
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)

"""The speedup ceilings the decoder cost curve ([`hf_blockwise.evaluation.cost_curve`]) implies for the bench's
modes that feed the same number of tokens every step."""

from __future__ import annotations

from collections.abc import Sequence

from hf_blockwise.evaluation.cost_curve import speedup_ceiling
from hf_blockwise.evaluation.harness import ModeResult
from hf_blockwise.tools.bench.modes import Mode
from hf_blockwise.tools.bench.setup import BenchSetup


def block_widths(setup: BenchSetup, modes: Sequence[str]) -> dict[str, int]:
    """Tokens fed per step, for the modes whose every step feeds the same number: sized modes and oracles (their
    k), heads (the heads' k) and GAD (the drafter's k). IAD's width follows the source, so it has none."""
    loaded, widths = setup.loaded, {}
    for name in modes:
        mode = Mode.parse(name)
        if mode.block_size is not None:
            widths[name] = mode.block_size
        elif mode.drafter == "heads" and loaded.heads_model is not None:
            widths[name] = loaded.heads_model.blockwise_config.block_size
        elif mode.drafter == "nar" and loaded.nar_model is not None:
            widths[name] = setup.gad_block_size or loaded.nar_model.nar_config.block_size
    return widths


def set_speedup_ceilings(
    results: Sequence[ModeResult],
    curve: Sequence[tuple[int, float]],
    compiled: Sequence[tuple[int, float]] | None = None,
    *,
    setup: BenchSetup,
) -> None:
    """Sets `speedup_ceiling` ([`speedup_ceiling`]) of the batch-1 results of fixed-width modes the curve covers:
    from the `compiled` curve for the float32 modes of the compiled engine where it is given, from the eager `curve`
    for the others (int8 modes included: the curves time the float32 model)."""
    widths = block_widths(setup, [result.mode for result in results])
    for result in results:
        width, mode = widths.get(result.mode), Mode.parse(result.mode)
        times = compiled if compiled is not None and mode.compiled and not mode.int8 else curve
        if width is not None and width <= len(times) and result.batch_size == 1 and result.mean_accepted:
            result.speedup_ceiling = speedup_ceiling(times, result.mean_accepted, width)

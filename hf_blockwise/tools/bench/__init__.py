"""`hf-blockwise bench`: every decoding mode side by side, in one run, measured against transformers' greedy.

Each mode decodes the same sentences in the same batches through one harness ([`hf_blockwise.evaluation.measure`]):
times are summed over batches (each batch timed once, modes interleaved per batch so that they share the machine's
state). Per mode: wall-clock ratio to greedy, target tokens/s, words/s (Devlin 2017's metric; single-threaded with
`--threads 1`), decoder forwards per output token, mean accepted block, identical-to-greedy rate (generated tokens
only: [`hf_blockwise.evaluation.same_output`]) and BLEU against references.

Two modes measure the decoding loop itself rather than a drafter:

- `loop`: `blockwise_generate` with no drafter (`assistant=None`, i.e. `NoDrafter`): one token per decoder call,
  like greedy, so its ratio to greedy is the loop's own overhead per step.
- `oracle` (rows `oracle_k{k}`, one per `--oracle-block-sizes` value): the drafts are greedy's own output for
  that batch (greedy runs first on each batch; a [`ReferenceDrafter`] proposes its next `k - 1` tokens), so
  every draft is accepted and each step gains k tokens. Its output must be identical to greedy's (100%), and its
  speedup is the loop's ceiling on this model and data at block size k: what a perfect drafter that costs
  nothing would reach. If a drafter's speedup is far below the oracle's at the same mean accepted block, the
  drafter (its accuracy or its own cost) limits you; if the oracle itself gains little, the loop and the
  model's cost of feeding k tokens per call ([`decoder_cost_curve`]) do, and no drafter can do better.

The bench also runs on randomly initialised models of real models' shapes and random source ids
(`--model-config`, [`hf_blockwise.evaluation.model_configs`]): greedy, loop and oracle need no trained drafter.

The package by concern: `modes.py` (the grammar of mode names, parsed once into a [`Mode`]), `setup.py` (what
the modes decode with, and the batches), `runners.py` (one runner per mode), `ct2_pass.py` (CTranslate2's own
pass), `cost_curve.py` (the decoder cost curve and speedup ceilings), `report.py` (tables, JSON and plots) and
`run.py` (which modes run, and the run itself). Models and drafters come from [`hf_blockwise.loading`], and
every timing from the measurement harness ([`hf_blockwise.evaluation.harness`]).
"""

from hf_blockwise.evaluation.cost_curve import decoder_cost_curve, speedup_ceiling
from hf_blockwise.tools.bench.cost_curve import block_widths, set_speedup_ceilings
from hf_blockwise.tools.bench.modes import (
    ALL_MODES,
    COMPILED_MODES,
    DEFAULT_MODES,
    DEFAULT_ORACLE_BLOCK_SIZES,
    FAST_PATH_MODES,
    INT8_MODES,
    LOOP_MODES,
    MODE_NAMES,
    Mode,
)
from hf_blockwise.tools.bench.report import markdown_table, mode_colours, plot, plot_cost_curve, write_report
from hf_blockwise.tools.bench.run import available_modes, run_bench
from hf_blockwise.tools.bench.runners import compile_modes, mode_runner
from hf_blockwise.tools.bench.setup import BenchSetup, make_batches, usable_batch_sizes

__all__ = [
    "ALL_MODES",
    "COMPILED_MODES",
    "DEFAULT_MODES",
    "DEFAULT_ORACLE_BLOCK_SIZES",
    "FAST_PATH_MODES",
    "INT8_MODES",
    "LOOP_MODES",
    "MODE_NAMES",
    "BenchSetup",
    "Mode",
    "available_modes",
    "block_widths",
    "compile_modes",
    "decoder_cost_curve",
    "make_batches",
    "markdown_table",
    "mode_colours",
    "mode_runner",
    "plot",
    "plot_cost_curve",
    "run_bench",
    "set_speedup_ceilings",
    "speedup_ceiling",
    "usable_batch_sizes",
    "write_report",
]

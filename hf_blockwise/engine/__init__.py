"""The compiled engine: the verification forward of the loop through `torch.compile`, over a static cache.

Decoding a few tokens per call on a CPU is bound by moving the weights, not by arithmetic, and eager PyTorch adds
two costs on top: its float32 `linear` for a few rows goes through kernels that re-read the weights per row, and
each of the decoder's few hundred small ops pays its own dispatch. The engine compiles transformers' own decoder
forward (no modeling code of ours) with inductor: on CPU with `freezing`, so the weights are packed once and a call
that feeds up to ~6 tokens costs about what one costs (`docs/bench/call-cost-curves-1-16.md`), its float linears on
inductor's C++ GEMM template (the libraries read a few rows' weights at a third of the memory's speed on the EPYC:
[`CompileOptions.gemm_template`]); on CUDA with mode `reduce-overhead` (CUDA graphs).

What keeps the compiled graph from recompiling during a call:

- the self-attention cache is static ([`boundary.static_decoder_cache`]): keys and values live in preallocated
  buffers, cropping moves a write position (a tensor, no host read), and the buffer length is rounded up to a
  multiple of 64 so that calls of similar lengths share it; on CPU a call is shown views of the positions in use
  ([`boundary.attention_window`]: its attention reads no more), whose length is one more dynamic size;
- shapes are dynamic (`dynamic=True`): one graph serves every feed width from 3 up and every source length;
  batch size 1 gets a graph of its own (dynamo specializes sizes of 1); duck shaping is off, so sizes that happen
  to be equal when a graph is traced (3 rows feeding 3 columns) are not taken for one;
- the first forward of a call, which writes the cross-attention cache, runs eagerly, or with
  `CompileOptions(compiled_prefill=True)` through graphs of its own (a second compiled module);
- the decoder states that state-reading drafters need are an output of the same graph: a hook on the output
  projection, registered before compilation and traced into the graph, hands over its input.

One arithmetic for every call of a decode. A token's logits must not depend on how many tokens its call feeds, or
a verification call of k tokens could round differently from greedy's one-token calls. Library kernels choose their
path by the call's shape and the machine (gemv for one row, small-matrix kernels, split K; other thresholds on each
CPU vendor), so on CPU the engine compiles through [`fixed_order.inductor_backend`]: attention's products (and
any float `matmul`) become inductor loops whose reduction order is fixed by the generated code, the same for every
feed width, batch size and attention window (the keys are summed in slot order: the positions a window leaves out
would add exact zeros last). With int8 linears (exact int32 sums) every product of the decoder is then exact or in an
order the graph owns, and a k-token call computes bit for bit what k one-token calls compute, on any CPU: the int8
engine's greedy (`blockwise_compile=True`, no assistant) *is* the int8 model's greedy output, and every drafter
reproduces it by construction. float32 `linear`s run on inductor's GEMM template (the batch-1 graph) or the
libraries (a batch's), whose code (not ours) orders their sums (inductor's plain loops cost ~1.4x a call on the
2-core EPYC), so a float32 engine is exact up to near-ties ([`greedy_divergences`]), unless
`CompileOptions(fixed_order_linears=True)` owns them too. A decode of b rows that shrinks to one row moves to the
batch-1 graph; the generated kernels give a row the same bits in both.

Checked where it runs: the first drafted decode of each kind (one row, several rows, several rows left with one;
chains or trees) runs [`check_arithmetic`]: a wide call against one-token calls on the call's own
encoder output, the one-token calls over the whole cache (another attention window than the wide call's); a row
left of several against the same row in a two-row call; a tree's side branch against its path as a chain;
`torch.equal` on logits. Where the graphs own every float product, it passes or a
[`OneArithmeticWarning`] (once per engine) names what differed and by how much: outputs are then exact up to
near-ties on this machine, never a silent claim. Every call feeds at least `MIN_FEED_WIDTH` (2)
columns, filler that causal attention hides, so that one graph serves every width (dynamo specializes a size of 1);
every cache of a decode has one capacity, whatever the drafter's block size.

Where the compiled objects live, and when they are dropped:

- engines and drafting blocks are kept in one registry, keyed by model (weakly: a model that is garbage-collected
  takes its entries with it); [`engine_of`] reads it and [`drop_compiled`] empties a model's entries;
- each compiled module gets a code object of its own for its `forward`. Dynamo keeps graphs per code object,
  guarded by the objects a frame reads but not by weight values: with a shared code object, a new engine of a
  model whose weights changed in place would be served the old frozen graph (measured), and dropping it would take
  a process-wide `torch.compiler.reset()`. With its own code object an engine's graphs can be reached only through
  it, so weights changed after compilation (training, `load_state_dict`, writes through `.data`), seen by a
  [`WeightsSnapshot`], replace that model's engine alone; other models keep their graphs. It also keeps each
  engine's few graphs (2-4) within dynamo's default recompile limit, which is per code object: no global limit is
  raised;
- inductor's `freezing` is a global flag read when a graph is compiled; it is set around the engine's calls only
  and restored after each.
"""

from hf_blockwise.compile_options import (
    CompileOptions,
    CompileUnavailableError,
    check_compile_available,
    on_cpu_inductor,
)
from hf_blockwise.engine.compiled_module import CompiledModule, WeightsSnapshot, own_code
from hf_blockwise.engine.decoder import MIN_FEED_WIDTH, ArithmeticVerdict, CompiledDecoder
from hf_blockwise.engine.probe import OneArithmeticWarning, check_arithmetic
from hf_blockwise.engine.registry import compiled_block, compiled_decoder, drop_compiled, engine_of

__all__ = [
    "MIN_FEED_WIDTH",
    "ArithmeticVerdict",
    "CompileOptions",
    "CompileUnavailableError",
    "CompiledDecoder",
    "CompiledModule",
    "OneArithmeticWarning",
    "WeightsSnapshot",
    "check_arithmetic",
    "check_compile_available",
    "compiled_block",
    "compiled_decoder",
    "drop_compiled",
    "engine_of",
    "on_cpu_inductor",
    "own_code",
]

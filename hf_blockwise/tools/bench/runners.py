"""One runner per mode: a function `runner(batch, earlier)` that decodes one batch (see [`harness.measure`]).

Drafting modes build their drafter through [`hf_blockwise.loading.build_drafter`]; the others (greedy, beam
search, transformers' assisted modes, the loop alone, the oracle) come from a table by family.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from transformers import CompileConfig

from hf_blockwise.drafters.oracle import ReferenceDrafter
from hf_blockwise.evaluation.harness import Batch, Runner, sequences_of, wall_clock
from hf_blockwise.generation.acceptance import AcceptanceRule, GADPlusPlusAcceptance, TopKAcceptance
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.loading import DrafterOptions, build_drafter
from hf_blockwise.tools.bench.modes import Mode
from hf_blockwise.tools.bench.setup import BenchSetup


def search_kwargs(mode: Mode, setup: BenchSetup) -> dict[str, Any]:
    """The `generate` arguments that choose between greedy search and (`_sample` modes) sampling."""
    if not mode.sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": setup.temperature, "top_p": setup.top_p}


def _blockwise_runner(model: nn.Module, limit: int, **generate_kwargs: Any) -> Runner:
    """`model.generate` through this package's loop (or a [`BlockwiseHeadsModel`]'s own generate); greedy unless
    `generate_kwargs` ask for beams or sampling."""
    kwargs = {"num_beams": 1, "do_sample": False, **generate_kwargs}
    return lambda batch, _: model.generate(**batch, **kwargs, max_new_tokens=limit, return_dict_in_generate=True)


def _greedy(mode: Mode, setup: BenchSetup) -> Runner:
    base, limit, search = setup.loaded.base, setup.max_new_tokens, search_kwargs(mode, setup)
    if mode.compiled:  # the engine's greedy: the loop with no drafter, compiled
        return _loop(mode, setup)
    # a dict-style output: Whisper's keeps its decoder prompt in `sequences` (a tensor output drops it), like the
    # loop's outputs, which are compared with it and which the oracle drafts from
    return lambda batch, _: base.generate(
        **batch, **search, num_beams=1, max_new_tokens=limit, return_dict_in_generate=True
    )


def _hf_compiled_greedy(mode: Mode, setup: BenchSetup) -> Runner:
    """transformers' greedy `generate` as a user compiles it: a static cache and a compiled forward."""
    base, limit = setup.loaded.base, setup.max_new_tokens
    config = CompileConfig(fullgraph=False, dynamic=True)
    return lambda batch, _: base.generate(
        **batch, do_sample=False, num_beams=1, max_new_tokens=limit, cache_implementation="static",
        compile_config=config,
    )  # fmt: skip


def _loop(mode: Mode, setup: BenchSetup) -> Runner:
    """The loop with no drafter (one token per decoder call)."""
    return _blockwise_runner(
        setup.loaded.base, setup.max_new_tokens, custom_generate=blockwise_generate, assistant=None,
        blockwise_compile=setup.engine(mode.compiled), num_beams=mode.num_beams, **search_kwargs(mode, setup),
    )  # fmt: skip


def _oracle(mode: Mode, setup: BenchSetup) -> Runner:
    """Blockwise decoding that drafts greedy's own output of the same batch (the `greedy` mode's, or with the
    engine `greedy_compiled`'s, so that every draft is accepted)."""
    base, limit, reference = setup.loaded.base, setup.max_new_tokens, mode.reference

    def run(batch: Batch, earlier: dict[str, Any]) -> Any:
        drafter = ReferenceDrafter(sequences_of(earlier[reference]), block_size=mode.block_size)
        return base.generate(
            **batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=limit,
            return_dict_in_generate=True, blockwise_compile=setup.engine(mode.compiled),
        )  # fmt: skip

    return run


def _generate(**generate_kwargs: Any) -> Callable[[Mode, BenchSetup], Runner]:
    """A runner of transformers' own `generate` with `generate_kwargs` (beam search, prompt lookup...)."""

    def runner(mode: Mode, setup: BenchSetup) -> Runner:
        base, limit, search = setup.loaded.base, setup.max_new_tokens, search_kwargs(mode, setup)
        return lambda batch, _: base.generate(**batch, **search, max_new_tokens=limit, **generate_kwargs)

    return runner


def _assisted(mode: Mode, setup: BenchSetup) -> Runner:
    return _generate(assistant_model=setup.loaded.assistant_model)(mode, setup)


_RUNNERS: dict[str, Callable[[Mode, BenchSetup], Runner]] = {
    "greedy": _greedy,
    "hf_greedy": _hf_compiled_greedy,
    "beam": lambda mode, setup: _generate(num_beams=mode.num_beams)(mode, setup),
    "prompt_lookup": _generate(prompt_lookup_num_tokens=10),
    "assisted": _assisted,
    "loop": _loop,
    "oracle": _oracle,
}


def drafter_options(mode: Mode, setup: BenchSetup) -> DrafterOptions:
    """How `mode` sets its drafter up: its block size and threshold (GAD unsized: the setup's block size), the
    heads' shortlist (not for `heads_full_vocab`), source copy's length and realignment (`iad_realign`)."""
    gad_block_size = mode.block_size or setup.gad_block_size
    return DrafterOptions(
        block_size=gad_block_size if mode.drafter == "nar" else mode.block_size, threshold=mode.threshold,
        use_shortlist=mode.family != "heads_full_vocab", max_draft_length=setup.iad_max_draft_length,
        realign=mode.family == "iad_realign", tree_nodes=mode.tree_nodes, tree_branching=mode.tree_branching,
    )  # fmt: skip


def acceptance_rule(mode: Mode, setup: BenchSetup) -> AcceptanceRule | None:
    """The acceptance rule of `mode`: top-2 (`heads_top2`), GAD++ (`gad_pp`), else exact (`None`)."""
    if mode.family == "heads_top2":
        return TopKAcceptance(2)
    if mode.family == "gad_pp":
        tolerance = setup.gad_tolerance if mode.tolerance is None else mode.tolerance
        return GADPlusPlusAcceptance(mode.top_beta or setup.gad_top_beta, tolerance)
    return None


def _drafter_runner(mode: Mode, setup: BenchSetup) -> Runner:
    """A drafting mode: heads and sequential heads decode through their model's own `generate`, every other
    drafter through the base's `generate` with this package's loop."""
    loaded = setup.loaded
    drafter = build_drafter(mode.drafter, loaded, drafter_options(mode, setup))
    kwargs: dict[str, Any] = {
        "assistant": drafter, "blockwise_compile": setup.engine(mode.compiled), "num_beams": mode.num_beams,
        **search_kwargs(mode, setup),
    }  # fmt: skip
    rule = acceptance_rule(mode, setup)
    if rule is not None:
        kwargs["acceptance"] = rule
    own_model = {"heads": loaded.heads_model, "seq_heads": loaded.sequential_heads_model}.get(mode.drafter)
    if own_model is not None:
        return _blockwise_runner(own_model, setup.max_new_tokens, **kwargs)
    return _blockwise_runner(loaded.base, setup.max_new_tokens, custom_generate=blockwise_generate, **kwargs)


def mode_runner(mode: Mode | str, setup: BenchSetup) -> Runner:
    """A function `runner(batch, earlier)` decoding one tokenized batch in `mode` (see [`harness.measure`]);
    returns sequences or a dict-style output.

    For the int8 modes, `setup` is the quantized one ([`LoadedModel.int8_copy`]). `oracle_k{k}` modes read their
    reference mode's output of the same batch from `earlier`.
    """
    mode = Mode.parse(mode) if isinstance(mode, str) else mode
    if mode.num_beams > 1:
        return padded_after_eos(_runner_of(mode, setup), setup.loaded.base.generation_config)
    if mode.sample:
        return seeded(_runner_of(mode, setup), setup.sampling_seed)
    return _runner_of(mode, setup)


def seeded(runner: Runner, seed: int) -> Runner:
    """`runner` after `torch.manual_seed(seed)`: a sampling mode draws the same way on a batch as every other one
    (the loop's seed, drawn from torch's state, then gives drafted runs the undrafted run's tokens)."""

    def run(batch: Batch, earlier: dict[str, Any]) -> Any:
        torch.manual_seed(seed)
        return runner(batch, earlier)

    return run


def padded_after_eos(runner: Runner, generation_config: Any) -> Runner:
    """`runner` with every row's tokens after its first EOS made pads, as greedy pads its shorter rows: beam search
    fills them with EOS where the pad id is 0 (`pad_token_id or eos_token_id[0]` in `_beam_search`), which would
    count as generated tokens and differ from greedy's and CTranslate2's padding."""
    eos = generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else eos)
    pad = generation_config.pad_token_id

    def run(batch: Batch, earlier: dict[str, Any]) -> Any:
        output = runner(batch, earlier)
        sequences = sequences_of(output)
        ended = torch.isin(sequences[:, 1:], eos.to(sequences.device)).long().cumsum(dim=1) > 0  # (b, length - 1)
        after = torch.nn.functional.pad(ended[:, :-1], (2, 0), value=False)  # strictly after the first EOS
        padded = sequences.masked_fill(after, pad)
        if isinstance(output, torch.Tensor):
            return padded
        output.sequences = padded
        return output

    return run


def _runner_of(mode: Mode, setup: BenchSetup) -> Runner:
    """The runner of `mode` by its family (or drafter)."""
    if mode.drafter is not None:
        return _drafter_runner(mode, setup)
    if mode.family not in _RUNNERS or (mode.family == "oracle" and mode.block_size is None):
        raise ValueError(
            f"mode {mode.name!r} has no runner of its own (CTranslate2 runs in its own pass; an oracle needs its "
            "block size: oracle_k<k>)"
        )
    return _RUNNERS[mode.family](mode, setup)


def compile_modes(runners: dict[str, Runner], batch: Batch, compiled: Collection[str]) -> dict[str, float]:
    """Runs the runners named in `compiled` once on `batch`, untimed, so that compilation is not timed as decoding;
    returns each one's wall time for that run (its compilation, when it was the first to need a graph). Runners run
    in order, `greedy` included, so that an oracle finds the greedy output it drafts from."""
    earlier: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    if not compiled:
        return seconds
    with torch.no_grad():
        for name, runner in runners.items():
            if name in compiled or name == "greedy":
                start = wall_clock()
                earlier[name] = runner(batch, earlier)
                if name in compiled:
                    seconds[name] = wall_clock() - start
    return seconds

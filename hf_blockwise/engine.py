"""The compiled engine: the verification forward of the loop through `torch.compile`, over a static cache.

Decoding a few tokens per call on a CPU is bound by moving the weights, not by arithmetic, and eager PyTorch adds
two costs on top: its float32 `linear` for a few rows goes through kernels that re-read the weights per row, and
each of the decoder's few hundred small ops pays its own dispatch. The engine compiles transformers' own decoder
forward (no modeling code of ours) with inductor: on CPU with `freezing`, so the weights are prepacked for oneDNN
and a call that feeds 8 tokens costs about what one costs; on CUDA with mode `reduce-overhead` (CUDA graphs).

What keeps the compiled graph from recompiling during a call:

- the self-attention cache is static ([`boundary.static_decoder_cache`]): keys and values live in preallocated
  buffers, cropping moves a write position (a tensor, no host read), and the buffer length is rounded up to a
  multiple of 64 so that calls of similar lengths share it;
- shapes are dynamic (`dynamic=True`): one graph serves every feed width from 2 up and every source length;
  dynamo specializes sizes of 1, so a one-token feed is padded with one filler column (causal attention hides it)
  and batch size 1 gets a graph of its own;
- the first forward of a call, which writes the cross-attention cache, runs eagerly;
- the decoder states that state-reading drafters need are an output of the same graph: a hook on the output
  projection, registered before compilation and traced into the graph, hands over its input.

Compiled kernels order some floating-point sums differently from eager ones, so the engine's greedy (the loop with
no drafter) is the exact reference of its drafting modes; against transformers' eager greedy an output may differ
only at a near-tie, which [`first_divergence`] shows. Weights changed after compilation (training,
`load_state_dict`) are detected by their version counters and the model is compiled again (after
`torch.compiler.reset()`: dynamo's guards do not look at weight values, so its cache would serve the old graph).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch._inductor.config
from torch import nn

from hf_blockwise import boundary as hf

# static cache buffers are rounded up to this many positions, so that calls of similar lengths share their shape
_CACHE_ROUNDING = 64
# dynamo keeps at most this many graphs per compiled function; an engine has 2-4 (batch 1 or more, a one-column
# feed at a position limit) and a process may build engines for several models
_RECOMPILE_LIMIT = 64


class CompileUnavailableError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler for inductor on CPU, a torch without dynamo)."""


@dataclass(frozen=True)
class CompileOptions:
    """How `blockwise_compile=` compiles the verification forward.

    Args:
        backend (`str`, defaults to `"inductor"`): the `torch.compile` backend.
        mode (`str`, *optional*): the `torch.compile` mode; `None` picks `"reduce-overhead"` (CUDA graphs) on CUDA
            and the default on CPU.
        freezing (`bool`, defaults to `True`): inductor's freezing on CPU: weights become constants of the graph,
            prepacked for oneDNN (the gain on CPU). The graph then holds its own copy of the weights.
    """

    backend: str = "inductor"
    mode: str | None = None
    freezing: bool = True

    @classmethod
    def coerce(cls, value: bool | CompileOptions | None) -> CompileOptions | None:
        """`blockwise_compile=` as given: `True` for the defaults, `False`/`None` for eager, or options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"blockwise_compile= takes a bool or a CompileOptions, got {type(value).__name__}")


def check_compile_available(device: torch.device, options: CompileOptions) -> None:
    """Raises [`CompileUnavailableError`] naming what is missing for `torch.compile` on `device`."""
    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnavailableError(f"torch.compile is not supported by this torch ({torch.__version__}) here")
    if (
        options.backend == "inductor"
        and device.type == "cpu"
        and not any(shutil.which(name) for name in ("g++", "c++", "clang++"))
    ):
        raise CompileUnavailableError("inductor needs a C++ compiler on CPU (g++, c++ or clang++), and none is on PATH")


def weights_fingerprint(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Each parameter's and buffer's storage address and version counter: any in-place change (an optimizer step,
    `load_state_dict`) or replaced tensor changes it."""
    return tuple(
        (tensor.data_ptr(), 0 if tensor.is_inference() else tensor._version)
        for tensor in (*model.parameters(), *model.buffers())
    )


class CompiledModule:
    """`module` through `torch.compile` with the engine's options: dynamic shapes, and on CPU frozen (prepacked)
    weights. The verification forward and the drafters' drafting blocks are compiled with it.

    Args:
        module (`nn.Module`): what to compile; dynamo sees its weights as parameters.
        options ([`CompileOptions`]).
        owner (`nn.Module`): the model whose weights `module` uses (or derives buffers from): the fingerprint that
            tells a stale graph ([`weights_fingerprint`]) is taken over it.
    """

    def __init__(self, module: nn.Module, options: CompileOptions, owner: nn.Module) -> None:
        device = next(owner.parameters()).device
        check_compile_available(device, options)
        self.options = options
        self.fingerprint = weights_fingerprint(owner)
        mode = options.mode
        if mode is None and device.type == "cuda":
            mode = "reduce-overhead"
        # freezing: weights become prepacked constants (CPU); not with CUDA graphs, which need the cache's static
        # addresses that freezing would fold
        self.freezing = options.freezing and options.backend == "inductor" and mode != "reduce-overhead"
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        self._compiled = torch.compile(module, backend=options.backend, mode=mode, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        # inductor reads `freezing` from its global config when it compiles (torch.compile's options= do not reach
        # that decision), so it is set for the call only
        with torch._inductor.config.patch(freezing=self.freezing):
            return self._compiled(*args)

    def close(self) -> None:
        """Nothing to release (the engine of a decoder removes its hook)."""


class CompiledDecoder:
    """transformers' decoder forward of one model, compiled, with the decoder states as a second output.

    Args:
        model: the transformers seq2seq model.
        options ([`CompileOptions`]).
    """

    def __init__(self, model: nn.Module, options: CompileOptions) -> None:
        self.options = options
        self.fingerprint = weights_fingerprint(model)
        self.position_limit = hf.decoder_position_limit(model)
        self.num_layers = hf.decoder_layer_count(model)
        self._step = _DecoderStep(model)
        # a module, so that dynamo sees the weights as parameters
        self._compiled = CompiledModule(self._step, options, model)
        self.freezing = self._compiled.freezing
        # compiled calls run no module hooks, so a caller counting decoder calls (the bench) reads this instead
        self.compiled_calls = 0

    def close(self) -> None:
        """Removes the engine's hook from the model (done when an engine is replaced)."""
        self._step.hook_handle.remove()

    def new_cache(self, max_length: int) -> Any:
        """A static cache with room for `max_length` positions (rounded up)."""
        return hf.static_decoder_cache(self.num_layers, -(-max_length // _CACHE_ROUNDING) * _CACHE_ROUNDING)

    def forward(
        self, tokens: torch.Tensor, cache: Any, forward_kwargs: dict[str, Any], cache_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One cached decoder pass over `tokens`, compiled after the first.

        Args:
            tokens (`torch.LongTensor` of shape `(batch_size, width)`).
            cache: from [`new_cache`]; `cache_length` positions of it are valid.

        Returns:
            logits (`torch.FloatTensor` of shape `(batch_size, width, vocab_size)`) and the states at the output
            projection (`torch.Tensor` of shape `(batch_size, width, hidden_size)`).
        """
        if cache_length == 0:  # writes the cross-attention cache: another graph, run once per call
            outputs = self._step(tokens, cache, forward_kwargs)
            if self.freezing:
                hf.unpin_static_cache(cache)
            return outputs
        width = tokens.shape[1]
        if width == 1 and (self.position_limit is None or cache_length + 2 <= self.position_limit):
            tokens = torch.cat([tokens, tokens], dim=1)  # the second column is hidden by causal attention
        logits, states = self._compiled(tokens, cache, forward_kwargs)
        self.compiled_calls += 1
        return logits[:, :width], states[:, :width]


class _DecoderStep(nn.Module):
    """transformers' forward of `model` with the input of its output projection as a second output.

    The projection's forward hook is registered once, before compilation, so that dynamo traces it into the graph;
    it keeps the tensor only while this module's forward runs (eager calls of the model are left alone).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.capturing = False
        self.states: torch.Tensor | None = None
        projection = model.get_output_embeddings()
        if projection is None:
            raise ValueError(f"{type(model).__name__} has no output projection (get_output_embeddings() is None)")
        self.hook_handle = projection.register_forward_hook(self._keep_states)

    def _keep_states(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.capturing:
            self.states = args[0]

    def forward(
        self, tokens: torch.Tensor, cache: Any, forward_kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.capturing = True
        outputs = self.model(
            decoder_input_ids=tokens, past_key_values=cache, use_cache=True, return_dict=True,
            **{**forward_kwargs, "decoder_attention_mask": hf.static_cache_mask(cache, tokens)},
        )  # fmt: skip
        self.capturing = False
        states, self.states = self.states, None
        return outputs.logits, states


# where a model keeps its engine, as transformers keeps its own compiled forward on the model (`_compiled_call`)
_ENGINE_ATTRIBUTE = "_hf_blockwise_engine"
_BLOCK_ATTRIBUTE = "_hf_blockwise_drafting_block"


def compiled_decoder(model: nn.Module, options: CompileOptions) -> CompiledDecoder | None:
    """The model's compiled engine, built on first use and kept on the model; `None`, with a warning that says
    why, where compilation is unavailable (the loop then runs eagerly, with the same output rules).

    Weights changed since the engine was built make a new one (a recompilation, with a warning): a frozen graph
    holds the weights it was compiled with.
    """
    return _kept(model, _ENGINE_ATTRIBUTE, options, lambda: CompiledDecoder(model, options))


def compiled_block(
    owner: nn.Module, key: str, build: Callable[[], nn.Module], options: CompileOptions
) -> CompiledModule | None:
    """A drafter's compiled drafting block, kept on the drafter's model `owner` as the decoder's engine is kept on
    its model, with the same rules: rebuilt when `owner`'s weights change, `None` with a warning where compilation
    is unavailable.

    Args:
        owner (`nn.Module`): the drafter's model (its weights and the base's it reads).
        key (`str`): which block of `owner` (a drafter model may have one per block size).
        build (`Callable[[], nn.Module]`): makes the module to compile, on first use.
    """
    return _kept(owner, f"{_BLOCK_ATTRIBUTE}_{key}", options, lambda: CompiledModule(build(), options, owner))


def _kept(owner: nn.Module, attribute: str, options: CompileOptions, build: Callable[[], Any]) -> Any:
    """The compiled object kept on `owner` under `attribute`, (re)built by `build` when missing, compiled with other
    options or holding stale weights."""
    engine = owner.__dict__.get(attribute)
    if engine is not None and engine.options == options:
        if engine.fingerprint == weights_fingerprint(owner):
            return engine
        warnings.warn(
            f"The weights of this {type(owner).__name__} changed since it was compiled; compiling it again "
            "(torch.compiler.reset(): the graphs of other compiled models are compiled again too when next used)",
            stacklevel=4,
        )
        # dynamo keeps graphs by code and guards, which do not look at weight values: a frozen graph of this model
        # would be found again by a new engine, so every graph goes
        torch.compiler.reset()
    try:
        replacement = build()
    except CompileUnavailableError as error:
        warnings.warn(f"blockwise_compile: {error}; decoding eagerly instead", stacklevel=4)
        return None
    if engine is not None:
        engine.close()
    owner.__dict__[attribute] = replacement  # a plain attribute: not a submodule, not in the state dict
    return replacement


def engine_of(model: nn.Module) -> CompiledDecoder | None:
    """The engine `blockwise_compile=` built for `model`, or `None` where it has none."""
    return model.__dict__.get(_ENGINE_ATTRIBUTE)

"""The engine's one-arithmetic probe ([`check_arithmetic`]): on this machine and model, does a verification call
compute bit for bit what one-token calls compute? Run once per engine for each kind of decode; a failure where the
graphs claim one arithmetic warns ([`OneArithmeticWarning`]).
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import torch

from hf_blockwise import boundary as hf
from hf_blockwise.engine.decoder import ArithmeticVerdict, CompiledDecoder


class OneArithmeticWarning(UserWarning):
    """The engine's probe found, on this machine, a verification call that does not compute bit for bit what
    one-token calls compute: outputs are exact up to near-ties here, not bitwise."""


def check_arithmetic(
    engine: CompiledDecoder,
    prompt: torch.Tensor,
    forward_kwargs: dict[str, Any],
    max_length: int,
    width: int,
    tree: bool = False,
    shrunk: bool = False,
) -> ArithmeticVerdict:
    """Probes, on this machine and this model, whether a `width`-token call computes what one-token calls
    compute; once per engine for each kind of decode (one row, several rows, several rows shrunk to one; chains
    or trees).

    On the call's own encoder output, over scratch caches of the decode's capacity: `width` random tokens fed
    in one call against the same tokens fed one per call (`torch.equal` on logits); with `shrunk` (a decode of
    several rows left with one, which moves to the batch-1 graph), the row's logits against the same row in a
    two-row call; with `tree`, a tree of the same tokens (a chain and a side branch) through the tree graph
    against its paths fed as chains; with a compiled first call (`compiled_prefill`), the first call of the
    prompt and the tokens against the first call of the prompt alone (greedy's). A difference, where the graphs
    claim one arithmetic, warns once
    ([`OneArithmeticWarning`]). The probe's calls are not counted in `compiled_calls`.

    Args:
        prompt (`torch.LongTensor` of shape `(batch_size, prompt_length)`): the decoder start (and prompt).
        forward_kwargs (`dict`): the encoder outputs and attention mask of those rows.
        max_length (`int`): the decode's length limit (the scratch caches get the decode's capacity).
        width (`int`): the widest feed of the decode.
        tree (`bool`): the decode feeds trees.
        shrunk (`bool`): `prompt` is the one row left of a decode of several.

    Returns:
        [`ArithmeticVerdict`].
    """
    kind = "several rows, then one" if shrunk else "several rows" if prompt.shape[0] > 1 else "one row"
    key = (kind, tree)
    if key not in engine.verdicts:
        begin, calls = time.perf_counter(), engine.compiled_calls
        with torch.no_grad():
            difference = _probe(engine, prompt, forward_kwargs, max_length, width, tree, shrunk)
        engine.compiled_calls = calls  # the probe's calls are no decode's forwards
        seconds = time.perf_counter() - begin
        verdict = ArithmeticVerdict(engine.owns_products(), not difference, difference, seconds)
        if verdict.claimed and difference and all(old.bitwise for old in engine.verdicts.values() if old.claimed):
            warnings.warn(
                f"The compiled engine's one-arithmetic probe failed on this machine: {difference}. Verification "
                "calls do not compute bit for bit what one-token calls compute here, so outputs are exact up to "
                "near-ties (see hf_blockwise.greedy_divergences), not bitwise.",
                OneArithmeticWarning,
                stacklevel=4,
            )
        engine.verdicts[key] = verdict
    return engine.verdicts[key]


def _probe(
    engine: CompiledDecoder,
    prompt: torch.Tensor,
    forward_kwargs: dict[str, Any],
    max_length: int,
    width: int,
    tree: bool,
    shrunk: bool,
) -> str:
    """The probe's comparisons; the first that differs, described, or an empty string."""
    if engine.position_limit is not None:
        width = max(1, min(width, engine.position_limit - prompt.shape[1]))
    vocab_size = engine.model().get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)  # the caller's random state is left alone
    tokens = torch.randint(vocab_size, (prompt.shape[0], width), generator=generator).to(prompt.device)
    # a tree decode's calls go through the tree graph: the probe's too, each chain fed as a tree of one chain
    probe = functools.partial(_probe_logits, engine, max_length=max_length, as_tree=tree)
    together = probe(prompt, forward_kwargs, tokens, one_call=True)  # (b, width, V)
    comparisons = [
        (f"a {width}-token call against one-token calls", together,
         lambda: probe(prompt, forward_kwargs, tokens, one_call=False)),
    ]  # fmt: skip
    if shrunk:  # the row, decoded alone now, against the same row in the several-row graph
        twice = torch.zeros(2, dtype=torch.long, device=prompt.device)
        pair = hf.select_forward_rows(forward_kwargs, twice)
        comparisons.append(
            ("a row alone against the same row in a two-row call", together,
             lambda: probe(prompt[twice], pair, tokens[twice], one_call=True)[:1])
        )  # fmt: skip
    if engine.options.compiled_prefill and not tree:  # a drafted decode's first call feeds drafts after the prompt
        first = functools.partial(_first_call_logits, engine, forward_kwargs=forward_kwargs, max_length=max_length)
        start = prompt.shape[1]
        comparisons.append(
            ("a first call of the prompt and drafts against one of the prompt alone",
             first(torch.cat([prompt, tokens], dim=1))[:, :start], lambda: first(prompt)[:, :start])
        )  # fmt: skip
    if tree and width > 2:  # a chain of width - 1 and a side branch after its first node
        in_tree = probe(prompt, forward_kwargs, tokens, one_call=True, side_branch=True)
        branch = tokens[:, [0, width - 1]]  # the side branch's path, fed as a chain
        comparisons += [
            ("a tree call's main chain against a chain call", in_tree[:, :-1], lambda: together[:, :-1]),
            ("a tree call's side branch against its path as a chain", in_tree[:, -1:],
             lambda: probe(prompt, forward_kwargs, branch, one_call=True)[:, -1:]),
        ]  # fmt: skip
    for description, logits, reference in comparisons:
        expected = reference()
        if not torch.equal(logits, expected):
            largest = float((logits - expected).abs().max())
            return f"{description} (batch {logits.shape[0]}): max |logit difference| {largest:.3g}"
    return ""


def _first_call_logits(
    engine: CompiledDecoder, tokens: torch.Tensor, forward_kwargs: dict[str, Any], max_length: int
) -> torch.Tensor:
    """Logits `(b, n, V)` of the first call of a decode that feeds `tokens` (shape `(b, n)`), in a fresh cache."""
    return engine.forward(tokens, engine.new_cache(max_length, tokens.shape[1]), forward_kwargs, cache_length=0)[0]


def _probe_logits(
    engine: CompiledDecoder,
    prompt: torch.Tensor,
    forward_kwargs: dict[str, Any],
    tokens: torch.Tensor,
    one_call: bool,
    max_length: int,
    as_tree: bool = False,
    side_branch: bool = False,
) -> torch.Tensor:
    """Logits of `tokens` (shape `(b, n)`) after `prompt` in a fresh cache: fed in one call, or one token per
    call with the cache cropped back after each call's filler (as the loop does) and attending over the whole
    capacity; with `as_tree` every call is a tree (a chain's shape, or with `side_branch` a chain of n - 1 and a
    branch after the first node)."""
    cache = engine.new_cache(max_length, tokens.shape[1])
    engine.forward(prompt, cache, forward_kwargs, cache_length=0)
    start, batch = prompt.shape[1], tokens.shape[0]
    if one_call:
        tree = _probe_tree(batch, tokens.shape[1], side_branch, tokens.device) if as_tree else None
        return engine.forward(tokens, cache, forward_kwargs, start, tree)[0]
    logits = []
    one = _probe_tree(batch, 1, False, tokens.device) if as_tree else None
    for column in range(tokens.shape[1]):  # over the whole capacity: another window than the wide call's
        fed = tokens[:, column : column + 1]
        logits.append(engine.forward(fed, cache, forward_kwargs, start + column, one, full_cache=True)[0])
        hf.crop_cache(cache, start + column + 1)
    return torch.cat(logits, dim=1)


def _probe_tree(batch_size: int, width: int, side_branch: bool, device: torch.device) -> hf.TreeInputs:
    """A probe's tree of `width` nodes: a chain, or with `side_branch` a chain of `width - 1` and a last node
    after the first."""
    ancestors = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # (width, width)
    depth = torch.arange(width, device=device)
    if side_branch:
        ancestors[-1, 1:-1] = False  # the last node's ancestors: node 0 only
        depth[-1] = 1
    return hf.TreeInputs(depth=depth.repeat(batch_size, 1), ancestors=ancestors.repeat(batch_size, 1, 1))

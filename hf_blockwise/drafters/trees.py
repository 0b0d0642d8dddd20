"""Draft trees from ranked candidates, grown by confidence (EAGLE-2's rule on a drafter's own probabilities).

A drafter that drafts a chain sees, at each depth, a whole distribution; its runners-up cost nothing more to
propose. [`ranked_tree`] turns the top `m` candidates of each depth into a tree: the main chain (every depth's
first choice) and each depth's runners-up as leaves beside the chain's node there. Every candidate is scored by its
cumulative draft probability (the product along its path), and the best `num_nodes` are kept: EAGLE-2's dynamic
tree, restricted to branches off the main chain (branches of branches would need more drafting passes). A node's
score never exceeds its parent's, so the kept set is a tree; ties keep the shallower node.

Verification cost on a CPU is flat up to ~8 fed tokens (`docs/results.md`), so the budget is best spent where the
chain is least sure.
"""

from __future__ import annotations

import torch

from hf_blockwise.drafters.base import Drafts, draw_among_likely
from hf_blockwise.shared_noise import gumbel


def tree_candidates(num_drafts: int, branching: int, frontier: int) -> int:
    """Candidates a drafter ranks per row: `branching` per depth along one chain (`frontier` 0), or `branching` per
    expanded node with `frontier` nodes expanded at each depth after the first."""
    if frontier == 0:
        return num_drafts * branching
    return branching + (num_drafts - 1) * frontier * branching


def check_tree_options(num_nodes: int | None, branching: int, num_drafts: int, frontier: int = 0) -> None:
    """Raises a `ValueError` naming the option when a tree of `num_nodes` over `num_drafts` depths of `branching`
    candidates each (`frontier` expanded per depth) cannot be grown."""
    if num_nodes is None:
        return
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"tree_nodes must be a positive int or None (a chain), got {num_nodes!r}")
    if isinstance(branching, bool) or not isinstance(branching, int) or branching < 2:
        raise ValueError(f"tree_branching must be an int >= 2 (candidates per depth), got {branching!r}")
    if isinstance(frontier, bool) or not isinstance(frontier, int) or not 0 <= frontier <= branching:
        raise ValueError(f"tree_frontier must be an int from 0 to tree_branching={branching}, got {frontier!r}")
    if num_nodes > tree_candidates(num_drafts, branching, frontier):
        raise ValueError(
            f"tree_nodes={num_nodes} is more than the {tree_candidates(num_drafts, branching, frontier)} candidates "
            f"of {num_drafts} depths (tree_branching={branching}, tree_frontier={frontier}); raise one of them"
        )


def ranked_tree(tokens: torch.Tensor, probabilities: torch.Tensor, num_nodes: int) -> Drafts:
    """The best `num_nodes` of the main chain and its runners-up, as a tree (a drafter that drafts one chain and
    ranks each depth's candidates: heads, or a feature drafter without expansion).

    Args:
        tokens (`torch.LongTensor` of shape `(b, D, m)`): at each depth, the drafter's `m` best tokens, best first
            (depth d's candidates follow the main chain's first d tokens).
        probabilities (`torch.FloatTensor` of shape `(b, D, m)`): their draft probabilities.
        num_nodes (`int`): nodes kept per row (at most `D * m`).
    """
    batch, depths, width = tokens.shape
    chain = probabilities[..., 0].float().cumprod(dim=1)  # (b, D): the chain through depth d
    before = torch.cat([chain.new_ones(batch, 1), chain[:, :-1]], dim=1)  # (b, D): the chain above depth d
    scores = before[..., None] * probabilities.float()  # (b, D, m)
    depth = torch.arange(depths, device=tokens.device)[:, None].expand(depths, width)  # (D, m)
    parents = torch.where(depth > 0, (depth - 1) * width, -1)  # the chain's node one depth up, at rank 0
    return select_tree(
        tokens.reshape(batch, -1),
        parents.reshape(1, -1).expand(batch, -1),
        depth.reshape(1, -1).expand(batch, -1),
        scores.reshape(batch, -1),
        num_nodes,
        depths,
    )


def select_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    scores: torch.Tensor,
    num_nodes: int,
    num_depths: int,
) -> Drafts:
    """The best `num_nodes` candidates by cumulative probability, as [`Drafts`] with the main chain first.

    Args:
        tokens (`torch.LongTensor` of shape `(b, T)`): candidates, ordered by depth (parents before children).
        parents (`torch.LongTensor` of shape `(b, T)`): each candidate's parent among them, `-1` at depth 1.
        depth (`torch.LongTensor` of shape `(b, T)`): each candidate's depth, `0..num_depths - 1`.
        scores (`torch.FloatTensor` of shape `(b, T)`): cumulative draft probabilities (never above the parent's).
        num_nodes (`int`): nodes kept per row.

    Returns:
        [`Drafts`] with `parents`: first the main chain (the path to the deepest kept node, the best of those), by
        depth, then the other kept nodes in candidate order.
    """
    kept_tokens, kept_parents = select_tree_tensors(tokens, parents, depth, scores, num_nodes, num_depths)
    lengths = torch.full((tokens.shape[0],), num_nodes, dtype=torch.long, device=tokens.device)
    return Drafts(tokens=kept_tokens, lengths=lengths, parents=kept_parents)


def select_tree_tensors(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: torch.Tensor,
    scores: torch.Tensor,
    num_nodes: int,
    num_depths: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[`select_tree`] as tensors (for a compiled drafting block): the kept tokens and parents, `(b, num_nodes)`."""
    batch, total = tokens.shape
    # a stable sort keeps the earlier candidate (shallower) first among equal scores: a parent before its child
    kept = scores.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes]  # (b, N)
    is_kept = torch.zeros(batch, total, dtype=torch.bool, device=tokens.device).scatter(1, kept, True)
    leaf = torch.where(is_kept, depth.float() * 2 + scores.float(), -1.0).argmax(dim=1)  # (b,): deepest, then best
    on_chain = torch.zeros_like(is_kept)
    node = leaf
    for _ in range(num_depths):  # up the leaf's path, one depth per step
        index = node.clamp(min=0)[:, None]  # past the root (node -1) a row keeps what index 0 holds
        on_chain = on_chain.scatter(1, index, on_chain.gather(1, index) | (node >= 0)[:, None])
        node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)[:, None])[:, 0], -1)
    order_key = torch.where(on_chain, depth, total + torch.arange(total, device=tokens.device))
    order_key = torch.where(is_kept, order_key, 3 * total)
    order = order_key.sort(dim=1, stable=True).indices[:, :num_nodes]  # (b, N): candidate at each new index
    new_index = torch.full_like(parents, -1).scatter(
        1, order, torch.arange(num_nodes, device=tokens.device).expand(batch, -1)
    )
    old_parents = parents.gather(1, order)
    new_parents = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp(min=0)), -1)
    return tokens.gather(1, order), new_parents


def drafted_candidates(
    logits: torch.Tensor,
    token_ids: torch.Tensor | None,
    branching: int,
    keys: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter's `branching` best tokens and their probabilities, best first: how every drafter chooses, eagerly
    and in the compiled drafting block.

    Args:
        logits (`torch.Tensor` of shape `(..., S)`): over the vocabulary, or over a shortlist `token_ids` (`(S,)`).
        keys (`torch.LongTensor` of shape `logits.shape[:-1]`, *optional*): a sampling call's noise keys at these
            logits' positions ([`DraftNoise.keys`]); with `branching` 1 the token is then the one sampling would
            draw from the drafter's distribution ([`draw_among_likely`], the noise hashed for the likely tokens
            only: hashing a whole vocabulary at every draft of 16 rows cost more than the drafting).
        temperature (`float`, defaults to 1.0): the sampling call's temperature.

    Returns:
        tokens (`torch.LongTensor` of shape `(..., branching)`) and probabilities (`torch.FloatTensor`, same shape);
        with `branching` 1 the token is the argmax (or the sampled token), as a chain drafter takes it.
    """
    probabilities = logits.float().softmax(dim=-1)
    if branching > 1:  # trees rank by the drafter's own probabilities, sampling or not
        top, best = probabilities.topk(branching, dim=-1)
    else:
        if keys is None:
            best = logits.argmax(dim=-1, keepdim=True)
        else:

            def noise_of(index: torch.Tensor) -> torch.Tensor:  # (..., K) indices into the logits -> their noise
                return gumbel(keys[..., None], index if token_ids is None else token_ids[index])

            best = draw_among_likely(logits, temperature, noise_of)
        top = probabilities.gather(-1, best)
    return (best if token_ids is None else token_ids[best]), top


def expanded_depths(num_drafts: int, branching: int, frontier: int, device: torch.device) -> torch.Tensor:
    """The depth of each candidate of an expanded tree (`FeatureDraftBlock`'s order), shape `(T,)`."""
    later = torch.arange(1, num_drafts, device=device).repeat_interleave(frontier * branching)
    return torch.cat([torch.zeros(branching, dtype=torch.long, device=device), later])

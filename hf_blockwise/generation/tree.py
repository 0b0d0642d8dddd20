"""Tree verification: one decoder call checks every node of a tree of drafts; the longest greedy path is kept.

A row's feed is its pending tokens (a chain) and then its tree's nodes, flat, each after its parent:

    columns   0 .. p-1      p .. p+n-1                      p+n ..
              pending       nodes (main chain first)        filler
    depth     0 .. p-1      p - 1 + the node's tree depth    own column

Column c sits at decoder position `cache_length + depth[c]` and attends to the cache and to its ancestors
(`boundary/tree.py`). The output at a column is greedy's next token after the path to it, so a node is right when its
token is its parent's greedy token and every node above it is right; the deepest right column wins (the first one
among equals: the main chain, which is laid out first). Its path is then a chain like any other: the cache is
compacted to it, the decoder states are gathered along it, and the step goes on as a chain's step does
(`generation/step.py`).

Exactness. A node off the main chain attends to ancestors that sit in other slots than a chain's would (with gaps
between them). Through the compiled engine this changes no bit: its attention sums over the keys in slot order
(`fixed_order.fixed_order_attention`), so the masked slots between add zeros, and every node gets the logits of its
path fed as a chain (`tests/test_trees.py`; the engine's probe checks a side branch on the machine). Eagerly,
transformers' attention may group its sums otherwise, and a near-tie may decide differently there. The main chain is
laid out where a chain would be, and every parent before its children.
"""

from __future__ import annotations

import torch

from hf_blockwise import boundary as hf
from hf_blockwise.drafters.base import Drafts
from hf_blockwise.generation.acceptance import ExactAcceptance, accepted_at
from hf_blockwise.generation.state import DecodingSetup, DecodingState, StepFeed


def tree_step_allowed(state: DecodingState, setup: DecodingSetup, drafts: Drafts) -> bool:
    """Whether this step can verify the drafts as a tree: they are one, and no logits processor that reads the
    prefix may act at any length the tree reaches (its nodes' prefixes differ by row, and such processors are called
    once per length for the whole batch). Otherwise the step verifies the main chain, with the same output."""
    if drafts.parents is None:
        return False
    # a column's depth is at most block_size - 1 (pending tokens, then at most block_size - pending drafts deep)
    deepest = state.cache_length + setup.block_size
    return not any(
        hf.processor_acts_at(processor, length)
        for processor in setup.logits_processor
        if not hf.processor_ignores_prefix(processor)
        for length in range(state.cache_length + 1, deepest + 1)
    )


def ancestry(parents: torch.Tensor) -> torch.Tensor:
    """`[b, i, j]`: column j is column i or one of its ancestors, from each column's parent (`-1`: none), shape
    `(b, W)` -> `(b, W, W)`; a transitive closure by repeated squaring."""
    width = parents.shape[1]
    eye = torch.eye(width, dtype=torch.bool, device=parents.device)
    reach = eye | (torch.nn.functional.one_hot(parents.clamp(min=0), width).bool() & (parents >= 0)[..., None])
    steps = 1
    while steps < width:
        reach_float = reach.float()
        reach = (reach_float @ reach_float) > 0
        steps *= 2
    return reach


def path_to(ancestors: torch.Tensor, depth: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """Each row's path from its first fed column to `column`: the column at each depth, the identity past its end.

    Args:
        ancestors (`torch.BoolTensor` of shape `(b, W, W)`) and depth (`torch.LongTensor` of shape `(b, W)`): a tree
            feed's structure ([`hf.TreeInputs`]).
        column (`torch.LongTensor` of shape `(b,)`): where each row's path ends.

    Returns:
        `torch.LongTensor` of shape `(b, W)`, for [`hf.compact_cache`] and gathering states along the path.
    """
    levels = torch.arange(depth.shape[1], device=depth.device)
    on_path = ancestors[torch.arange(ancestors.shape[0], device=depth.device), column]  # (b, W)
    at_depth = on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # (b, depth, column)
    return torch.where(at_depth.any(dim=2), at_depth.long().argmax(dim=2), levels)


def build_tree_feed(
    state: DecodingState, setup: DecodingSetup, drafts: Drafts, max_drafts: torch.Tensor
) -> tuple[StepFeed, hf.TreeInputs, torch.Tensor]:
    """Lays out each row's pending tokens and tree (module docstring).

    Args:
        drafts ([`Drafts`]) with `parents`; a node deeper than the row's `max_drafts` is fed but never accepted.

    Returns:
        the feed, its tree structure, and `parent_column` (`torch.LongTensor` of shape `(b, W)`): the column whose
        output judges each column's token (`-1` for column 0).
    """
    sequences, filler = state.sequences, setup.filler_token_id
    num_pending = state.lengths - state.cache_length  # (b,)
    width = state.max_pending + drafts.tokens.shape[1]
    if setup.position_limit is not None:  # the model numbers every column before the hook places it by depth
        width = min(width, setup.position_limit - state.cache_length)
    width = max(width, state.max_pending, 1)
    columns = torch.arange(width, device=sequences.device)  # (W,)
    node = (columns - num_pending[:, None]).clamp(0, max(drafts.tokens.shape[1] - 1, 0))  # (b, W)
    is_pending = columns < num_pending[:, None]
    is_node = ~is_pending & (columns - num_pending[:, None] < drafts.lengths[:, None])
    from_sequences = sequences[:, (state.cache_length + columns).clamp(max=sequences.shape[1] - 1)]
    tokens = torch.where(is_pending, from_sequences, filler)
    parent_column = columns.expand_as(node) - 1
    if drafts.tokens.shape[1] > 0:
        tokens = torch.where(is_node, drafts.tokens.gather(1, node), tokens)
        parent_column = torch.where(is_node, num_pending[:, None] + drafts.parents.gather(1, node), parent_column)
    ancestors = ancestry(torch.where(is_pending | is_node, parent_column, -1))  # filler: itself only
    depth = torch.where(is_pending | is_node, ancestors.sum(dim=2) - 1, columns)  # (b, W)
    is_draft = is_node & (depth - num_pending[:, None] + 1 <= max_drafts[:, None])
    feed = StepFeed(
        tokens=tokens,
        num_pending=num_pending,
        num_pending_fed=num_pending,
        num_drafts_fed=is_draft.sum(dim=1),
        deciding=torch.ones_like(is_pending[:, 0]),
    )
    return feed, hf.TreeInputs(depth=depth, ancestors=ancestors), torch.where(is_draft, parent_column, -1)


def tree_scores(setup: DecodingSetup, logits: torch.Tensor) -> torch.Tensor:
    """Processed scores at every column, shape `(b, W, V)`: only processors that ignore the prefix act on a tree
    step ([`tree_step_allowed`]), so one call over all columns is their composition."""
    return hf.apply_prefix_free_processors(setup.logits_processor, logits)


def verify_tree(
    scores: torch.Tensor, feed: StepFeed, tree: hf.TreeInputs, parent_column: torch.Tensor, setup: DecodingSetup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keeps each row's deepest node that greedy decoding would reach, and the base's own token after it.

    Args:
        scores (`torch.FloatTensor` of shape `(b, W, V)`): from [`tree_scores`].
        parent_column (`torch.LongTensor` of shape `(b, W)`): from [`build_tree_feed`]; `-1` where a column is no
            draft that may be accepted.

    Returns:
        new_tokens (`torch.LongTensor` of shape `(b, W + 1)`): the accepted path's drafts, then the base's token.
        num_accepted (`torch.LongTensor` of shape `(b,)`).
        path (`torch.LongTensor` of shape `(b, W)`): the fed column at each depth of the accepted path (the identity
            past its end), for [`hf.compact_cache`] and the states.
    """
    width = feed.tokens.shape[1]
    greedy = scores.argmax(dim=-1)  # (b, W)
    is_draft = parent_column >= 0
    judge = parent_column.clamp(min=0)
    if isinstance(setup.acceptance, ExactAcceptance):
        match = greedy.gather(1, judge) == feed.tokens
    else:
        index = judge[..., None].expand(-1, -1, scores.shape[2])
        # a node's place in its block is its depth past the pending tokens (MinimumBlockAcceptance forces by it)
        places = tree.depth - feed.num_pending[:, None]  # (b, W), < 0 at pending columns
        match = accepted_at(setup.acceptance, scores.gather(1, index), feed.tokens, places)
    columns = torch.arange(width, device=scores.device)
    right = (columns < feed.num_pending[:, None]) | (is_draft & match)  # (b, W)
    reached = ~(tree.ancestors & ~right[:, None, :]).any(dim=2)  # (b, W): the whole path to it is right
    best = torch.where(reached, tree.depth + 1, 0).argmax(dim=1)  # (b,): the first of the deepest
    path = path_to(tree.ancestors, tree.depth, best)  # (b, W)
    best_depth = tree.depth.gather(1, best[:, None])[:, 0]
    num_accepted = best_depth - (feed.num_pending - 1)
    offsets = torch.arange(width + 1, device=scores.device)
    path_tokens = feed.tokens.gather(1, path.gather(1, (feed.num_pending[:, None] + offsets[:-1]).clamp(max=width - 1)))
    path_tokens = torch.cat([path_tokens, path_tokens[:, -1:]], dim=1)  # (b, W + 1)
    bonus = greedy.gather(1, best[:, None])  # (b, 1)
    new_tokens = torch.where(offsets < num_accepted[:, None], path_tokens, bonus)
    return new_tokens, num_accepted, path

"""Tree verification (`generation/tree.py`): one call verifies a tree of drafts, the longest greedy path is kept.

Trees come from a drafter that is right most of the time and wrong sometimes, at every depth and on every branch:
random trees (any shape, parents before children) whose nodes follow the greedy output with some probability. The
output must be greedy's at batch 1, 3 and 8, eagerly and through the compiled engine; with int8 products the tree
call's logits are bitwise a chain call's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, VOCAB_SIZE, build_model, random_batch
from near_ties import assert_greedy_up_to_near_ties
from test_every_architecture import EXTRA
from test_exactness import heads_model
from test_feature_drafter import fitted_feature_drafter

from hf_blockwise import (
    CompositeDrafter,
    InputCopyDrafter,
    MinimumBlockAcceptance,
    blockwise_generate,
    quantize_dynamic_int8,
)
from hf_blockwise.drafters.base import Drafter, DraftRequest, Drafts
from hf_blockwise.drafters.feature import FeatureDrafter
from hf_blockwise.drafters.trees import ranked_tree, select_tree
from hf_blockwise.engine import CompileOptions, compiled_decoder
from hf_blockwise.generation.capability import UnsupportedModelError

# decoders with an absolute position module take trees; T5's relative positions and M2M100's positions counted from
# non-pad tokens are refused
TREE_ARCHITECTURES = ("bart", "mbart", "marian", "pegasus")
REFUSED = {"t5": "position module", "mt5": "position module", "m2m100": "non-pad"}
# beyond the core: the zoo's decoders without an absolute position module, or with positions counted from non-pad
# tokens, refuse trees; every other one takes them
EXTRA_REFUSED = {
    "encoder-decoder": "position module", "longt5": "position module", "switch_transformers": "position module",
    "t5gemma": "position module", "t5gemma2": "position module", "umt5": "position module",
    "nllb-moe": "non-pad", "seamless_m4t": "non-pad", "seamless_m4t_v2": "non-pad",
}  # fmt: skip
# prefix-free processors keep tree steps; prefix-reading ones make the steps they act on verify the main chain
TREE_ARGUMENTS = {
    "max_new_tokens": {"max_new_tokens": 24},
    "max_length": {"max_length": 17},
    "suppress_tokens": {"suppress_tokens": [5, 6], "max_new_tokens": 24},
    "several_eos": {"eos_token_id": [7, 11, 13], "max_new_tokens": 24},
    "repetition_penalty": {"repetition_penalty": 1.4, "max_new_tokens": 20},
    "min_new_tokens": {"min_new_tokens": 12, "max_new_tokens": 20},
}


class RandomTreeDrafter(Drafter):
    """Random trees of `tree_nodes` drafts whose nodes continue the reference with probability `right`.

    Node i's parent is a random earlier node (or the last verified token); its token is the reference's next token
    after the path to it when that path follows the reference and a coin says so, else a random token. The first
    `chain` nodes form the main chain.
    """

    def __init__(self, reference: torch.Tensor, block_size: int, tree_nodes: int, right: float, seed: int) -> None:
        self.reference, self.block_size, self.tree_nodes = reference, block_size, tree_nodes
        self.num_nodes = tree_nodes
        self.right, self.seed = right, seed

    def prepare(self, encoder_input_ids, encoder_attention_mask):
        return self.reference

    def select_rows(self, drafter_state, rows):
        return drafter_state.index_select(0, rows)

    def get_candidates(self, request: DraftRequest) -> Drafts:
        reference = request.drafter_state
        generator = torch.Generator().manual_seed(self.seed + int(request.lengths.sum()))
        batch, nodes = reference.shape[0], self.num_nodes
        parents = torch.full((batch, nodes), -1, dtype=torch.long)
        depth = torch.zeros(batch, nodes, dtype=torch.long)  # 1 for a child of the last verified token
        follows = torch.zeros(batch, nodes, dtype=torch.bool)
        tokens = torch.randint(3, VOCAB_SIZE, (batch, nodes), generator=generator)
        for node in range(nodes):
            if node < self.block_size - 1:  # the main chain
                parent = torch.full((batch,), node - 1)
            else:
                parent = (torch.rand(batch, generator=generator) * (node + 1)).long() - 1
            parent = torch.where(depth.gather(1, parent.clamp(min=0)[:, None])[:, 0] >= self.block_size - 1, -1, parent)
            parent_follows = torch.where(parent >= 0, follows.gather(1, parent.clamp(min=0)[:, None])[:, 0], True)
            parent_depth = torch.where(parent >= 0, depth.gather(1, parent.clamp(min=0)[:, None])[:, 0], 0)
            position = (request.lengths + parent_depth).clamp(max=reference.shape[1] - 1)
            coin = torch.rand(batch, generator=generator) < self.right
            tokens[:, node] = torch.where(
                parent_follows & coin, reference.gather(1, position[:, None])[:, 0], tokens[:, node]
            )
            parents[:, node], depth[:, node] = parent, parent_depth + 1
            follows[:, node] = parent_follows & coin
        return Drafts(tokens=tokens, lengths=torch.full((batch,), nodes, dtype=torch.long), parents=parents)


@pytest.mark.parametrize("arguments", sorted(TREE_ARGUMENTS))
@pytest.mark.parametrize("architecture", TREE_ARCHITECTURES)
def test_tree_drafts_give_greedys_output(tiny_models, architecture: str, arguments: str) -> None:
    base = tiny_models[architecture]
    kwargs = TREE_ARGUMENTS[arguments]
    for batch_size, seed, block_size, nodes in [(1, 0, 3, 4), (3, 1, 4, 7), (8, 2, 5, 9)]:
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, **kwargs)
        for right in (0.9, 0.5):
            drafter = RandomTreeDrafter(greedy, block_size, nodes, right, seed)
            output = base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, **kwargs)
            assert_greedy_up_to_near_ties(base, batch, greedy, output, **kwargs)


def test_a_tree_accepts_a_right_branch_beside_a_wrong_chain() -> None:
    """Every main-chain draft is wrong and every runner-up right: a chain step gains one token, a tree step two."""
    base = build_model("marian")
    batch = random_batch(base, 2, seed=3)
    kwargs = {"max_new_tokens": 16, "suppress_tokens": [base.config.eos_token_id], "forced_eos_token_id": None}
    kwargs["return_dict_in_generate"] = True
    greedy = base.generate(**batch, do_sample=False, num_beams=1, **kwargs).sequences

    class WrongChainRightSibling(Drafter):
        block_size, tree_nodes = 4, 6

        def get_candidates(self, request: DraftRequest) -> Drafts:
            positions = (request.lengths[:, None] + torch.arange(3)).clamp(max=greedy.shape[1] - 1)
            right = greedy[request.rows].gather(1, positions)  # (b, 3)
            tokens = torch.stack([(right + 1) % VOCAB_SIZE, right], dim=-1)  # (b, 3, 2): the chain wrong
            return ranked_tree(tokens, torch.tensor([0.6, 0.4]).expand(*tokens.shape).clone(), 6)

    output = base.generate(**batch, custom_generate=blockwise_generate, assistant=WrongChainRightSibling(), **kwargs)
    assert torch.equal(output.sequences, greedy)
    gained = output.decoding_stats.accepted[:-1]  # the last step may be cut by max_new_tokens
    assert bool((gained[gained > 0] == 2).all()), gained.T


@pytest.mark.parametrize("min_block", [2, 3])
def test_minimum_block_counts_places_in_the_block_on_trees_as_on_chains(min_block: int) -> None:
    """Every draft is a token the base never picks (suppressed): a step gains the `min_block - 1` forced drafts and
    the base's own token, `min_block` tokens, whether the drafts form a chain or a tree (forced by depth, not by
    column)."""
    base = build_model("marian")
    batch = random_batch(base, 2, seed=5)
    never = 5
    kwargs = {"max_new_tokens": 15, "suppress_tokens": [never, base.config.eos_token_id], "forced_eos_token_id": None}

    class NeverRight(Drafter):
        def __init__(self, tree_nodes: int | None) -> None:
            self.block_size, self.tree_nodes = 4, tree_nodes

        def get_candidates(self, request: DraftRequest) -> Drafts:
            tokens = torch.full((request.lengths.shape[0], 3), never)  # (b, 3)
            if self.tree_nodes is None:
                return Drafts(tokens=tokens, lengths=torch.full_like(request.lengths, 3))
            ranked = torch.stack([tokens, tokens], dim=-1)  # (b, 3, 2): two candidates per depth, both wrong
            return ranked_tree(ranked, torch.tensor([0.6, 0.4]).expand(*ranked.shape).clone(), self.tree_nodes)

    for tree_nodes in (None, 6):
        output = base.generate(
            **batch, custom_generate=blockwise_generate, assistant=NeverRight(tree_nodes),
            acceptance=MinimumBlockAcceptance(min_block=min_block), return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
        gained = output.decoding_stats.accepted[:-1]  # the last step may be cut by max_new_tokens
        assert bool((gained[gained > 0] == min_block).all()), (tree_nodes, gained.T)
        forced = output.sequences[:, 1:][:, : 15 - 15 % min_block].reshape(2, -1, min_block)
        assert bool((forced[..., :-1] == never).all()), (tree_nodes, output.sequences)  # the forced drafts kept


def test_compiled_tree_drafts_give_the_engines_greedy() -> None:
    """Trees through the int8 engine at batch 1 and 3 (each compiles graphs of its own): the engine's greedy, bitwise,
    and the engine's probe found every tree call computing what chain calls compute, side branches included (a
    side branch's node sits at another slot than in its chain; attention sums the keys in slot order, so the masked
    slots between add zeros: `fixed_order.fixed_order_attention`). The position hook that places a tree's columns
    by depth is the eager one, tested on every tree architecture above."""
    base = quantize_dynamic_int8(build_model("marian"))
    kwargs = {"max_new_tokens": 20, "custom_generate": blockwise_generate, "blockwise_compile": True}
    for batch_size, seed in ((1, 0), (3, 1)):
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, **kwargs)
        assert_greedy_up_to_near_ties(base, batch, base.generate(**batch, max_new_tokens=20), greedy, max_new_tokens=20)
        for right in (1.0, 0.7):
            drafter = RandomTreeDrafter(greedy, 4, 8, right, seed)
            assert torch.equal(base.generate(**batch, assistant=drafter, **kwargs), greedy), (batch_size, right)
    verdicts = compiled_decoder(base, CompileOptions()).verdicts
    assert {("one row", True), ("several rows", True)} <= set(verdicts)
    assert all(verdict.claimed and verdict.bitwise for verdict in verdicts.values())


@pytest.mark.parametrize("architecture", sorted(REFUSED))
def test_decoders_that_cannot_take_trees_are_refused_clearly(tiny_models, architecture: str) -> None:
    base = tiny_models[architecture]
    batch = random_batch(base, 1, seed=0)
    drafter = RandomTreeDrafter(torch.zeros(1, 30, dtype=torch.long), 3, 4, 0.5, 0)
    with pytest.raises(UnsupportedModelError, match=REFUSED[architecture]):
        base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, max_new_tokens=8)


def test_a_drafter_returning_trees_must_declare_them(tiny_models) -> None:
    base = tiny_models["marian"]
    batch = random_batch(base, 1, seed=0)
    undeclared = RandomTreeDrafter(torch.zeros(1, 30, dtype=torch.long), 3, 4, 0.5, 0)
    undeclared.tree_nodes = 2  # returns trees of 4
    with pytest.raises(ValueError, match="declares tree_nodes=2"):
        base.generate(**batch, custom_generate=blockwise_generate, assistant=undeclared, max_new_tokens=8)


def test_ranked_tree_keeps_the_best_nodes_by_cumulative_probability() -> None:
    tokens = torch.arange(12).reshape(1, 4, 3)
    probabilities = torch.tensor([[[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1], [0.99, 0.01, 0.0]]])
    drafts = ranked_tree(tokens, probabilities, 6)
    # chain 0.6, 0.54, 0.27, 0.267; runners-up 0.3 (depth 0), 0.216 (depth 2); then 0.03 (depth 1) is left out
    assert drafts.tokens.tolist() == [[0, 3, 6, 9, 1, 7]]
    assert drafts.parents.tolist() == [[-1, 0, 1, 2, -1, 1]]
    assert drafts.main_chain().lengths.tolist() == [4]


def test_every_core_architecture_is_covered() -> None:
    assert set(TREE_ARCHITECTURES) | set(REFUSED) == set(ARCHITECTURES)
    assert set(EXTRA_REFUSED) < set(EXTRA)


def test_feature_drafter_trees_give_greedys_output() -> None:
    """A partly trained feature drafter (right sometimes) grows trees EAGLE-2's way (2 and 3 candidates per node,
    as many expanded per depth) and as runners-up of one chain: greedy's output at batch 1 and 4 (the engine's
    trees: `test_compiled_tree_drafts_give_the_engines_greedy`)."""
    model, _, _ = fitted_feature_drafter("marian", steps=40)
    base = model.base_model
    kwargs = {"max_new_tokens": 20, "custom_generate": blockwise_generate}
    for batch_size, seed in ((1, 3), (4, 4)):
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, **kwargs)
        for nodes, branching, frontier in ((6, 2, 2), (10, 3, 3), (5, 2, 0)):
            drafter = FeatureDrafter(
                model, block_size=4, tree_nodes=nodes, tree_branching=branching, tree_frontier=frontier
            )
            output = base.generate(**batch, assistant=drafter, **kwargs)
            assert torch.equal(output, greedy), (batch_size, nodes, branching, frontier)
        # the source copy's chains beside the drafter's trees (random sources: the copy is right rarely)
        composite = CompositeDrafter(InputCopyDrafter(base, max_draft_length=3), FeatureDrafter(model, 4, tree_nodes=6))
        assert composite.tree_nodes == 6
        assert torch.equal(base.generate(**batch, assistant=composite, **kwargs), greedy)


def test_heads_trees_give_greedys_output(tiny_models) -> None:
    base = tiny_models["bart"]
    heads = heads_model(base, block_size=4, seed=0, zero=False)
    for batch_size, seed in ((1, 0), (3, 1)):
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=20)
        output = heads.generate(**batch, assistant=heads.drafter(tree_nodes=5, tree_branching=3), max_new_tokens=20)
        assert_greedy_up_to_near_ties(base, batch, greedy, output, max_new_tokens=20)


def test_tree_options_are_checked() -> None:
    model, _, _ = fitted_feature_drafter("marian", steps=0)
    with pytest.raises(ValueError, match="tree_nodes=20 is more than the 10 candidates"):
        FeatureDrafter(model, block_size=4, tree_nodes=20, tree_branching=2, tree_frontier=2)
    with pytest.raises(ValueError, match="tree_frontier must be an int from 0 to tree_branching=2"):
        FeatureDrafter(model, block_size=4, tree_nodes=6, tree_branching=2, tree_frontier=3)
    with pytest.raises(ValueError, match="threshold cuts chains"):
        FeatureDrafter(model, block_size=4, tree_nodes=6, threshold=0.3)


@pytest.mark.parametrize("architecture", EXTRA)
def test_every_architecture_takes_trees_exactly_or_refuses_them(architecture: str) -> None:
    """Beyond the core architectures: random trees give greedy's output (batch 1 and 5, a prefix-free processor so
    that tree steps run) on every decoder but `EXTRA_REFUSED`'s, which are refused with an `UnsupportedModelError`
    that says why."""
    base = build_model(architecture)
    kwargs = {"max_new_tokens": 16, "suppress_tokens": [5]}
    for batch_size, seed in ((1, 0), (5, 1)):
        batch = random_batch(base, batch_size, seed)
        greedy = base.generate(**batch, do_sample=False, num_beams=1, **kwargs)
        drafter = RandomTreeDrafter(greedy, 4, 7, 0.8, seed)
        if architecture in EXTRA_REFUSED:
            with pytest.raises(UnsupportedModelError, match=f"tree drafts: .*{EXTRA_REFUSED[architecture]}"):
                base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, **kwargs)
            continue
        output = base.generate(**batch, custom_generate=blockwise_generate, assistant=drafter, **kwargs)
        assert_greedy_up_to_near_ties(base, batch, greedy, output, **kwargs)


def test_select_tree_lays_every_parent_before_its_children() -> None:
    """The deepest kept node may be shallower than the candidates' depths (the walk up its path then passes the
    root): the main chain still comes first, and every parent before its children, as a bitwise tree call needs
    (attention sums a node's ancestors in slot order)."""
    tokens = torch.arange(7)[None]
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2, 4]])
    depth = torch.tensor([[0, 0, 1, 1, 1, 2, 2]])
    scores = torch.tensor([[0.6, 0.4, 0.5, 0.1, 0.2, 0.45, 0.05]])
    drafts = select_tree(tokens, parents, depth, scores, num_nodes=5, num_depths=4)
    # kept: 0, 2, 5, 1, 4; the deepest kept is 5 (depth 2 of 4), its path 0 -> 2 -> 5 comes first
    assert drafts.tokens.tolist() == [[0, 2, 5, 1, 4]]
    assert drafts.parents.tolist() == [[-1, 0, 1, -1, 3]]
    assert bool((drafts.parents < torch.arange(5)).all())

"""Sampling through the loop (`generation/sampling.py`): greedy search on scores perturbed by noise shared by
(seed, row, position, token). Its output is transformers' greedy search with the same warpers and the same noise as
a logits processor, token for token; the same with drafts (chains and trees) as without; and each token is drawn from
the warped distribution (chi-square over thousands of rows; a mutation that shares the noise between rows fails)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import OracleDrafter, random_batch
from scipy.stats import chisquare
from test_trees import RandomTreeDrafter
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    Drafter,
    DraftNoise,
    DraftRequest,
    Drafts,
    FeatureDrafterConfig,
    FeatureDrafterModel,
    blockwise_generate,
)
from hf_blockwise.engine import CompileOptions
from hf_blockwise.generation import step as step_module
from hf_blockwise.generation.sampling import call_seed, perturbed_scores, shared_gumbel_noise

# generate arguments, and the warpers transformers builds from them, in its order
WARPERS = {
    "temperature": ({"temperature": 0.7}, [TemperatureLogitsWarper(0.7)]),
    "top_k": ({"temperature": 1.3, "top_k": 6}, [TemperatureLogitsWarper(1.3), TopKLogitsWarper(6)]),
    "top_p": ({"top_p": 0.8}, [TopPLogitsWarper(0.8)]),
    "min_p": ({"min_p": 0.05}, [MinPLogitsWarper(0.05)]),
    "typical_p": ({"typical_p": 0.9}, [TypicalLogitsWarper(0.9)]),
}


class SharedNoise(LogitsProcessor):
    """The loop's perturbation as a processor of transformers' greedy search: row i of the batch, at the position
    its prefix's length gives."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(input_ids.shape[0])
        positions = torch.full((input_ids.shape[0], 1), input_ids.shape[1])
        return perturbed_scores(scores[:, None], self.seed, rows, positions)[:, 0]


def _sampled(model, batch: dict, seed: int, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(**batch, do_sample=True, custom_generate=blockwise_generate, **kwargs)


@pytest.mark.parametrize("warpers", sorted(WARPERS))
@pytest.mark.parametrize("architecture", ["marian", "t5"])
def test_sampling_is_greedy_search_on_the_shared_noise_with_or_without_drafts(
    tiny_models, architecture: str, warpers: str
) -> None:
    base = tiny_models[architecture]
    arguments, warper_list = WARPERS[warpers]
    for batch_size, seed in ((1, 0), (3, 1)):
        batch = random_batch(base, batch_size, seed=seed)
        kwargs = {"max_new_tokens": 12, **arguments}
        sampled = _sampled(base, batch, seed, **kwargs)
        torch.manual_seed(seed)
        noise = SharedNoise(call_seed())  # the seed the call draws first
        reference = base.generate(
            **batch, do_sample=False, max_new_tokens=12, logits_processor=LogitsProcessorList([*warper_list, noise])
        )
        assert torch.equal(sampled, reference), (batch_size, sampled, reference)
        for corruption in (0.0, 0.4):  # drafts right, and right most of the time
            drafter = OracleDrafter(sampled, block_size=4, corruption=corruption, seed=seed)
            assert torch.equal(_sampled(base, batch, seed, assistant=drafter, **kwargs), sampled), corruption


def test_sampled_trees_and_the_engine_give_the_undrafted_tokens(tiny_models) -> None:
    """Trees (a node at depth d decides position d, on any branch: the same noise) and the compiled engine's
    verification (dynamo alone here: the scores are perturbed eagerly after it)."""
    base = tiny_models["marian"]
    kwargs = {"max_new_tokens": 14, "temperature": 0.8, "top_p": 0.95}
    for batch_size, seed in ((1, 2), (3, 3)):
        batch = random_batch(base, batch_size, seed=seed)
        sampled = _sampled(base, batch, seed, **kwargs)
        for right in (1.0, 0.6):
            tree = RandomTreeDrafter(sampled, 4, 7, right, seed)
            assert torch.equal(_sampled(base, batch, seed, assistant=tree, **kwargs), sampled), right
        drafter = OracleDrafter(sampled, block_size=3, corruption=0.3, seed=seed)
        compiled = _sampled(base, batch, seed, assistant=drafter, blockwise_compile=CompileOptions(backend="eager"),
                            **kwargs)  # fmt: skip
        assert torch.equal(compiled, sampled)


class SelfDrafter(Drafter):
    """Drafts with the model itself, one token at a time over the whole prefix (no cache), each token chosen on
    `DraftRequest.sampling` (the call's noise at the draft's position): what sampling draws, so every draft is
    kept. `shift` moves the positions it reads the noise at (a wrong contract, whose drafts are mostly refused)."""

    def __init__(self, base, block_size: int, encoder_batch: dict, shift: int = 0) -> None:
        self.base, self.block_size, self.encoder_batch, self.shift = base, block_size, encoder_batch, shift
        self.tree_nodes = None

    @torch.no_grad()
    def get_candidates(self, request: DraftRequest) -> Drafts:
        assert request.sampling is not None and request.rows is not None
        rows, lengths = request.rows, request.lengths
        prefix = request.sequences[:, : int(lengths.max())]
        drafts = []
        for index in range(self.block_size - 1):
            fed = torch.cat([prefix, *[draft[:, None] for draft in drafts]], dim=1)
            at = (lengths - 1 + index)[:, None, None].expand(-1, 1, self.base.config.vocab_size)
            logits = self.base(
                input_ids=self.encoder_batch["input_ids"][rows],
                attention_mask=self.encoder_batch["attention_mask"][rows],
                decoder_input_ids=self._placed(fed, lengths, index),
            ).logits.gather(1, at)[:, 0]  # (b, V): the logits that decide position lengths + index
            at = (lengths + index + self.shift)[:, None]
            noise = request.sampling.noise(at, torch.arange(logits.shape[-1]))[:, 0]  # (b, V)
            drafts.append((logits / request.sampling.temperature + noise).argmax(dim=-1))
        tokens = torch.stack(drafts, dim=1)
        return Drafts(tokens=tokens, lengths=torch.full_like(lengths, self.block_size - 1))

    @staticmethod
    def _placed(fed: torch.Tensor, lengths: torch.Tensor, index: int) -> torch.Tensor:
        """Each row's verified tokens, then its drafts so far right after them (rows are right-padded)."""
        placed = fed.clone()
        width = fed.shape[1] - index
        for row, length in enumerate(lengths.tolist()):
            placed[row, length : length + index] = fed[row, width:]
        return placed


def test_drafters_draft_what_sampling_draws_on_the_calls_noise(tiny_models) -> None:
    """A drafter that drafts from the model's own distribution on `DraftRequest.sampling` (temperature and noise
    at each draft's position) proposes exactly what sampling draws: every draft is kept, so each row takes 4 tokens a
    call, at batch 1 and 3; the same drafter reading the noise one position off is mostly refused (at least twice
    the calls). Heads and the feature drafter draft on the noise too, and give the undrafted tokens."""
    base = tiny_models["marian"]
    kwargs = {"max_new_tokens": 12, "temperature": 0.9}
    for batch_size, seed in ((1, 5), (3, 6)):
        batch = random_batch(base, batch_size, seed=seed)
        sampled = _sampled(base, batch, seed, **kwargs)
        calls = {}
        for shift in (0, 1):
            drafter = SelfDrafter(base, 4, batch, shift)
            output = _sampled(base, batch, seed, assistant=drafter, return_dict_in_generate=True, **kwargs)
            assert torch.equal(output.sequences, sampled), shift
            calls[shift] = output.decoding_stats.num_forwards
            longest = int(output.decoding_stats.accepted.sum(dim=0).max())  # (steps, rows): the longest row's tokens
        assert calls[0] == -(-longest // 4) and calls[1] >= 2 * calls[0], (calls, longest)
        heads = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3)).drafter()
        feature = FeatureDrafterModel(base, FeatureDrafterConfig(block_size=3)).drafter()
        for drafter in (heads, feature):
            assert torch.equal(_sampled(base, batch, seed, assistant=drafter, **kwargs), sampled), type(drafter)
        if batch_size == 1:  # the feature drafter's drafting block (batch 1 under an engine) drafts on the noise too
            eager = _sampled(base, batch, seed, assistant=feature, return_dict_in_generate=True, **kwargs)
            engine = CompileOptions(backend="eager")  # dynamo alone: the block's arithmetic is the module's
            block = _sampled(base, batch, seed, assistant=feature, return_dict_in_generate=True,
                             blockwise_compile=engine, **kwargs)  # fmt: skip
            assert torch.equal(block.sequences, sampled)
            assert torch.equal(block.decoding_stats.accepted, eager.decoding_stats.accepted)  # the same drafts kept


def test_the_noise_of_kept_tokens_alone_is_the_whole_vocabularys_noise_there() -> None:
    """`perturbed_scores` hashes the noise of the tokens the warpers keep only: bit for bit the whole vocabulary's
    noise at those tokens, `-inf` elsewhere; a drafter's candidates get the same draws (`DraftNoise.noise`, what
    `drafted_candidates` draws with)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, 500, generator=generator)
    rows, positions = torch.tensor([0, 2, 5]), torch.randint(1, 40, (3, 4), generator=generator)
    whole = scores + shared_gumbel_noise(11, rows, positions, 500)
    assert torch.equal(perturbed_scores(scores, 11, rows, positions), whole)
    warped = scores.masked_fill(torch.rand(3, 4, 500, generator=generator) < 0.9, float("-inf"))
    assert torch.equal(
        perturbed_scores(warped, 11, rows, positions), warped + shared_gumbel_noise(11, rows, positions, 500)
    )
    candidates = torch.randint(500, (3, 4, 7), generator=generator)  # per-row token ids broadcast against the keys
    picked = shared_gumbel_noise(11, rows, positions, 0, candidates)
    assert torch.equal(picked, shared_gumbel_noise(11, rows, positions, 500).gather(-1, candidates))
    drafts = DraftNoise(seed=11, rows=rows, temperature=1.0)
    assert torch.equal(drafts.noise(positions, candidates), picked)


def _sampled_rows(base, rows: int, seed: int, **kwargs) -> torch.Tensor:
    """`rows` copies of one source, sampled: the whole sequences, shape `(rows, 1 + generated)`."""
    source = random_batch(base, 1, seed=9)
    batch = {name: value.expand(rows, -1) for name, value in source.items()}  # one source, `rows` times
    return _sampled(base, batch, seed, **kwargs)


def _warped_probabilities(base, prefix: list[int], warper_list: list) -> torch.Tensor:
    """The warped distribution of the token after the decoder start and `prefix`, shape `(V,)`."""
    with torch.no_grad():
        start = torch.tensor([[base.generation_config.decoder_start_token_id, *prefix]])
        logits = base(**random_batch(base, 1, seed=9), decoder_input_ids=start).logits[:, -1]  # (1, V)
    return torch.softmax(LogitsProcessorList(warper_list)(start, logits), dim=-1)[0]


def _chi_square(tokens: torch.Tensor, probabilities: torch.Tensor) -> float:
    """The p-value of `tokens` (samples) against `probabilities`, bins of expected count under 5 pooled."""
    counts = torch.bincount(tokens, minlength=probabilities.shape[0]).double()
    expected = probabilities.double() / probabilities.double().sum() * tokens.shape[0]  # float32 sums drift
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = wanted > 0
    return float(chisquare(observed[keep].numpy(), wanted[keep].numpy()).pvalue)


# the chi-square family: every warper's test at each of its first POSITIONS positions, failed by a correct loop with
# probability under FAMILY_ALPHA
FAMILY_ALPHA, POSITIONS = 0.01, 3


def _positions_p_values(base, sequences: torch.Tensor, warper_list: list) -> list[float]:
    """For positions 1..3: the p-value of the tokens drawn there, among the rows that share the most common prefix
    before it, against the model's warped distribution after that prefix (position 1: every row)."""
    generated, p_values = sequences[:, 1:], []
    for position in range(POSITIONS):
        prefix, rows = generated[0, :0], torch.ones(generated.shape[0], dtype=torch.bool)  # position 1: every row
        if position > 0:
            prefixes, counts = generated[:, :position].unique(dim=0, return_counts=True)
            prefix = prefixes[counts.argmax()]  # (position,)
            rows = (generated[:, :position] == prefix).all(dim=1)
        probabilities = _warped_probabilities(base, prefix.tolist(), warper_list)
        p_values.append(_chi_square(generated[rows, position], probabilities))
    return p_values


@pytest.mark.parametrize("warpers", sorted(WARPERS))
def test_each_token_is_drawn_from_the_warped_distribution(tiny_models, warpers: str, monkeypatch) -> None:
    """20,000 rows of one source sample 3 tokens, with drafts right most of the time (the same tokens as without):
    at each of the first 3 positions, among the rows sharing the most common prefix, a chi-square test against the
    warped softmax of the model's logits after that prefix passes; a loop whose noise is shared between rows, or that
    verifies drafts against unperturbed scores (two wrong constructions), fails it."""
    base = tiny_models["marian"]
    arguments, warper_list = WARPERS[warpers]
    kwargs = {"max_new_tokens": 3, "eos_token_id": None, **arguments}  # no row ends before its 3 tokens
    sequences = _sampled_rows(base, 20_000, seed=4, **kwargs)
    drafter = OracleDrafter(sequences, block_size=3, corruption=0.3, seed=4)
    assert torch.equal(_sampled_rows(base, 20_000, seed=4, assistant=drafter, **kwargs), sequences)
    # the suite fails if any of the family's p-values is rejected: Holm's first step (Bonferroni on the smallest) keeps
    # a correct loop's chance of failing under 1% over every warper and position
    assert min(_positions_p_values(base, sequences, warper_list)) > FAMILY_ALPHA / (len(WARPERS) * POSITIONS)

    def shared_between_rows(scores, seed, rows, positions):
        return perturbed_scores(scores, seed, torch.zeros_like(rows), positions)

    for mutation in (shared_between_rows, lambda scores, *_: scores):
        monkeypatch.setattr(step_module, "perturbed_scores", mutation)
        wrong = _sampled_rows(base, 20_000, seed=4, assistant=drafter, **kwargs)
        assert min(_positions_p_values(base, wrong, warper_list)) < 1e-6


def test_beam_sampling_is_refused_by_name(tiny_models) -> None:
    base = tiny_models["marian"]
    batch = random_batch(base, 1, seed=0)
    with pytest.raises(ValueError, match="do_sample=True selects 'beam_sample'"):
        base.generate(**batch, do_sample=True, num_beams=2, custom_generate=blockwise_generate, max_new_tokens=4)


def _rows_ending_apart(base, batch: dict, max_new_tokens: int) -> list[int]:
    """Stop tokens (besides EOS) that greedy search emits early in some rows, chosen so that the rows end at as many
    different steps as there are rows (a row ends at its first stop token; greedy's earlier tokens do not change)."""
    free_running = base.generate(**batch, max_new_tokens=max_new_tokens)[:, 1:].tolist()
    candidates = sorted({token for row in free_running for token in row})
    for pair in itertools.combinations(candidates, 2):
        eos = {*pair, base.config.eos_token_id}
        ends = {next((i for i, token in enumerate(row) if token in eos), len(row)) for row in free_running}
        if len(ends) == len(free_running):
            return sorted(eos)
    raise AssertionError("no stop tokens end these rows apart")


@pytest.mark.parametrize("architecture", ["bart", "t5"])  # the tiny Marian repeats one token
def test_output_scores_and_logits_are_the_searchs_and_nan_after_a_rows_end(tiny_models, architecture: str) -> None:
    """`output_scores=True` and `output_logits=True` through the loop with drafts (right most of the time): greedy
    search's processed scores of every generated token, and sampling's warped ones (transformers' greedy search on
    the warpers and the shared noise scores them perturbed: the same once the noise is taken off), and the raw logits;
    NaN where a row has ended and transformers scores the padding it feeds. Up to float: a verification call sums in
    another order than one-token calls."""
    base = tiny_models[architecture]
    batch = random_batch(base, 3, seed=7)
    eos = _rows_ending_apart(base, batch, 14)
    kwargs = {"max_new_tokens": 14, "eos_token_id": eos, "return_dict_in_generate": True, "output_scores": True,
              "output_logits": True}  # fmt: skip
    pad = base.generation_config.pad_token_id
    for sample in (False, True):
        seed, arguments, warpers = 8, *WARPERS["top_k"]
        torch.manual_seed(seed)
        noise = SharedNoise(call_seed())
        processors = LogitsProcessorList([*warpers, noise] if sample else [])
        expected = base.generate(**batch, **kwargs, do_sample=False, logits_processor=processors,
                                 **(arguments if sample else {}))  # fmt: skip
        lengths = (expected.sequences[:, 1:] != pad).sum(dim=1)
        assert sample or len(set(lengths.tolist())) == 3, "rows end at different steps"
        drafter = OracleDrafter(expected.sequences, block_size=4, corruption=0.3, seed=seed)
        torch.manual_seed(seed)
        output = base.generate(**batch, **kwargs, do_sample=sample, custom_generate=blockwise_generate,
                               assistant=drafter, **(arguments if sample else {}))  # fmt: skip
        assert torch.equal(output.sequences, expected.sequences)
        assert len(output.scores) == len(expected.scores) == len(output.logits) == int(lengths.max())
        for step, (scores, reference) in enumerate(zip(output.scores, expected.scores, strict=True)):
            if sample:  # the reference's kept tokens carry the noise of their row and position
                positions = torch.full((3, 1), step + 1)
                noise_there = shared_gumbel_noise(noise.seed, torch.arange(3), positions, reference.shape[-1])[:, 0]
                reference = reference - noise_there
            _assert_live_rows_close(scores, reference, step < lengths)
            _assert_live_rows_close(output.logits[step], expected.logits[step], step < lengths)


def _assert_live_rows_close(values: torch.Tensor, reference: torch.Tensor, live: torch.Tensor) -> None:
    """NaN in the rows that have ended, none in the others, whose values are the reference's up to float (where the
    reference is finite: warpers remove tokens)."""
    assert torch.isnan(values[~live]).all() and not torch.isnan(values[live]).any()
    finite = torch.isfinite(reference[live])
    assert torch.equal(torch.isfinite(values[live]), finite)
    scale = float(reference[live][finite].abs().max())  # T5's scores reach ~80
    torch.testing.assert_close(values[live][finite], reference[live][finite], atol=2e-5 * scale, rtol=0)


def test_output_scores_with_trees_are_refused_by_name(tiny_models) -> None:
    base = tiny_models["marian"]
    batch = random_batch(base, 1, seed=0)
    tree = RandomTreeDrafter(base.generate(**batch, max_new_tokens=6), 4, 7, 1.0, 0)
    with pytest.raises(ValueError, match="output_scores=True is not supported with a drafter of trees"):
        base.generate(**batch, custom_generate=blockwise_generate, assistant=tree, max_new_tokens=6,
                      return_dict_in_generate=True, output_scores=True)  # fmt: skip

"""BlockwiseHeadsModel as users meet it: wrapping, heads, save/load, generate arguments, streaming, errors."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os

import pytest
import torch
from conftest import ARCHITECTURES, build_model, load_recipe_module, random_batch
from safetensors import safe_open
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer

from hf_blockwise import (
    BlockwiseHeadsConfig,
    BlockwiseHeadsModel,
    DecodingStats,
    DraftRequest,
    blockwise_generate,
    frequent_tokens,
    greedy_divergences,
)
from hf_blockwise import boundary as hf
from hf_blockwise.boundary import output_projection_logits
from hf_blockwise.loading import SHIPPED_MODEL, LoadedModel, load_model
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.tools.bench import BenchSetup, run_bench


def draft(drafter, request: DraftRequest):
    """One drafting step outside the loop: the drafter's per-call state first, as `generate` prepares it."""
    return drafter.get_candidates(dataclasses.replace(request, drafter_state=drafter.prepare(None, None)))


def trained_looking_heads(base, block_size: int = 4, seed: int = 0) -> BlockwiseHeadsModel:
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=block_size))
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.heads.down.weight, std=1.0)
    return model


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_untrained_heads_copy_p1(tiny_models, architecture: str) -> None:
    """Zero-initialised heads through the base's own projection (bias, T5 rescaling) reproduce its logits."""
    base = tiny_models[architecture]
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3))
    batch = random_batch(base, 2, seed=3)
    with torch.no_grad():
        output = model(**batch, decoder_input_ids=torch.randint(3, 50, (2, 5)))
    assert output.head_logits.shape == (2, 5, 2, base.config.vocab_size)
    for head in range(2):
        torch.testing.assert_close(output.head_logits[:, :, head], output.logits, rtol=1e-5, atol=1e-5)


def test_output_projection_applies_final_logits_bias(tiny_models) -> None:
    base = tiny_models["marian"]
    states = torch.randn(3, base.config.d_model)
    expected = base.lm_head(states) + base.final_logits_bias
    torch.testing.assert_close(output_projection_logits(base, states), expected)


def test_config_is_filled_from_base_and_validated(tiny_models) -> None:
    model = BlockwiseHeadsModel(tiny_models["t5"], BlockwiseHeadsConfig(block_size=5))
    assert model.config is tiny_models["t5"].config
    config = model.blockwise_config
    assert config.num_heads == 4
    assert config.head_hidden_size == 48  # the base decoder's d_ff
    assert (config.base_model_type, config.hidden_size, config.vocab_size) == ("t5", 32, 64)
    assert model.heads.up.out_features == 4 * 48 and model.heads.down.out_features == 4 * 32
    round_trip = BlockwiseHeadsConfig.from_dict(json.loads(config.to_json_string()))
    assert round_trip == config
    for bad in ({"block_size": 1}, {"block_size": 2.5}, {"block_size": True}, {"head_hidden_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BlockwiseHeadsConfig(**bad)
    with pytest.raises(ValueError, match="Unknown BlockwiseHeadsConfig keys"):
        BlockwiseHeadsConfig.from_dict({"block_size": 3, "heads": 2})


def test_save_and_load_round_trip(tmp_path, tiny_models) -> None:
    base = tiny_models["bart"]
    model = trained_looking_heads(base, block_size=4)
    batch = random_batch(base, 8, seed=4)
    before = model.generate(**batch, max_new_tokens=20, return_dict_in_generate=True)

    base_dir, heads_dir = tmp_path / "base", tmp_path / "heads"
    base.save_pretrained(base_dir)
    model.save_pretrained(heads_dir, base_model_name_or_path=str(base_dir))
    assert sorted(os.listdir(heads_dir)) == ["blockwise_config.json", "blockwise_heads.safetensors"]
    saved_config = json.loads((heads_dir / "blockwise_config.json").read_text())
    assert saved_config["base_model_name_or_path"] == str(base_dir) and saved_config["block_size"] == 4

    attached = BlockwiseHeadsModel.from_pretrained(heads_dir, base_model=base)
    loaded = BlockwiseHeadsModel.from_pretrained(heads_dir)  # loads the base named in the config
    for other in (attached, loaded):
        after = other.generate(**batch, max_new_tokens=20, return_dict_in_generate=True)
        assert torch.equal(after.sequences, before.sequences)
        assert torch.equal(after.decoding_stats.accepted, before.decoding_stats.accepted)
    assert torch.equal(before.sequences, base.generate(**batch, max_new_tokens=20))


@pytest.mark.parametrize(
    ("other", "mismatch"),
    [("t5", "base_model_type"), ("mbart", "base_model_type"), ("bart_wide", "hidden_size"), ("bart_vocab", "vocab")],
)
def test_heads_refuse_a_base_that_does_not_fit(tmp_path, tiny_models, other: str, mismatch: str) -> None:
    trained_looking_heads(tiny_models["bart"]).save_pretrained(tmp_path)
    if other == "bart_wide":
        from transformers import BartConfig, BartForConditionalGeneration

        base = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=48, encoder_layers=1, decoder_layers=1))
    elif other == "bart_vocab":
        base = build_model("bart")
        base.resize_token_embeddings(80)
    else:
        base = tiny_models[other]
    with pytest.raises(ValueError, match=rf"do not fit the base model.*{mismatch}.*heads expect .* base has"):
        BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)


def test_corrupt_or_missing_files_give_clear_errors(tmp_path, tiny_models) -> None:
    base = tiny_models["bart"]
    trained_looking_heads(base).save_pretrained(tmp_path)
    weights = tmp_path / "blockwise_heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)
    (tmp_path / "blockwise_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)
    with pytest.raises(FileNotFoundError, match=r"holds no blockwise_config\.json"):
        BlockwiseHeadsModel.from_pretrained(tmp_path / "..", base_model=base)
    (tmp_path / "blockwise_config.json").write_text(json.dumps({"block_size": 4}))
    with pytest.raises(ValueError, match="names no base checkpoint"):
        BlockwiseHeadsModel.from_pretrained(tmp_path)


def test_heads_of_another_block_size_are_refused(tmp_path, tiny_models) -> None:
    base = tiny_models["bart"]
    trained_looking_heads(base, block_size=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "blockwise_config.json").read_text())
    (tmp_path / "blockwise_config.json").write_text(json.dumps({**config, "block_size": 6}))
    with pytest.raises(ValueError, match="do not match the config"):
        BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path) -> None:
    target = tmp_path / "blockwise_config.json"
    atomic_write_text(target, "old")

    with pytest.raises(TypeError):
        atomic_write_text(target, 123)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["blockwise_config.json"]  # no temporary file left behind


def test_return_dict_carries_decoding_stats(tiny_models) -> None:
    base = tiny_models["pegasus"]
    model = trained_looking_heads(base, block_size=4)
    batch = random_batch(base, 3, seed=5)
    output = model.generate(**batch, max_new_tokens=16, return_dict_in_generate=True)
    stats = output.decoding_stats
    assert isinstance(stats, DecodingStats)
    assert stats.accepted.shape == (stats.num_forwards, 3)
    assert stats.accepted.max() <= 4 and stats.accepted[0].tolist() == [1, 1, 1]  # nothing to verify at prefill
    generated = (output.sequences[:, 1:] != base.config.pad_token_id).sum(dim=1)
    assert torch.equal(stats.accepted.sum(dim=0), generated)
    active = stats.accepted > 0
    assert stats.mean_accepted == pytest.approx(float(stats.accepted[active].float().mean()))
    assert output.past_key_values is None
    plain = model.generate(**batch, max_new_tokens=16)
    assert torch.equal(plain, output.sequences)


class RecordingStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("through", ["heads_model", "custom_generate"])
def test_streamer_receives_every_token_then_end(tiny_models, through: str) -> None:
    base = tiny_models["marian"]
    batch = random_batch(base, 1, seed=6)
    greedy = base.generate(**batch, max_new_tokens=20)
    streamer = RecordingStreamer()
    if through == "heads_model":
        trained_looking_heads(base).generate(**batch, max_new_tokens=20, streamer=streamer)
    else:
        base.generate(**batch, max_new_tokens=20, streamer=streamer, custom_generate=blockwise_generate)
    assert streamer.ended
    assert [token for chunk in streamer.chunks for token in chunk] == greedy[0].tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_beams": 3, "do_sample": True}, "reproduces greedy search, sampling and beam search.*'beam_sample'"),
        (
            {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
            "num_beam_groups=2 selects 'group_beam_search'. Use num_beam_groups=1",
        ),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive_search"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions=True is not supported"),
        ({"use_cache": False}, "needs the KV cache"),
        ({"cache_implementation": "static"}, "cache_implementation='static' is not supported"),
    ],
)
def test_unsupported_generate_arguments_are_refused(tiny_models, kwargs: dict, message: str) -> None:
    base = tiny_models["bart"]
    model = trained_looking_heads(base)
    with pytest.raises(ValueError, match=message):
        model.generate(**random_batch(base, 2, seed=0), max_new_tokens=5, **kwargs)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_position_limits_are_read_from_the_model(tiny_models, architecture: str) -> None:
    """Fixed position tables (learned or sinusoidal) have a limit, relative or growing ones none; and a decoder
    fed exactly up to its limit works while one position more fails, which is what the limit claims."""
    base = tiny_models[architecture]
    limit = hf.position_limit(base.get_decoder())
    assert limit == hf.position_limit(base.get_encoder())
    if architecture in ("t5", "mt5", "m2m100"):  # relative positions; M2M100's sinusoidal table grows on demand
        assert limit is None
        return
    assert limit == base.config.max_position_embeddings
    start = torch.tensor([[base.generation_config.decoder_start_token_id]])
    encoder_outputs = base.get_encoder()(input_ids=torch.tensor([[5, 6, 7]]))
    with torch.no_grad():
        base(encoder_outputs=encoder_outputs, decoder_input_ids=start.repeat(1, limit))
        with pytest.raises(IndexError):
            base(encoder_outputs=encoder_outputs, decoder_input_ids=start.repeat(1, limit + 1))


@pytest.mark.parametrize("architecture", ["bart", "marian"])
def test_lengths_past_the_positions_are_clear_errors(tiny_models, architecture: str) -> None:
    base = tiny_models[architecture]
    limit = base.config.max_position_embeddings
    model = trained_looking_heads(base)
    too_long = torch.full((1, limit + 1), 5)
    with pytest.raises(ValueError, match=f"input is {limit + 1} tokens long, but the encoder .* has {limit} positions"):
        model.generate(input_ids=too_long, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"input is .* tokens long"):
        model.generate(input_ids=too_long, max_new_tokens=4, assistant=None)  # the plain greedy path too
    with pytest.raises(ValueError, match=f"input is {limit + 1} tokens long"):  # the bench checks before timing
        setup = BenchSetup(LoadedModel(base=base, tokenizer=None))
        run_bench(setup, [[5] * 4, [5] * (limit + 1)], None, ["greedy"], [1])
    batch = random_batch(base, 2, seed=0)
    message = f"needs {limit + 1} decoder positions, but the decoder .* has {limit}; pass max_new_tokens={limit} or"
    with pytest.raises(ValueError, match=message):
        model.generate(**batch, max_new_tokens=limit + 1, min_new_tokens=limit + 1)
    with pytest.raises(ValueError, match=message):
        base.generate(**batch, custom_generate=blockwise_generate, max_length=limit + 2)
    # exactly at the limit: identical to greedy, which runs there too
    at_limit = dict(max_new_tokens=limit, min_new_tokens=limit)
    expected = base.generate(**batch, **at_limit)
    assert torch.equal(model.generate(**batch, **at_limit), expected)


def test_local_looking_paths_that_do_not_exist_are_clear_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "a_file").write_text("x")
    missing = ("./heads", "../nowhere/heads", str(tmp_path / "heads"), "a/b/c", "checkpoints/hedas", "~/nothing")
    for path in missing:
        with pytest.raises(ValueError, match="no such directory"):
            BlockwiseHeadsModel.from_pretrained(path)
    with pytest.raises(ValueError, match="a file, not a directory"):
        BlockwiseHeadsModel.from_pretrained("./a_file")
    hf.check_local_path("Helsinki-NLP/opus-mt-en-de", "model")  # may be a hub id: left to transformers
    hf.check_local_path("checkpoints", "model")  # exists
    with pytest.raises(ValueError, match="model_path 'checkpoints/nope': no such directory"):
        load_model("checkpoints/nope")


def test_bad_calls_are_refused(tiny_models) -> None:
    base = tiny_models["bart"]
    model = trained_looking_heads(base)
    batch = random_batch(base, 2, seed=0)
    with pytest.raises(ValueError, match="empty batch"):
        model.generate(input_ids=batch["input_ids"][:0], attention_mask=batch["attention_mask"][:0])
    with pytest.raises(TypeError, match="assistant= takes an hf_blockwise Drafter"):
        model.generate(**batch, assistant=base)
    with pytest.raises(TypeError, match="acceptance= takes an AcceptanceRule"):
        model.generate(**batch, acceptance="top-k")
    with pytest.raises(ValueError, match="batch size 1 only"):
        model.generate(**batch, streamer=RecordingStreamer())
    one_row = {name: value[:1] for name, value in batch.items()}
    with pytest.raises(ValueError, match=r"streamer= cannot be used with beam search \(num_beams=4\)"):
        model.generate(**one_row, streamer=RecordingStreamer(), num_beams=4)
    decoder_only = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="encoder-decoder"):
        BlockwiseHeadsModel(decoder_only)


def test_greedy_divergences_report_every_departure_with_rank_and_gap(tiny_models) -> None:
    """A candidate with two last tokens altered: both departures found, each with its rank in
    greedy's processed scores (a repetition penalty applied) and the gap in float spacings; greedy's own output has
    none; a token swapped for greedy's second best at a gap forced to zero is a near-tie, one swapped for a worse
    token is not."""
    base = tiny_models["t5"]
    batch = random_batch(base, 3, seed=8)
    kwargs = {"max_new_tokens": 10, "min_new_tokens": 10, "repetition_penalty": 1.3}
    greedy = base.generate(**batch, **kwargs)
    assert greedy_divergences(base, batch, greedy, **kwargs) == []
    scores = base.generate(**batch, **kwargs, output_scores=True, return_dict_in_generate=True).scores
    altered = greedy.clone()
    second = int(scores[9][1].topk(2).indices[1])  # greedy's second best at the last position (10) of row 1
    altered[1, 10] = second
    altered[2, 10] = int(scores[9][2].topk(5).indices[4])  # fifth best at the last position of row 2
    first, later = greedy_divergences(base, batch, altered, **kwargs)
    assert (first.row, first.position, first.candidate_token, first.candidate_rank) == (1, 10, second, 1)
    assert first.greedy_token == int(greedy[1, 10]) and first.gap > 0 and first.spacing > 0
    assert first.gap_in_spacings == first.gap / first.spacing
    assert not first.is_near_tie()  # a real disagreement, not floating-point noise
    assert first.is_near_tie(max_spacings=first.gap_in_spacings)
    assert (later.row, later.position, later.candidate_rank) == (2, 10, 4)
    altered[0, 4] = int(scores[3][0].topk(2).indices[1])  # mid-row: later tokens are off greedy's path too
    departures = [(d.row, d.position) for d in greedy_divergences(base, batch, altered, **kwargs)]
    assert departures[0] == (0, 4) and all(position >= 4 for row, position in departures if row == 0)
    assert not later.is_near_tie(max_spacings=float("inf"))  # not greedy's second: never a tie
    tied = dataclasses.replace(first, gap=0.0)
    assert tied.is_near_tie()


def test_training_step_moves_heads_and_leaves_frozen_base(tiny_models) -> None:
    base = build_model("marian", seed=1)
    base_before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=4))
    base.requires_grad_(False)
    heads_before = {name: tensor.clone() for name, tensor in model.heads.state_dict().items()}
    optimizer = torch.optim.AdamW(model.heads.parameters(), lr=1e-2)
    batch = random_batch(base, 4, seed=9)
    labels = torch.randint(3, 60, (4, 8))
    losses = []
    for _ in range(5):
        output = model(**batch, labels=labels)
        assert output.head_losses.shape == (3,)
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(float(output.loss.detach()))
    assert losses[-1] < losses[0]
    assert any(not torch.equal(heads_before[n], t) for n, t in model.heads.state_dict().items())
    assert all(torch.equal(base_before[n], t) for n, t in base.state_dict().items())


@pytest.mark.parametrize("architecture", ["marian", "t5"])
def test_shortlist_restricts_proposals_keeps_output_and_is_saved(tmp_path, tiny_models, architecture: str) -> None:
    base = tiny_models[architecture]
    model = trained_looking_heads(base, block_size=4, seed=5)
    batch = random_batch(base, 3, seed=4)
    greedy = base.generate(**batch, do_sample=False, max_new_tokens=12)
    shortlist = frequent_tokens(greedy.tolist(), size=8, always=[base.config.eos_token_id])
    model.set_shortlist(shortlist)

    states = torch.randn(5, base.config.d_model)
    request = DraftRequest(
        sequences=torch.zeros(5, 4, dtype=torch.long),
        lengths=torch.ones(5, dtype=torch.long),
        max_drafts=torch.full((5,), 3),
        last_states=states,
    )
    drafts = draft(model.drafter(), request)
    assert torch.isin(drafts.tokens, shortlist).all()
    # among the shortlist, each head proposes exactly what the full projection ranks highest
    full_logits = output_projection_logits(base, model.heads(states))  # (5, 3, V)
    expected = shortlist[full_logits[..., shortlist].argmax(dim=-1)]
    assert torch.equal(drafts.tokens, expected)
    assert torch.equal(model.generate(**batch, max_new_tokens=12), greedy)

    model.save_pretrained(tmp_path, dtype=torch.float16)
    reloaded = BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)
    assert reloaded.blockwise_config.shortlist_size == shortlist.numel()
    assert reloaded.heads.shortlist.dtype == torch.long and torch.equal(reloaded.heads.shortlist, shortlist)
    model.set_shortlist(None)
    assert model.heads.shortlist is None and model.blockwise_config.shortlist_size is None


def test_bad_shortlists_are_refused(tiny_models) -> None:
    model = BlockwiseHeadsModel(tiny_models["bart"], BlockwiseHeadsConfig(block_size=3))
    with pytest.raises(ValueError, match="must lie in"):
        model.set_shortlist([1, 10_000])
    with pytest.raises(ValueError, match="unique"):
        model.set_shortlist([3, 3])
    with pytest.raises(ValueError, match="at least one"):
        model.set_shortlist([])
    assert frequent_tokens([[5, 5, 7, -100], [7, 7, 9]], size=2, always=[1]).tolist() == [1, 7]


def test_fewer_heads_propose_the_prefix_of_all_heads(tiny_models) -> None:
    base = tiny_models["pegasus"]
    model = trained_looking_heads(base, block_size=6, seed=2)
    request = DraftRequest(
        sequences=torch.zeros(4, 3, dtype=torch.long),
        lengths=torch.ones(4, dtype=torch.long),
        max_drafts=torch.full((4,), 5),
        last_states=torch.randn(4, base.config.d_model),
    )
    every_head = draft(model.drafter(), request).tokens  # (4, 5)
    first_two = draft(model.drafter(block_size=3), request)
    assert torch.equal(first_two.tokens, every_head[:, :2]) and first_two.lengths.tolist() == [2] * 4
    batch = random_batch(base, 2, seed=9)
    greedy = base.generate(**batch, max_new_tokens=15)
    assert torch.equal(model.generate(**batch, assistant=model.drafter(block_size=3), max_new_tokens=15), greedy)
    with pytest.raises(ValueError, match="block_size must be between 2 and the model's block size 6"):
        model.drafter(block_size=7)


@pytest.mark.parametrize("architecture", ["t5", "marian"])
def test_token_conditioned_heads_train_save_and_reload(tmp_path, tiny_models, architecture: str) -> None:
    """Heads that also read the chosen token: the loss reaches their token input, and they round-trip."""
    base = tiny_models[architecture]
    model = BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3, condition_on_token=True))
    assert model.heads.up.in_features == 2 * base.config.d_model
    batch = random_batch(base, 2, seed=6)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.nn.init.normal_(model.heads.down.weight, std=0.1)
    model(**batch, labels=labels).loss.backward()
    token_columns = model.heads.up.weight.grad[:, base.config.d_model :]
    assert token_columns.abs().sum() > 0
    with pytest.raises(ValueError, match="token_embeddings exactly when"):
        model.heads(torch.zeros(1, base.config.d_model))

    model.save_pretrained(tmp_path)
    reloaded = BlockwiseHeadsModel.from_pretrained(tmp_path, base_model=base)
    assert reloaded.blockwise_config.condition_on_token
    assert torch.equal(reloaded.heads.up.weight, model.heads.up.weight)
    assert torch.equal(reloaded.generate(**batch, max_new_tokens=10), base.generate(**batch, max_new_tokens=10))


def test_heads_drafter_derives_the_shortlist_projection_per_call_not_once(tiny_models) -> None:
    """A drafter made before `set_shortlist` (or `.to()`) drafts with the model as it is at `generate` time."""
    model = trained_looking_heads(tiny_models["bart"], block_size=4, seed=3)
    drafter = model.drafter()  # no shortlist yet
    model.set_shortlist([1, 5, 6, 7])
    request = DraftRequest(
        sequences=torch.zeros(3, 4, dtype=torch.long),
        lengths=torch.ones(3, dtype=torch.long),
        max_drafts=torch.full((3,), 3),
        last_states=torch.randn(3, model.config.d_model),
    )
    assert torch.isin(draft(drafter, request).tokens, torch.tensor([1, 5, 6, 7])).all()
    model.set_shortlist(None)


def test_shipped_models_load_as_float32_and_limit_new_tokens(tmp_path) -> None:
    """Plain `from_pretrained` gives float32 (fp16 on disk), and `max_new_tokens` conflicts with nothing."""
    model = build_model("marian")
    model.generation_config.max_length = 50
    load_recipe_module("recipe_common").save_shipped_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float16}  # noqa: SIM118
    assert model.dtype == torch.float32  # the caller's model is left as it was
    for directory in (tmp_path, SHIPPED_MODEL, os.path.join(os.path.dirname(SHIPPED_MODEL), "gec-en")):
        assert AutoModelForSeq2SeqLM.from_pretrained(directory).dtype == torch.float32
        generation = GenerationConfig.from_pretrained(directory)
        assert generation.max_new_tokens is not None and "max_length" not in generation.to_diff_dict()


def test_resaved_heads_name_a_base_that_resolves_and_another_base_is_a_warning(tmp_path, monkeypatch) -> None:
    """Heads shipped inside their base's directory (base "."), loaded and saved elsewhere, still find their base;
    heads attached to another named checkpoint of the same shapes get a warning, not silence."""
    base = build_model("marian")
    base.generation_config.max_length = None
    shipped = tmp_path / "shipped"
    base.save_pretrained(shipped)
    BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3)).save_pretrained(shipped, base_model_name_or_path=".")
    loaded = BlockwiseHeadsModel.from_pretrained(shipped)
    loaded.save_pretrained(tmp_path / "resaved")
    monkeypatch.chdir(tmp_path)  # a relative "." would now point here, where no model is
    again = BlockwiseHeadsModel.from_pretrained(tmp_path / "resaved")
    assert os.path.realpath(again.blockwise_config.base_model_name_or_path) == os.path.realpath(shipped)
    other = build_model("marian", seed=1)
    other.name_or_path = "some-org/another-marian"
    with pytest.warns(UserWarning, match="trained for base .* attached to 'some-org/another-marian'"):
        BlockwiseHeadsModel.from_pretrained(tmp_path / "resaved", base_model=other)


def test_the_cache_argument_is_the_name_the_forward_takes() -> None:
    """transformers 5.25 renamed forward's `past_key_values` to `cache`: the loop passes the cache under the name the
    model's forward names, a PEFT-style wrapper's (`**kwargs`) under its base's, and a forward naming neither is
    refused."""

    class Renamed(torch.nn.Module):
        def forward(self, decoder_input_ids=None, cache=None, **kwargs):
            return cache

    class Before(torch.nn.Module):
        def forward(self, decoder_input_ids=None, past_key_values=None):
            return past_key_values

    class Wrapper(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base = base

        def get_base_model(self) -> torch.nn.Module:
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    class Neither(torch.nn.Module):
        def forward(self, decoder_input_ids=None):
            return decoder_input_ids

    assert hf.cache_argument(Renamed()) == "cache"
    assert hf.cache_argument(Before()) == "past_key_values"
    assert hf.cache_argument(Wrapper(Renamed())) == "cache"
    assert hf.cache_argument(Wrapper(Before())) == "past_key_values"
    with pytest.raises(ValueError, match=r"Neither\.forward takes none of"):
        hf.cache_argument(Neither())
    model = ARCHITECTURES["bart"]()
    assert hf.cache_argument(model) in inspect.unwrap(type(model).forward).__code__.co_varnames

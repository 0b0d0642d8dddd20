"""Probes every tiny model of `tests/zoo.py` for the decoder behaviours that blockwise decoding relies on.

Blockwise decoding feeds the decoder *several* tokens per cached forward and crops the KV cache back when a
guess is rejected. That is exact only where, for each architecture (one column each; the numbers are
max|difference| / max|logit|, "ok" below 1e-4, ARGMAXn when n positions change their argmax):

* (a) `mvs_b1`, `mvs_b3`: the start token then 5 tokens in one cached forward give the logits of feeding them
  one at a time (batch of 1; batch of 3 with sources of mixed lengths); `prefill`: all 6 in one forward into
  an empty cache; `nocache`: one at a time vs one uncached (teacher-forced) forward; `gen_nocache`: greedy
  `generate` with and without the cache;
* (b) `pad_b3`: as `mvs_b3` with a pad token among the fed tokens (M2M100-style positions count non-pad
  tokens: those differ *only* with a pad present);
* (c) `crop`: after 6 tokens, `cache.crop(-2)` and re-feeding the last 2 in one forward gives the logits of
  4 single forwards then those 2 in one forward; `crop>win`: the same with 12 tokens and `crop(-3)` (beyond
  T5Gemma's sliding window of 8) with the cache `generate` builds; `rec_past`: that cache after
  `activate_past_recording()`; `plain`: a config-less `DynamicCache()` (plain layers, the window applied by
  the attention mask only); `plain=gen`: the config-less cache vs `generate`'s (and vs no cache) over 12
  tokens; `cfg_both`: a hand-built cache with `DynamicCache(config=...)` for cross-attention too;
* (d) `projection`, `post_proj`: whether `model.get_output_embeddings()` is the linear map onto the vocabulary,
  and what is done to its output before it is `outputs.logits` (a `final_logits_bias`, a soft-cap);
* (e) `multi_raises`: the decoder refuses more than one new token with a non-empty cache;
* (f) `self_cache` (the self-attention cache layer classes), `_supports_cache_class`, `text_config` (what
  `config.get_text_config(decoder=True)` returns), `gen_defaults` (generation defaults that change greedy
  output), and notes: MoE capacity, sliding-window caches, output projections that are not (B, T, d) -> vocab.

Run: `python scripts/probe_architectures.py [names...] [--output /tmp/probe_report.txt]` (fp32, CPU, < 1 min).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from transformers import logging as transformers_logging
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.configuration_utils import GenerationMode
from zoo import ARCHITECTURES, VOCAB_SIZE

NUM_FED = 6  # the start token and 5 more
LONG_FED = 12  # more than the zoo's sliding window (8)
TOLERANCE = 1e-4  # relative to the largest |logit|: fp32 reorderings stay far below, real differences far above

# Generation defaults that change what greedy search outputs; reported where a model's differ from GenerationConfig's.
GENERATION_DEFAULTS = ("forced_bos_token_id", "forced_eos_token_id", "bad_words_ids", "no_repeat_ngram_size",
                       "encoder_no_repeat_ngram_size", "begin_suppress_tokens", "suppress_tokens",
                       "repetition_penalty", "min_length", "num_beams", "max_length")  # fmt: skip


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ARCHITECTURES[name]().eval()


def decoder_config(model: nn.Module):
    return model.config.get_text_config(decoder=True)


def generate_cache(model: nn.Module) -> EncoderDecoderCache:
    """The cache `generate` builds for greedy search, by the model's own (possibly overridden) method.

    Mostly `EncoderDecoderCache(DynamicCache(config=...), DynamicCache(config=...))`, but T5Gemma and T5Gemma2
    override `_prepare_cache_for_generation` to give cross-attention full (non-sliding) layers.
    """
    model_kwargs: dict = {}
    model._prepare_cache_for_generation(
        copy.deepcopy(model.generation_config), model_kwargs, GenerationMode.GREEDY_SEARCH, 3, 64
    )
    return model_kwargs["past_key_values"]


def config_cache(model: nn.Module) -> EncoderDecoderCache:
    """`DynamicCache(config=...)` for self- *and* cross-attention, as a caller building "generate's cache" by hand
    would (the original `new_decoder_cache`): sliding-window layers then also hold the encoder keys."""
    config = decoder_config(model)
    return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))


def recording_cache(model: nn.Module) -> EncoderDecoderCache:
    """`generate`'s cache, with sliding-window layers keeping their past until `crop` (as assisted decoding does)."""
    cache = generate_cache(model)
    cache.activate_past_recording()
    return cache


def plain_cache(model: nn.Module) -> EncoderDecoderCache:
    """A config-less cache: every self-attention layer a plain, croppable `DynamicLayer`."""
    return EncoderDecoderCache(DynamicCache(), DynamicCache())


def special_ids(model: nn.Module) -> set[int]:
    """Every id a config names (pad, eos, bos, decoder start, image/boi/eoi …), in the model and decoder configs."""
    ids: set[int] = set()
    for config in (model.config, decoder_config(model), getattr(model.config, "encoder", None)):
        if config is None:
            continue
        for key, value in config.to_dict().items():
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int):
                ids.add(value)
    return ids


def source_batch(model: nn.Module, batch_size: int, seed: int, length: int = 12) -> dict[str, torch.Tensor]:
    """Random right-padded sources, like `conftest.random_batch`; row 0 full length, the others shorter."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(3, VOCAB_SIZE)) - special_ids(model)))
    ids = allowed[torch.randint(len(allowed), (batch_size, length), generator=generator)]
    lengths = torch.tensor([length, 5, 9][:batch_size])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, model.config.pad_token_id), "attention_mask": mask}


def decoder_tokens(model: nn.Module, batch_size: int, count: int, seed: int) -> torch.Tensor:
    """The decoder start token followed by `count - 1` random non-special tokens."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(sorted(set(range(3, VOCAB_SIZE)) - special_ids(model)))
    body = allowed[torch.randint(len(allowed), (batch_size, count - 1), generator=generator)]
    start = torch.full((batch_size, 1), start_token(model))
    return torch.cat([start, body], dim=1)


def start_token(model: nn.Module) -> int:
    start = model.generation_config.decoder_start_token_id
    if start is None:
        start = model.config.decoder_start_token_id
    return int(start if not isinstance(start, list) else start[0])


class Decoder:
    """Cached decoder forwards over one encoded source batch, called as `generate`'s loop calls them."""

    def __init__(self, model: nn.Module, source: dict[str, torch.Tensor]):
        self.model = model
        self.source = source
        self.mask = source["attention_mask"]
        with torch.no_grad():
            self.encoder_outputs = model.get_encoder()(**source, return_dict=True)

    def __call__(self, tokens: torch.Tensor, cache: EncoderDecoderCache | None) -> torch.Tensor:
        """A cached forward (as `generate` runs it), or, with `cache=None`, an uncached one as in training
        (the source `input_ids` passed too: FSMT builds its decoder masks only from them)."""
        extra = {} if cache is not None else {"input_ids": self.source["input_ids"]}
        with torch.no_grad():
            outputs = self.model(
                encoder_outputs=self.encoder_outputs, attention_mask=self.mask, decoder_input_ids=tokens,
                past_key_values=cache, use_cache=cache is not None, return_dict=True, **extra,
            )  # fmt: skip
        return outputs.logits

    def feed(self, tokens: torch.Tensor, cache: EncoderDecoderCache, chunks: list[int]) -> torch.Tensor:
        """Feeds `tokens` in consecutive chunks of the given widths; the logits of every position."""
        logits, start = [], 0
        for width in chunks:
            logits.append(self(tokens[:, start : start + width], cache))
            start += width
        return torch.cat(logits, dim=1)


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, int]:
    """Max |difference| relative to the largest |logit|, and the number of positions whose argmax differs."""
    scale = reference.abs().max().clamp(min=1e-6)
    difference = float((reference - other).abs().max() / scale)
    flips = int((reference.argmax(-1) != other.argmax(-1)).sum())
    return difference, flips


def describe(result: tuple[float, int]) -> str:
    difference, flips = result
    verdict = "ok" if difference <= TOLERANCE else ("DIFF" if flips == 0 else f"ARGMAX{flips}")
    return f"{difference:.0e} {verdict}"


def attempt(function: Callable[[], str]) -> str:
    try:
        return function()
    except Exception as error:
        return f"raises {type(error).__name__}: {' '.join(str(error).split())[:150]}"


def short(cell: str) -> str:
    return cell if not cell.startswith("raises ") else "raises " + cell.split(":")[0].split()[-1]


def probe(name: str) -> tuple[dict[str, str], list[str]]:
    model = build(name)
    notes: list[str] = []
    one = Decoder(model, source_batch(model, 1, seed=1))
    three = Decoder(model, source_batch(model, 3, seed=2))
    tokens1 = decoder_tokens(model, 1, NUM_FED, seed=3)
    tokens3 = decoder_tokens(model, 3, NUM_FED, seed=4)
    row = {**forward_checks(model, one, three, tokens1, tokens3, notes), **crop_checks(model, three)}
    # (d) the output projection.
    row["projection"], row["post_proj"] = projection_check(model, three, tokens3, notes)
    row.update(quirk_rows(model, three, tokens3))
    notes.extend(other_quirks(model, three, tokens3))
    return row, notes


def forward_checks(
    model, one: Decoder, three: Decoder, tokens1: torch.Tensor, tokens3: torch.Tensor, notes: list[str]
) -> dict[str, str]:
    """(a) multi-token against one-token forwards, cached against uncached, and (b) a pad among the fed tokens."""
    row: dict[str, str] = {}

    # (a) one token at a time vs the start token then 5 in one forward; and all 6 in one forward (prefill).
    def multi_vs_single(decoder: Decoder, tokens: torch.Tensor, chunks: list[int]) -> str:
        single = decoder.feed(tokens, generate_cache(model), [1] * tokens.shape[1])
        return describe(compare(single, decoder.feed(tokens, generate_cache(model), chunks)))

    row["mvs_b1"] = attempt(lambda: multi_vs_single(one, tokens1, [1, NUM_FED - 1]))
    row["mvs_b3"] = attempt(lambda: multi_vs_single(three, tokens3, [1, NUM_FED - 1]))
    row["prefill"] = attempt(lambda: multi_vs_single(one, tokens1, [NUM_FED]))
    row["multi_raises"] = "yes" if row["mvs_b1"].startswith("raises") else "no"

    # One token at a time with a cache vs one uncached forward over all positions (teacher forcing).
    def cached_vs_uncached() -> str:
        single = three.feed(tokens3, generate_cache(model), [1] * NUM_FED)
        return describe(compare(single, three(tokens3, None)))

    row["nocache"] = attempt(cached_vs_uncached)

    # A hand-built cache with the config on both sides, over a source longer than a sliding window.
    def config_on_both_sides() -> str:
        single = three.feed(tokens3, generate_cache(model), [1] * NUM_FED)
        return describe(compare(single, three.feed(tokens3, config_cache(model), [1] * NUM_FED)))

    row["cfg_both"] = attempt(config_on_both_sides)

    # Does greedy generate give the same tokens without the cache?
    def generate_without_cache() -> str:
        source = source_batch(model, 3, seed=2)
        options = dict(max_new_tokens=16, do_sample=False, max_length=None)
        cached = model.generate(**source, **options)
        uncached = model.generate(**source, **options, use_cache=False)
        if cached.shape == uncached.shape and torch.equal(cached, uncached):
            return "same"
        return f"DIFFERS ({int((cached[:, : uncached.shape[1]] != uncached[:, : cached.shape[1]]).sum())} tokens)"

    row["gen_nocache"] = attempt(generate_without_cache)

    # (b) a pad among the fed tokens.
    padded = tokens3.clone()
    padded[:, 3] = model.config.pad_token_id
    row["pad_b3"] = attempt(lambda: multi_vs_single(three, padded, [1, NUM_FED - 1]))
    if row["pad_b3"].split()[-1] != "ok" and row["mvs_b3"].split()[-1] == "ok":
        notes.append("multi-token forwards differ from single-token ones ONLY when a pad token is fed")

    return row


def crop_checks(model, three: Decoder) -> dict[str, str]:
    """(c) cropping the cache and re-feeding, with every kind of cache, against generate's own."""
    row: dict[str, str] = {}

    # (c) crop(-2) after 6 tokens, re-feeding the last 2; reference: 4 single forwards then 2 in one forward.
    def crop_check(make_cache: Callable[[], EncoderDecoderCache], count: int, remove: int) -> str:
        tokens = decoder_tokens(model, 3, count, seed=5)
        reference = three.feed(tokens, make_cache(), [1] * (count - remove) + [remove])[:, -remove:]
        cache = make_cache()
        three.feed(tokens, cache, [1] * count)
        cache.crop(-remove)
        if cache.get_seq_length() != count - remove:
            return f"length {cache.get_seq_length()} != {count - remove}"
        return describe(compare(reference, three(tokens[:, -remove:], cache)))

    row["crop"] = attempt(lambda: crop_check(lambda: generate_cache(model), NUM_FED, 2))
    row["crop>win"] = attempt(lambda: crop_check(lambda: generate_cache(model), LONG_FED, 3))
    row["rec_past"] = attempt(lambda: crop_check(lambda: recording_cache(model), LONG_FED, 3))
    row["plain"] = attempt(lambda: crop_check(lambda: plain_cache(model), LONG_FED, 3))

    # A config-less cache must give generate's logits: the attention mask alone must apply the sliding window.
    def plain_vs_generate() -> str:
        tokens = decoder_tokens(model, 3, LONG_FED, seed=6)
        reference = three.feed(tokens, generate_cache(model), [1] * LONG_FED)
        uncached = three(tokens, None)
        plain = three.feed(tokens, plain_cache(model), [1, 4, LONG_FED - 5])
        return f"{describe(compare(reference, plain))} / nocache {describe(compare(reference, uncached))}"

    row["plain=gen"] = attempt(plain_vs_generate)

    return row


def quirk_rows(model, three: Decoder, tokens3: torch.Tensor) -> dict[str, str]:
    """(f) the cache's layer types, cache-class support, the decoder config class and generation defaults."""
    row: dict[str, str] = {}
    # (f) other quirks.
    cache = generate_cache(model)
    three.feed(tokens3, cache, [1, 1])
    layers = [type(layer).__name__.replace("Dynamic", "") for layer in cache.self_attention_cache.layers]
    row["self_cache"] = ",".join(layers) or "-"
    row["_supports_cache_class"] = str(getattr(model, "_supports_cache_class", "absent"))
    row["text_config"] = attempt(lambda: type(decoder_config(model)).__name__)
    defaults = model.generation_config.to_diff_dict()
    changed = {key: defaults[key] for key in GENERATION_DEFAULTS if key in defaults}
    row["gen_defaults"] = ",".join(f"{key}={value}" for key, value in changed.items()) or "-"
    return row


@contextmanager
def visible_final_logits_bias(model: nn.Module) -> Iterator[torch.Tensor | None]:
    """BART-family models add a `final_logits_bias` buffer that starts at zero (checkpoints such as Marian's have a
    non-zero one): within the block it holds random values, so that adding it shows."""
    bias = getattr(model, "final_logits_bias", None)
    if not isinstance(bias, torch.Tensor):
        yield None
        return
    saved = bias.clone()
    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(0)))
    try:
        yield bias
    finally:
        bias.copy_(saved)


def projection_check(model: nn.Module, decoder: Decoder, tokens: torch.Tensor, notes: list[str]) -> tuple[str, str]:
    """What `get_output_embeddings()` is, and what happens to its output before it becomes `outputs.logits`."""
    projection = model.get_output_embeddings()
    if projection is None:
        return "None", "-"
    vocab = decoder_config(model).vocab_size
    weight = getattr(projection, "weight", None)
    kind = type(projection).__name__
    if weight is None or weight.shape[0] != vocab:
        return f"{kind} shape {None if weight is None else tuple(weight.shape)}", "-"
    if not isinstance(projection, nn.Linear):
        real = find_projection(model, decoder, tokens)
        notes.append(
            f"get_output_embeddings() is a {kind} (hooks on it see token ids); the nn.Linear whose output is the "
            f"logits: {real}"
        )
        kind = f"{kind}!"
        if real in dict(model.named_modules()):
            projection = model.get_submodule(real)
    description = kind + (" tied" if projection.weight is model.get_input_embeddings().weight else "")
    description += " +bias" if getattr(projection, "bias", None) is not None else ""
    seen: dict[str, torch.Tensor] = {}
    handle = projection.register_forward_hook(lambda module, args, output: seen.update(input=args[0], output=output))
    with visible_final_logits_bias(model) as bias:
        try:
            logits = decoder(tokens, None)
        finally:
            handle.remove()
        received, projected = seen["input"], seen["output"]
        if received.dim() != 3:
            notes.append(
                f"the output projection receives a {received.dim()}-d tensor {tuple(received.shape)}, not (B, T, d); "
                f"logits are {tuple(logits.shape)}: a hook that selects decoder positions on dim 1 selects streams"
            )
            projected = projected[:, 0] if projected.dim() == 4 else projected
            description += f" in{tuple(received.shape)}"
        if projected.shape != logits.shape:
            return description, f"shape {tuple(projected.shape)} vs logits {tuple(logits.shape)}"
        if torch.equal(projected, logits):
            return description, "none"
        candidates = {}
        if bias is not None:
            candidates["+final_logits_bias"] = projected + bias
        cap = getattr(decoder_config(model), "final_logit_softcapping", None)
        if cap:
            candidates[f"softcap {cap}"] = torch.tanh(projected / cap) * cap
        for what, candidate in candidates.items():
            if torch.allclose(candidate, logits, atol=1e-5, rtol=1e-5):
                return description, what
        return description, f"UNEXPLAINED (max diff {float((projected - logits).abs().max()):.1e})"


def find_projection(model: nn.Module, decoder: Decoder, tokens: torch.Tensor) -> str:
    """The name of the `nn.Linear` onto the vocabulary whose output equals `outputs.logits`, found by hooking all."""
    vocab = decoder_config(model).vocab_size
    outputs: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda module, args, output, name=name: outputs.__setitem__(name, output))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.out_features == vocab
    ]
    try:
        logits = decoder(tokens, None)
    finally:
        for handle in handles:
            handle.remove()
    found = [name for name, output in outputs.items() if output.shape == logits.shape and torch.equal(output, logits)]
    return ", ".join(found) or f"none of {sorted(outputs)}"


def other_quirks(model: nn.Module, decoder: Decoder, tokens: torch.Tensor) -> list[str]:
    notes = []
    config = decoder_config(model)
    # Mixture of experts with a per-forward capacity: a block of more tokens than the capacity drops some.
    routers = [module for module in model.modules() if hasattr(module, "expert_capacity")]
    if routers:
        # NLLB-MoE's router recomputes its capacity every eval forward from the number of tokens in the forward.
        attribute = (
            "moe_eval_capacity_token_fraction"
            if hasattr(routers[0], "moe_eval_capacity_token_fraction")
            else ("expert_capacity")
        )
        saved = [getattr(router, attribute) for router in routers]
        for router in routers:
            setattr(router, attribute, 0.25 if attribute != "expert_capacity" else 1)
        try:
            single = decoder.feed(tokens, generate_cache(model), [1] * tokens.shape[1])
            multi = decoder.feed(tokens, generate_cache(model), [1, tokens.shape[1] - 1])
            notes.append(
                f"MoE ({type(routers[0]).__name__}, {attribute}={saved[0]}): with {attribute}="
                f"{getattr(routers[0], attribute)}, multi vs single {describe(compare(single, multi))}"
            )
        finally:
            for router, value in zip(routers, saved, strict=True):
                setattr(router, attribute, value)
    layer_types = getattr(config, "layer_types", None)
    sliding = generate_cache(model).self_attention_cache.is_sliding
    if any(sliding):
        notes.append(
            f"generate's cache: is_sliding={sliding}, is_croppable={generate_cache(model).is_croppable} (although "
            "crop raises once a sliding layer holds sliding_window tokens)"
        )
    if layer_types is not None:
        window = getattr(config, "sliding_window", None)
        notes.append(f"decoder layer_types={list(layer_types)}, sliding_window={window}")
    if hasattr(model.config, "src_vocab_size"):
        notes.append(f"src_vocab_size={model.config.src_vocab_size}, tgt_vocab_size={model.config.tgt_vocab_size}")
    # Which cache object the model hands back when given generate's.
    cache = generate_cache(model)
    with torch.no_grad():
        outputs = model(
            encoder_outputs=decoder.encoder_outputs, attention_mask=decoder.mask, decoder_input_ids=tokens[:, :1],
            past_key_values=cache, use_cache=True, return_dict=True,
        )  # fmt: skip
    returned = outputs.past_key_values
    if returned is not cache:
        notes.append(f"forward returns a different cache object: {type(returned).__name__}")
    if cache.cross_attention_cache.get_seq_length() == 0:
        notes.append("the cross-attention cache stays empty (cross-attention keys/values recomputed every forward)")
    return notes


# Two tables: the exactness checks (a)-(c), (e); then the structure (d), (f).
CHECKS = ("mvs_b1", "mvs_b3", "prefill", "nocache", "gen_nocache", "cfg_both", "pad_b3", "crop", "crop>win",
          "rec_past", "plain", "plain=gen", "multi_raises")  # fmt: skip
STRUCTURE = ("projection", "post_proj", "self_cache", "_supports_cache_class", "text_config", "gen_defaults")


def render(names: list[str], rows: dict[str, dict[str, str]], columns: tuple[str, ...]) -> list[str]:
    table = [("arch", *columns)] + [(name, *(short(rows[name].get(c, "?")) for c in columns)) for name in names]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns) + 1)]
    return ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="zoo entries (default: all)")
    parser.add_argument("--output", default="/tmp/probe_report.txt")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers_logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # tiny tensors: one thread is many times faster than several, on a busy machine
    names = arguments.names or list(ARCHITECTURES)
    started = time.perf_counter()
    rows, details = {}, {}
    for name in names:
        try:
            rows[name], details[name] = probe(name)
        except Exception as error:
            rows[name], details[name] = {}, [f"probe failed: {type(error).__name__}: {error}"]
    lines = [*render(names, rows, CHECKS), "", *render(names, rows, STRUCTURE)]
    lines += ["", f"max|diff| / max|logit|: ok <= {TOLERANCE:g} < DIFF; ARGMAXn: n positions change their argmax.", ""]
    for name in names:
        full = [f"{c}: {rows[name][c]}" for c in CHECKS + STRUCTURE if rows[name].get(c, "").startswith("raises")]
        if full or details[name]:
            lines.append(f"[{name}]")
            lines += [f"  {line}" for line in full + details[name]]
    lines.append(f"\n{len(names)} architectures in {time.perf_counter() - started:.1f}s")
    report = "\n".join(lines)
    print(report)
    Path(arguments.output).write_text(report + "\n")


if __name__ == "__main__":
    main()

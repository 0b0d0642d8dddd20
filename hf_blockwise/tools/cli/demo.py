"""`hf-blockwise demo`: greedy and blockwise side by side on a few sentences (or, with `--task asr`, audio clips),
through the measurement harness."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.utils import logging as transformers_logging

from hf_blockwise.audio import read_audio_folder, read_wav
from hf_blockwise.evaluation.harness import measure
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.loading import (
    DRAFTERS,
    FEATURE_DRAFTER_SUBDIR,
    REALISTIC_MODEL,
    SHIPPED_SPEECH_MODEL,
    LoadedModel,
    build_drafter,
    load_model,
)
from hf_blockwise.tools.bench import compile_modes, make_batches
from hf_blockwise.tools.cli.arguments import check_shipped_model, limit_words, positive_int, require_tokenizer

DEMO_SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two children are playing in the sand at the beach.",
    "A woman with a red hat is riding a bicycle down the street.",
    "A group of people are sitting around a table outside.",
    "A black dog is running through the grass.",
    "A young girl is climbing a rock wall.",
]


def run_demo(
    model_path: str,
    sentences: Sequence[str],
    repeats: int,
    threads: int | None,
    max_new_tokens: int | None = None,
    int8: bool = False,
    drafter: str = "best",
    compile: bool = True,
    num_beams: int | None = None,
) -> int:
    """Greedy (or beam search) and blockwise side by side, one sentence at a time, through the measurement
    harness; prints each pair of outputs, whether they are identical, the mean accepted block and the speedup.

    Args:
        max_new_tokens (`int`, *optional*): the length limit; by default the checkpoint's generation_config's.
        drafter (`str`): `"heads"` (the model's proposal heads), `"feature"` (its `feature-drafter/`), or `"best"`:
            the feature drafter when the model ships one, else the heads.
        compile (`bool`): decode blockwise through the compiled engine (`blockwise_compile=True`), compiled once
            before timing. With `int8` the greedy side is the engine's greedy too, "the int8 model's greedy output"
            (the int8 contract, docs/guides/int8.md), which drafting reproduces bit for bit.
        num_beams (`int`, *optional*): beams of both sides; by default the checkpoint's generation_config's.

    Returns:
        `int`: 0 when every output is identical to greedy's, else 1 (the exit status).
    """
    transformers_logging.set_verbosity_error()  # the demo's own output is the point
    if threads:
        torch.set_num_threads(threads)
    if not os.path.isdir(model_path):
        raise SystemExit(f"No checkpoint at {model_path}: pass --model DIR holding a base model, heads and tokenizer")
    require_tokenizer(model_path)
    loaded = load_model(model_path, int8=int8)  # int8: greedy below is then the int8 model's greedy too
    if drafter == "feature" and loaded.feature_model is None:
        raise SystemExit(f"{model_path} ships no {FEATURE_DRAFTER_SUBDIR}/: use --drafter heads")
    chosen = "feature" if drafter in ("feature", "best") and loaded.feature_model is not None else "heads"
    if chosen == "heads" and loaded.heads_model is None:
        raise SystemExit(f"{model_path} has no proposal heads and ships no {FEATURE_DRAFTER_SUBDIR}/ to draft with")
    assistant = build_drafter(chosen, loaded)
    name = "feature drafter" if chosen == "feature" else "proposal heads"
    precision = "int8" if int8 else "fp32"
    engine = "compiled engine" if compile else "eager"
    print(
        f"model: {model_path} ({name}, k={assistant.block_size}, {precision}, {engine}), "
        f"{torch.get_num_threads()} threads, batch 1, {limit_words(loaded.base, max_new_tokens)}"
    )
    batches = [dict(loaded.tokenizer([sentence], return_tensors="pt")) for sentence in sentences]
    search = _search(loaded.base, max_new_tokens, num_beams)
    return _side_by_side(loaded, assistant, batches, sentences, repeats, search, compile, int8 and compile)


def run_asr_demo(
    model_path: str,
    audio_folder: str | None,
    repeats: int,
    threads: int | None,
    max_new_tokens: int | None,
    compile: bool,
    num_beams: int | None = None,
) -> int:
    """Speech recognition, greedy (or beam search) and blockwise side by side, one clip at a time: the speech
    encoder-decoder at `model_path` (saved with its processor) with its `feature-drafter/`, on its `clips/` or on
    `audio_folder`; `num_beams` as in [`run_demo`].

    Returns:
        `int`: 0 when every transcript is identical to greedy's, else 1 (the exit status).
    """
    transformers_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    require_tokenizer(model_path)
    loaded = load_model(model_path)
    base, extractor = loaded.base, loaded.feature_extractor
    if extractor is None:
        raise SystemExit(f"{model_path} is a text model: run the demo without --task asr")
    if loaded.feature_model is None:
        raise SystemExit(f"{model_path} ships no {FEATURE_DRAFTER_SUBDIR}/ to draft with")
    assistant = build_drafter("feature", loaded)
    examples = read_audio_folder(audio_folder or os.path.join(model_path, "clips"))
    audio = [read_wav(example.path, extractor.sampling_rate) for example in examples]
    batches = make_batches(audio, 1, loaded.tokenizer, base.config.pad_token_id, base.device, extractor)
    labels = [example.path.name + (f" ({example.transcript})" if example.transcript else "") for example in examples]
    print(
        f"model: {model_path} (feature drafter, k={assistant.block_size}, fp32, "
        f"{'compiled engine' if compile else 'eager'}), {torch.get_num_threads()} threads, batch 1, "
        f"{limit_words(base, max_new_tokens)}"
    )
    search = _search(base, max_new_tokens, num_beams)
    return _side_by_side(loaded, assistant, batches, labels, repeats, search, compile)


def _search(base: nn.Module, max_new_tokens: int | None, num_beams: int | None = None) -> dict[str, Any]:
    """The generate arguments of both sides of the demo: the checkpoint's beams (or `num_beams`), never sampling
    (said when the checkpoint samples), its length limit unless `max_new_tokens` is given."""
    defaults = base.generation_config
    if defaults.do_sample:
        print("note: the checkpoint's generation_config samples (do_sample=True); the demo decodes without sampling")
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    return {"do_sample": False, "num_beams": num_beams or defaults.num_beams or 1, **limit}


def _side_by_side(
    loaded: LoadedModel, assistant, batches: list[dict], labels: Sequence[str], repeats: int,
    search: dict[str, Any], compile: bool, engine_greedy: bool = False,
) -> int:  # fmt: skip
    """Greedy (or beam search) and blockwise decoding of each one-row batch through the measurement harness, both
    with the generate arguments `search`; prints each pair of outputs under its label, whether they are identical,
    the mean accepted block and the speedup. `engine_greedy` takes the compiled engine's decoding (no assistant) as
    the reference side, transformers' eager one otherwise."""
    base, tokenizer = loaded.base, loaded.tokenizer
    reference = "greedy" if search["num_beams"] == 1 else f"beam {search['num_beams']}"
    greedy_kwargs = {"custom_generate": blockwise_generate, "blockwise_compile": True} if engine_greedy else {}
    runners = {
        "greedy": lambda batch, _: base.generate(**batch, return_dict_in_generate=True, **greedy_kwargs, **search),
        "blockwise": lambda batch, _: base.generate(
            **batch, custom_generate=blockwise_generate, assistant=assistant, return_dict_in_generate=True,
            blockwise_compile=compile, **search,
        ),
    }  # fmt: skip
    if engine_greedy:
        print(
            f"{reference}: the compiled engine's int8 {reference}, the int8 model's reference output "
            "(docs/guides/int8.md)"
        )
        compile_modes({"greedy": runners["greedy"]}, batches[0], {"greedy"})
    if compile:
        print(
            "compiling the decoder's verification forward and the drafter's block with torch.compile before timing "
            "(one-time; 82 s on a cold cache on a 2-core EPYC Zen 4, --no-compile skips it) ...",
            flush=True,
        )
        seconds = compile_modes({"blockwise": runners["blockwise"]}, batches[0], {"blockwise"})["blockwise"]
        print(f"compiled (inductor, weights frozen and prepacked) in {seconds:.1f}s")
    results = measure(
        runners, batches, pad_token_id=base.config.pad_token_id, reference="greedy", tokenizer=tokenizer,
        repeats=repeats, progress=False, count_forwards_of=[base],
    )  # fmt: skip
    greedy, blockwise = results["greedy"], results["blockwise"]
    for label, greedy_text, text, same in zip(
        labels, greedy.texts, blockwise.texts, blockwise.identical_rows, strict=True
    ):
        print(f"\nsource:    {label}")
        print(f"{reference + ':':<10} {greedy_text.strip()}")
        print(f"blockwise: {text.strip()}   [identical: {same}]")
    print(f"\nidentical outputs: {blockwise.identical}/{len(labels)}")
    unit = "tokens" if search["num_beams"] == 1 else "beam steps"
    print(f"mean accepted block: {blockwise.mean_accepted:.2f} {unit} per decoder call")
    print(
        f"time (sum of per-input medians over {repeats} runs): {reference} {greedy.seconds:.3f}s, "
        f"blockwise {blockwise.seconds:.3f}s, speedup {blockwise.speedup:.2f}x"
    )
    return 0 if blockwise.identical == len(labels) else 1


def run_demo_command(demo: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise demo`: translation (the shipped realistic model, `marian-base-en-de`, by default) or, with
    `--task asr`, speech recognition (the shipped speech model by default)."""
    if args.task == "asr":
        if args.sentences or args.int8 or args.drafter != "best":
            demo.error("--task asr takes no sentences, --int8 or --drafter (it drafts with the feature drafter)")
        model = args.model or SHIPPED_SPEECH_MODEL
        check_shipped_model(demo, model)
        if not os.path.isdir(model):
            demo.error(
                f"no speech model at {model}: pass --model DIR with a speech encoder-decoder, its processor and a "
                "feature-drafter/ subfolder (and --audio-folder DIR unless DIR/clips holds the audio)"
            )
        return run_asr_demo(
            model,
            args.audio_folder,
            args.repeats,
            args.threads,
            args.max_new_tokens,
            compile=not args.no_compile,
            num_beams=args.num_beams,
        )
    if args.audio_folder:
        demo.error("--audio-folder needs --task asr")
    sentences = args.sentences or DEMO_SENTENCES
    check_shipped_model(demo, args.model or REALISTIC_MODEL)
    return run_demo(
        args.model or REALISTIC_MODEL,
        sentences,
        args.repeats,
        args.threads,
        args.max_new_tokens,
        args.int8,
        args.drafter,
        compile=not args.no_compile,
        num_beams=args.num_beams,
    )


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    """The flags of `hf-blockwise demo`."""
    demo.add_argument(
        "--model", default=None, help="directory with a base model, its drafters and tokenizer (default: the shipped "
        "marian-base-en-de; with --task asr the shipped speech-en; hf_blockwise/pretrained/multi30k-en-de is a "
        "quicker try)",
    )  # fmt: skip
    demo.add_argument("--repeats", type=positive_int, default=5, help="timing runs per sentence (median is reported)")
    demo.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="length limit; default: the checkpoint's generation_config, as model.generate() without arguments",
    )
    demo.add_argument(
        "--num-beams", type=positive_int, default=None, help="beam search of N beams on both sides (1: greedy); "
        "default: the checkpoint's generation_config"
    )  # fmt: skip
    demo.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    demo.add_argument("--int8", action="store_true", help="quantize the base to int8 first (CPU; both modes)")
    demo.add_argument(
        "--drafter", choices=("best", *(name for name, kind in DRAFTERS.items() if kind.demo)), default="best",
        help="best: the shipped feature drafter if the model has one, else its proposal heads",
    )  # fmt: skip
    demo.add_argument("--no-compile", action="store_true", help="decode blockwise eagerly, without the compiled engine")
    demo.add_argument(
        "--task", choices=("translation", "asr"), default="translation",
        help="asr: a speech model (--model DIR with its processor and feature-drafter/; default: the shipped "
        "speech-en) transcribes --audio-folder (default: DIR/clips) greedy and with its feature drafter",
    )  # fmt: skip
    demo.add_argument("--audio-folder", default=None, help="--task asr: 16-bit .wav files (and metadata.csv)")
    demo.add_argument("sentences", nargs="*", help="English sentences to translate (default: built-in examples)")

"""`hf-blockwise` console script: `demo` (greedy and blockwise side by side), `bench` (every mode, or the loop alone
on random models of real shapes with `--model-config`) and `generate` (a whole corpus, resumable, sharded over
`accelerate launch` processes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise import boundary as hf
from hf_blockwise.corpus import DRAFTERS
from hf_blockwise.corpus.job import CorpusJob, CorpusOptions, length_limit, merged_generate_kwargs, prepare_job, run_job
from hf_blockwise.corpus.paths import check_output_is_not_a_source, check_output_location, check_tokenizer
from hf_blockwise.evaluation.harness import measure
from hf_blockwise.generation.loop import blockwise_generate
from hf_blockwise.loading import (
    FEATURE_DRAFTER_SUBDIR,
    NAR_DRAFTER_SUBDIR,
    LoadedModel,
    build_drafter,
    default_max_new_tokens,
    load_model,
)
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.tools.audio import read_audio_folder, read_wav
from hf_blockwise.tools.bench import (
    DEFAULT_MODES,
    DEFAULT_ORACLE_BLOCK_SIZES,
    FAST_PATH_MODES,
    LOOP_MODES,
    MODE_NAMES,
    BenchSetup,
    Mode,
    compile_modes,
    decoder_cost_curve,
    make_batches,
    plot_cost_curve,
    read_lines,
    run_bench,
    set_speedup_ceilings,
    write_report,
)
from hf_blockwise.tools.model_configs import MODEL_CONFIGS, build_model, random_sources, resolve_name

DEMO_SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two children are playing in the sand at the beach.",
    "A woman with a red hat is riding a bicycle down the street.",
    "A group of people are sitting around a table outside.",
    "A black dog is running through the grass.",
    "A young girl is climbing a rock wall.",
]

PRETRAINED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pretrained")
# the small Multi30k model (7.7M parameters: a quick try, notebooks) and the realistic one (43M, opus-mt-en-de's
# decoder shape), which the demo and the bench run by default
SHIPPED_MODEL = os.path.join(PRETRAINED, "multi30k-en-de")
REALISTIC_MODEL = os.path.join(PRETRAINED, "marian-base-en-de")
SHIPPED_SPEECH_MODEL = os.path.join(PRETRAINED, "speech-en")


def run_demo(
    model_path: str,
    sentences: Sequence[str],
    repeats: int,
    threads: int | None,
    max_new_tokens: int | None = None,
    int8: bool = False,
    drafter: str = "best",
    compile: bool = True,
) -> int:
    """Greedy and blockwise side by side, one sentence at a time, through the measurement harness; prints each
    pair of outputs, whether they are identical, the mean accepted block and the speedup.

    Args:
        max_new_tokens (`int`, *optional*): the length limit; by default the checkpoint's generation_config's.
        drafter (`str`): `"heads"` (the model's proposal heads), `"feature"` (its `feature-drafter/`), or `"best"`:
            the feature drafter when the model ships one, else the heads.
        compile (`bool`): decode blockwise through the compiled engine (`blockwise_compile=True`), compiled once
            before timing. With `int8` the greedy side is the engine's greedy too, "the int8 model's greedy output"
            (the README's int8 contract), which drafting reproduces bit for bit.

    Returns:
        `int`: 0 when every output is identical to greedy's, else 1 (the exit status).
    """
    transformers_logging.set_verbosity_error()  # the demo's own output is the point
    if threads:
        torch.set_num_threads(threads)
    if not os.path.isdir(model_path):
        raise SystemExit(f"No checkpoint at {model_path}: pass --model DIR holding a base model, heads and tokenizer")
    _require_tokenizer(model_path)
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
        f"{torch.get_num_threads()} threads, batch 1, {_limit_words(loaded.base, max_new_tokens)}"
    )
    batches = [dict(loaded.tokenizer([sentence], return_tensors="pt")) for sentence in sentences]
    return _side_by_side(loaded, assistant, batches, sentences, repeats, max_new_tokens, compile, int8 and compile)


def run_asr_demo(
    model_path: str,
    audio_folder: str | None,
    repeats: int,
    threads: int | None,
    max_new_tokens: int | None,
    compile: bool,
) -> int:
    """Speech recognition, greedy and blockwise side by side, one clip at a time: the speech encoder-decoder at
    `model_path` (saved with its processor) with its `feature-drafter/`, on its `clips/` or on `audio_folder`.

    Returns:
        `int`: 0 when every transcript is identical to greedy's, else 1 (the exit status).
    """
    transformers_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    _require_tokenizer(model_path)
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
        f"{_limit_words(base, max_new_tokens)}"
    )
    return _side_by_side(loaded, assistant, batches, labels, repeats, max_new_tokens, compile)


def _require_tokenizer(model_path: str) -> None:
    """Exits with the reason when a local model directory holds no tokenizer (transformers' own error names none)."""
    try:
        check_tokenizer(model_path)
    except ValueError as error:
        raise SystemExit(str(error)) from error


def _limit_words(base: torch.nn.Module, max_new_tokens: int | None) -> str:
    """The length limit of a run in words: given, or the checkpoint's default and where it comes from."""
    if max_new_tokens is not None:
        return f"max_new_tokens {max_new_tokens} (--max-new-tokens)"
    limit, source = default_max_new_tokens(base)
    return f"max_new_tokens {limit} ({source})"


def _side_by_side(
    loaded: LoadedModel, assistant, batches: list[dict], labels: Sequence[str], repeats: int,
    max_new_tokens: int | None, compile: bool, engine_greedy: bool = False,
) -> int:  # fmt: skip
    """Greedy and blockwise decoding of each one-row batch through the measurement harness; prints each pair of
    outputs under its label, whether they are identical, the mean accepted block and the speedup.
    `max_new_tokens=None` keeps the model's generation config's limit; `engine_greedy` takes the compiled engine's
    greedy (no assistant) as the greedy side, transformers' eager greedy otherwise."""
    base, tokenizer = loaded.base, loaded.tokenizer
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    greedy_kwargs = {"custom_generate": blockwise_generate, "blockwise_compile": True} if engine_greedy else {}
    runners = {
        "greedy": lambda batch, _: base.generate(
            **batch, do_sample=False, num_beams=1, return_dict_in_generate=True, **greedy_kwargs, **limit
        ),
        "blockwise": lambda batch, _: base.generate(
            **batch, custom_generate=blockwise_generate, assistant=assistant, return_dict_in_generate=True,
            blockwise_compile=compile, **limit,
        ),
    }  # fmt: skip
    if engine_greedy:
        print("greedy: the compiled engine's int8 greedy, the int8 model's reference output (README, int8)")
        compile_modes({"greedy": runners["greedy"]}, batches[0], {"greedy"})
    if compile:
        print(
            "compiling the decoder's verification forward and the drafter's block with torch.compile before timing "
            "(one-time; ~20-30 s on the shipped models here, --no-compile skips it) ...",
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
        print(f"greedy:    {greedy_text.strip()}")
        print(f"blockwise: {text.strip()}   [identical: {same}]")
    print(f"\nidentical outputs: {blockwise.identical}/{len(labels)}")
    print(f"mean accepted block: {blockwise.mean_accepted:.2f} tokens per decoder call")
    print(
        f"time (sum of per-input medians over {repeats} runs): greedy {greedy.seconds:.3f}s, "
        f"blockwise {blockwise.seconds:.3f}s, speedup {blockwise.speedup:.2f}x"
    )
    return 0 if blockwise.identical == len(labels) else 1


# `--model-config` runs: sources of this many random token ids, and these defaults
MODEL_CONFIG_SOURCE_LENGTH = 20
MODEL_CONFIG_SENTENCES = 8
MODEL_CONFIG_MAX_NEW_TOKENS = 32
MODEL_CONFIG_ORACLE_BLOCK_SIZES = (2, 3, 4, 5, 6, 8)


def _sources(args: argparse.Namespace, setup: BenchSetup) -> tuple[list, list[str] | None]:
    """What the bench decodes, with references when there are some: the audio of `--audio-folder` (speech models),
    the sentences of `--source-file`, or the demo's examples."""
    if (setup.loaded.feature_extractor is None) != (args.audio_folder is None):
        needs = "--audio-folder" if args.audio_folder is None else "--source-file (text)"
        raise SystemExit(f"the encoder of {args.model} reads {hf.encoder_input_name(setup.loaded.base)}: pass {needs}")
    if args.audio_folder:
        examples = read_audio_folder(args.audio_folder)[: args.sentences]
        rate = setup.loaded.feature_extractor.sampling_rate
        sources = [read_wav(example.path, rate) for example in examples]
        transcripts = [example.transcript for example in examples]
        return sources, None if None in transcripts else transcripts
    if args.source_file:
        sources = read_lines(args.source_file)
        references = read_lines(args.reference_file) if args.reference_file else None
    else:
        sources, references = list(DEMO_SENTENCES), None
    if references is not None and len(references) != len(sources):
        raise SystemExit(f"{len(sources)} source lines but {len(references)} reference lines")
    if args.sentences:
        sources = sources[: args.sentences]
        references = references[: args.sentences] if references is not None else None
    return sources, references


def _model_config_setup(args: argparse.Namespace) -> tuple[BenchSetup, list[list[int]]]:
    """`--model-config`: a randomly initialised model of that shape and random source ids (no tokenizer)."""
    base = build_model(args.model_config, tiny=args.tiny_model_config)
    sources = random_sources(base.config, args.sentences or MODEL_CONFIG_SENTENCES, MODEL_CONFIG_SOURCE_LENGTH)
    setup = BenchSetup(LoadedModel(base=base, tokenizer=None), args.max_new_tokens or MODEL_CONFIG_MAX_NEW_TOKENS)
    return setup, sources


def _bench_setup(args: argparse.Namespace) -> tuple[BenchSetup, list, list[str] | None]:
    """The setup, sources and references of a `bench` command."""
    if args.model_config:
        setup, sources = _model_config_setup(args)
        references = None
    else:
        _require_tokenizer(args.model)
        loaded = load_model(
            args.model, assistant_path=args.assistant_model, nar_drafter_path=args.nar_drafter,
            feature_drafter_path=args.feature_drafter, sequential_heads_path=args.sequential_heads,
        )  # fmt: skip
        # the checkpoint's generation_config by default, as model.generate() without arguments
        limit = args.max_new_tokens or default_max_new_tokens(loaded.base)[0]
        setup = BenchSetup(loaded, limit, iad_max_draft_length=args.iad_max_draft_length)
        sources, references = _sources(args, setup)
    oracle_block_sizes = args.oracle_block_sizes or (
        MODEL_CONFIG_ORACLE_BLOCK_SIZES if args.model_config else DEFAULT_ORACLE_BLOCK_SIZES
    )
    setup = dataclasses.replace(
        setup, gad_block_size=args.gad_block_size, gad_top_beta=args.gad_top_beta, gad_tolerance=args.gad_tolerance,
        oracle_block_sizes=tuple(oracle_block_sizes), ct2_threads=args.ct2_threads or torch.get_num_threads(),
    )  # fmt: skip
    return setup, sources, references


def _requested_modes(args: argparse.Namespace) -> list[str]:
    if args.modes:
        return args.modes
    if args.model_config:
        return list(LOOP_MODES)
    return list(FAST_PATH_MODES if args.fast_path else DEFAULT_MODES)


def run_bench_command(args: argparse.Namespace) -> int:
    """`hf-blockwise bench`: decodes, writes `bench.json`, `bench.md`, `bench.png` (and the cost curve) into
    `--out`, prints the table and where the report is."""
    transformers_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sentences = min(args.sentences or 16, 16)
    setup, sources, references = _bench_setup(args)
    cost_curve = args.cost_curve or args.model_config is not None
    curve_tokens = args.cost_curve_max_tokens or (max(setup.oracle_block_sizes) if args.model_config else 32)
    curve = write_cost_curve(setup, sources[0], args.out, curve_tokens) if cost_curve else None
    results = run_bench(setup, sources, references, _requested_modes(args), args.batch_sizes)
    if curve is not None:
        set_speedup_ceilings(results, curve, setup)
    settings = {
        "model": args.model if args.model_config is None else None,
        "model_config": args.model_config,
        "tiny_model_config": args.tiny_model_config,
        "nar_drafter": args.nar_drafter,
        "gad_block_size": args.gad_block_size,
        "gad_top_beta": args.gad_top_beta,
        "gad_tolerance": args.gad_tolerance,
        "oracle_block_sizes": list(setup.oracle_block_sizes),
        "source_file": args.source_file,
        "audio_folder": args.audio_folder,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "ct2_threads": setup.ct2_threads,
        "batch_sizes": sorted({result.batch_size for result in results}),
        "max_new_tokens": setup.max_new_tokens,
        "max_new_tokens_from": _limit_source(args, setup),
        "device": str(next(setup.loaded.base.parameters()).device),
    }
    written = write_report(results, args.out, _report_header(args, settings), settings)
    with open(written[1], encoding="utf-8") as report:
        print(report.read())
    print(f"report written to {os.path.abspath(args.out)}: " + ", ".join(os.path.basename(path) for path in written))
    return 0


def _limit_source(args: argparse.Namespace, setup: BenchSetup) -> str:
    """Where the bench's length limit comes from, for the report's settings."""
    if args.max_new_tokens is not None:
        return "--max-new-tokens"
    if args.model_config:
        return f"the --model-config default ({MODEL_CONFIG_MAX_NEW_TOKENS})"
    return default_max_new_tokens(setup.loaded.base)[1]


def _report_header(args: argparse.Namespace, settings: dict) -> str:
    if args.model_config:
        model = f"random-init {args.model_config} shapes" + (" (tiny)" if args.tiny_model_config else "")
        sources = f"{settings['sentences']} random sources of {MODEL_CONFIG_SOURCE_LENGTH} tokens"
    else:
        model = os.path.basename(os.path.normpath(args.model))
        sources = f"{settings['sentences']} " + ("utterances" if args.audio_folder else "sentences")
    return (
        f"# hf-blockwise bench: {model}, {sources}, {settings['max_new_tokens']} new tokens at most, "
        f"{settings['threads']} threads (CTranslate2: {settings['ct2_threads']}), {settings['device']}"
    )


def write_cost_curve(
    setup: BenchSetup, sentence: str | Sequence[int], out_dir: str, max_tokens: int = 32
) -> list[tuple[int, float]]:
    """Times the decoder cost curve on `sentence` (text, or token ids without a tokenizer) for 1..`max_tokens`
    tokens; writes `cost_curve.json` and `cost_curve.png` into `out_dir`."""
    base, tokenizer = setup.loaded.base, setup.loaded.tokenizer
    curve = decoder_cost_curve(base, tokenizer, sentence, max_tokens=max_tokens)
    compiled = decoder_cost_curve(base, tokenizer, sentence, max_tokens=max_tokens, compiled=True)
    os.makedirs(out_dir, exist_ok=True)
    report = {
        "sentence": sentence, "threads": torch.get_num_threads(), "ms_per_call": {n: 1000 * t for n, t in curve},
        "ms_per_call_compiled": {n: 1000 * t for n, t in compiled},
    }  # fmt: skip
    atomic_write_text(os.path.join(out_dir, "cost_curve.json"), json.dumps(report, indent=2) + "\n")
    plot_cost_curve(curve, os.path.join(out_dir, "cost_curve.png"), compiled)
    for name, times in (("eager", curve), ("compiled", compiled)):
        shown = ", ".join(f"{n}: {1000 * t:.2f}" for n, t in times[:8])
        print(f"decoder cost curve, {name} (ms per call by tokens fed): {shown}")
    return curve


MAX_NEW_TOKENS_HELP = (
    "length limit of each output; default: the checkpoint's generation_config, as model.generate() without "
    "arguments (its max_new_tokens: 128 for the shipped model; printed at the start of the run)"
)


def _positive_int(text: str) -> int:
    """An argparse type: an int of at least 1 (0 or a negative count would be ignored or mean nothing)."""
    try:
        value = int(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from error
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object (generate's keyword arguments by name)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}); e.g. '{{\"no_repeat_ngram_size\": 3}}'") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object of generate arguments by name, got a {type(value).__name__}: "
            "e.g. '{\"no_repeat_ngram_size\": 3}'"
        )
    return value


def _model_config_name(name: str) -> str:
    try:
        return resolve_name(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    _add_bench_source_arguments(bench)
    _add_bench_mode_arguments(bench)
    _add_bench_run_arguments(bench)


def _add_bench_source_arguments(bench: argparse.ArgumentParser) -> None:
    """What `bench` decodes with and what it decodes."""
    bench.add_argument(
        "--model", default=REALISTIC_MODEL, help="seq2seq model directory, with or without heads (default: the "
        "shipped marian-base-en-de)",
    )  # fmt: skip
    bench.add_argument(
        "--model-config",
        type=_model_config_name,
        default=None,
        help="instead of --model: a randomly initialised model of this shape, on random source ids ("
        + ", ".join(MODEL_CONFIGS)
        + "); modes greedy, loop, oracle and the decoder cost curve by default",
    )
    bench.add_argument("--tiny-model-config", action="store_true", help=argparse.SUPPRESS)  # tests: tiny shapes
    bench.add_argument(
        "--assistant-model",
        default=None,
        help="small seq2seq model for transformers' assisted generation (a NAR drafter directory works too)",
    )
    bench.add_argument("--source-file", default=None, help="one source per line (.gz allowed); default: demo")
    bench.add_argument(
        "--audio-folder", default=None, help="speech models: a folder of 16-bit .wav files, with transcripts in its "
        "metadata.csv (the audiofolder layout: file_name, transcription) for WER and BLEU"
    )  # fmt: skip
    bench.add_argument("--reference-file", default=None, help="references for BLEU, line by line")
    bench.add_argument(
        "--sentences", type=_positive_int, default=None,
        help=f"use the first N sources (--model-config: N random sources, default {MODEL_CONFIG_SENTENCES})",
    )  # fmt: skip


def _add_bench_mode_arguments(bench: argparse.ArgumentParser) -> None:
    """How `bench` decodes (modes, batch sizes, drafters)."""
    bench.add_argument(
        "--batch-sizes",
        type=_positive_int,
        nargs="+",
        default=[1, 16],
        help="those larger than the sentences are skipped",
    )
    bench.add_argument(
        "--modes",
        nargs="+",
        default=None,
        type=_mode_name,
        help="any of " + " ".join(MODE_NAMES) + ", oracle_k<k>, heads_k<k>, seq_heads_k<k>, feature_k<k>, "
        "feature_k<k>_t<threshold>, feature_t<threshold>, each also with a _compiled suffix; default: "
        + " ".join(DEFAULT_MODES),
    )
    bench.add_argument(
        "--fast-path",
        action="store_true",
        help="the CPU fast path step by step: " + ", then ".join(FAST_PATH_MODES) + " (int8 needs a CPU)",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help=f"length limit of every mode; default: the checkpoint's generation_config, as model.generate() without "
        f"arguments (128 for the shipped model; --model-config: {MODEL_CONFIG_MAX_NEW_TOKENS})",
    )
    bench.add_argument(
        "--iad-max-draft-length", type=_positive_int, default=32, help="source tokens IAD drafts per step"
    )
    bench.add_argument(
        "--nar-drafter",
        default=None,
        help=f"non-autoregressive drafter for the gad modes (default: <model>/{NAR_DRAFTER_SUBDIR} if present)",
    )
    bench.add_argument(
        "--feature-drafter", default=None, help="feature drafter directory (default: <model>/feature-drafter if any)"
    )
    bench.add_argument(
        "--sequential-heads", default=None, help="sequential heads directory (default: <model>/sequential-heads)"
    )
    bench.add_argument(
        "--gad-block-size", type=_positive_int, default=None, help="tokens per GAD step (default: trained)"
    )
    bench.add_argument("--gad-top-beta", type=_positive_int, default=3, help="GAD++ top-beta")
    bench.add_argument("--gad-tolerance", type=float, default=1.0, help="GAD++ log-likelihood tolerance tau")
    bench.add_argument(
        "--oracle-block-sizes",
        "--oracle-block-size",
        dest="oracle_block_sizes",
        type=_positive_int,
        nargs="+",
        default=None,
        help="block sizes k of the oracle mode (drafts = greedy's own output), one row oracle_k{k} each; default "
        f"{' '.join(map(str, DEFAULT_ORACLE_BLOCK_SIZES))} (--model-config: "
        f"{' '.join(map(str, MODEL_CONFIG_ORACLE_BLOCK_SIZES))})",
    )


def _add_bench_run_arguments(bench: argparse.ArgumentParser) -> None:
    """How `bench` runs (threads, a quick run) and what it writes (reports, the cost curve)."""
    bench.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (1 = Devlin's words/s)")
    bench.add_argument(
        "--ct2-threads", type=_positive_int, default=None, help="CTranslate2's threads in the ct2 modes (default: "
        "--threads, or torch's)"
    )  # fmt: skip
    bench.add_argument("--out", default="bench", help="directory for bench.json, bench.md, bench.png")
    bench.add_argument("--quick", action="store_true", help="at most 16 sentences: a run of about a minute")
    bench.add_argument("--cost-curve", action="store_true", help="also time one decoder call for 1..32 tokens")
    bench.add_argument(
        "--cost-curve-max-tokens", type=_positive_int, default=None, help="cost curve up to N tokens (default 32; "
        "--model-config: the largest oracle block size)"
    )  # fmt: skip


def _mode_name(mode: str) -> str:
    try:
        Mode.parse(mode)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"unknown mode {mode!r}") from error
    return mode


def _check_bench_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if any(k < 2 for k in args.oracle_block_sizes or ()):
        parser.error("--oracle-block-sizes must be >= 2")
    if args.tiny_model_config and not args.model_config:
        parser.error("--tiny-model-config needs --model-config")
    if args.audio_folder and (args.source_file or args.reference_file):
        parser.error("--audio-folder brings its own sources and transcripts: no --source-file or --reference-file")
    if args.audio_folder and args.cost_curve:
        parser.error("--cost-curve times text sources; it does not take --audio-folder")
    if args.model_config and (
        args.source_file or args.reference_file or args.audio_folder or args.assistant_model or args.nar_drafter
    ):
        parser.error("--model-config decodes random source ids with a random model: it takes no files or drafters")


def _add_generate_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", required=True, help="model directory (with its drafters) or hub id")
    command.add_argument(
        "--input", required=True,
        help="text file (one source per line, .gz allowed), .jsonl (with --column), .csv/.tsv/.parquet/.json data "
        "file, a dataset saved with save_to_disk, or a hub dataset name (with --column, --split)",
    )  # fmt: skip
    command.add_argument("--output", required=True, help="output file: text, or JSONL when it ends in .jsonl")
    command.add_argument("--column", default=None, help="the column / JSON field holding the sources")
    command.add_argument("--split", default=None, help="the dataset split (datasets with several)")
    command.add_argument(
        "--drafter", choices=DRAFTERS, default="auto",
        help="auto: the fastest exact choice measured here: at batch 1 composite (else feature, heads, input_copy, "
        "none, by what the model has), above batch 1 none (the loop alone)",
    )  # fmt: skip
    command.add_argument("--batch-size", type=_positive_int, default=16, help="most rows per batch")
    command.add_argument(
        "--max-batch-tokens", type=_positive_int, default=None, help="most padded source tokens per batch"
    )
    command.add_argument("--max-new-tokens", type=_positive_int, default=None, help=MAX_NEW_TOKENS_HELP)
    command.add_argument(
        "--generate-kwargs", type=_json_object, default=None,
        help='more generate arguments, as a JSON object: \'{"no_repeat_ngram_size": 3}\'',
    )  # fmt: skip
    command.add_argument("--compile", action="store_true", help="verify through the compiled engine")
    command.add_argument("--format", choices=("text", "jsonl"), default=None, help="default: from the file name")
    command.add_argument("--stats", action="store_true", help="JSONL records carry new_tokens and decoder_calls")
    command.add_argument(
        "--on-long", choices=("fail", "skip"), default="fail",
        help="sources longer than the model's positions: fail, or skip with a warning (empty output line)",
    )  # fmt: skip
    command.add_argument(
        "--chunk-size", type=_positive_int, default=1024,
        help="lines sorted, written and resumed together; the unit of sharding",
    )  # fmt: skip
    command.add_argument(
        "--overwrite", action="store_true", help="replace an earlier output instead of resuming it (never the input)"
    )
    command.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (per process)")
    command.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_generate_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise generate`: [`generate_corpus`] with the command's flags; prints the settings it runs with
    (the length limit and where it comes from) and, at the end, the run's figures."""
    _check_generate_paths(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # loading bars would interleave with the job's own
    try:
        options = CorpusOptions(
            drafter=args.drafter, batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
            generate_kwargs=merged_generate_kwargs(args.max_new_tokens, args.generate_kwargs), compile=args.compile,
            output_format=args.format, stats=args.stats, on_long=args.on_long, chunk_size=args.chunk_size,
        )  # fmt: skip
        job = prepare_job(args.model, args.input, args.output, column=args.column, split=args.split, options=options)
        if job.state.is_main_process:
            print(_job_summary(job), flush=True)
        report = run_job(job, overwrite=args.overwrite, progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"hf-blockwise generate: {error}") from error
    print(
        f"{report.output}: {report.lines} lines decoded ({report.resumed_lines} already there, {report.skipped} "
        f"skipped) with drafter {report.drafter} in {report.seconds:.1f}s: {report.sentences_per_second:.1f} "
        f"sentences/s, {report.tokens_per_second:.0f} tokens/s, {report.tokens_per_call:.2f} tokens per decoder call"
    )
    return 0


def _check_generate_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit status 2) before anything loads: an output that cannot be written or that is the input or
    a model file, and a model directory without a tokenizer."""
    output = Path(args.output)
    try:
        check_output_location(output)
        check_output_is_not_a_source(output, args.input, args.model)
        check_tokenizer(args.model)
    except ValueError as error:
        parser.error(str(error))


def _job_summary(job: CorpusJob) -> str:
    settings = job.settings
    budget = f", {settings.max_batch_tokens} source tokens" if settings.max_batch_tokens else ""
    return (
        f"generate: {settings.num_lines} sources from {settings.input} with {settings.model}, drafter "
        f"{settings.drafter}, {length_limit(job)}, at most {settings.batch_size} rows{budget} per batch"
        + (f", generate arguments {others}" if (others := _other_arguments(settings.generate_kwargs)) else "")
    )


def _other_arguments(generate_kwargs: dict) -> dict:
    return {key: value for key, value in generate_kwargs.items() if key != "max_new_tokens"}


def run_demo_command(demo: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise demo`: translation (the shipped realistic model, `marian-base-en-de`, by default) or, with
    `--task asr`, speech recognition (the shipped speech model by default)."""
    if args.task == "asr":
        if args.sentences or args.int8 or args.drafter != "best":
            demo.error("--task asr takes no sentences, --int8 or --drafter (it drafts with the feature drafter)")
        model = args.model or SHIPPED_SPEECH_MODEL
        if not os.path.isdir(model):
            demo.error(
                f"no speech model at {model}: pass --model DIR with a speech encoder-decoder, its processor and a "
                "feature-drafter/ subfolder (and --audio-folder DIR unless DIR/clips holds the audio)"
            )
        return run_asr_demo(
            model, args.audio_folder, args.repeats, args.threads, args.max_new_tokens, compile=not args.no_compile
        )
    if args.audio_folder:
        demo.error("--audio-folder needs --task asr")
    sentences = args.sentences or DEMO_SENTENCES
    return run_demo(
        args.model or REALISTIC_MODEL,
        sentences,
        args.repeats,
        args.threads,
        args.max_new_tokens,
        args.int8,
        args.drafter,
        compile=not args.no_compile,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The `hf-blockwise` console script: `demo`, `bench` and `generate`."""
    parser = argparse.ArgumentParser(prog="hf-blockwise", description="Exact blockwise parallel decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="translate a few sentences, greedy and blockwise side by side")
    demo.add_argument(
        "--model", default=None, help="directory with a base model, its drafters and tokenizer (default: the shipped "
        "marian-base-en-de; with --task asr the shipped speech-en; hf_blockwise/pretrained/multi30k-en-de is a "
        "quicker try)",
    )  # fmt: skip
    demo.add_argument("--repeats", type=_positive_int, default=5, help="timing runs per sentence (median is reported)")
    demo.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help="length limit; default: the checkpoint's generation_config, as model.generate() without arguments",
    )
    demo.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    demo.add_argument("--int8", action="store_true", help="quantize the base to int8 first (CPU; both modes)")
    demo.add_argument(
        "--drafter", choices=("best", "feature", "heads"), default="best",
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
    bench = commands.add_parser("bench", help="every decoding mode side by side, measured against greedy")
    _add_bench_arguments(bench)
    generate = commands.add_parser(
        "generate", help="a whole corpus, in sorted batches, resumable; data parallel under accelerate launch"
    )
    _add_generate_arguments(generate)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_generate_command(generate, args)
    if args.command == "bench":
        _check_bench_arguments(bench, args)
        return run_bench_command(args)
    if args.command == "demo":
        return run_demo_command(demo, args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

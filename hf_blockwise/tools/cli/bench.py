"""`hf-blockwise bench`: every mode side by side, measured against greedy (or the loop alone on random models of
real shapes, `--model-config`), with its report and cost curve."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers.utils import logging as transformers_logging

from hf_blockwise import boundary as hf
from hf_blockwise.audio import read_audio_folder, read_wav
from hf_blockwise.evaluation.model_configs import MODEL_CONFIGS, build_model, random_sources, resolve_name
from hf_blockwise.loading import NAR_DRAFTER_SUBDIR, REALISTIC_MODEL, LoadedModel, default_max_new_tokens, load_model
from hf_blockwise.serialization import atomic_write_text
from hf_blockwise.text_files import read_lines
from hf_blockwise.tools.bench import (
    ALL_MODES,
    DEFAULT_MODES,
    DEFAULT_ORACLE_BLOCK_SIZES,
    FAST_PATH_MODES,
    LOOP_MODES,
    MODE_NAMES,
    BenchSetup,
    Mode,
    decoder_cost_curve,
    plot_cost_curve,
    run_bench,
    set_speedup_ceilings,
    write_report,
)
from hf_blockwise.tools.cli.arguments import (
    check_shipped_model,
    positive_float,
    positive_int,
    require_tokenizer,
    unit_interval,
)
from hf_blockwise.tools.cli.demo import DEMO_SENTENCES

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
        try:
            sources = read_lines(args.source_file)
            references = read_lines(args.reference_file) if args.reference_file else None
        except ValueError as error:  # not UTF-8: the file, line and byte, and what to do
            raise SystemExit(str(error)) from None
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
        require_tokenizer(args.model)
        try:
            loaded = load_model(
                args.model, assistant_path=args.assistant_model, nar_drafter_path=args.nar_drafter,
                feature_drafter_path=args.feature_drafter, sequential_heads_path=args.sequential_heads,
            )  # fmt: skip
        except ValueError as error:  # a model that is not there, or not what its folder says
            raise SystemExit(f"hf-blockwise bench: {error}") from error
        # the checkpoint's generation_config by default, as model.generate() without arguments
        limit = args.max_new_tokens or default_max_new_tokens(loaded.base)[0]
        setup = BenchSetup(loaded, limit, iad_max_draft_length=args.iad_max_draft_length)
        sources, references = _sources(args, setup)
    setup.loaded.to(args.device)
    oracle_block_sizes = args.oracle_block_sizes or (
        MODEL_CONFIG_ORACLE_BLOCK_SIZES if args.model_config else DEFAULT_ORACLE_BLOCK_SIZES
    )
    setup = dataclasses.replace(
        setup, gad_block_size=args.gad_block_size, gad_top_beta=args.gad_top_beta, gad_tolerance=args.gad_tolerance,
        oracle_block_sizes=tuple(oracle_block_sizes), ct2_threads=args.ct2_threads or torch.get_num_threads(),
        temperature=args.temperature, top_p=args.top_p, compiled_prefill=args.compiled_prefill,
    )  # fmt: skip
    return setup, sources, references


def requested_modes(args: argparse.Namespace) -> list[str]:
    if args.modes == [ALL_MODES]:
        return list(MODE_NAMES)
    if args.modes:
        return args.modes
    if args.model_config:
        return list(LOOP_MODES)
    return list(FAST_PATH_MODES if args.fast_path else DEFAULT_MODES)


def run_bench_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`hf-blockwise bench`: checks the flags (usage errors through `parser`), decodes, writes `bench.json`,
    `bench.md`, `bench.png` (and the cost curve) into `--out`, prints the table and where the report is."""
    check_bench_arguments(parser, args)
    transformers_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sentences = min(args.sentences or 16, 16)
    setup, sources, references = _bench_setup(args)
    cost_curve = args.cost_curve or args.model_config is not None
    curve_tokens = args.cost_curve_max_tokens or (max(setup.oracle_block_sizes) if args.model_config else 32)
    modes = requested_modes(args)
    # the compiled curve where compiled modes run: it times their engine (built once, for both)
    compiled = any(Mode.parse(mode).compiled for mode in modes)
    curves = write_cost_curve(setup, sources[0], args.out, curve_tokens, compiled) if cost_curve else None
    results = run_bench(setup, sources, references, modes, args.batch_sizes)
    if curves is not None:
        set_speedup_ceilings(results, *curves, setup=setup)
    settings = {
        "model": args.model if args.model_config is None else None,
        "model_config": args.model_config,
        "tiny_model_config": args.tiny_model_config,
        "nar_drafter": args.nar_drafter,
        "feature_drafter": args.feature_drafter,
        "sequential_heads": args.sequential_heads,
        "gad_block_size": args.gad_block_size,
        "gad_top_beta": args.gad_top_beta,
        "gad_tolerance": args.gad_tolerance,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "oracle_block_sizes": list(setup.oracle_block_sizes),
        "source_file": args.source_file,
        "audio_folder": args.audio_folder,
        "sentences": len(sources),
        "threads": torch.get_num_threads(),
        "ct2_threads": setup.ct2_threads,
        "compiled_prefill": setup.compiled_prefill,
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
    # drafters saved outside the model's folder: a report must say which one its rows measured
    elsewhere = [
        f"{name} {path}"
        for name, path in (("feature drafter", args.feature_drafter), ("NAR drafter", args.nar_drafter),
                           ("sequential heads", args.sequential_heads))
        if path
    ]  # fmt: skip
    return (
        f"# hf-blockwise bench: {model}, {sources}, {settings['max_new_tokens']} new tokens at most, "
        f"{settings['threads']} threads (CTranslate2: {settings['ct2_threads']}), {settings['device']}"
        + (", compiled modes with their first call compiled" if settings["compiled_prefill"] else "")
        + "".join(f", {drafter}" for drafter in elsewhere)
    )


def write_cost_curve(
    setup: BenchSetup, sentence: str | Sequence[int], out_dir: str, max_tokens: int = 32, compiled: bool = False
) -> tuple[list[tuple[int, float]], list[tuple[int, float]] | None]:
    """Times the decoder cost curve on `sentence` (text, or token ids without a tokenizer) for 1..`max_tokens`
    tokens, eager and, with `compiled`, through the compiled engine; writes `cost_curve.json` (`ms_per_call`,
    `ms_per_call_compiled`) and `cost_curve.png` into `out_dir`.

    Returns:
        The eager curve and the compiled one (`None` without `compiled`), (tokens fed, seconds per call) each.
    """
    base, tokenizer = setup.loaded.base, setup.loaded.tokenizer
    curves = {"eager": decoder_cost_curve(base, tokenizer, sentence, max_tokens=max_tokens)}
    if compiled:
        curves["compiled"] = decoder_cost_curve(base, tokenizer, sentence, max_tokens=max_tokens, compiled=True)
    os.makedirs(out_dir, exist_ok=True)
    report: dict[str, Any] = {"sentence": sentence, "threads": torch.get_num_threads()}
    for name, times in curves.items():
        report["ms_per_call" + ("" if name == "eager" else "_compiled")] = {n: 1000 * t for n, t in times}
        shown = ", ".join(f"{n}: {1000 * t:.2f}" for n, t in times[:8])
        print(f"decoder cost curve, {name} (ms per call by tokens fed): {shown}")
    atomic_write_text(os.path.join(out_dir, "cost_curve.json"), json.dumps(report, indent=2) + "\n")
    plot_cost_curve(curves["eager"], os.path.join(out_dir, "cost_curve.png"), curves.get("compiled"))
    return curves["eager"], curves.get("compiled")


def _model_config_name(name: str) -> str:
    try:
        return resolve_name(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
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
        "--sentences", type=positive_int, default=None,
        help=f"use the first N sources (--model-config: N random sources, default {MODEL_CONFIG_SENTENCES})",
    )  # fmt: skip


_MODES_HELP = (
    "any of " + " ".join(MODE_NAMES) + ", oracle_k<k>, heads_k<k>, seq_heads_k<k>, feature_k<k>, "
    "feature_k<k>_t<threshold>, feature_t<threshold>, each also with a _compiled suffix, gad_k<k>, "
    "gad_pp_k<k>[_beta<β>][_tau<τ>], trees <heads|feature>_k<k>_n<nodes>[_m<branching>], beam<N> and <mode>_b<N> "
    "(beam search); or all (every mode); default: the references, CTranslate2, the fastest exact modes and the "
    "oracle: " + " ".join(DEFAULT_MODES)
)


def _add_bench_mode_arguments(bench: argparse.ArgumentParser) -> None:
    """How `bench` decodes (modes, batch sizes, drafters)."""
    bench.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1, 16],
        help="those larger than the sentences are skipped",
    )
    bench.add_argument("--modes", nargs="+", default=None, type=_mode_name, help=_MODES_HELP)
    bench.add_argument(
        "--fast-path",
        action="store_true",
        help="the CPU fast path step by step: " + ", then ".join(FAST_PATH_MODES) + " (int8 needs a CPU)",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help=f"length limit of every mode; default: the checkpoint's generation_config, as model.generate() without "
        f"arguments (128 for the shipped model; --model-config: {MODEL_CONFIG_MAX_NEW_TOKENS})",
    )
    bench.add_argument(
        "--iad-max-draft-length", type=positive_int, default=32, help="source tokens IAD drafts per step"
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
        "--gad-block-size", type=positive_int, default=None, help="tokens per GAD step (default: trained)"
    )
    bench.add_argument("--gad-top-beta", type=positive_int, default=3, help="GAD++ top-beta")
    bench.add_argument("--gad-tolerance", type=float, default=1.0, help="GAD++ log-likelihood tolerance tau")
    bench.add_argument(
        "--temperature", type=positive_float, default=0.7, help="the _sample modes' temperature (default 0.7)"
    )
    bench.add_argument("--top-p", type=unit_interval, default=0.9, help="the _sample modes' top-p (default 0.9)")
    bench.add_argument(
        "--oracle-block-sizes",
        "--oracle-block-size",
        dest="oracle_block_sizes",
        type=positive_int,
        nargs="+",
        default=None,
        help="block sizes k of the oracle mode (drafts = greedy's own output), one row oracle_k{k} each; default "
        f"{' '.join(map(str, DEFAULT_ORACLE_BLOCK_SIZES))} (--model-config: "
        f"{' '.join(map(str, MODEL_CONFIG_ORACLE_BLOCK_SIZES))})",
    )


def _add_bench_run_arguments(bench: argparse.ArgumentParser) -> None:
    """How `bench` runs (threads, a quick run) and what it writes (reports, the cost curve)."""
    bench.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (1 = Devlin's words/s)")
    bench.add_argument(
        "--ct2-threads", type=positive_int, default=None, help="CTranslate2's threads in the ct2 modes (default: "
        "--threads, or torch's)"
    )  # fmt: skip
    bench.add_argument(
        "--device", default="cpu", help="torch device the models run on, e.g. cuda (timings then wait for the GPU's "
        "queued work; the _int8 modes quantize for a CPU)"
    )  # fmt: skip
    bench.add_argument(
        "--compiled-prefill",
        action="store_true",
        help="the _compiled modes compile each generate's first decoder call too (CompileOptions.compiled_prefill)",
    )
    bench.add_argument("--out", default="bench", help="directory for bench.json, bench.md, bench.png")
    bench.add_argument("--quick", action="store_true", help="at most 16 sentences: a run of about a minute")
    bench.add_argument(
        "--cost-curve",
        action="store_true",
        help="also time one decoder call for 1..32 tokens "
        "(eager, and through the compiled engine where compiled modes run)",
    )
    bench.add_argument(
        "--cost-curve-max-tokens", type=positive_int, default=None, help="cost curve up to N tokens (default 32; "
        "--model-config: the largest oracle block size)"
    )  # fmt: skip


def _mode_name(mode: str) -> str:
    if mode == ALL_MODES:
        return mode
    try:
        Mode.parse(mode)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error  # an unknown name, or a size no drafter takes
    return mode


def _check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--device` names a device torch has here, and one every requested mode runs on."""
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    if device.type == "cpu":
        return
    int8 = [name for name in requested_modes(args) if Mode.parse(name).cpu_only]
    if int8:
        parser.error(
            f"--device {args.device}: the modes {', '.join(int8)} quantize with torch's dynamic int8 products, which "
            "run on a CPU; name --modes without them"
        )


def check_bench_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.modes and ALL_MODES in args.modes and len(args.modes) > 1:
        parser.error(f"--modes {ALL_MODES} runs every mode: name no other")
    if any(k < 2 for k in args.oracle_block_sizes or ()):
        parser.error("--oracle-block-sizes must be >= 2")
    if args.tiny_model_config and not args.model_config:
        parser.error("--tiny-model-config needs --model-config")
    if not args.model_config:
        check_shipped_model(parser, args.model)
    if args.audio_folder and (args.source_file or args.reference_file):
        parser.error("--audio-folder brings its own sources and transcripts: no --source-file or --reference-file")
    if args.audio_folder and args.cost_curve:
        parser.error("--cost-curve times text sources; it does not take --audio-folder")
    _check_device(parser, args)
    if args.model_config and (
        args.source_file or args.reference_file or args.audio_folder or args.assistant_model or args.nar_drafter
    ):
        parser.error("--model-config decodes random source ids with a random model: it takes no files or drafters")

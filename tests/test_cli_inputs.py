"""What a user gives `hf-blockwise generate` / `generate_corpus` (and the demo and bench): the checkpoint's
`generation_config` as the default length, blank lines, loaded models, resolved paths, and clear refusals of inputs
that would be ignored, overwritten or fail deep inside (each a usage error naming the argument and the fix)."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import build_model, save_with_random_heads, word_tokenizer

from hf_blockwise import BlockwiseHeadsConfig, BlockwiseHeadsModel
from hf_blockwise.corpus import generate_corpus, plan_batches
from hf_blockwise.loading import default_max_new_tokens, load_model
from hf_blockwise.tools.bench import Mode
from hf_blockwise.tools.cli import main

CHECKPOINT_LIMIT = 5  # the saved generation_config's max_new_tokens: short, so that outputs reach it


def random_sources(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, 64)}" for _ in range(rng.randint(1, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Marian with a word tokenizer and random heads, saved with a generation_config of max_new_tokens 5."""
    directory = tmp_path_factory.mktemp("model")
    save_with_random_heads(directory, generation={"max_length": None, "max_new_tokens": CHECKPOINT_LIMIT})
    return directory


def greedy(model_dir: Path, sources: list[str], batch_size: int, **generate_kwargs) -> list[str]:
    """transformers' greedy `generate` over the batches the job plans (one chunk), in input order; no length
    argument means the checkpoint's generation_config, as `model.generate()`."""
    loaded = load_model(str(model_dir))
    encoded = loaded.tokenizer(sources)["input_ids"]
    outputs = {}
    for batch in plan_batches([len(ids) for ids in encoded], batch_size):
        padded = loaded.tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
        sequences = loaded.base.generate(**padded, **generate_kwargs)
        texts = loaded.tokenizer.batch_decode(sequences, skip_special_tokens=True)
        outputs.update(zip(batch, texts, strict=True))
    return [outputs[index] for index in range(len(sources))]


def run_cli(capsys, *arguments: str) -> tuple[int, str, str]:
    """`hf-blockwise ARGUMENTS`: (exit status, stdout, stderr); a usage error exits 2 with its message on stderr."""
    try:
        status = main(list(arguments))
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
        captured = capsys.readouterr()
        return status, captured.out, captured.err + ("" if isinstance(exit.code, int) else str(exit.code))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def generate_arguments(model_dir: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(model_dir), "--input", str(source), "--output", str(output), "--batch-size", "4",
        "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def test_the_checkpoints_generation_config_is_the_default_length(tmp_path, model_dir, capsys) -> None:
    sources = random_sources(24, seed=1)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(sources) + "\n")
    expected = greedy(model_dir, sources, 4)  # model.generate() without a length: the checkpoint's 5 new tokens
    assert expected != greedy(model_dir, sources, 4, max_new_tokens=16)  # the limit decides some lines

    status, out, _ = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "out.txt"))
    assert status == 0 and "max_new_tokens 5 (the checkpoint's generation_config)" in out
    assert (tmp_path / "out.txt").read_text().splitlines() == expected
    generate_corpus(str(model_dir), sources, tmp_path / "api.txt", batch_size=4, progress=False)
    assert (tmp_path / "api.txt").read_text().splitlines() == expected

    # an explicit length overrides the checkpoint's
    status, out, _ = run_cli(
        capsys, *generate_arguments(model_dir, source, tmp_path / "16.txt", "--max-new-tokens", "16")
    )
    assert status == 0 and "max_new_tokens 16 (given)" in out
    assert (tmp_path / "16.txt").read_text().splitlines() == greedy(model_dir, sources, 4, max_new_tokens=16)

    # the bench and the demo use it too, and say so
    bench = ["bench", "--model", str(model_dir), "--source-file", str(source), "--sentences", "4"]
    bench += ["--modes", "greedy", "loop", "--batch-sizes", "2", "--out", str(tmp_path / "bench")]
    assert run_cli(capsys, *bench)[0] == 0
    settings = json.loads((tmp_path / "bench" / "bench.json").read_text())["settings"]
    assert settings["max_new_tokens"] == CHECKPOINT_LIMIT
    assert settings["max_new_tokens_from"] == "the checkpoint's generation_config"
    status, out, _ = run_cli(capsys, "demo", "--model", str(model_dir), "--repeats", "1", "--no-compile", sources[0])
    assert status == 0 and "max_new_tokens 5 (the checkpoint's generation_config)" in out
    assert f"blockwise: {greedy(model_dir, sources[:1], 1)[0].strip()}   [identical: True]" in out


def test_the_demo_of_a_checkpoint_that_defaults_to_beams_runs_its_beams(tmp_path, capsys) -> None:
    """opus-mt's and BART-CNN's generation_config ask for 4 beams: the demo decodes 4 beams both ways (transformers'
    beam search and the blockwise beam loop), identical; `--num-beams 1` decodes greedy."""
    directory = tmp_path / "beams"
    base = build_model("marian", seed=3)
    base.generation_config.num_beams = 4
    base.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    BlockwiseHeadsModel(base, BlockwiseHeadsConfig(block_size=3)).save_pretrained(
        directory, base_model_name_or_path="."
    )
    status, out, _ = run_cli(capsys, "demo", "--model", str(directory), "--repeats", "1", "--no-compile", "w5 w6 w7")
    assert status == 0, out
    assert "beam 4:" in out and "[identical: True]" in out and "beam steps per decoder call" in out
    beams = BlockwiseHeadsModel.from_pretrained(str(directory)).base_model.generate(
        **word_tokenizer()(["w5 w6 w7"], return_tensors="pt")
    )
    text = word_tokenizer().decode(beams[0], skip_special_tokens=True).strip()
    assert f"blockwise: {text}   [identical: True]" in out
    status, out, _ = run_cli(
        capsys, "demo", "--model", str(directory), "--repeats", "1", "--no-compile", "--num-beams", "1", "w5 w6 w7"
    )
    assert status == 0 and "greedy:" in out and "tokens per decoder call" in out


def test_the_default_length_without_max_new_tokens_is_generates() -> None:
    """A generation_config with only `max_length` (opus-mt's 512) or nothing: the limit `generate` applies."""
    model = build_model("marian", seed=3)
    ids = torch.tensor([[5, 6, 7, 1]])
    model.generation_config.max_length = 7
    assert default_max_new_tokens(model)[0] == 6
    assert torch.equal(model.generate(ids), model.generate(ids, max_new_tokens=6))
    model.generation_config.max_length = None
    limit, source = default_max_new_tokens(model)
    assert limit == 20 and "transformers' default" in source
    assert torch.equal(model.generate(ids), model.generate(ids, max_new_tokens=20))


def test_the_output_is_never_the_input_or_a_model_file(tmp_path, model_dir, capsys, monkeypatch) -> None:
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\nw7\n")
    (tmp_path / "link.txt").symlink_to(source)
    monkeypatch.chdir(tmp_path)
    for output in (source, Path("in.txt"), Path("./sub/../in.txt"), tmp_path / "link.txt"):
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, output, "--overwrite"))
        assert status == 2 and "would overwrite the input" in err and "choose another output" in err, output
    with pytest.raises(ValueError, match="would overwrite the input"):
        generate_corpus(str(model_dir), "in.txt", source, overwrite=True, progress=False)
    assert source.read_text() == "w5 w6\nw7\n"

    config = (model_dir / "config.json").read_bytes()
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, model_dir / "config.json", "--overwrite"))
    assert status == 2 and "is a file of the model directory" in err
    assert (model_dir / "config.json").read_bytes() == config
    # a new file beside the model is no model file: written, and replaced by --overwrite
    assert run_cli(capsys, *generate_arguments(model_dir, source, model_dir / "out.txt"))[0] == 0
    assert run_cli(capsys, *generate_arguments(model_dir, source, model_dir / "out.txt", "--overwrite"))[0] == 0
    assert len((model_dir / "out.txt").read_text().splitlines()) == 2


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_blank_line_gives_a_blank_line(tmp_path, model_dir, batch_size: int) -> None:
    sources = random_sources(9, seed=2)
    with_blanks = ["", *sources[:3], "", "   ", *sources[3:7], "\t", *sources[7:], ""]
    arguments = {"batch_size": batch_size, "max_new_tokens": 8, "progress": False}
    generate_corpus(str(model_dir), sources, tmp_path / "plain.txt", **arguments)
    generate_corpus(str(model_dir), with_blanks, tmp_path / "blanks.txt", **arguments)
    plain = (tmp_path / "plain.txt").read_text().splitlines()
    lines = (tmp_path / "blanks.txt").read_text().splitlines()
    assert len(lines) == len(with_blanks)
    assert [line for line, text in zip(lines, with_blanks, strict=True) if not text.strip()] == [""] * 5
    assert [line for line, text in zip(lines, with_blanks, strict=True) if text.strip()] == plain

    report = generate_corpus(str(model_dir), with_blanks, tmp_path / "blanks.jsonl", stats=True, **arguments)
    records = [json.loads(line) for line in (tmp_path / "blanks.jsonl").read_text().splitlines()]
    assert records[0] == {"index": 0, "output": "", "new_tokens": 0, "decoder_calls": 0}
    assert report.new_tokens == sum(record["new_tokens"] for record in records)


def test_a_file_of_blank_lines_gives_blank_lines(tmp_path, model_dir, capsys) -> None:
    (tmp_path / "blank.txt").write_text("\n\n\n")
    status, out, _ = run_cli(capsys, *generate_arguments(model_dir, tmp_path / "blank.txt", tmp_path / "out.txt"))
    assert status == 0 and "3 lines decoded" in out
    assert (tmp_path / "out.txt").read_text() == "\n\n\n"


@pytest.mark.parametrize(
    "command, flag",
    [
        ("generate", "--threads"), ("generate", "--batch-size"), ("generate", "--chunk-size"),
        ("generate", "--max-new-tokens"), ("generate", "--max-batch-tokens"), ("bench", "--threads"),
        ("bench", "--batch-sizes"), ("bench", "--max-new-tokens"), ("demo", "--threads"), ("demo", "--repeats"),
    ],
)  # fmt: skip
def test_non_positive_numbers_are_usage_errors(tmp_path, capsys, command: str, flag: str) -> None:
    required = ["--model", "m", "--input", "in.txt", "--output", "out.txt"] if command == "generate" else []
    for value in ("0", "-2"):
        status, _, err = run_cli(capsys, command, *required, flag, value)
        assert status == 2 and f"argument {flag}: must be >= 1, got {value}" in err
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        generate_corpus("m", ["w5"], tmp_path / "out.txt", max_new_tokens=0)


def test_a_loaded_model_is_accepted_with_its_tokenizer(tmp_path, model_dir) -> None:
    sources = random_sources(12, seed=3)
    arguments = {"batch_size": 4, "progress": False}
    generate_corpus(str(model_dir), sources, tmp_path / "from-dir.txt", **arguments)
    model, tokenizer = BlockwiseHeadsModel.from_pretrained(model_dir).eval(), word_tokenizer()
    report = generate_corpus(model, sources, tmp_path / "loaded.txt", tokenizer=tokenizer, drafter="heads", **arguments)
    assert (tmp_path / "loaded.txt").read_text() == (tmp_path / "from-dir.txt").read_text()
    assert report.drafter == "heads" and report.lines == 12
    again = generate_corpus(model, sources, tmp_path / "loaded.txt", tokenizer=tokenizer, drafter="heads", **arguments)
    assert again.lines == 0 and again.resumed_lines == 12  # the same weights: the finished output is recognized
    generate_corpus(model.base_model, sources, tmp_path / "base.txt", tokenizer=tokenizer, **arguments)
    assert (tmp_path / "base.txt").read_text() == (tmp_path / "from-dir.txt").read_text()

    with pytest.raises(ValueError, match=r"given a loaded BlockwiseHeadsModel: pass its tokenizer too"):
        generate_corpus(model, sources, tmp_path / "x.txt", **arguments)
    with pytest.raises(ValueError, match=r"tokenizer= goes with a loaded model"):
        generate_corpus(str(model_dir), sources, tmp_path / "x.txt", tokenizer=tokenizer, **arguments)
    with torch.no_grad():
        model.base_model.lm_head.weight[0, 0] += 1.0  # other weights under the same name
    with pytest.raises(ValueError, match=r"belongs to another run: .*model '<in-memory MarianMTModel"):
        generate_corpus(model, sources, tmp_path / "loaded.txt", tokenizer=tokenizer, drafter="heads", **arguments)
    model.train()
    with pytest.raises(ValueError, match=r"in training mode \(dropout on\): call .eval\(\) first"):
        generate_corpus(model, sources, tmp_path / "y.txt", tokenizer=tokenizer, **arguments)


def test_a_resumed_run_compares_resolved_paths(tmp_path, model_dir, monkeypatch) -> None:
    (tmp_path / "in.txt").write_text("\n".join(random_sources(10, seed=4)) + "\n")
    monkeypatch.chdir(tmp_path)
    first = generate_corpus(os.path.relpath(model_dir), "in.txt", "out.txt", batch_size=4, progress=False)
    assert first.lines == 10
    recorded = json.loads(Path("out.txt.progress.json").read_text())["settings"]
    assert recorded["model"] == str(model_dir.resolve()) and recorded["input"] == str((tmp_path / "in.txt").resolve())
    again = generate_corpus(
        str(model_dir.resolve()), str(tmp_path / "in.txt"), tmp_path / "out.txt", batch_size=4, progress=False
    )
    assert again.lines == 0 and again.resumed_lines == 10


def test_cli_usage_errors_name_the_argument_and_the_fix(tmp_path, model_dir, capsys) -> None:
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\n")
    for value, expected in (("[1,2]", "expected a JSON object of generate arguments by name, got a list"),
                            ("{nope", "not JSON")):  # fmt: skip
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"),
                                 "--generate-kwargs", value)  # fmt: skip
        assert status == 2 and f"argument --generate-kwargs: {expected}" in err
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"), "--generate-kwargs",
                             '{"assistant": 1}')  # fmt: skip
    assert status == 1 and "which the corpus job sets itself" in err
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"), "--generate-kwargs",
                             '{"do_sample": true}')  # fmt: skip
    assert status == 1 and "do_sample=True: the corpus job decodes greedy or beam search" in err

    (tmp_path / "a-file").write_text("")
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "a-file" / "out.txt"))
    assert status == 2 and "a-file is a file, not a directory; choose an output in a directory" in err
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path))
    assert status == 2 and "is a directory: name a file in it" in err

    no_tokenizer = tmp_path / "no-tokenizer"
    build_model("marian", seed=3).save_pretrained(no_tokenizer)
    status, _, err = run_cli(capsys, *generate_arguments(no_tokenizer, source, tmp_path / "o.txt"))
    assert status == 2 and "holds no tokenizer" in err and "tokenizer.save_pretrained(DIR)" in err
    for command in (["demo", "--model", str(no_tokenizer)], ["bench", "--model", str(no_tokenizer)]):
        status, _, err = run_cli(capsys, *command)
        assert status == 1 and "holds no tokenizer" in err


def test_text_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path, model_dir, capsys) -> None:
    """Latin-1 text and binary files as `--input` (text and JSONL) and as the bench's `--source-file`: the file, the
    line and the byte, and what to do, not a traceback."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("w5 w6\nw7 caf\u00e9\n".encode("latin-1"))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"w5\n\x00\x9f\x92\x00\n")
    records = tmp_path / "in.jsonl"
    records.write_bytes(b'{"text": "w5"}\n{"text": "w6 \xe9"}\n')
    for source, expected in (
        (latin1, f"{latin1}, line 2, byte 7: 0xe9 is not UTF-8. .* iconv -f WINDOWS-1252 -t UTF-8 {latin1}"),
        (binary, f"{binary}, line 2, byte 2: 0x9f is not UTF-8, and the file holds NUL bytes: it looks binary"),
        (records, f"{records}, line 2, byte 14: 0xe9 is not UTF-8"),
    ):
        column = ("--column", "text") if source.suffix == ".jsonl" else ()
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"), *column)
        assert status == 1 and re.search(expected, err), err
    status, _, err = run_cli(capsys, "bench", "--model", str(model_dir), "--source-file", str(latin1),
                             "--modes", "greedy", "--out", str(tmp_path / "bench"))  # fmt: skip
    assert status == 1 and f"{latin1}, line 2, byte 7: 0xe9 is not UTF-8" in err and "Traceback" not in err


def test_inputs_and_outputs_that_cannot_be_read_or_written_name_the_path(tmp_path, model_dir, capsys) -> None:
    """A directory or a cut-short `.gz` as `--input`, an output where no file can be made (`/proc`: root may write
    there by its permissions), and a source too long for the model, named by its line in the input file (1-based,
    not its index in a chunk)."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    compressed = gzip.compress("".join(f"{line}\n" for line in random_sources(300, seed=1)).encode())
    (tmp_path / "cut.txt.gz").write_bytes(compressed[: len(compressed) // 2])
    (tmp_path / "plain.txt.gz").write_text("w5 w6\n")  # named .gz, but no gzip
    for source, expected in (
        (folder, f"--input {folder} is a directory, but no dataset saved with save_to_disk"),
        (tmp_path / "cut.txt.gz", f"{tmp_path / 'cut.txt.gz'} is not a whole gzip file (Compressed file ended"),
        (tmp_path / "plain.txt.gz", f"{tmp_path / 'plain.txt.gz'} is not a whole gzip file (Not a gzipped file"),
    ):
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"))
        assert status == 1 and expected in err and "Traceback" not in err, err
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\nw7\n" + " ".join(["w8"] * 5000) + "\n")  # line 3: 5,001 tokens for 128 positions
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, tmp_path / "o.txt"), "--chunk-size", "2")
    assert status == 1 and f"line 3 of {source} (14999 characters, starting 'w8 w8" in err, err
    assert "is too long: the source has 5001 tokens; the model has positions for 128" in err
    assert "--on-long skip" in err
    if os.path.isdir("/proc/self"):
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, Path("/proc/hf-blockwise-out.txt")))
        assert status == 2 and "/proc/hf-blockwise-out.txt: no file can be created in /proc" in err, err


def test_a_read_only_output_directory_is_a_usage_error(tmp_path, model_dir, capsys) -> None:
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\n")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    immutable = False
    if os.access(read_only, os.W_OK):  # root ignores permissions; an immutable folder stops root too
        immutable = subprocess.run(["chattr", "+i", str(read_only)], capture_output=True).returncode == 0
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("no way to make a read-only folder here (root without chattr)")
        status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, read_only / "sub" / "out.txt"))
        assert status == 2 and "read-only is not writable; choose an output in a directory you can write to" in err
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(read_only)], check=True)
        read_only.chmod(0o755)


def test_the_bench_device_is_checked_before_anything_loads(capsys) -> None:
    """`--device` names a device torch has here, and one every requested mode runs on: torch's int8 products
    (`_int8` modes, `feature_int8d`) run on a CPU, CTranslate2's int8 on its own devices."""
    config = ["bench", "--model-config", "opus-mt-en-de", "--tiny-model-config"]
    status, _, err = run_cli(capsys, *config, "--device", "cpu:x")
    assert status == 2 and "--device 'cpu:x'" in err
    if not torch.cuda.is_available():
        status, _, err = run_cli(capsys, *config, "--device", "cuda")
        assert status == 2 and "torch sees no CUDA device here" in err
    # any device but a CPU (meta stands in for a GPU here): the int8 modes are named, CTranslate2's int8 is not
    status, _, err = run_cli(capsys, *config, "--device", "meta", "--modes", "greedy", "greedy_int8", "ct2_int8")
    assert status == 2 and "the modes greedy_int8 quantize" in err
    status, _, err = run_cli(capsys, "bench", "--device", "meta")  # a model's default modes hold int8 ones
    assert status == 2 and "greedy_int8_compiled, feature_int8_compiled quantize" in err
    assert Mode.parse("greedy_int8_compiled").cpu_only and Mode.parse("feature_k6_n10_int8").cpu_only
    assert Mode.parse("feature_int8d").cpu_only
    assert not Mode.parse("ct2_int8").cpu_only and not Mode.parse("feature_compiled").cpu_only


def test_generate_runs_beam_search_with_num_beams(tmp_path, model_dir, capsys) -> None:
    """`--num-beams 3`: the corpus is transformers' beam search of 3 beams, line for line (drafted by the heads);
    `--num-beams` and the same key in `--generate-kwargs` must agree."""
    sources = random_sources(10, seed=4)
    source = tmp_path / "in.txt"
    source.write_text("\n".join(sources) + "\n")
    # the tiny model repeats its likeliest word: forbidding repeats gives beam search choices to make
    expected = greedy(model_dir, sources, 4, num_beams=3, no_repeat_ngram_size=1)
    assert expected != greedy(model_dir, sources, 4, no_repeat_ngram_size=1)  # beams decide some lines
    output = tmp_path / "beams.txt"
    arguments = ("--num-beams", "3", "--generate-kwargs", '{"no_repeat_ngram_size": 1}')
    status, _, err = run_cli(capsys, *generate_arguments(model_dir, source, output, *arguments))
    assert status == 0, err
    assert output.read_text().splitlines() == expected
    clash = generate_arguments(model_dir, source, tmp_path / "x.txt", "--num-beams", "3")
    status, _, err = run_cli(capsys, *clash, "--generate-kwargs", '{"num_beams": 2}')
    assert status != 0 and "num_beams is given twice" in err

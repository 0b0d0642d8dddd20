"""`hf-blockwise generate` / `generate_corpus`: exact line for line, every input kind, resumable after kills, the
same output from two `accelerate launch` processes, and clear refusals."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from conftest import build_model, random_sources, save_corpus_model, word_tokenizer

from hf_blockwise import BlockwiseHeadsModel
from hf_blockwise import boundary as hf
from hf_blockwise.corpus import generate_corpus, plan_batches, read_sources
from hf_blockwise.corpus.decoding import batch_invariant, encoder_outputs_by_row
from hf_blockwise.corpus.job import CorpusJob, run_job
from hf_blockwise.corpus.output import CorpusRepairWarning, CorpusSettings, lock_path, progress_path
from hf_blockwise.corpus.planning import chunks_of_shard
from hf_blockwise.loading import load_model
from hf_blockwise.tools.cli import main

MAX_NEW_TOKENS = 16
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_corpus_model(tmp_path_factory.mktemp("model"))


def greedy_in_the_same_batches(model_dir: Path, sources: list[str], batch_size: int, chunk_size: int) -> list[str]:
    """transformers' greedy `generate` over the batches the job plans, put back in input order: the exact reference
    (the same batches rule out floating-point differences of other paddings)."""
    base, tokenizer = BlockwiseHeadsModel.from_pretrained(model_dir).base_model, word_tokenizer()
    outputs: dict[int, str] = {}
    for chunk in chunks_of_shard(len(sources), chunk_size, 1, 0):
        encoded = tokenizer([sources[i] for i in chunk])["input_ids"]
        for batch in plan_batches([len(ids) for ids in encoded], batch_size):
            padded = tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
            sequences = base.generate(**padded, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, num_beams=1)
            for index, text in zip(batch, tokenizer.batch_decode(sequences, skip_special_tokens=True), strict=True):
                outputs[chunk.start + index] = text
    return [outputs[index] for index in range(len(sources))]


def test_batches_are_sorted_and_kept_under_the_token_budget() -> None:
    lengths = [3, 9, 1, 9, 4, 7, 2]
    assert plan_batches(lengths, 3) == [[1, 3, 5], [4, 0, 6], [2]]
    batches = plan_batches(lengths, 8, max_batch_tokens=18)
    assert batches == [[1, 3], [5, 4], [0, 6, 2]]
    assert all(max(lengths[i] for i in batch) * len(batch) <= 18 for batch in batches)
    assert plan_batches([30, 2], 4, max_batch_tokens=10) == [[0], [1]]  # too long for the budget: alone
    assert [list(chunk) for chunk in chunks_of_shard(10, 3, 2, 1)] == [[3, 4, 5], [9]]


@pytest.mark.parametrize("drafter", ["auto", "none", "heads", "feature", "input_copy", "composite"])
def test_every_drafter_gives_greedys_output_line_for_line(tmp_path, model_dir, drafter: str) -> None:
    sources = random_sources(40, seed=1)
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    report = generate_corpus(
        str(model_dir), str(tmp_path / "in.txt"), tmp_path / "out.txt", drafter=drafter, batch_size=4,
        chunk_size=16, max_new_tokens=MAX_NEW_TOKENS, progress=False,
    )  # fmt: skip
    expected = greedy_in_the_same_batches(model_dir, sources, batch_size=4, chunk_size=16)
    assert (tmp_path / "out.txt").read_text().splitlines() == expected
    assert report.lines == 40 and report.new_tokens > 0 and report.row_calls > 0
    assert report.drafter == ("none" if drafter == "auto" else drafter)  # auto: the loop alone above batch 1
    if drafter == "auto":  # at batch 1, the composite of source copy and the shipped feature drafter
        one = generate_corpus(
            str(model_dir), sources[:6], tmp_path / "one.txt", batch_size=1, max_new_tokens=MAX_NEW_TOKENS,
            progress=False,
        )  # fmt: skip
        assert one.drafter == "composite"
        assert (tmp_path / "one.txt").read_text().splitlines() == greedy_in_the_same_batches(
            model_dir, sources[:6], 1, 1024
        )


def test_token_budget_jsonl_stats_and_datasets(tmp_path, model_dir) -> None:
    sources = random_sources(30, seed=2)
    records = [{"id": i, "src": text} for i, text in enumerate(sources)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    arguments = {"batch_size": 8, "chunk_size": 12, "max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    generate_corpus(str(model_dir), sources, tmp_path / "plain.txt", **arguments)
    plain = (tmp_path / "plain.txt").read_text().splitlines()
    assert plain == greedy_in_the_same_batches(model_dir, sources, batch_size=8, chunk_size=12)

    report = generate_corpus(
        str(model_dir), str(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", column="src", stats=True,
        max_batch_tokens=40, **arguments,
    )  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(30))
    assert all(line["decoder_calls"] >= 1 and line["new_tokens"] >= line["decoder_calls"] for line in lines)
    assert sum(line["new_tokens"] for line in lines) == report.new_tokens
    # another batching may round differently in theory; on this model every line is the same
    assert [line["output"] for line in lines] == plain

    dataset = datasets.Dataset.from_dict({"src": sources, "other": list(range(30))})
    generate_corpus(str(model_dir), dataset, tmp_path / "from-dataset.txt", column="src", **arguments)
    datasets.DatasetDict({"validation": dataset}).save_to_disk(tmp_path / "saved")
    generate_corpus(
        str(model_dir), str(tmp_path / "saved"), tmp_path / "from-disk.txt", column="src", split="validation",
        **arguments,
    )  # fmt: skip
    for name in ("from-dataset.txt", "from-disk.txt"):
        assert (tmp_path / name).read_text().splitlines() == plain


def test_inputs_and_outputs_are_refused_clearly(tmp_path, model_dir) -> None:
    (tmp_path / "in.txt").write_text("w5 w6\nw7\n")
    (tmp_path / "in.jsonl").write_text('{"src": "w5"}\n{"text": "w6"}\n')
    (tmp_path / "empty.txt").write_text("")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"src": ["w5"]})}).save_to_disk(tmp_path / "saved")
    with pytest.raises(ValueError, match="is empty"):
        read_sources(str(tmp_path / "empty.txt"), None, None)
    with pytest.raises(ValueError, match=r"text file .* no column 'src'"):
        read_sources(str(tmp_path / "in.txt"), "src", None)
    with pytest.raises(ValueError, match=r"line 2: no field 'src' \(it has \['text'\]\)"):
        read_sources(str(tmp_path / "in.jsonl"), "src", None)
    with pytest.raises(ValueError, match=r"no column 'text'; its columns are \['src'\]"):
        read_sources(str(tmp_path / "saved"), "text", "train")
    with pytest.raises(ValueError, match=r"has splits \['train'\]"):
        read_sources(str(tmp_path / "saved"), "src", None)
    with pytest.raises(ValueError, match="not a string"):
        read_sources(["w5", None], None, None)
    with pytest.raises(ValueError, match=r"missing/file.txt: no such file"):
        read_sources(str(tmp_path / "missing" / "file.txt"), None, None)
    with pytest.raises(ValueError, match=r"'A dog runs on the beach' is no file, .* pass a list of strings"):
        read_sources("A dog runs on the beach", None, None)  # a sentence where a file belongs: no hub request

    arguments = {"max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    (tmp_path / "foreign.txt").write_text("someone else's work\n")
    with pytest.raises(ValueError, match="was not written by hf-blockwise generate"):
        generate_corpus(str(model_dir), str(tmp_path / "in.txt"), tmp_path / "foreign.txt", **arguments)
    assert (tmp_path / "foreign.txt").read_text() == "someone else's work\n"  # left as it was
    generate_corpus(str(model_dir), str(tmp_path / "in.txt"), tmp_path / "out.txt", batch_size=2, **arguments)
    with pytest.raises(ValueError, match=r"belongs to another run: .*batch_size 2 \(now 4\)"):
        generate_corpus(str(model_dir), str(tmp_path / "in.txt"), tmp_path / "out.txt", batch_size=4, **arguments)
    generate_corpus(
        str(model_dir), str(tmp_path / "in.txt"), tmp_path / "out.txt", batch_size=4, overwrite=True, **arguments
    )
    with pytest.raises(ValueError, match=r"use a \.jsonl output"):
        generate_corpus(str(model_dir), ["w5"], tmp_path / "stats.txt", stats=True, **arguments)
    with pytest.raises(ValueError, match="unknown drafter 'fast'"):
        generate_corpus(str(model_dir), ["w5"], tmp_path / "x.txt", drafter="fast", **arguments)
    with pytest.raises(SystemExit, match=r"hf-blockwise generate: .*empty"):
        main(["generate", "--model", str(model_dir), "--input", str(tmp_path / "empty.txt"), "--output", "o.txt"])


def test_the_source_limit_is_the_encoders_position_table() -> None:
    """Read from the encoder's positions, not the config: T5's relative positions have no limit (its config's
    `n_positions` is no bound), Marian's sinusoidal table has `max_position_embeddings` rows."""
    assert hf.encoder_position_limit(build_model("t5")) is None
    assert hf.encoder_position_limit(build_model("marian")) == 128


def test_sources_longer_than_the_positions_fail_or_are_skipped(tmp_path, model_dir) -> None:
    long_source = " ".join(["w9"] * 200)  # the tiny Marian has 128 positions
    sources = ["w5 w6", long_source, "w7"]
    arguments = {"max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    with pytest.raises(ValueError, match=r"201 tokens; the model has positions for 128.*--on-long skip"):
        generate_corpus(str(model_dir), sources, tmp_path / "fail.txt", **arguments)
    with pytest.warns(UserWarning, match="1 sources were longer"):
        report = generate_corpus(str(model_dir), sources, tmp_path / "skip.jsonl", on_long="skip", **arguments)
    lines = [json.loads(line) for line in (tmp_path / "skip.jsonl").read_text().splitlines()]
    assert lines[1] == {
        "index": 1,
        "output": None,
        "skipped": "the source has 201 tokens; the model has positions for 128",
    }
    assert lines[0]["output"] and report.skipped == 1


def generate_command(model_dir: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return [
        "-m", "hf_blockwise.tools.cli", "generate", "--model", str(model_dir), "--input", str(source), "--output",
        str(output), "--batch-size", "4", "--chunk-size", "8", "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def test_a_run_killed_three_times_resumes_to_the_same_bytes(tmp_path, model_dir, capsys) -> None:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(random_sources(240, seed=4)) + "\n")
    environment = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    rng = random.Random(0)
    progress_file = tmp_path / "out.txt.progress.json"
    interrupted = 0
    for _ in range(3):
        done = json.loads(progress_file.read_text())["lines"] if progress_file.exists() else 0
        target = done + rng.randrange(8, 40)  # lines to wait for before the kill, then a random few milliseconds
        process = subprocess.Popen(
            [sys.executable, *generate_command(model_dir, source, tmp_path / "out.txt")], env=environment, cwd=tmp_path
        )
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if progress_file.exists() and json.loads(progress_file.read_text() or '{"lines": 0}')["lines"] >= target:
                time.sleep(rng.uniform(0, 0.05))
                break
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        interrupted += process.wait() == -signal.SIGKILL
    assert interrupted >= 2, "the kills must land while the job runs"
    partial = json.loads(progress_file.read_text())
    assert 0 < partial["lines"] < 240 and not partial["complete"]
    with open(tmp_path / "out.txt", "ab") as handle:  # a kill in the middle of an append leaves a torn line
        handle.write(b"half a li")
    assert subprocess.run([sys.executable, *generate_command(model_dir, source, tmp_path / "out.txt")],
                          env=environment, cwd=tmp_path).returncode == 0  # fmt: skip
    # the reference in-process (one process start fewer): the same settings as the command's
    once = tmp_path / "once.txt"
    generate_corpus(str(model_dir), str(source), once, batch_size=4, chunk_size=8, max_new_tokens=MAX_NEW_TOKENS,
                    progress=False)  # fmt: skip
    assert (tmp_path / "out.txt").read_bytes() == once.read_bytes()
    assert json.loads(progress_file.read_text())["complete"]
    lines = (tmp_path / "out.txt").read_text().splitlines(keepends=True)  # the case: a finished output cut
    (tmp_path / "out.txt").write_text("".join(lines[:100]))
    with pytest.warns(CorpusRepairWarning, match="out.txt did not hold what this job wrote"):  # in-process: faster
        assert main(generate_command(model_dir, source, tmp_path / "out.txt")[2:]) == 0
    assert (tmp_path / "out.txt").read_bytes() == once.read_bytes()
    assert re.search(r"decoded again from line \d+", capsys.readouterr().out)


def test_two_accelerate_processes_write_what_one_process_writes(tmp_path, model_dir) -> None:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(random_sources(50, seed=5)) + "\n")
    environment = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
    ]  # fmt: skip
    run = subprocess.run(
        [*launch, *generate_command(model_dir, source, tmp_path / "two.txt")],
        env=environment, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    subprocess.run(
        [sys.executable, *generate_command(model_dir, source, tmp_path / "one.txt")], env=environment, check=True
    )
    assert (tmp_path / "two.txt").read_bytes() == (tmp_path / "one.txt").read_bytes()
    assert not list(tmp_path.glob("two.txt.shard*"))  # merged and removed
    progress = json.loads((tmp_path / "two.txt.progress.json").read_text())
    assert progress["complete"] and progress["lines"] == 50
    # a finished output is recognized whatever the number of processes: nothing is decoded again
    rerun = subprocess.run(
        [sys.executable, *generate_command(model_dir, source, tmp_path / "two.txt")],
        env=environment, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "0 lines decoded (50 already there" in rerun.stdout
    # a merged output changed since is refused by a run of several processes (each would decode only its share)
    (tmp_path / "two.txt").write_bytes((tmp_path / "two.txt").read_bytes()[:-5])
    settings = CorpusSettings(**{**progress["settings"], "num_shards": 2, "shard": 0})
    job = CorpusJob(None, None, [], settings, {}, tmp_path / "two.txt", tmp_path / "two.txt.shard000-of-002")
    with pytest.raises(ValueError, match=r"two.txt no longer holds what was written, from the chunk at line 49 on"):
        run_job(job)


# holds the lock of the output given as argv[1] as a run does (`run_job`), until it is killed
HOLD_OUTPUT_LOCK = """
import sys, time
from pathlib import Path
from hf_blockwise.corpus.output import locked_output
with locked_output(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_second_run_on_an_output_being_written_is_refused_naming_the_first(tmp_path, model_dir) -> None:
    """Two runs writing one output at once would interleave their appends and progress files: the second is refused
    before it writes anything, naming the first's pid; a run killed leaves its lock file but no lock (flock)."""
    output = tmp_path / "out.txt"
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_OUTPUT_LOCK, str(output)], env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        arguments = {"max_new_tokens": MAX_NEW_TOKENS, "progress": False}
        pattern = rf"out.txt is being written by another run \(pid {holder.pid}, .*\): wait for it to finish"
        with pytest.raises(ValueError, match=pattern):
            generate_corpus(str(model_dir), ["w5 w6", "w7"], output, **arguments)
        assert not output.exists() and not progress_path(output).exists()  # refused before writing anything
        with pytest.raises(SystemExit, match=rf"hf-blockwise generate: .*out.txt is being written .*pid {holder.pid}"):
            main(["generate", "--model", str(model_dir), "--input", str(REPO / "README.md"), "--output", str(output)])
    finally:
        holder.kill()
        holder.wait()
    assert lock_path(output).read_text() == f"{holder.pid}\n"  # left by the killed run, its lock gone with it
    generate_corpus(str(model_dir), ["w5 w6", "w7"], output, **arguments)
    assert len(output.read_text().splitlines()) == 2
    assert not lock_path(output).exists()  # removed at the end of the run


def _damages(n: int) -> dict[str, Any]:
    """Ways of changing the lines of an output of `n` lines (`None`: the file deleted)."""
    return {
        "second half deleted": lambda lines: lines[: n // 2],
        "first half deleted": lambda lines: lines[n // 2 :],
        "lines 11-20 deleted": lambda lines: [*lines[:10], *lines[20:]],
        "file deleted": None,
        "a junk line appended": lambda lines: [*lines, "junk\n"],
        "line 15 edited": lambda lines: [*lines[:14], "w5 edited\n", *lines[15:]],
        "last line cut short": lambda lines: [*lines[:-1], lines[-1][:-3]],
    }


def _first_difference(lines: list[str], damaged: list[str]) -> int:
    """The first line (from 1) of `damaged` that is not the line `lines` holds there (outputs of a tiny model repeat
    themselves: deleted lines may be followed by the same text)."""
    return next(index for index in range(len(lines) + 1) if index >= len(damaged) or damaged[index] != lines[index]) + 1


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "interrupted"])
def test_an_output_changed_since_is_decoded_again_to_the_same_bytes(tmp_path, model_dir, finished: bool) -> None:
    """Lines deleted, appended or edited in a finished or an interrupted output (24 of 40 lines): the next run
    checks the output against the chunks' digests, decodes again from the first damaged chunk, names the first bad
    line in one warning, and ends byte-identical to an uninterrupted run. Bytes after the last chunk of an
    interrupted output are a torn append: cut without a word."""
    loaded = load_model(str(model_dir))
    sources = random_sources(40, seed=8)
    arguments = {"max_new_tokens": MAX_NEW_TOKENS, "progress": False, "batch_size": 4, "chunk_size": 8}
    once = tmp_path / "once.txt"
    generate_corpus(loaded, sources, once, **arguments)
    expected = once.read_bytes()
    recorded = json.loads(progress_path(once).read_text())
    if not finished:  # what a run killed after its third chunk leaves
        recorded = {**recorded, "complete": False, "chunks": recorded["chunks"][:3]}
        recorded.update(lines=24, bytes=sum(chunk["bytes"] for chunk in recorded["chunks"]))
    n = recorded["lines"]
    lines = expected[: recorded["bytes"]].decode().splitlines(keepends=True)
    for name, change in _damages(n).items():
        output = tmp_path / f"{name.replace(' ', '-')}.txt"
        progress_path(output).write_text(json.dumps(recorded))
        damaged = [] if change is None else change(lines)
        if change is not None:
            output.write_text("".join(damaged))
        first_bad = _first_difference(lines, damaged) if damaged[:n] != lines else n + 1
        torn = not finished and name == "a junk line appended"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = generate_corpus(loaded, sources, output, **arguments)
        repairs = [str(warning.message) for warning in caught if warning.category is CorpusRepairWarning]
        assert output.read_bytes() == expected, name
        assert json.loads(progress_path(output).read_text())["complete"], name
        if torn:
            assert repairs == [] and report.repaired_from is None, name
            continue
        assert report.repaired_from == first_bad, (name, report.repaired_from)
        assert len(repairs) == 1 and f"{output} did not hold what this job wrote from line {first_bad} on" in repairs[0]
    unchanged = generate_corpus(loaded, sources, once, **arguments)  # a sound output is left alone
    assert unchanged.lines == 0 and unchanged.resumed_lines == 40 and unchanged.repaired_from is None


def test_int8_runs_record_it_and_encode_rows_alone_where_the_engine_is_batch_invariant(tmp_path, model_dir) -> None:
    """`int8=True` decodes with the int8 base (its greedy in the same batches), is recorded (a resumed float run is
    refused), and only with the compiled engine on CPU are the rows encoded alone; `encoder_outputs_by_row` puts
    each row's states, bitwise those of the row encoded alone, at its unpadded positions (either padding side)."""
    sources = random_sources(12, seed=31)
    arguments = {"batch_size": 4, "max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    generate_corpus(str(model_dir), sources, tmp_path / "int8.txt", int8=True, **arguments)
    progress = json.loads(progress_path(tmp_path / "int8.txt").read_text())
    assert progress["settings"]["int8"] is True
    loaded = load_model(str(model_dir), int8=True)
    encoded = loaded.tokenizer(sources)["input_ids"]
    expected: dict[int, str] = {}
    for batch in plan_batches([len(ids) for ids in encoded], 4):  # the job's batches of its one chunk
        padded = loaded.tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
        sequences = loaded.base.generate(**padded, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, num_beams=1)
        expected.update(zip(batch, loaded.tokenizer.batch_decode(sequences, skip_special_tokens=True), strict=True))
    assert (tmp_path / "int8.txt").read_text().splitlines() == [expected[i] for i in range(12)]
    (tmp_path / "in.txt").write_text("\n".join(sources) + "\n")
    command = [
        "generate",
        "--model",
        str(model_dir),
        "--input",
        str(tmp_path / "in.txt"),
        "--int8",
        "--batch-size",
        "4",
    ]
    main([*command, "--output", str(tmp_path / "cli.txt"), "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress"])
    assert (tmp_path / "cli.txt").read_text() == (tmp_path / "int8.txt").read_text()
    with pytest.raises(ValueError, match=r"belongs to another run: .*int8 True \(now False\)"):
        generate_corpus(str(model_dir), sources, tmp_path / "int8.txt", **arguments)

    assert batch_invariant(loaded, compile=True) and not batch_invariant(loaded, compile=False)
    assert not batch_invariant(load_model(str(model_dir)), compile=True)
    tokenizer = loaded.tokenizer
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = tokenizer(["w5 w6 w7 w8 w9", "w10", "w11 w12"], return_tensors="pt", padding=True)
        with torch.inference_mode():
            by_row = encoder_outputs_by_row(loaded.base, batch["input_ids"], batch["attention_mask"]).last_hidden_state
            for row, mask in enumerate(batch["attention_mask"].bool()):
                ids = batch["input_ids"][row, mask][None]
                alone = loaded.base.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
                assert torch.equal(by_row[row, mask], alone.last_hidden_state[0]), (side, row)
                assert not by_row[row, ~mask].any(), (side, row)
    tokenizer.padding_side = "right"

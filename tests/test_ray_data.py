"""`CorpusPredictor`, the corpus job for Ray Data's `map_batches`: `hf-blockwise generate`'s output row for row (byte
for byte through a local Ray cluster of two actors), both batch formats, its stats and skips, and clear refusals."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import ray
import ray.data
from conftest import random_sources, save_corpus_model

from hf_blockwise import CorpusPredictor, generate_corpus
from hf_blockwise.quantization import is_int8
from hf_blockwise.tools.cli import main

MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_corpus_model(tmp_path_factory.mktemp("model"))


def generated_lines(model_dir: Path, sources: list[str], output: Path, **settings) -> list[str]:
    """`hf-blockwise generate`'s text output for `sources`, line by line."""
    source_file = output.with_suffix(".in.txt")
    source_file.write_text("\n".join(sources) + "\n")
    arguments = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]
    status = main(["generate", "--model", str(model_dir), "--input", str(source_file), "--output", str(output),
                   "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress", *arguments])  # fmt: skip
    assert status in (0, None)
    return output.read_text(encoding="utf-8").splitlines()


def test_a_ray_data_run_of_two_actors_writes_what_hf_blockwise_generate_writes(tmp_path, model_dir) -> None:
    sources = [*random_sources(38, seed=11), ""]  # and a blank row
    expected = generated_lines(model_dir, sources, tmp_path / "out.txt", batch_size=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        dataset = ray.data.from_items([{"index": i, "text": text} for i, text in enumerate(sources)])
        rows = dataset.map_batches(
            CorpusPredictor,
            fn_constructor_kwargs={"model": str(model_dir), "batch_size": 1, "max_new_tokens": MAX_NEW_TOKENS},
            batch_size=5, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
        ).take_all()  # fmt: skip
    finally:
        ray.shutdown()
    rows.sort(key=lambda row: row["index"])
    assert [row["text"] for row in rows] == sources  # the batch's own columns kept
    outputs = [row["output"] for row in rows]
    # byte for byte: at batch size 1 a row's output depends on nothing else, however Ray batches the rows
    assert "".join(f"{output}\n" for output in outputs).encode() == (tmp_path / "out.txt").read_bytes()
    assert outputs == expected and outputs[-1] == ""  # blank in, blank out


def test_a_batch_decoded_as_the_jobs_chunk_gives_its_lines_in_both_batch_formats(tmp_path, model_dir) -> None:
    sources = random_sources(23, seed=12)
    settings = {"drafter": "feature", "batch_size": 4, "max_batch_tokens": 40}
    expected = generated_lines(model_dir, sources, tmp_path / "out.txt", chunk_size=64, **settings)
    predictor = CorpusPredictor(str(model_dir), max_new_tokens=MAX_NEW_TOKENS, stats=True, **settings)
    assert predictor.drafter_name == "feature"
    # the whole batch is one chunk of the job: the same sorted batches, so the same rows decoded together
    numpy_batch = {"text": np.array(sources, dtype=object), "id": np.arange(23)}
    columns = predictor(numpy_batch)
    assert list(columns["output"]) == expected and list(columns["id"]) == list(range(23))
    assert all(columns["decoder_calls"] >= 1) and all(columns["new_tokens"] >= columns["decoder_calls"])
    frame = predictor(pd.DataFrame({"text": sources}))
    assert isinstance(frame, pd.DataFrame) and frame["output"].tolist() == expected
    assert frame["new_tokens"].tolist() == columns["new_tokens"].tolist()


def test_an_int8_predictor_decodes_with_the_int8_base(model_dir) -> None:
    predictor = CorpusPredictor(str(model_dir), max_new_tokens=MAX_NEW_TOKENS, int8=True, batch_size=2)
    assert is_int8(predictor.loaded.base)
    sources = random_sources(5, seed=13)
    output = Path(tempfile.mkdtemp()) / "out.txt"
    settings = {"batch_size": 2, "max_new_tokens": MAX_NEW_TOKENS, "progress": False}
    assert generate_corpus(str(model_dir), sources, output, int8=True, **settings).lines == 5
    assert list(predictor({"text": sources})["output"]) == output.read_text().splitlines()


def test_too_long_rows_are_skipped_or_refused_naming_the_row(model_dir) -> None:
    long = " ".join(["w5"] * 600)  # past the tiny model's 512 positions
    skipping = CorpusPredictor(str(model_dir), max_new_tokens=MAX_NEW_TOKENS, on_long="skip", batch_size=2)
    columns = skipping({"text": np.array(["w5 w6", long, "w7"], dtype=object)})
    assert columns["output"][1] is None and "positions" in columns["skipped"][1]
    assert columns["skipped"][0] is None and isinstance(columns["output"][0], str)
    failing = CorpusPredictor(str(model_dir), max_new_tokens=MAX_NEW_TOKENS, batch_size=2)
    with pytest.raises(ValueError, match=r"line 2 of the batch's column 'text'.*too long"):
        failing({"text": ["w5", long]})


def test_bad_settings_and_batches_are_refused_clearly(model_dir) -> None:
    model = str(model_dir)
    for kwargs, message in (
        ({"drafter": "magic"}, "unknown drafter 'magic'"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"column": "text", "output_column": "text"}, "is the column of sources"),
        ({"output_column": ""}, "output_column must be a column name"),
        ({"threads": 0}, "threads must be a positive int"),
        ({"generate_kwargs": {"do_sample": True}}, "do_sample=True"),
        ({"drafter": "nar"}, "unknown drafter 'nar'"),
    ):
        with pytest.raises(ValueError, match=message):
            CorpusPredictor(model, max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    predictor = CorpusPredictor(model, max_new_tokens=MAX_NEW_TOKENS, column="src")
    with pytest.raises(KeyError, match=r"no column 'src'; its columns are \['text'\]"):
        predictor({"text": np.array(["w5"])})
    with pytest.raises(ValueError, match=r"row 2 of the batch's column 'src' is None, not a string"):
        predictor({"src": np.array(["w5", None], dtype=object)})

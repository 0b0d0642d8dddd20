"""[`CorpusPredictor`]: the corpus job's decoding as a callable class for Ray Data's `Dataset.map_batches` (and any
batch-inference framework that calls a class once per batch), rows in, rows out.

It imports nothing of Ray: a batch is a dict of columns (Ray's `"numpy"` batch format, the default) or a pandas
`DataFrame` (`batch_format="pandas"`), and what comes back has the batch's columns and the outputs. Ray builds the
class once per actor (`compute=ray.data.ActorPoolStrategy(size=N)`: N actors), so the model, its drafter and the
compiled engine are loaded and compiled once per actor, not per batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from torch import nn

from hf_blockwise.corpus.decoding import DecodedRow, decode_chunk, output_text
from hf_blockwise.corpus.job import (
    CorpusOptions,
    check_int8_device,
    check_not_sampling,
    choose_drafter,
    merged_generate_kwargs,
)
from hf_blockwise.corpus.models import load_for_corpus
from hf_blockwise.loading import LoadedModel, build_drafter


@dataclass(frozen=True)
class _BatchSettings:
    """What [`decode_chunk`] reads of the settings: each batch is decoded as the corpus job decodes a chunk."""

    input: str
    batch_size: int
    max_batch_tokens: int | None
    on_long: str
    compile: bool


class CorpusPredictor:
    """`hf-blockwise generate`'s decoding of a batch of rows, for `ray.data.Dataset.map_batches`.

    Each batch is decoded as the corpus job decodes one chunk of its input: sorted by source length into batches of
    at most `batch_size` rows (and `max_batch_tokens` padded source tokens), through the loop with the drafter, put
    back in the batch's order. A row's output is then `hf-blockwise generate`'s line for the same source with the
    same settings where the rows decoded together are the same: always at `batch_size=1` (each row is decoded alone,
    however Ray batches the data set); with `int8=True, compile=True` on the CPU each row is encoded alone and the
    int8 engine computes its calls as in a batch of one ([`batch_invariant`]: 96 of 96 news sentences as at batch 1,
    not yet bitwise); otherwise a row's tokens may depend on the rows padded beside it, at floating-point near-ties,
    as they do between two `--batch-size` settings of the corpus job.

    ```python
    # Ray builds one predictor per actor, from fn_constructor_kwargs
    outputs = ray.data.read_text("in.txt").map_batches(
        CorpusPredictor, fn_constructor_kwargs={"model": "DIR", "batch_size": 1, "compile": True},
        batch_size=64, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1,
    )
    ```

    Args:
        model: a model directory (with its drafters) or hub id, as `hf-blockwise generate --model` takes it, or a
            model already loaded (see [`generate_corpus`]) with its `tokenizer`.
        column (`str`, defaults to `"text"`): the column of sources (`ray.data.read_text` names it `text`).
        output_column (`str`, defaults to `"output"`): the column the outputs go to (text as a text output line
            holds it: line breaks inside become spaces; `None` for a row skipped as too long).
        drafter, batch_size, max_batch_tokens, max_new_tokens, num_beams, generate_kwargs, compile, int8, on_long:
            as [`generate_corpus`] and `hf-blockwise generate` take them (`"auto"`: composite at batch size 1, else
            the loop alone; the checkpoint's `generation_config` by default).
        stats (`bool`): also the columns `new_tokens` and `decoder_calls` of each row.
        threads (`int`, *optional*): torch CPU threads of each actor (`--threads`); by default what torch has
            there (Ray sets `OMP_NUM_THREADS` to the actor's `num_cpus`).

    With `on_long="skip"`, a `skipped` column says why a row was not decoded (`None` for the others).
    """

    def __init__(
        self,
        model: str | os.PathLike | nn.Module | LoadedModel,
        *,
        tokenizer: Any = None,
        column: str = "text",
        output_column: str = "output",
        drafter: str = "auto",
        batch_size: int = 16,
        max_batch_tokens: int | None = None,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        compile: bool = False,
        int8: bool = False,
        stats: bool = False,
        on_long: str = "fail",
        threads: int | None = None,
    ) -> None:
        options = CorpusOptions(
            drafter=drafter, batch_size=batch_size, max_batch_tokens=max_batch_tokens, compile=compile, int8=int8,
            generate_kwargs=merged_generate_kwargs(max_new_tokens, generate_kwargs, num_beams), on_long=on_long,
        )  # fmt: skip
        options.check_decoding()
        for what, value in (("column", column), ("output_column", output_column)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what} must be a column name (a non-empty str), got {value!r}")
        if column == output_column:
            raise ValueError(f"output_column {output_column!r} is the column of sources: name another")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        device = PartialState().device  # as the corpus job: the GPU Ray gives the actor (num_gpus=1), else the CPU
        check_int8_device(int8, device)
        loaded, name = load_for_corpus(model, tokenizer, int8=int8)
        loaded.check_reads_text(name)
        check_not_sampling(loaded, options.generate_kwargs)
        loaded.to(device)
        self.loaded = loaded
        self.drafter_name = choose_drafter(options.drafter, loaded, options.batch_size)
        self.drafter = build_drafter(self.drafter_name, loaded)
        self.generate_kwargs = dict(options.generate_kwargs)
        self.column, self.output_column, self.stats = column, output_column, stats
        self.settings = _BatchSettings(
            input=f"the batch's column {column!r}", batch_size=options.batch_size,
            max_batch_tokens=options.max_batch_tokens, on_long=options.on_long, compile=options.compile,
        )  # fmt: skip

    def __call__(self, batch: Any) -> Any:
        """Decodes a batch: a dict of columns (NumPy arrays or lists) or a pandas `DataFrame`; returns the same kind,
        with the output columns added.

        Raises:
            `KeyError`: the batch has no column `column` (the error lists its columns).
            `ValueError`: a source is not a string, or (with `on_long="fail"`) too long for the model.
        """
        columns = list(batch.columns if hasattr(batch, "columns") else batch.keys())
        if self.column not in columns:
            raise KeyError(f"the batch has no column {self.column!r}; its columns are {columns} (pass column=)")
        outputs = self.predict(list(batch[self.column]))
        if isinstance(batch, Mapping):
            return {**batch, **outputs}
        result = batch.copy()  # a pandas DataFrame
        for name, values in outputs.items():
            result[name] = values
        return result

    def predict(self, texts: Sequence[Any]) -> dict[str, np.ndarray]:
        """The output columns for `texts` (one source each, in order): `output_column` (NumPy array of `str`, `None`
        for a skipped row), and with `stats` `new_tokens` and `decoder_calls`, with `on_long="skip"` `skipped`."""
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"row {index + 1} of the batch's column {self.column!r} is {text!r}, not a string")
        sources = [str(text) for text in texts]  # NumPy's str_ too
        with torch.inference_mode():
            rows = decode_chunk(self.loaded, self.drafter, sources, self.settings, self.generate_kwargs)
        return self._columns(rows)

    def _columns(self, rows: Sequence[DecodedRow]) -> dict[str, np.ndarray]:
        columns = {self.output_column: _objects([None if row.skipped else output_text(row) for row in rows])}
        if self.stats:
            columns["new_tokens"] = np.array([row.new_tokens for row in rows], dtype=np.int64)
            columns["decoder_calls"] = np.array([row.decoder_calls for row in rows], dtype=np.int64)
        if self.settings.on_long == "skip":
            columns["skipped"] = _objects([row.skipped for row in rows])
        return columns


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-D object array of `values` (strings and `None`; `np.array` of strings would make a fixed-width array)."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array

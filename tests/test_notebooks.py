"""The Colab notebooks, executed end to end on local stand-ins for their Hub checkpoints and data sets.

Each notebook's cell tagged `parameters` names Hub resources; the test injects, right after it, a cell that
points them at the shipped checkpoints and `../shared/data` and shrinks the work to seconds, as papermill does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from hf_blockwise.loading import SHIPPED_MODEL

SHIPPED_GEC_MODEL = str(Path(SHIPPED_MODEL).parent / "gec-en")
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def run_notebook(name: str, overrides: dict[str, object], workdir: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    source = "\n".join(f"{key} = {json.dumps(value)}" for key, value in overrides.items())
    # one torch thread, as the test workers run: two xdist workers and a kernel of 2 threads oversubscribe the CPU
    source += "\nimport torch\ntorch.set_num_threads(1)"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(source))
    resources = {"metadata": {"path": str(workdir)}}
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources=resources)
    client.execute()
    return notebook


def text_output(notebook: nbformat.NotebookNode) -> str:
    return "\n".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )


def require_shared_data() -> None:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"the offline data sets are not at {SHARED_DATA}")


def test_notebooks_are_committed_without_outputs() -> None:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"


def test_quickstart_runs(tmp_path) -> None:
    require_shared_data()
    notebook = run_notebook(
        "quickstart.ipynb",
        {
            "MODEL_NAME": SHIPPED_MODEL,
            "DATASET": str(SHARED_DATA / "multi30k"),
            "TRAIN_EXAMPLES": 96,
            "TRAIN_STEPS": 3,
            "TEST_EXAMPLES": 4,
            "OUTPUT_DIR": str(tmp_path / "heads"),
        },
        tmp_path,
    )
    output = text_output(notebook)
    assert "identical to greedy: True" in output
    assert "identical to greedy: 4/4" in output
    assert (tmp_path / "heads" / "blockwise_heads.safetensors").is_file()


def test_training_notebook_runs(tmp_path) -> None:
    require_shared_data()
    notebook = run_notebook(
        "train_heads.ipynb",
        {
            "MODEL_NAME": SHIPPED_MODEL,
            "DATASET": str(SHARED_DATA / "multi30k"),
            "TRAIN_EXAMPLES": 96,
            "EVAL_EXAMPLES": 6,
            "MAX_STEPS": 4,
            "LOGGING_STEPS": 2,
            "SAVE_STEPS": 2,
            "OUTPUT_DIR": str(tmp_path / "run"),
        },
        tmp_path,
    )
    output = text_output(notebook)
    assert "eval_mean_accepted" in output
    assert "checkpoint-4" in output
    plots = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "display_data"]
    assert plots, "the head-accuracy plot was not shown"
    assert (tmp_path / "run" / "final" / "blockwise_config.json").is_file()
    assert "feature drafter, tokens per decoder call" in output
    assert (tmp_path / "run-feature" / "final" / "feature_drafter_config.json").is_file()


def test_error_correction_notebook_runs(tmp_path) -> None:
    require_shared_data()
    notebook = run_notebook(
        "error_correction_iad.ipynb",
        {
            "MODEL_NAME": SHIPPED_GEC_MODEL,
            "SOURCE_PREFIX": "",
            "DATASET": str(SHARED_DATA / "jfleg"),
            "NUM_SENTENCES": 4,
        },
        tmp_path,
    )
    output = text_output(notebook)
    # IAD reproduces greedy decoding on every sentence
    assert re.search(r"IAD: [0-9.]+x greedy, identical 4/4", output), output
    assert "IAD mean accepted tokens per decoder call" in output

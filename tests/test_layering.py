"""The library sits below its tools: importing `hf_blockwise` (its public API, the corpus job and the evaluation
harness included) loads nothing from `hf_blockwise.tools` (bench, CLI). The import-linter contract in
pyproject.toml keeps the library's packages from importing the tools; this test covers the package's own
`__init__` too, in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_blockwise

# The house rule for the repository's code: a function longer than this is split into named helpers.
MAX_FUNCTION_LINES = 60

TOOLS_LOADED = "import hf_blockwise, sys; print([m for m in sys.modules if m.startswith('hf_blockwise.tools')])"


def test_importing_the_library_loads_no_tool() -> None:
    printed = subprocess.run([sys.executable, "-c", TOOLS_LOADED], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "[]"


HEAVY_MODULES = ("datasets", "sacrebleu", "hf_blockwise.corpus")
HEAVY_LOADED = f"import hf_blockwise, sys; print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))"


def test_importing_the_library_loads_no_corpus_dependency_until_the_corpus_job_is_used() -> None:
    """datasets (~1.5 s to import) and sacrebleu are loaded where they are used, not by `import hf_blockwise`."""
    printed = subprocess.run([sys.executable, "-c", HEAVY_LOADED], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "[]"
    assert hf_blockwise.generate_corpus.__module__ == "hf_blockwise.corpus.job"  # served on first use
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_blockwise.nope  # noqa: B018


def test_importing_the_library_imports_nothing_until_a_name_is_used() -> None:
    """`import hf_blockwise` loads no submodule, torch or transformers; each public name loads its own module on
    first use, and `__all__` lists exactly the names served."""
    loaded = "sorted(m for m in sys.modules if m.startswith(('hf_blockwise.', 'torch', 'transformers')))"
    probe = f"import hf_blockwise, sys; print({loaded})"
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert printed.strip() == "[]"
    assert sorted(hf_blockwise.__all__) == sorted(hf_blockwise._SOURCES)
    for name in hf_blockwise.__all__:
        assert getattr(hf_blockwise, name).__name__ == name


def test_the_public_api_comes_from_the_library() -> None:
    for name in hf_blockwise.__all__:
        module = getattr(getattr(hf_blockwise, name), "__module__", "")
        assert not module.startswith("hf_blockwise.tools"), f"{name} comes from {module}"


def test_recipes_and_scripts_import_no_tool() -> None:
    """The training recipes and the scripts share their helpers beside them (`training/recipe_common.py`, `data.py`,
    `scripts/script_common.py`) or take them from the library, never from `hf_blockwise.tools` (the bench and the CLI
    sit on top of everything; scripts run the bench through its command line)."""
    repository = Path(hf_blockwise.__file__).parent.parent
    offenders = []
    for path in sorted([*(repository / "training").glob("*.py"), *(repository / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}: {name}" for name in names if name.startswith("hf_blockwise.tools")]
    assert not offenders, offenders


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, length) of every function or method in `source` longer than `limit` lines, from `def` to
    its last line (decorators not counted), nested functions included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append((name[:-1], length))
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def test_long_functions_measures_def_to_last_line() -> None:
    source = "class A:\n    @staticmethod\n    def f():\n" + "        x = 1\n" * 5 + "def g():\n    pass\n"
    assert long_functions(source, 5) == [("A.f", 6)]
    assert long_functions(source, 6) == []


def test_no_function_in_the_repository_is_over_the_limit() -> None:
    """The package, its recipes, scripts and tests."""
    root = Path(hf_blockwise.__file__).parent.parent
    too_long = [
        f"{path.relative_to(root)}: {name} ({length} lines)"
        for folder in ("hf_blockwise", "training", "scripts", "tests")
        for path in sorted((root / folder).rglob("*.py"))
        for name, length in long_functions(path.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines, split them into named helpers: {too_long}"


MAX_MODULE_LINES = 600


def test_no_module_of_the_library_is_over_the_limit() -> None:
    """A module holds one job: past this many lines it is split into modules of a package."""
    root = Path(hf_blockwise.__file__).parent
    too_long = [
        f"{path.relative_to(root.parent)} ({lines} lines)"
        for path in sorted(root.rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines, split them: {too_long}"

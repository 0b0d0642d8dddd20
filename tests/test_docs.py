"""Every code block of the quickstart and the guides runs, as a reader would run it: a page's ```python blocks in
order in one fresh namespace (a notebook per page), its ```bash blocks with `bash -e`, all from the repository root.
```console blocks are commands shown and not run (installs, minutes-long benchmarks, several machines); no other
fence is allowed on these pages, so nothing meant to run escapes the test. The README's example runs too, and the
API reference documents every public name."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from fake_hub import fake_hub_cache, use_hub_cache

import hf_blockwise

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "docs" / "quickstart.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]
RUN = ("python", "bash")
SHOWN = ("console", "text")
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def code_blocks(page: Path) -> list[tuple[str, int, str]]:
    """The fenced blocks of a page at the top level: (language, line of the opening fence, code)."""
    text = page.read_text(encoding="utf-8")
    return [(match.group(1), text.count("\n", 0, match.start()) + 1, match.group(2)) for match in FENCE.finditer(text)]


def run_python(code: str, line: int, name: str, namespace: dict) -> None:
    # padded so that a traceback's line numbers are the page's
    exec(compile("\n" * line + code, name, "exec"), namespace)


def page_id(page: Path) -> str:
    return page.relative_to(REPO / "docs").as_posix()


def test_the_pages_exist_and_fence_only_runnable_or_shown_code() -> None:
    assert len(PAGES) >= 10, [page_id(page) for page in PAGES]
    for page in PAGES:
        blocks = code_blocks(page)
        assert any(language in RUN for language, _, _ in blocks), f"{page_id(page)} runs no code"
        unknown = [(language, line) for language, line, _ in blocks if language not in RUN + SHOWN]
        assert not unknown, f"{page_id(page)}: fences other than {RUN + SHOWN} at {unknown}"
        indented = re.findall(r"^[ \t]+```", page.read_text(encoding="utf-8"), re.MULTILINE)
        assert not indented, f"{page_id(page)}: an indented fence would escape the test"


# pages that load models by hub id: they run against tiny models of those ids in an offline hub cache (fake_hub.py)
HUB_PAGES = ("guides/hub-models.md",)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_block_of_the_page_runs(page: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(REPO)
    if page_id(page) in HUB_PAGES:
        use_hub_cache(monkeypatch, fake_hub_cache(tmp_path / "hub"))
    namespace: dict = {"__name__": "__main__"}
    # one torch thread, as the test process has (conftest): two test workers share the CPU
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    for language, line, code in code_blocks(page):
        where = f"{page_id(page)}, the {language} block at line {line}"
        if language == "python":
            run_python(code, line, f"docs/{page_id(page)}", namespace)
        elif language == "bash":
            run = subprocess.run(
                ["bash", "-e", "-c", code], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
            )
            assert run.returncode == 0, f"{where} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def test_the_readme_example_runs(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    blocks = [(line, code) for language, line, code in code_blocks(REPO / "README.md") if language == "python"]
    assert blocks, "the README shows no Python example"
    namespace: dict = {"__name__": "__main__"}
    for line, code in blocks:
        run_python(code, line, "README.md", namespace)


def test_the_api_reference_documents_every_public_name() -> None:
    pages = "\n".join(page.read_text(encoding="utf-8") for page in (REPO / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: hf_blockwise\.(\w+)$", pages, re.MULTILINE))
    missing = sorted(set(hf_blockwise.__all__) - documented)
    assert not missing, f"add `::: hf_blockwise.NAME` lines for {missing} to a page of docs/api/"


# a speed ratio as the pages quote it ("2.43x"): each one must stand in a bench report, where a repo command wrote it
SPEED_RATIO = re.compile(r"(?<![\w.])\d+\.\d+x\b")
QUOTING_PAGES = [
    REPO / "README.md",
    *(REPO / "docs" / name for name in ("index.md", "quickstart.md", "concepts.md", "models.md", "glossary.md")),
    *sorted((REPO / "docs" / "guides").glob("*.md")),
]


def test_every_speed_ratio_the_pages_quote_stands_in_a_bench_report() -> None:
    """The README, the overview pages and the guides quote speed ratios from the reports under `docs/bench/`
    (`hf-blockwise bench` and the scripts write them, `scripts/benchmarks.sh` lists the commands): a ratio found in
    none of them was typed by hand, or its report was regenerated since."""
    reports = "\n".join(
        path.read_text(encoding="utf-8", errors="replace")
        for path in sorted((REPO / "docs" / "bench").rglob("*"))
        if path.suffix in (".md", ".json", ".txt", ".csv")
    )
    unsourced = {
        page.relative_to(REPO).as_posix(): missing
        for page in QUOTING_PAGES
        if (
            missing := sorted(
                set(SPEED_RATIO.findall(page.read_text(encoding="utf-8"))) - set(re.findall(r"\d+\.\d+x", reports))
            )
        )
    }
    assert not unsourced, f"speed ratios quoted but in no report under docs/bench/: {unsourced}"

"""The wheel is the library alone: small, without the shipped models, and it runs the demo on a shipped model given by
path; without one, the demo says where the models are. The transformers it requires is the range the test command
tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from test_corpus import random_sources
from test_own_text import save_tiny_model

from hf_blockwise.boundary import TESTED_TRANSFORMERS_RANGE, TESTED_TRANSFORMERS_VERSIONS
from hf_blockwise.loading import SHIPPED_MODEL

REPO = Path(__file__).resolve().parents[1]
MAX_WHEEL_BYTES = 5 * 1024 * 1024


def test_the_wheel_holds_the_library_alone_and_runs_the_demo_on_a_model_by_path(tmp_path) -> None:
    source = tmp_path / "source"  # a copy: building writes build/ beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    # the shipped models' files but their weights (255 MB to copy): the exclusion is by folder, checked below
    ignore = shutil.ignore_patterns("__pycache__", "*.safetensors")
    shutil.copytree(REPO / "hf_blockwise", source / "hf_blockwise", ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("hf_blockwise-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.stat().st_size <= MAX_WHEEL_BYTES, wheel.stat().st_size
    assert (source / "hf_blockwise" / "pretrained" / "marian-base-en-de" / "config.json").is_file()
    assert not [name for name in names if "/pretrained/" in name or name.endswith(".safetensors")]
    assert "hf_blockwise/tools/cli/demo.py" in names
    assert "hf_blockwise/kernels/int8_vnni.cpp" in names  # the int8 kernel's source, compiled where it runs
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    # the installed wheel first on the path, run from outside the checkout (its dependencies: this environment's)
    environment = {**os.environ, "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}

    def run(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *arguments], env=environment, cwd=tmp_path, capture_output=True, text=True
        )

    where = run("-c", "import hf_blockwise; print(hf_blockwise.__file__)")
    assert where.stdout.strip() == str(site / "hf_blockwise" / "__init__.py"), where.stderr
    demo = ["-m", "hf_blockwise.tools.cli", "demo", "--repeats", "1", "--no-compile", "--max-new-tokens", "8"]
    shipped = run(*demo, "--model", SHIPPED_MODEL, "A dog runs on the beach.")
    assert shipped.returncode == 0 and "identical outputs: 1/1" in shipped.stdout, shipped.stderr[-2000:]
    missing = run(*demo)
    assert missing.returncode == 2, missing.stderr
    assert "the shipped model marian-base-en-de is not installed here" in missing.stderr
    assert "pip install -e ." in missing.stderr
    # a drafter for one's own model, from the installed package alone
    (tmp_path / "text.txt").write_text("\n".join(random_sources(40, seed=3)) + "\n", encoding="utf-8")
    own = run(
        "-m", "hf_blockwise.tools.cli", "train", "heads", "--model", str(save_tiny_model(tmp_path / "own")),
        "--source-file", "text.txt", "--out", "drafter", "--max-steps", "2", "--eval-lines", "4", "--no-progress",
    )  # fmt: skip
    assert own.returncode == 0, own.stderr[-2000:]
    assert "heads saved in drafter after 2 steps on 36 lines" in own.stdout
    assert (tmp_path / "drafter" / "blockwise_heads.safetensors").is_file()


def test_the_required_transformers_are_the_tested_range_and_the_test_command_runs_its_ends() -> None:
    # the dependency's line of pyproject.toml (tomllib is Python 3.11+, the package supports 3.10)
    (required,) = re.findall(r'^\s*"transformers([^"]*)",', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert SpecifierSet(required) == SpecifierSet(TESTED_TRANSFORMERS_RANGE)
    versions = sorted(Version(version) for version in TESTED_TRANSFORMERS_VERSIONS)
    assert all(version in SpecifierSet(TESTED_TRANSFORMERS_RANGE) for version in versions)
    # the range ends where its tested versions do: no minor release above the newest or below the oldest is claimed
    allowed = SpecifierSet(TESTED_TRANSFORMERS_RANGE)
    assert Version(f"{versions[0].major}.{versions[0].minor - 1}.99") not in allowed
    assert Version(f"{versions[-1].major}.{versions[-1].minor + 1}.0") not in allowed
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "TESTED_TRANSFORMERS_VERSIONS" in script and '"transformers==$version"' in script

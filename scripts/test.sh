#!/usr/bin/env bash
# Installs hf_blockwise with its test tools (and the optional CTranslate2, whose bench modes are tested) and runs lint, format check, the import-graph check and the test suite.
# torch is installed first from the pinned CPU build, so that resolving `torch>=2.4` pulls nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev,ctranslate2]"
python3 -m ruff check .
python3 -m ruff format --check .
lint-imports  # the import graph has no cycles ([tool.importlinter] in pyproject.toml)
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$(mktemp -d)"  # the docs site, warnings are errors (no --quiet: mkdocs 1.6 would drop them before --strict counts them)
# inductor compiles in the test process itself: no pool of compile workers per xdist worker on a 2-core machine
export TORCHINDUCTOR_COMPILE_THREADS=1
python3 -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=20  # two workers (one torch thread each, conftest); an idle one takes queued tests

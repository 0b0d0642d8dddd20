#!/usr/bin/env bash
# Installs hf_blockwise with its test tools (and the optional CTranslate2 and Ray Data, whose bench modes and corpus
# predictor are tested) and runs lint, format check, the import-graph check and the test suite;
# then the boundary's subset of the suite on the oldest and the newest transformers of the tested range.
# torch is installed first from the pinned CPU build, so that resolving `torch>=2.4` pulls nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev,ctranslate2,ray]"
python3 -m ruff check .
python3 -m ruff format --check .
lint-imports  # the import graph has no cycles ([tool.importlinter] in pyproject.toml)
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$(mktemp -d)"  # the docs site, warnings are errors (no --quiet: mkdocs 1.6 would drop them before --strict counts them)
# inductor compiles in the test process itself: no pool of compile workers per xdist worker on a 2-core machine
export TORCHINDUCTOR_COMPILE_THREADS=1
python3 -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=20  # two workers (one torch thread each, conftest); an idle one takes queued tests

# The tested transformers range (hf_blockwise.boundary.TESTED_TRANSFORMERS_VERSIONS, what pyproject.toml requires): its
# oldest and newest releases, each in a virtual environment over this one's packages, run the tests of every contact
# with transformers (loading and saving, generate's arguments, the step, the exactness of the eager loop and of the
# compiled engine); a version equal to the installed one is skipped (the whole suite above ran on it)
RANGE_TESTS=(
    tests/test_model_api.py tests/test_bad_inputs.py tests/test_serialization.py tests/test_step.py
    tests/test_exactness.py::test_no_drafter_is_greedy tests/test_exactness.py::test_perfect_drafter_needs_one_forward_per_block
    tests/test_engine.py::test_compiled_drafting_is_exact_against_the_engines_greedy
)
installed="$(python3 -c 'import transformers; print(transformers.__version__)')"
for version in $(python3 -c 'from hf_blockwise.boundary import TESTED_TRANSFORMERS_VERSIONS as v; print(*v)'); do
    if [ "$version" = "$installed" ]; then continue; fi
    environment="$(mktemp -d)/transformers-$version"
    python3 -m venv --system-site-packages "$environment"
    "$environment/bin/python" -m pip install -q "transformers==$version"
    echo "transformers $version:"
    "$environment/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist worksteal "${RANGE_TESTS[@]}"
done

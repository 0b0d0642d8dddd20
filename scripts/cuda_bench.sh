#!/usr/bin/env bash
# CUDA timings of the loop, the compiled engine and the drafters (docs/results.md, "On a GPU"), on a machine with a
# CUDA GPU: bash scripts/cuda_bench.sh OUT_DIR SOURCE_FILE REFERENCE_FILE
# The shipped multi30k-en-de model with its drafters on Multi30k test_2016, eager and compiled (CUDA graphs), batch 1
# and 16; then random-weight models of real checkpoints' shapes with oracle drafts (the loop's ceiling where drafts
# are perfect) and the decoder's cost by fed tokens. Each bench is bounded by BENCH_TIMEOUT seconds (default 150) and
# a failed one is reported and skipped, so one run brings back what worked. Over 10 minutes on an H200 in all.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1; src=$2; ref=$3
mt=hf_blockwise/pretrained/multi30k-en-de

bench() {
    local name=$1; shift
    echo "=== $name: $*"
    timeout "${BENCH_TIMEOUT:-150}" python -m hf_blockwise.tools.cli bench --device cuda --out "$out/$name" "$@" \
        || echo "=== $name failed (exit $?)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
bench multi30k-b1 --model $mt --source-file "$src" --reference-file "$ref" --sentences 100 --batch-sizes 1 \
    --modes greedy heads feature seq_heads composite oracle --oracle-block-sizes 4 8 --cost-curve
# the compiled engine (CUDA graphs) second: the first run (about 10 minutes) ran out of device time before it
BENCH_TIMEOUT=240 bench multi30k-compiled-b1 --model $mt --source-file "$src" --reference-file "$ref" \
    --sentences 50 --batch-sizes 1 --modes greedy greedy_compiled heads_compiled feature_compiled oracle_compiled \
    --oracle-block-sizes 4
bench multi30k-b16 --model $mt --source-file "$src" --reference-file "$ref" --sentences 96 --batch-sizes 16 \
    --modes greedy heads feature oracle --oracle-block-sizes 4 8
for config in opus-mt-en-de bart-large nllb-200-distilled-600M; do
    bench $config --model-config $config --sentences 16 --batch-sizes 1 16 --modes greedy greedy_compiled loop oracle \
        --oracle-block-sizes 4 8 --cost-curve-max-tokens 16
done

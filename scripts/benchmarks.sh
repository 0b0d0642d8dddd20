#!/usr/bin/env bash
# Regenerates every benchmark figure quoted in docs/results.md (about 2 hours on a 2-core CPU; run it on an
# otherwise idle machine: timings are ratios measured in the same run, but a busy machine skews them).
# Needs the offline data sets in ../shared/data beside the repository, and `pip install -e .[ctranslate2]` for the
# CTranslate2 rows.
set -euo pipefail
cd "$(dirname "$0")/.."
data=../shared/data
mt=hf_blockwise/pretrained/multi30k-en-de
gec=hf_blockwise/pretrained/gec-en

base=hf_blockwise/pretrained/marian-base-en-de

# the source and reference files of a test set: set_files multi30k|europarl sets $src and $ref
set_files() {
    if [ "$1" = multi30k ]; then
        src=$data/multi30k/test_2016_flickr.en.gz; ref=$data/multi30k/test_2016_flickr.de.gz
    else
        src=$data/europarl_de_en/validation.en; ref=$data/europarl_de_en/validation.de
    fi
}

# issue 43: int8 products on hf_blockwise's VNNI kernel (weights packed once): the int8 engine and int8 drafting
# against CTranslate2 int8, both sets at batch 1 (with HF_BLOCKWISE_INT8_KERNEL=0 in the environment the same command
# measures torch._int_mm); the int8 call's cost against its bytes
for set in multi30k europarl; do
    set_files $set
    sentences=100; [ $set = europarl ] && sentences=60
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences $sentences --batch-sizes 1 \
        --threads 2 --modes greedy greedy_int8_compiled feature_int8_compiled ct2_int8 \
        --out docs/bench/marian-base-$set-int8-kernel-b1
done
# issue 43: the same with each generate's first call compiled too (CompileOptions.compiled_prefill), Multi30k
set_files multi30k
hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_int8_compiled feature_int8_compiled ct2_int8 --compiled-prefill \
    --out docs/bench/marian-base-multi30k-int8-prefill-b1
hf-blockwise profile calls --threads 2 --max-tokens 8 --kinds "int8 eager" "int8 compiled" --torch-profile \
    > docs/bench/int8-kernel-call-cost.md
hf-blockwise profile calls --threads 2 --max-tokens 16 --kinds "float32 compiled" "int8 compiled" \
    > docs/bench/call-cost-curves-1-16.md
# issue 43: a compiled int8 call by part (products, the graph's kernels, inductor's Python, dynamo) and a drafted
# generate's fixed cost by part (encoder with the int8 refresh, the engine's stale check, setup)
hf-blockwise profile calls --threads 2 --max-tokens 4 --kinds "int8 compiled" --torch-profile \
    > docs/bench/int8-call-parts.md
hf-blockwise profile step --threads 2 --drafter feature --int8 --compiled --compiled-prefill --source-file $src \
    --sentences 30 > docs/bench/marian-base-step-profile-int8-fixed.md
# chains at k = 4 and 2, int8, Multi30k at batch 1
set_files multi30k
hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 --threads 2 \
    --modes greedy_int8_compiled feature_int8_compiled feature_k2_int8_compiled \
    --out docs/bench/marian-base-multi30k-chains-k2-k4-b1
# issue 43: eager int8 layers in one call of the kernel's library (the encoder, the engine's eager first call,
# transformers' int8 greedy), both sets
for set in multi30k europarl; do
    set_files $set
    sentences=100; [ $set = europarl ] && sentences=60
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences $sentences \
        --batch-sizes 1 --threads 2 --modes greedy greedy_int8 greedy_int8_compiled feature_int8_compiled ct2_int8 \
        --out docs/bench/marian-base-$set-int8-fused-b1
done

# issue 41: one arithmetic on any CPU: identity of every int8 drafter (chains, trees, heads) and of float32 trees
# against the engine's greedy, both sets at batch 1 (fewer sentences: on a CPU without VNNI an int8 call costs ~95 ms);
# the probe's verdict and cost
python scripts/arithmetic_probe.py --threads 2 > docs/bench/arithmetic-probe.md
for set in multi30k europarl; do
    set_files $set
    sentences=40; [ $set = europarl ] && sentences=16  # news sentences are ~3x longer
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences $sentences --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled greedy_int8_compiled feature_int8_compiled heads_int8_compiled \
        feature_k6_n10_int8_compiled feature_k6_n10_compiled --out docs/bench/marian-base-$set-one-arithmetic-b1
done

# issue 33: beam search through the loop (4 beams): transformers' beam search, ours without drafts (eager and
# compiled), with the feature drafter's chains and trees (each beam's 3 best children per depth, 10 nodes), CTranslate2's
# beam 4 (float32, int8), batch 1 and 16; the ceiling of drafting under beams (steps per call, perfect chains and trees)
for set in multi30k europarl; do
    set_files $set
    sentences=100; [ $set = europarl ] && sentences=50  # news sentences are ~3x longer
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences $sentences --batch-sizes 1 \
        --threads 2 --modes greedy beam4 loop_b4 greedy_compiled_b4 feature_b4 feature_compiled_b4 \
        feature_k4_n10_m3_compiled_b4 ct2_b4 ct2_int8_b4 --out docs/bench/marian-base-$set-beam4-b1
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 48 --batch-sizes 16 \
        --threads 2 --modes greedy beam4 loop_b4 greedy_compiled_b4 feature_compiled_b4 ct2_b4 ct2_int8_b4 \
        --out docs/bench/marian-base-$set-beam4-b16
    python scripts/beam_ceiling.py --model $base --source-file $src --sentences $sentences --num-beams 4 \
        > docs/bench/marian-base-$set-beam4-ceiling.md
done

# issue 32: the ceiling of trees: perfect trees of 10 and 16 nodes (oracle chains of as many drafts)
for set in multi30k europarl; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled feature_k6_n10_compiled feature_k6_n16_m4_compiled oracle_compiled \
        --oracle-block-sizes 11 17 --out docs/bench/marian-base-$set-tree-ceiling-b1
done
# issue 32: identity of trees on 300 sentences each (compiled, against the engine's greedy; int8 against int8)
for set in multi30k europarl; do
    set_files $set
    hf-blockwise profile divergences --model $base --compiled --drafter feature --source-file $src --sentences 300 \
        --threads 2 --block-size 6 --tree-nodes 10 --int8 > docs/bench/marian-base-$set-tree-divergences.md
    hf-blockwise profile divergences --model $base --compiled --drafter feature --source-file $src --sentences 300 \
        --threads 2 --block-size 6 --tree-nodes 16 --tree-branching 4 >> docs/bench/marian-base-$set-tree-divergences.md
done

# issue 32: trees of drafts against chains, both sets at batch 1 and 16, CTranslate2 beside them; chains and trees of
# equal nodes (feature_k9: a chain of 8 against feature_k5_n8: a tree of 8); the compiled call's cost by fed tokens
# (where it stops being flat); one step's parts for a chain and a tree
for set in multi30k europarl; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled greedy_int8_compiled feature_compiled feature_k5_compiled \
        feature_k9_compiled feature_k5_n8_compiled feature_k6_n10_compiled feature_k6_n16_m4_compiled \
        feature_int8_compiled feature_k6_n10_int8_compiled heads_compiled heads_k4_n6_compiled oracle_compiled \
        ct2 ct2_int8 --oracle-block-sizes 4 6 --cost-curve --cost-curve-max-tokens 20 \
        --out docs/bench/marian-base-$set-trees-b1
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 96 --batch-sizes 16 \
        --threads 2 --modes greedy greedy_compiled feature_compiled feature_k5_n8_compiled ct2 ct2_int8 \
        --out docs/bench/marian-base-$set-trees-b16
done
set_files multi30k
hf-blockwise profile step --model $base --source-file $src --sentences 50 --threads 2 --block-size 5 \
    --compiled > docs/bench/marian-base-step-profile-trees.md
hf-blockwise profile step --model $base --source-file $src --sentences 50 --threads 2 --block-size 6 \
    --tree-nodes 10 --compiled >> docs/bench/marian-base-step-profile-trees.md

# issue 31: one arithmetic for every compiled call; int8 drafting against the int8 engine's greedy, both sets at
# batch 1 and Europarl at batch 16, CTranslate2 beside them; the int8 call's cost against its bytes; what the
# stale-weight check costs
hf-blockwise profile calls --threads 2 --torch-profile > docs/bench/int8-call-cost.md
python scripts/int8_kernels.py --threads 2 > docs/bench/int8-kernels-2threads.md
for set in europarl multi30k; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled greedy_int8_compiled feature_compiled feature_int8_compiled \
        heads_int8_compiled ct2 ct2_int8 --out docs/bench/marian-base-$set-int8-b1
done
for set in europarl multi30k; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 96 --batch-sizes 16 \
        --threads 2 --modes greedy greedy_compiled greedy_int8_compiled feature_int8_compiled ct2 ct2_int8 \
        --out docs/bench/marian-base-$set-int8-b16
done
# one verification call against one draft (int8 model; float32 base with the int8 drafter)
set_files multi30k
hf-blockwise profile step --model $base --source-file $src --sentences 50 --threads 2 --int8 \
    --compiled > docs/bench/marian-base-step-profile-int8.md
hf-blockwise profile step --model $base --source-file $src --sentences 50 --threads 2 --int8-drafter \
    --compiled > docs/bench/marian-base-step-profile-int8-drafter.md
python scripts/stale_weights_check.py --threads 2
# an int8 feature drafter over the float32 model (a separate run, batch 1)
for set in multi30k europarl; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled feature_compiled feature_int8d_compiled \
        --out docs/bench/marian-base-$set-int8-drafter-b1
done

# issue 26: the realistic base (opus-mt-en-de's decoder shape) with its drafters, exact int8 and CTranslate2 side by
# side (2 threads each), Multi30k test_2016 and Europarl validation, batch 1 and 16
for set in multi30k europarl; do
    set_files $set
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled greedy_int8 greedy_int8_compiled feature feature_compiled \
        feature_int8_compiled heads_compiled heads_int8_compiled oracle_compiled ct2 ct2_int8 \
        --oracle-block-sizes 4 --out docs/bench/marian-base-$set-b1
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 96 --batch-sizes 16 \
        --threads 2 --modes greedy greedy_compiled greedy_int8_compiled feature_compiled feature_int8_compiled \
        oracle_compiled ct2 ct2_int8 --oracle-block-sizes 4 --out docs/bench/marian-base-$set-b16
    # the eager int8 path: int8 drafting against int8 greedy
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
        --threads 2 --modes greedy greedy_int8 feature_int8 heads_int8 --out docs/bench/marian-base-$set-int8-eager
done
# the feature drafter's k chosen by speed (compiled, batch 1)
hf-blockwise bench --model $base --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 100 --batch-sizes 1 --threads 2 \
    --modes greedy greedy_compiled feature_k3_compiled feature_compiled feature_k5_compiled feature_k6_compiled \
    --out docs/bench/marian-base-multi30k-feature-k
# the int8 kernel candidates, one thread
python scripts/int8_kernels.py --threads 1
# where int8 drafting leaves int8 greedy on the news set, and the top-2 gaps there
hf-blockwise profile divergences --model $base --drafter feature --int8 \
    --source-file $data/europarl_de_en/validation.en --sentences 40 --threads 2
# its decoder cost curve (eager and compiled, 1..8 tokens), the step profile (float32 and int8) and peak memory
hf-blockwise bench --model $base --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 3 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_compiled --cost-curve --cost-curve-max-tokens 8 --out docs/bench/marian-base-cost-curve
for engine in "" --compiled; do
    hf-blockwise profile step --model $base --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 50 \
        --threads 2 $engine
done
hf-blockwise profile step --model $base --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 50 \
    --threads 2 --int8 --compiled
python scripts/peak_memory.py --model $base --source-file $data/multi30k/test_2016_flickr.en.gz --modes greedy \
    greedy_compiled greedy_int8_compiled feature_compiled feature_int8_compiled ct2 ct2_int8

# the compiled engine (issue 18): every compiled mode beside eager greedy, the eager loop and drafter, transformers'
# own compiled greedy and CTranslate2, batch 1
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 2 \
    --modes greedy loop greedy_compiled oracle_compiled feature feature_compiled heads_compiled seq_heads_compiled \
    hf_greedy_compiled ct2 ct2_int8 --oracle-block-sizes 4 8 --out docs/bench/multi30k-compiled
# compiled drafting (issue 18): the feature drafter's compiled block at k = 3..5; error correction and batch 16
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 2 \
    --modes greedy greedy_compiled feature feature_compiled feature_k4_compiled feature_k5_compiled \
    --out docs/bench/multi30k-feature-compiled
hf-blockwise bench --model $gec --source-file $data/jfleg/dev.src --reference-file $data/jfleg/dev.ref0 --sentences 300 \
    --modes greedy greedy_compiled iad iad_compiled --batch-sizes 1 --threads 2 --out docs/bench/gec-jfleg-compiled
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 16 --threads 2 \
    --modes greedy loop greedy_compiled oracle_compiled feature feature_compiled --oracle-block-sizes 4 \
    --out docs/bench/multi30k-compiled-b16
# where a step's time goes (verification, drafting, bookkeeping, generate's fixed cost), printed
for engine in "" --compiled; do
    hf-blockwise profile step --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 100 \
        --threads 2 $engine
done
# the decoder cost curve, eager and compiled, 1..8 tokens
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 3 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_compiled --cost-curve --cost-curve-max-tokens 8 --out docs/bench/multi30k-cost-curve-compiled
# Multi30k en→de, shipped model: our modes at batch 1 and 16 (2 threads), with the loop alone (`loop`), the loop's
# ceiling with perfect drafts (`oracle`, k = 4 and 8) and the decoder cost curve
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 16 --threads 2 \
    --modes greedy prompt_lookup heads heads_top2 gad gad_pp loop oracle --oracle-block-sizes 4 8 \
    --cost-curve --out docs/bench/multi30k
# beam search and transformers' assisted generation (the shipped GAD drafter's model used autoregressively)
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 2 \
    --modes greedy beam4 assisted --assistant-model $mt/nar-drafter --out docs/bench/multi30k-transformers
# what ceiling a model of a given size has on this CPU (randomly initialised models of real shapes)
python scripts/model_size_table.py --threads 2
# the CPU fast path step by step, single thread (Devlin 2017's words/s)
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 1 \
    --fast-path --out docs/bench/multi30k-fast-path
# error correction with input-guided drafts (Ge et al. Table 1 shape): JFLEG dev and W&I+LOCNESS dev
hf-blockwise bench --model $gec --source-file $data/jfleg/dev.src --reference-file $data/jfleg/dev.ref0 \
    --modes greedy prompt_lookup iad iad_realign greedy_int8 iad_int8 ct2 ct2_int8 --batch-sizes 1 --threads 2 \
    --out docs/bench/gec-jfleg
hf-blockwise bench --model $gec --source-file $data/gec_wi_locness/dev.src.gz \
    --reference-file $data/gec_wi_locness/dev.tgt.gz --sentences 300 --modes greedy prompt_lookup iad \
    greedy_int8 iad_int8 --batch-sizes 1 --threads 2 --out docs/bench/gec-wi-locness
# IAD draft length: Ge drafts the whole rest of the source; on a CPU a wide verification pass costs more
for length in 8 16; do
    hf-blockwise bench --model $gec --source-file $data/jfleg/dev.src --reference-file $data/jfleg/dev.ref0 \
        --sentences 300 --modes greedy iad greedy_int8 iad_int8 --iad-max-draft-length $length --batch-sizes 1 \
        --threads 2 --out docs/bench/gec-jfleg-draft$length
done
# GAD and GAD++ sweeps over k, beta and tau (Ge et al. Tables 5-7 shape)
python scripts/gad_sweep.py --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --threads 2 --out docs/bench/gad-sweep
# the drafters of issue 12 (Stern heads, sequential heads, feature drafter and its k / threshold sweep), batch 1
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 2 \
    --modes greedy heads seq_heads feature_k3 feature_k4 feature_k5 feature_k6 feature_k4_t0.3 feature_k5_t0.3 \
    feature_k6_t0.3 feature_k6_t0.5 feature_k8_t0.5 --out docs/bench/multi30k-drafters
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 16 --threads 2 \
    --modes greedy heads seq_heads feature_k3 feature_k4 feature_k5 feature_k6 feature_k5_t0.3 \
    --out docs/bench/multi30k-drafters-b16
# the shipped defaults at batch 1 and 16, beside the loop's ceiling
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 16 --threads 2 \
    --modes greedy heads seq_heads feature oracle --oracle-block-sizes 4 --out docs/bench/multi30k-feature
# cross-attention in the feature drafter: checkpoint-200 of the shipped recipe (copied aside as
# checkpoints/ablation-cross-200 while it trained) against checkpoint-200 of the same recipe with
# --cross-attention false --out checkpoints/feature-nocross (same data, schedule and steps)
for variant in cross:ablation-cross-200 nocross:feature-nocross/checkpoint-200; do
    hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz --sentences 300 \
        --batch-sizes 1 --threads 2 --modes greedy feature_k5 --feature-drafter checkpoints/${variant#*:} \
        --out docs/bench/feature-ablation/${variant%%:*}
done
# Stern's Table 1 shape: accepted tokens per call at k = 2..10 for every trained drafter
python scripts/acceptance_table.py --model $mt --sentences 300 --out docs/acceptance_table.md
# error correction: source copy, the gec-en feature drafter, and the composite of both, on JFLEG dev
hf-blockwise bench --model $gec --source-file $data/jfleg/dev.src --reference-file $data/jfleg/dev.ref0 \
    --modes greedy iad feature composite --batch-sizes 1 --threads 2 --out docs/bench/gec-jfleg-composite
# CTranslate2, the engine a CPU user would pick instead: its greedy search (float32, int8 weights) beside
# transformers' greedy and our exact drafters, batch 1 and 16
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 16 --threads 2 \
    --modes greedy heads feature greedy_int8 heads_int8 ct2 ct2_int8 --out docs/bench/multi30k-ct2
# the same at one thread, where CTranslate2 (which runs one thread in the bench) and torch have equal threads
hf-blockwise bench --model $mt --source-file $data/multi30k/test_2016_flickr.en.gz \
    --reference-file $data/multi30k/test_2016_flickr.de.gz --sentences 300 --batch-sizes 1 --threads 1 \
    --modes greedy heads feature greedy_int8 ct2 ct2_int8 --out docs/bench/multi30k-ct2-1thread
# speech (issue 19): the loop's ceiling (oracle drafts) on the speech recipe's Whisper-architecture model
# (checkpoints/speech-en/model: the recipe's last run) over its held-out synthetic utterances,
# written by training/train_speech.py into checkpoints/speech-en/heldout-audio
hf-blockwise bench --model checkpoints/speech-en/model --audio-folder checkpoints/speech-en/heldout-audio \
    --sentences 96 --batch-sizes 1 8 --threads 2 --oracle-block-sizes 4 8 --max-new-tokens 60 \
    --modes greedy greedy_compiled oracle oracle_compiled --out docs/bench/speech-en-oracle
# the shipped speech model (step 5 of the recipe) and its feature drafter, batches 1 and 8, with the ceiling at k = 5
hf-blockwise bench --model hf_blockwise/pretrained/speech-en --audio-folder checkpoints/speech-en/heldout-audio \
    --sentences 96 --batch-sizes 1 8 --threads 2 --oracle-block-sizes 5 --max-new-tokens 60 \
    --modes greedy greedy_compiled feature feature_compiled feature_k3_compiled oracle_compiled --out docs/bench/speech-en
# corpus throughput (issue 20): hf-blockwise generate's sorted batches and drafters against a naive unsorted greedy
# loop at batch 1, 16 and 64 and a token budget, on Europarl validation, Multi30k train sources, and W&I dev (IAD);
# the Europarl and W&I reports name the composite `auto (composite)`: `auto` meant the composite at every batch size then
python scripts/corpus_bench.py --model $mt --input $data/europarl_de_en/validation.en --lines 300 --compile \
    --batch-sizes 1 16 64 --drafters none composite feature --max-batch-tokens 1024 --out docs/bench/corpus-europarl
python scripts/corpus_bench.py --model $mt --input $data/multi30k/train.en.gz --lines 400 --compile \
    --batch-sizes 1 16 64 --drafters none auto --max-batch-tokens 1024 --out docs/bench/corpus-multi30k-train
python scripts/corpus_bench.py --model $gec --input $data/gec_wi_locness/dev.src.gz --lines 400 --compile \
    --batch-sizes 1 16 64 --drafters none input_copy feature composite --max-batch-tokens 1024 --out docs/bench/corpus-wi-dev
# issue 63: Stern's combined scoring and proposal model (marian-base-en-de-stern: the base fine-tuned with 7 heads)
# against its own greedy, k = 2..8 from the same heads (Stern's Table 1 "Both" column and Figure 4: bench.md and
# bench.png), Multi30k test_2016 and Europarl validation at batch 1; the shipped base's heads and feature drafter
# with the heads' compiled drafting block
stern=hf_blockwise/pretrained/marian-base-en-de-stern
for set in multi30k europarl; do
    set_files $set
    sentences=100; [ $set = europarl ] && sentences=60
    hf-blockwise bench --model $stern --source-file $src --reference-file $ref --sentences $sentences \
        --batch-sizes 1 --threads 2 --modes greedy greedy_compiled heads_k2_compiled heads_k4_compiled \
        heads_k6_compiled heads_compiled oracle_k8_compiled --out docs/bench/marian-base-stern-$set-b1
done
# the shipped base's heads (four epochs on the frozen base, issue 63) and feature drafter, both sets
for set in multi30k europarl; do
    set_files $set
    sentences=100; [ $set = europarl ] && sentences=60
    hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences $sentences --batch-sizes 1 \
        --threads 2 --modes greedy greedy_compiled heads_compiled feature_compiled oracle_k4_compiled \
        --out docs/bench/marian-base-$set-heads-block-b1
done
# the same on captions with each generate's first decoder call compiled too (CompileOptions(compiled_prefill=True))
set_files multi30k
hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_compiled heads_compiled feature_compiled oracle_k4_compiled --compiled-prefill \
    --out docs/bench/marian-base-multi30k-heads-block-prefill-b1

# issue 63: heads trained to their ceiling on the frozen marian-base-en-de (k = 8, training/README.md's
# checkpoints/heads-frozen-k8, not shipped: put beside a copy of the base), k = 4 and k = 8 from the same heads
heads_copy=$(mktemp -d)
cp $base/config.json $base/generation_config.json $base/model.safetensors $base/tokenizer.json \
    $base/tokenizer_config.json $heads_copy/
python -c "
import sys, torch
from transformers import AutoModelForSeq2SeqLM
from hf_blockwise import BlockwiseHeadsModel
base = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1])
heads = BlockwiseHeadsModel.from_pretrained('checkpoints/heads-frozen-k8/final', base_model=base)
heads.save_pretrained(sys.argv[1], base_model_name_or_path='.', dtype=torch.float16)
" $heads_copy
set_files multi30k
hf-blockwise bench --model $heads_copy --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_compiled heads_k4_compiled heads_compiled \
    --out docs/bench/marian-base-frozen-heads-k8-multi30k-b1

# issue 65: int8 on the kernel's AVX2 path (a CPU without AVX-512 VNNI: the AMD EPYC Zen 3), against the float32
# engine in the same run
hf-blockwise bench --model $base --source-file $src --reference-file $ref --sentences 100 --batch-sizes 1 \
    --threads 2 --modes greedy greedy_compiled greedy_int8_compiled --out docs/bench/marian-base-avx2-int8-multi30k-b1

# issue 64: speed_up's first call (it compiles) and steady state, multi30k-en-de with its feature drafter
python scripts/speed_up_timing.py

# issue 64: hf-blockwise train on the first 300 lines of Europarl's English training text, 30 steps (the output line
# and train_summary.json into docs/bench/own-drafter-marian-base-300/)
zcat $data/europarl_de_en/train.en.gz | head -n 300 > /tmp/europarl_300.txt
hf-blockwise train feature-drafter --model $base --source-file /tmp/europarl_300.txt --out own-drafter --max-steps 30 \
    --threads 2 --no-progress | tee docs/bench/own-drafter-marian-base-300/report.txt
cp own-drafter/train_summary.json docs/bench/own-drafter-marian-base-300/
# issue 65: Ray Data (CorpusPredictor, 2 actors) against hf-blockwise generate on the same 1,000 lines, byte for byte
python scripts/ray_corpus_check.py --model $base --input $data/multi30k/test_2016_flickr.en.gz --lines 1000 \
    --batch-sizes 1 16 --out docs/bench/ray-corpus-multi30k

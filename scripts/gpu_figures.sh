#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md ("On a GPU"). Usage, from the repository root on a CUDA machine:
#   scripts/gpu_figures.sh check   OUT_DIR   # CUDA tests (greedy identity, seeded sampling, host syncs)
#   scripts/gpu_figures.sh curves  OUT_DIR   # latency curves and per-step time split, shipped pair and 1.1B inflated target
#   scripts/gpu_figures.sh calibrate OUT_DIR # opttree calibrate's budget x delta grid for the shipped pair
#   scripts/gpu_figures.sh bench   OUT_DIR   # HumanEval bench against transformers' peers (compiled included), TARGETS
#   scripts/gpu_figures.sh profile OUT_DIR   # per step: wall time, kernels, GPU busy; eager and compiled (CUDA graphs), 1B target
#   scripts/gpu_figures.sh compiled OUT_DIR  # HumanEval bench, --compile (target's and draft's steps in CUDA graphs) vs hf-compiled, 1B
#   scripts/gpu_figures.sh batch   OUT_DIR   # a batch of BATCH prompts against one at a time and transformers' batched generate, 1B
#   scripts/gpu_figures.sh defaults OUT_DIR  # no flags (first-use choices on this GPU), shipped pair
#   scripts/gpu_figures.sh serve   OUT_DIR   # opttree serve under 1, 8 and 32 clients, batched or not, 1B target;
#                                            # a join's cost, prefilled alone or riding a step (scripts/join_cost.py)
#   scripts/gpu_figures.sh long    OUT_DIR   # decoding by prompt length: the KV cache written in place vs concatenated
#   scripts/gpu_figures.sh all     OUT_DIR   # check, curves, calibrate, bench, in that order
#   scripts/gpu_figures.sh short   OUT_DIR   # check, profile, compiled: each under a time limit, for a 15-minute lease
#   scripts/gpu_figures.sh rows    OUT_DIR   # check, defaults at T=0 and T=1, compiled steps with the delta stop on the
#                                            # host and on the device, the 1B target at T=1: under time limits, one lease
#   scripts/gpu_figures.sh stops   OUT_DIR   # compiled HumanEval bench (8 prompts, 96 tokens), eager steps with either
#                                            # delta stop, the 1B target at T=1 (4 prompts): under time limits, 5.5 minutes
# Packages carried along in wheels/ (made here by scripts/gpu_wheels.sh) are installed first, without dependencies: *.whl with pip, *.tar.xz as an
# unpacked package put first on PYTHONPATH (the transformers this project needs, xz-compressed to 4 MB:
# a GPU host's image may have an older one). HUMANEVAL (default ../shared/data/humaneval.jsonl),
# LIMIT (prompts, default 20), TEMPERATURE (of `bench` and `defaults`, default 0), BUDGETS (16,64), TARGETS (1b shipped), BATCH (8), PROFILED (eager methods of
# `profile`), COMPILED (its compiled ones), METHODS (of `bench` and `compiled`) and MAX_NEW (of `compiled`) can be overridden.
set -euo pipefail
what=$1 out=$2
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
opttree() { python3 -m opttree.cli "$@"; }
humaneval=${HUMANEVAL:-../shared/data/humaneval.jsonl}
big=/tmp/opttree-target-1b
mkdir -p "$out"
if [ -z "${OPTTREE_WHEELS_IN:-}" ]; then  # once: the steps of `all` and `short` inherit it
    if compgen -G "wheels/*.whl" > /dev/null; then python3 -m pip install -q --no-deps wheels/*.whl; fi
    for package in wheels/*.tar.xz; do
        [ -e "$package" ] || continue
        mkdir -p /tmp/opttree-packages && tar xJf "$package" -C /tmp/opttree-packages
        export PYTHONPATH=/tmp/opttree-packages:$PYTHONPATH
    done
    export OPTTREE_WHEELS_IN=1
fi
shipped_target=$(opttree models --path target) shipped_draft=$(opttree models --path draft)  # unpacked once
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
inflated() {  # the shipped target widened to 2048 / 5632 and deepened to 22 layers: 1.1B parameters, same function
    # optional: a time limit in seconds (default none)
    [ -d $big ] || timeout "${1:-0}" python3 -m opttree.cli train inflate --target $shipped_target --out $big --device cuda
}
if [ "$what" = all ]; then
    for step in check curves calibrate bench; do bash "$0" $step "$out"; done
    exit 0
fi
if [ "$what" = rows ]; then  # the README's GPU rows (no flags, T=0 and T=1) and the open questions of the step
    # logs in OUT_DIR, each step's files in one archive (a lease brings back few files)
    files=/tmp/opttree-rows
    timeout 70 bash "$0" check $files 2>&1 | tee "$out/check.txt" || true
    LIMIT=${LIMIT:-10} timeout 110 bash "$0" defaults $files 2>&1 | tee "$out/defaults.txt" || true
    LIMIT=${LIMIT:-10} TEMPERATURE=1 timeout 70 bash "$0" defaults $files 2>&1 | tee "$out/defaults-t1.txt" || true
    (time inflated 90) > "$out/inflate.txt" 2>&1 || true
    PROFILED= COMPILED=${COMPILED:-ar,opt@16,opt@16!host,opt:recycling+lookup@16,opt:recycling+lookup@16!host} \
        timeout 140 bash "$0" profile $files 2>&1 | tee "$out/profile.txt" || true
    TARGETS=1b LIMIT=${LIMIT:-8} BUDGETS=16 TEMPERATURE=1 METHODS=ar,hf-ar,opt,opt:recycling+lookup \
        timeout 100 bash "$0" bench $files 2>&1 | tee "$out/bench-t1.txt" || true
    tar czf "$out/rows.tar.gz" -C $files . || true
    exit 0
fi
if [ "$what" = stops ]; then
    files=/tmp/opttree-stops
    (time inflated 60) > "$out/inflate.txt" 2>&1 || true
    BENCH_OUT=$files/compiled-1b LIMIT=8 BUDGETS=16 MAX_NEW=96 METHODS=ar,hf-compiled,opt,opt:recycling+lookup \
        timeout 170 bash "$0" compiled $files 2>&1 | tee "$out/compiled.txt" || true
    PROFILED=ar,opt@16,opt@16!device,opt:recycling+lookup@16,opt:recycling+lookup@16!device COMPILED= \
        timeout 50 bash "$0" profile $files 2>&1 | tee "$out/profile-eager.txt" || true
    TARGETS=1b LIMIT=4 BUDGETS=16 TEMPERATURE=1 METHODS=ar,hf-ar,opt,opt:recycling+lookup \
        timeout 75 bash "$0" bench $files 2>&1 | tee "$out/bench-t1.txt" || true
    tar czf "$out/stops.tar.gz" -C $files . || true
    exit 0
fi
if [ "$what" = short ]; then  # each step's output kept in OUT_DIR even when its time runs out
    timeout 90 bash "$0" check "$out" 2>&1 | tee "$out/check.txt" || true
    inflated > "$out/inflate.txt" 2>&1 || true
    PROFILED=${PROFILED:-ar} timeout 180 bash "$0" profile "$out" 2>&1 | tee "$out/profile.txt" || true
    # 96 new tokens: the first 8 prompts then fit few capacity buckets, so each step compiles once or twice
    BENCH_OUT=/tmp/opttree-compiled-1b LIMIT=${LIMIT:-8} BUDGETS=${BUDGETS:-16,64} MAX_NEW=${MAX_NEW:-96} \
        timeout 240 bash "$0" compiled "$out" 2>&1 \
        | tee "$out/compiled.txt" || true
    for f in results.json results.md; do cp /tmp/opttree-compiled-1b/$f "$out/compiled-$f" 2>/dev/null || true; done
    exit 0
fi
case $what in
check)
    # the CUDA cases only (the CPU ones run everywhere); serially where pytest-xdist is missing
    workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4" || echo "-o addopts=")
    python3 -m pytest -q -rs $workers --durations=5 tests/test_devices.py \
        -k "cuda or another_device or host_syncs or graph_captured" 2>&1 | tail -30
    ;;
curves)  # latency curves and the per-step time split (scripts/gpu_profile.py), both targets
    inflated
    python3 scripts/gpu_profile.py --target $shipped_target --draft $shipped_draft
    python3 scripts/gpu_profile.py --target $big --draft $shipped_draft
    ;;
long)  # scripts/long_prompts.py on the GPU, shipped pair
    python3 scripts/long_prompts.py --device cuda --prompts "$humaneval" --rounds 2 --per-length 2 | tee "$out/long.txt"
    ;;
calibrate)  # the full calibration grid of the shipped pair (~7 min on an H100)
    opttree calibrate --device cuda --dtype bfloat16 --max-tokens 256 --budgets 8,16,32,48,64,96 \
        --deltas 0.1,0.3,0.6 --out "$out/cal-shipped" --no-progress
    ;;
bench)
    inflated
    for name in ${TARGETS:-1b shipped}; do
        target=$([ "$name" = 1b ] && echo $big || echo $shipped_target)
        opttree bench --target $target --draft $shipped_draft --device cuda --dtype bfloat16 \
            --prompts "$humaneval" --limit "${LIMIT:-20}" \
            --methods ${METHODS:-ar,hf-ar,hf-compiled,hf-lookup,opt,opt:recycling+lookup} --temperature ${TEMPERATURE:-0} \
            --budgets ${BUDGETS:-16,64} --delta 0.3 --max-new-tokens 128 --out "$out/bench-$name-t${TEMPERATURE:-0}" \
            --no-progress
    done
    ;;
profile)
    inflated
    python3 scripts/gpu_step_profile.py --target $big --draft $shipped_draft \
        --methods "${PROFILED-ar,opt@16,opt@64,opt:recycling+lookup@16,opt:recycling+lookup@64}" \
        --compiled "${COMPILED:-ar,opt@64,opt@64!host,opt:recycling+lookup@16,opt:recycling+lookup@16!host,opt@16,opt@16!host}"
    ;;
compiled)  # opttree's --compile: the target's and the draft's fixed-shape steps, CUDA graphs
    inflated
    opttree bench --target $big --draft $shipped_draft --device cuda --dtype bfloat16 --compile \
        --prompts "$humaneval" --limit "${LIMIT:-20}" --methods "${METHODS:-ar,hf-compiled,opt,opt:recycling+lookup}" \
        --budgets ${BUDGETS:-16,64} --delta 0.3 --max-new-tokens "${MAX_NEW:-128}" --out "${BENCH_OUT:-$out/compiled-1b}" \
        --no-progress
    ;;
batch)
    inflated
    opttree bench --target $big --draft $shipped_draft --device cuda --dtype bfloat16 --prompts "$humaneval" \
        --limit "${BATCH:-8}" --batch "${BATCH:-8}" --methods ar,hf-ar,opt,opt:recycling+lookup --budgets 16 \
        --delta 0.3 --max-new-tokens 128 --out "$out/batch-1b" --no-progress
    ;;
serve)
    inflated
    python3 scripts/serve_throughput.py --target $big --draft $shipped_draft --device cuda --dtype bfloat16 \
        --prompts "$humaneval" --limit 32 --max-tokens 128 --clients 1,8,32 --batches 1,32 \
        --batch-budgets off,sized,auto --rounds 1 | tee "$out/serve.txt"
    python3 scripts/join_cost.py --target $big --device cuda --budget 16 --joins 16 | tee "$out/join.txt"
    ;;
defaults)  # what a user gets with no flags: the first-use choices made on this GPU (an empty cache)
    OPTTREE_CACHE_DIR=/tmp/opttree-empty-cache opttree bench --device cuda --prompts "$humaneval" \
        --limit "${LIMIT:-20}" --methods ar,opt,hf-ar,hf-lookup --temperature ${TEMPERATURE:-0} \
        --out "$out/defaults-t${TEMPERATURE:-0}" --no-progress
    ;;
esac

#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md ("On a GPU"). Usage, from the repository root on a CUDA machine:
#   scripts/gpu_figures.sh check   OUT_DIR   # CUDA tests (greedy identity, seeded sampling, host syncs)
#   scripts/gpu_figures.sh curves  OUT_DIR   # latency curves and per-step time split, shipped pair and 1.1B inflated target
#   scripts/gpu_figures.sh calibrate OUT_DIR # opttree calibrate's budget x delta grid for the shipped pair
#   scripts/gpu_figures.sh bench   OUT_DIR   # HumanEval bench against transformers' peers, both targets
#   scripts/gpu_figures.sh all     OUT_DIR   # all of the above, in that order
# Wheels carried along in wheels/ (e.g. the transformers this project pins) are installed first, without
# dependencies: a GPU host's image may have an older transformers.
# HUMANEVAL (default ../shared/data/humaneval.jsonl), LIMIT (prompts, default 20) and BUDGETS (16,64) can be overridden.
set -euo pipefail
what=$1 out=$2
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
opttree() { python3 -m opttree.cli "$@"; }
humaneval=${HUMANEVAL:-../shared/data/humaneval.jsonl}
big=/tmp/opttree-target-1b
mkdir -p "$out"
if compgen -G "wheels/*.whl" > /dev/null; then python3 -m pip install -q --no-deps wheels/*.whl; fi
shipped_target=$(opttree models --path target) shipped_draft=$(opttree models --path draft)  # unpacked once
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
inflated() {  # the shipped target widened to 2048 / 5632 and deepened to 22 layers: 1.1B parameters, same function
    [ -d $big ] || opttree train inflate --target $shipped_target --out $big --device cuda
}
if [ "$what" = all ]; then
    for step in check curves calibrate bench; do "$0" $step "$out"; done
    exit 0
fi
case $what in
check)
    python3 -m pytest -q -rs -s tests/test_devices.py 2>&1 | tail -25
    ;;
curves)  # latency curves and the per-step time split (scripts/gpu_profile.py), both targets
    inflated
    python3 scripts/gpu_profile.py --target $shipped_target --draft $shipped_draft
    python3 scripts/gpu_profile.py --target $big --draft $shipped_draft
    ;;
calibrate)  # the full calibration grid of the shipped pair (~7 min on an H100)
    opttree calibrate --device cuda --dtype bfloat16 --max-tokens 256 --budgets 8,16,32,48,64,96 \
        --deltas 0.1,0.3,0.6 --out "$out/cal-shipped" --no-progress
    ;;
bench)
    inflated
    for target in $big $shipped_target; do
        name=$([ "$target" = $big ] && echo 1b || echo shipped)
        opttree bench --target $target --draft $shipped_draft --device cuda --dtype bfloat16 \
            --prompts "$humaneval" --limit "${LIMIT:-20}" --methods ar,opt,hf-assisted,hf-lookup \
            --budgets ${BUDGETS:-16,64} --delta 0.3 --max-new-tokens 128 --out /tmp/bench-$name --no-progress
        mkdir -p "$out/bench-$name"; cp /tmp/bench-$name/{results.md,results.json} "$out/bench-$name/"
    done
    ;;
esac

#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md ("On a GPU"). Usage, from the repository root on a CUDA machine:
#   scripts/gpu_figures.sh check   OUT_DIR   # CUDA tests (greedy identity, seeded sampling, host syncs)
#   scripts/gpu_figures.sh curves  OUT_DIR   # calibrate: latency curves and budgets, shipped pair and 1.1B inflated target
#   scripts/gpu_figures.sh bench   OUT_DIR   # HumanEval bench against transformers' peers, both targets
# HUMANEVAL (default ../shared/data/humaneval.jsonl) and LIMIT (prompts, default 40) can be overridden.
set -euo pipefail
what=$1 out=$2
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
opttree() { python3 -m opttree.cli "$@"; }
humaneval=${HUMANEVAL:-../shared/data/humaneval.jsonl}
big=/tmp/opttree-target-1b
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
inflated() {  # the shipped target widened to 2048 / 5632 and deepened to 22 layers: 1.1B parameters, same function
    [ -d $big ] || opttree train inflate --target src/opttree/models/target --out $big --device cuda
}
case $what in
check)
    python3 -m pytest -q -rs -s tests/test_devices.py 2>&1 | tail -25
    ;;
curves)
    opttree calibrate --device cuda --dtype bfloat16 --max-tokens 256 --budgets 8,16,32,48,64,96 \
        --deltas 0.1,0.3,0.6 --out /tmp/cal-shipped --no-progress
    inflated
    opttree calibrate --target $big --draft src/opttree/models/draft --device cuda --dtype bfloat16 \
        --max-tokens 256 --budgets 8,16,32,48,64,96 --deltas 0.1,0.3,0.6 --out /tmp/cal-1b --no-progress
    for run in shipped 1b; do
        mkdir -p "$out/cal-$run"; cp /tmp/cal-$run/{calibration.md,latency.png,profile.json} "$out/cal-$run/"
    done
    ;;
bench)
    inflated
    for target in src/opttree/models/target $big; do
        name=$([ $target = $big ] && echo 1b || echo shipped)
        opttree bench --target $target --draft src/opttree/models/draft --device cuda --dtype bfloat16 \
            --prompts "$humaneval" --limit "${LIMIT:-40}" --methods ar,opt,chain,hf-assisted,hf-lookup \
            --budgets 16,32,64 --delta 0.3 --max-new-tokens 128 --out /tmp/bench-$name --no-progress
        mkdir -p "$out/bench-$name"; cp /tmp/bench-$name/{results.md,results.json} "$out/bench-$name/"
    done
    ;;
esac

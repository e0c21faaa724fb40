#!/usr/bin/env bash
# The time per step of a target sharded over 2 ranks (torchrun, gloo, 1 thread each) against the same
# target unsharded (1 process, 2 threads), on the same prompts and methods. The two layouts cannot run
# in one process, so they alternate, ROUNDS times each (ABAB...), and the table gives every round.
# Usage: scripts/tp_timing.sh [PROMPTS] (default: examples/humaneval-10.jsonl); OUT=DIR ROUNDS=N LIMIT=N
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-examples/humaneval-10.jsonl}
OUT=${OUT:-runs/tp-timing}
ROUNDS=${ROUNDS:-2}
COMMON=(--prompts "$PROMPTS" --limit "${LIMIT:-5}" --methods ar,opt,opt:recycling+lookup --budgets 8
        --dtype float32 --max-new-tokens 64 --no-progress)
export OPTTREE_AUTO_CALIBRATE=0
mkdir -p "$OUT"; : > "$OUT.log"
for round in $(seq "$ROUNDS"); do
  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 -m opttree bench --tp \
    "${COMMON[@]}" --out "$OUT/sharded-$round" > /dev/null 2>>"$OUT.log" || { tail -20 "$OUT.log"; exit 1; }
  OMP_NUM_THREADS=2 python -m opttree bench "${COMMON[@]}" --out "$OUT/whole-$round" > /dev/null 2>>"$OUT.log"
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
print("| layout | round | method | tokens/s | MAL | draft ms / step | verify ms / step | speedup over its ar |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for layout, name in (("sharded", "2 ranks x 1 thread (--tp)"), ("whole", "1 process x 2 threads")):
    for r in range(1, rounds + 1):
        results = json.loads((out / f"{layout}-{r}" / "results.json").read_text())
        for row in (x for x in results["summary"] if x["category"] == "all"):
            print(f"| {name} | {r} | {row['label']} | {row['tokens_per_second']:.1f} | {row['mean_accepted_length']:.2f} "
                  f"| {row['draft_ms_per_step'] or 0:.1f} | {row['verify_ms_per_step'] or 0:.1f} | {row['speedup']:.2f}x |")
print(f"\n{results['meta']['machine']}, {results['meta']['date']}")
PY

#!/usr/bin/env bash
# One grid, two executors, on this machine's GPU(s), in one call (BENCHMARKS.md, "Grids"):
#   bash bench/grid_pool_gpu.sh OUT_DIR OLD_GRID_PY [GRID.json] [K]
# A: OLD_GRID_PY (opsd/research/grid.py of a commit before the GPU pool: every cell a thread of one
#    process, no GPU assignment) with --parallel K;
# B: this checkout's opsd.research.grid, its GPU pool with --cells-per-gpu K (each cell its own
#    CUDA_VISIBLE_DEVICES slot).
# Same cells (default grids/quickstart_gpu.json, K = 3), each in its own folder; prints the wall
# time of each and whether results.json and every cell's eval.json agree, and keeps the logs.
# ARMS="a" or ARMS="b" runs one of them (two device calls back to back: /tmp keeps grid A's folder
# between them); the comparison runs once both folders exist. Everything stops by END_S seconds
# after the start (default 570).
set -uo pipefail
OUT_DIR=${1:?usage: grid_pool_gpu.sh OUT_DIR OLD_GRID_PY [GRID.json] [K]}
OLD=${2:?the opsd/research/grid.py to compare with}
GRID=${3:-grids/quickstart_gpu.json}
K=${4:-3}
END_S=${END_S:-570}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
ARMS=${ARMS:-a b}
if [[ " $ARMS " == *" a "* ]]; then
  rm -rf /tmp/grid_a
  start=$SECONDS
  timeout $((END_S - SECONDS)) python3 "$OLD" "$GRID" --out /tmp/grid_a --parallel "$K" > "$OUT_DIR/grid_a.log" 2>&1
  echo "A (old executor, --parallel $K) exit $? in $((SECONDS - start)) s" | tee -a /tmp/grid_pool_summary.txt
fi
if [[ " $ARMS " == *" b "* ]]; then
  rm -rf /tmp/grid_b
  start=$SECONDS
  timeout $((END_S - SECONDS)) python3 -m opsd.research.grid "$GRID" --out /tmp/grid_b --cells-per-gpu "$K" \
    > "$OUT_DIR/grid_b.log" 2>&1
  echo "B (GPU pool, --cells-per-gpu $K) exit $? in $((SECONDS - start)) s" | tee -a /tmp/grid_pool_summary.txt
  grep -E "GPU pool|on GPU" "$OUT_DIR/grid_b.log" | head -8 | tee -a /tmp/grid_pool_summary.txt
fi
cp /tmp/grid_pool_summary.txt "$OUT_DIR/summary.txt"
[[ -f /tmp/grid_a/results.json && -f /tmp/grid_b/results.json ]] || exit 0
python3 - <<'PY' | tee -a "$OUT_DIR/summary.txt"
import json, sys
from pathlib import Path
a, b = Path("/tmp/grid_a"), Path("/tmp/grid_b")
ra, rb = (json.loads((p / "results.json").read_text()) for p in (a, b))
rb.pop("missing", None)
print("results.json:", "identical" if ra == rb else "DIFFERENT")
for name, arm in rb["arms"].items():
    print(f"  {name}: A {ra['arms'][name].get('per_run')} B {arm.get('per_run')}")
for report in sorted(a.rglob("eval.json")):
    other = b / report.relative_to(a)
    same = json.loads(report.read_text())["problems"] == json.loads(other.read_text())["problems"]
    print(f"  {report.relative_to(a)}: completions {'identical' if same else 'differ'}")
PY

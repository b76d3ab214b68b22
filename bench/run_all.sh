#!/usr/bin/env bash
# Every benchmark of BENCHMARKS.md in one go (one GPU-machine call):
#   bash bench/run_all.sh [OUT_DIR]        # GPU: Qwen3-1.7B shape
#   bash bench/run_all.sh /tmp/b --tiny    # CPU smoke run of the same scripts
# Logs and JSON land in OUT_DIR (default $OUT, else /tmp/opsd_bench); the two
# reports are printed last. Wheels in .whl/ (trl, datasets, ... for a machine
# without them) are installed into /tmp/site first.
set -uo pipefail
OUT_DIR=${1:-${OUT:-/tmp/opsd_bench}}
shift || true
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
timeout "${STEP_TIMEOUT:-280}" python3 bench/bench_step.py --json "$OUT_DIR/step.json" ${STEP_ARGS:-} "$@" > "$OUT_DIR/step.log" 2>&1
echo "bench_step exit $?" | tee -a "$OUT_DIR/step.log"
timeout "${ROLLOUT_TIMEOUT:-290}" python3 bench/bench_rollout.py --json "$OUT_DIR/rollout.json" ${ROLLOUT_ARGS:-} "$@" > "$OUT_DIR/rollout.log" 2>&1
echo "bench_rollout exit $?" | tee -a "$OUT_DIR/rollout.log"
grep -E "^\[(check|step|rollout|chunk|bench_step\] budget|bench_rollout\] budget)" "$OUT_DIR/step.log" "$OUT_DIR/rollout.log" | cut -c1-400
python3 - "$OUT_DIR" <<'PY'
import json, sys, pathlib
for name in ("step.json", "rollout.json"):
    path = pathlib.Path(sys.argv[1]) / name
    if path.exists():
        data = json.loads(path.read_text())
        print("\n" + data.get("report", f"({name}: no final report; see the log)"))
PY

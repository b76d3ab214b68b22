#!/usr/bin/env bash
# Rollout engine measurements in one GPU-machine call (BENCHMARKS.md section 2 and 3):
#   bash bench/rollout_gpu.sh OUT_DIR
# 1. bench_rollout.py on the Qwen3-1.7B shape, 32 prompts x 1024 new tokens, recipe sampling:
#    ROLLOUT_CONFIGS (default: the previous default graph_compiled+fullkv, the KV windows
#    unmerged, the KV windows + merged LoRA = the trainer default now), each with the
#    engine-vs-trainer log-probability check and a profile of PROFILE_STEPS decode steps;
# 2. bench_capped.py: CAPPED_STEPS optimizer steps of opsd_train.py (shipped defaults).
# Wheels in .whl/ are installed into /tmp/site first (BENCHMARKS.md says how to fetch them).
set -uo pipefail
OUT_DIR=${1:?usage: rollout_gpu.sh OUT_DIR}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
CONFIGS=${ROLLOUT_CONFIGS:-graph_compiled+fullkv,graph_compiled,graph_compiled+merged}
timeout "${ROLLOUT_TIMEOUT:-330}" python3 bench/bench_rollout.py --json "$OUT_DIR/rollout.json" --configs "$CONFIGS" \
  --profile-steps "${PROFILE_STEPS:-5}" --budget-s "${ROLLOUT_BUDGET_S:-280}" ${ROLLOUT_ARGS:-} > "$OUT_DIR/rollout.log" 2>&1
echo "bench_rollout exit $?" | tee -a "$OUT_DIR/rollout.log"
if [[ "${CAPPED_STEPS:-10}" -gt 0 ]]; then
  timeout "${CAPPED_TIMEOUT:-250}" python3 bench/bench_capped.py --json "$OUT_DIR/capped.json" --steps "${CAPPED_STEPS:-10}" \
    --micro-batches 4 --timeout-s "$(( ${CAPPED_TIMEOUT:-250} - 10 ))" > "$OUT_DIR/capped.log" 2>&1
  echo "bench_capped exit $?" | tee -a "$OUT_DIR/capped.log"
fi
grep -E "^\[(check|rollout|profile|capped)\]" "$OUT_DIR/rollout.log" "$OUT_DIR/capped.log" 2>/dev/null | cut -c1-300
python3 - "$OUT_DIR" <<'PY'
import json, sys, pathlib
for name in ("rollout.json", "capped.json"):
    path = pathlib.Path(sys.argv[1]) / name
    if path.exists():
        print("\n" + json.loads(path.read_text()).get("report", f"({name}: no final report; see the log)"))
PY

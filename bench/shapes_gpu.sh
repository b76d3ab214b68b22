#!/usr/bin/env bash
# One model shape on one GPU machine, in one call (BENCHMARKS.md "shape x engine"):
#   bash bench/shapes_gpu.sh OUT_DIR SHAPE [PARTS]     # SHAPE: qwen3-1.7b, qwen3-4b, qwen3-8b
# PARTS (default rollout,vllm,capped), in this order:
#   rollout  bench/bench_rollout.py: the own engine as the trainer runs it ($M), its checks (greedy
#            against transformers' generate, the sampled tokens' log-probabilities against the
#            trainer's forward, the teacher's weights bit-identical) and 32 x 1024 tokens/s;
#   vllm     bench/bench_vllm.py: vLLM at the same shape, 32 x 1024 (skipped without vLLM);
#   capped   bench/bench_capped.py: $STEPS (default 11) optimizer steps of opsd_train.py's
#            defaults at micro-batch $MB (default 4), GPU memory of all processes.
# CHECKS=0 skips the rollout part's checks (--skip-checks). Each part has a time limit (ROLLOUT_S, VLLM_S, CAPPED_S); OUT_DIR gets SHAPE_{rollout,vllm,capped}.json
# and their logs, and the reports are printed last.
set -uo pipefail
OUT_DIR=${1:?usage: shapes_gpu.sh OUT_DIR SHAPE [PARTS]}
SHAPE=${2:?usage: shapes_gpu.sh OUT_DIR SHAPE [PARTS]}
PARTS=${3:-rollout,vllm,capped}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
M=graph_compiled+merged
part() { [[ ",$PARTS," == *",$1,"* ]]; }
if part rollout; then
  timeout "${ROLLOUT_S:-240}" python3 bench/bench_rollout.py --shape "$SHAPE" --configs "$M" --repeats 2 \
    $([[ "${CHECKS:-1}" == 0 ]] && echo --skip-checks) \
    --json "$OUT_DIR/${SHAPE}_rollout.json" > "$OUT_DIR/${SHAPE}_rollout.log" 2>&1
  echo "rollout exit $?" >> "$OUT_DIR/${SHAPE}_rollout.log"
fi
if part vllm && python3 -c "import vllm" 2> /dev/null; then
  timeout "${VLLM_S:-180}" python3 bench/bench_vllm.py --shape "$SHAPE" --json "$OUT_DIR/${SHAPE}_vllm.json" \
    > "$OUT_DIR/${SHAPE}_vllm.log" 2>&1
  echo "vllm exit $?" >> "$OUT_DIR/${SHAPE}_vllm.log"
fi
if part capped; then
  timeout "${CAPPED_S:-330}" python3 bench/bench_capped.py --shape "$SHAPE" --micro-batches "${MB:-4}" \
    --steps "${STEPS:-11}" --timeout-s $(( ${CAPPED_S:-330} - 60 )) --json "$OUT_DIR/${SHAPE}_capped.json" \
    > "$OUT_DIR/${SHAPE}_capped.out" 2>&1
  echo "capped exit $?" >> "$OUT_DIR/${SHAPE}_capped.out"
fi
for f in "$OUT_DIR/${SHAPE}_rollout.log" "$OUT_DIR/${SHAPE}_vllm.log" "$OUT_DIR/${SHAPE}_capped.out"; do
  [[ -f "$f" ]] || continue
  echo "== $(basename "$f")"
  grep -E "^\[check\]|^\| |^check |^- |exit [0-9]|Error|error:" "$f" | tail -n 30
done

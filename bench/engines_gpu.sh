#!/usr/bin/env bash
# The rollout engines side by side on one GPU machine, in one call (BENCHMARKS.md, docs/ENGINE.md):
#   bash bench/engines_gpu.sh OUT_DIR [SHAPE]        # SHAPE: qwen3-1.7b (default), qwen3-4b, qwen3-8b
# the capped step (bench/bench_capped.py: one random-init model of SHAPE, micro-batch $MB x
# accumulation, 32 x 1024 sampled tokens a step, $STEPS optimizer steps) with the own engine,
# with vLLM colocate, and with vLLM colocate in sleep mode (its weights and KV cache released
# while the trainer runs), one after the other in this order; each run's GPU memory (all
# processes) is recorded. Needs vLLM importable (0.26.0 with torch 2.11 was run).
set -uo pipefail
OUT_DIR=${1:?usage: engines_gpu.sh OUT_DIR [SHAPE]}
SHAPE=${2:-qwen3-1.7b}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
python3 -c "import vllm, torch, transformers, trl; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT_DIR/machine.txt"
vllm="--use_vllm true --vllm_mode colocate"
python3 bench/bench_capped.py --shape "$SHAPE" --micro-batches "${MB:-4}" --steps "${STEPS:-11}" --timeout-s 280 \
  --trainer-args "" --trainer-args "$vllm" --trainer-args "$vllm --vllm_enable_sleep_mode true" \
  --json "$OUT_DIR/capped.json"

#!/usr/bin/env bash
# vLLM server mode with the server and the trainer on ONE GPU (docs/MULTI_GPU.md "server mode"):
#   bash bench/vllm_server_gpu.sh OUT_DIR
# 1. TRL's server (`trl vllm-serve`, i.e. python -m trl.scripts.vllm_serve, which runs vLLM's own
#    `vllm serve` with TRL's weight-transfer settings) on the learned tiny default, GPU share
#    $SERVER_SHARE (default 0.3), port $PORT (default 8000); waits for /health;
# 2. opsd_train.py on the same GPU in server mode, what train_capped.sh runs with
#    OPSD_VLLM_MODE=server OPSD_VLLM_SERVER_GPU=none, for 3 steps of batch 8 (tiny model and data);
# 3. the outcome: the trainer's exit status, its last lines and the server's errors.
# Needs vLLM with its server's dependencies (uvicorn, watchfiles, prometheus-fastapi-instrumentator,
# model-hosting-container-standards: a full `pip install vllm` has them) and TRL.
# Run 2026-12-03 (vLLM 0.26.0, TRL 1.16.0, one H200): the server came up, the trainer connected, and
# the server's weight-transfer set-up failed ("NCCL error: invalid usage"); the trainer waited.
set -uo pipefail
OUT_DIR=${1:?usage: vllm_server_gpu.sh OUT_DIR}
PORT=${PORT:-8000}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
model=$(python3 -c "from opsd import tiny_default; print(tiny_default.resolve_model('tiny'))")
work=runs/vllm_server
rm -rf "$work"; mkdir -p "$work"

python3 -m trl.scripts.vllm_serve --model "$model" --gpu_memory_utilization "${SERVER_SHARE:-0.3}" \
  --port "$PORT" > "$OUT_DIR/server.log" 2>&1 &
server=$!
up=0
for _ in $(seq 1 150); do  # up to 300 s
  if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2> /dev/null; then
    up=1; break
  fi
  kill -0 "$server" 2> /dev/null || break
  sleep 2
done
echo "server up: $up after ${SECONDS} s" | tee "$OUT_DIR/outcome.txt"
if (( up )); then
  timeout "${TRAIN_TIMEOUT:-200}" python3 opsd_train.py --model_name_or_path "$model" --dataset_name tiny \
    --output_dir "$work/run" --max_steps 3 --per_device_train_batch_size 8 --gradient_accumulation_steps 1 \
    --max_completion_length 64 --logging_steps 1 --save_strategy no --report_to none \
    --use_vllm true --vllm_mode server --vllm_server_base_url "http://127.0.0.1:$PORT" \
    > "$OUT_DIR/train.log" 2>&1
  echo "trainer exit $?" | tee -a "$OUT_DIR/outcome.txt"
fi
kill "$server" 2> /dev/null; wait "$server" 2> /dev/null
{ echo "== trainer, last lines"; tail -n 25 "$OUT_DIR/train.log" 2> /dev/null
  echo "== trainer, errors"; grep -n -i -E "error|nccl|duplicate|Traceback" "$OUT_DIR/train.log" 2> /dev/null | head -20
  echo "== server, errors"; grep -n -i -E "error|nccl|duplicate|Traceback" "$OUT_DIR/server.log" | head -20
} | tee -a "$OUT_DIR/outcome.txt"

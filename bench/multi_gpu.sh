#!/usr/bin/env bash
# The capped training step on one GPU, with DDP and with FSDP2, side by side (README, "More than
# one GPU"). Needs a machine with 2 GPUs; nothing outside it (a random-init Qwen3-1.7B-shaped
# model and the embedded `tiny` data, as bench/bench_capped.py).
#
#   bash bench/multi_gpu.sh OUT_DIR [--arms single,ddp,fsdp2] [--steps 8] [--completion 1024] [--dry-run]
#
# Each arm runs opsd_train.py for --steps optimizer steps with train_capped.sh's budget (global
# batch 32 = 4 per device x accumulation x processes, recipe.env) and transformers rollouts
# (vLLM off): `single` on GPU 0 without a launcher; any other arm is an OPSD_ACCELERATE_CONFIG
# name (ddp, fsdp2, zero2, zero3) launched by accelerate on GPUs 0,1. Per arm, OUT_DIR/ARM/ gets
# train.log (every line stamped with seconds since the start; TORCH_LOGS=recompiles), gpu_mem.csv
# (nvidia-smi every 0.5 s), metrics.jsonl, run_config.json and cmd.txt; after every call
# OUT_DIR/table.md (step time: median of steps 4..N, each timed from the previous step's line;
# peak memory per GPU; recompilations; loss and true KL per step side by side) covers every arm
# in OUT_DIR, so arms can be run in separate calls into one OUT_DIR.
# Budget: one call is at most ARM_TIMEOUT seconds per arm (default 540). FSDP2 rolls out with
# `generate` (the engine default: no CUDA-graph loop over sharded weights), which gathers every
# layer for every token: expect it to be the slow arm; --completion 256 keeps all three in one call.
# --dry-run prints what would run (no GPU needed). The model is written once to MODEL_DIR
# (default /tmp/opsd_multi_gpu_model), run folders go to RUN_DIR (default /tmp/opsd_multi_gpu_runs):
# neither belongs in OUT_DIR.
set -uo pipefail
repo="$(cd "$(dirname "$(realpath -- "${BASH_SOURCE[0]}")")/.." && pwd)"
usage="usage: bash bench/multi_gpu.sh OUT_DIR [--arms single,ddp,fsdp2] [--steps N>=8] [--completion N] [--dry-run]"

out="" arms="single,ddp,fsdp2" steps=8 completion=1024 dry_run=0
while (( $# )); do
  case "$1" in
    --arms) arms="${2:-}"; shift 2 || { echo "error: --arms needs a value; $usage" >&2; exit 2; } ;;
    --steps) steps="${2:-}"; shift 2 || { echo "error: --steps needs a value; $usage" >&2; exit 2; } ;;
    --completion) completion="${2:-}"; shift 2 || { echo "error: --completion needs a value; $usage" >&2; exit 2; } ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1; $usage" >&2; exit 2 ;;
    *) if [[ -n "$out" ]]; then echo "error: one OUT_DIR only (got $out and $1); $usage" >&2; exit 2; fi
       out="$1"; shift ;;
  esac
done
[[ -n "$out" ]] || { echo "error: OUT_DIR is missing; $usage" >&2; exit 2; }
# Steady state: steps 4..N (the first ones compile), at least 5 of them.
[[ "$steps" =~ ^[0-9]+$ ]] && (( steps >= 8 )) || { echo "error: --steps must be an integer >= 8, got '$steps'" >&2; exit 2; }
[[ "$completion" =~ ^[1-9][0-9]*$ ]] && (( completion <= 4096 )) \
  || { echo "error: --completion must be an integer in [1, 4096], got '$completion'" >&2; exit 2; }
IFS=, read -ra arm_list <<< "${arms// /}"
(( ${#arm_list[@]} )) || { echo "error: --arms is empty; $usage" >&2; exit 2; }
engines=$(cd "$repo" && python3 -c 'from opsd import config; print(" ".join(config.ACCELERATE_CONFIGS))')
declare -A engine_config=()
for arm in "${arm_list[@]}"; do
  [[ -z "${engine_config[$arm]+x}" ]] || { echo "error: --arms names $arm twice" >&2; exit 2; }
  if [[ "$arm" == single ]]; then
    engine_config[$arm]=""
  elif [[ " $engines " == *" $arm "* ]]; then
    engine_config[$arm]=$(python3 -m opsd.config accelerate-config "$arm") || exit 2
  else
    echo "error: --arms: '$arm' is not an arm; expected single or an engine: ${engines// /, }" >&2
    exit 2
  fi
done

model_dir="${MODEL_DIR:-/tmp/opsd_multi_gpu_model}"
run_root="${RUN_DIR:-/tmp/opsd_multi_gpu_runs}"
per_device=4
arm_command() {  # the command of one arm, one word per line
  local arm="$1" processes=2 gpus=0,1
  [[ "$arm" == single ]] && processes=1 gpus=0
  local accumulation=$((32 / (per_device * processes)))
  echo "env"; echo "CUDA_VISIBLE_DEVICES=$gpus"; echo "TORCH_LOGS=recompiles"
  if [[ "$arm" == single ]]; then
    echo "ACCELERATE_MIXED_PRECISION=no"; echo "ACCELERATE_DYNAMO_BACKEND=NO"; echo "python3"
  else
    printf '%s\n' accelerate launch --config_file "${engine_config[$arm]}" --num_processes "$processes" --num_machines 1
  fi
  printf '%s\n' "$repo/opsd_train.py" --model_name_or_path "$model_dir" --dataset_name tiny \
    --recipe "$repo/recipe.env" --output_dir "$run_root/$arm" --max_steps "$steps" \
    --per_device_train_batch_size "$per_device" --gradient_accumulation_steps "$accumulation" \
    --max_completion_length "$completion" --save_strategy no --logging_steps 1 --report_to none --resume false
}

if (( dry_run )); then
  mkdir -p "$out"
  for arm in "${arm_list[@]}"; do
    mapfile -t cmd < <(arm_command "$arm")
    echo "[plan] $arm: ${cmd[*]}"
  done | tee "$out/plan.txt"
  exit 0
fi

gpu_count=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
for arm in "${arm_list[@]}"; do
  need=2; [[ "$arm" == single ]] && need=1
  (( gpu_count >= need )) || { echo "error: arm $arm needs $need GPU(s), nvidia-smi lists $gpu_count" >&2; exit 2; }
done

mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
(nvidia-smi -L; date -u; python3 -c "import torch, transformers, accelerate, trl, peft
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'trl', trl.__version__, 'peft', peft.__version__)") > "$out/machine.txt" 2>&1
if [[ ! -f "$model_dir/config.json" ]]; then
  echo "[multi_gpu] writing a random-init Qwen3-1.7B-shaped model to $model_dir"
  python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '$repo/bench'); import bench_capped
bench_capped.write_random_model(Path('$model_dir'), 'qwen3-1.7b')" || { echo "error: could not write the model" >&2; exit 1; }
fi

for arm in "${arm_list[@]}"; do
  dir="$out/$arm"
  rm -rf "$dir" "$run_root/$arm"
  mkdir -p "$dir"
  mapfile -t cmd < <(arm_command "$arm")
  echo "${cmd[*]}" > "$dir/cmd.txt"
  echo "[multi_gpu] $arm: ${cmd[*]}"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$dir/gpu_mem.csv" 2>&1 &
  monitor=$!
  (cd "$repo" && timeout --signal=TERM --kill-after=30 "${ARM_TIMEOUT:-540}" "${cmd[@]}") 2>&1 \
    | python3 "$repo/bench/multi_gpu_report.py" stamp > "$dir/train.log"
  rc=${PIPESTATUS[0]}
  kill "$monitor" 2> /dev/null; wait "$monitor" 2> /dev/null
  echo "$rc" > "$dir/rc"
  cp "$run_root/$arm/metrics.jsonl" "$run_root/$arm/run_config.json" "$dir/" 2> /dev/null
  echo "[multi_gpu] $arm: exit $rc; $(grep -c '\[OPSD kl\] step=' "$dir/train.log") steps logged"
done
python3 "$repo/bench/multi_gpu_report.py" report "$out"

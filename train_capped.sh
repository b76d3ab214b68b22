#!/usr/bin/env bash
# OPSD capped run: 100 optimizer steps at global batch 32, LoRA, then checkpoint-100.
#
#   bash train_capped.sh [RECIPE_FILE]            # default recipe.env: released recipe + cosine LR
#   bash train_capped.sh recipe.released.env      # the released recipe (constant LR)
#
# Environment:
#   OPSD_MODEL          model (hub id or local folder), default Qwen/Qwen3-1.7B
#   OPSD_DATA           training data (HF name, .json/.jsonl/.parquet), default the released set
#   OPSD_OUTPUT         run folder, default <repo>/outputs/opsd-capped (tiny: <repo>/outputs/opsd-tiny)
#   OPSD_NUM_PROCESSES  processes, one per GPU, default = visible GPUs (1 without GPUs); fewer than
#                       the visible GPUs train on the first ones (CUDA_VISIBLE_DEVICES is narrowed)
#   OPSD_MAIN_PORT      across nodes (`srun`, one task a node: slurm/train_capped.sbatch): the main
#                       process's port, default 29500 + SLURM job id % 2000; each node is one machine
#   OPSD_ACCELERATE_CONFIG  the multi-GPU engine: ddp (default), fsdp2, zero2, zero3, or the path of
#                       an accelerate config file (`python -m opsd.config accelerate-config -h`)
#   OPSD_PER_DEVICE_BATCH  micro-batch per process, default 4; accumulation fills up to 32
#   OPSD_TOKEN_MEAN_ROWS  rows per token mean, a divisor of the micro-batch, default the micro-batch;
#                       OPSD_PER_DEVICE_BATCH=16 OPSD_TOKEN_MEAN_ROWS=4 is the default's loss in fewer,
#                       larger forwards (faster on a GPU, more memory)
#   OPSD_USE_VLLM       0 (default) = the project's own rollout engine, 1 = vLLM rollouts; the own
#                       engine is faster and leaner on one GPU (README "Real runs: which engine")
#   OPSD_VLLM_MODE      with vLLM: colocate (default: vLLM shares the training GPUs) or server (a separate
#                       `trl vllm-serve --model $OPSD_MODEL` must already be running); set, it means vLLM
#   OPSD_VLLM_SERVER_GPU  server mode: the GPU id(s) running the server, comma-separated, default 0;
#                       training uses the other visible GPUs (none: the server runs elsewhere)
#   OPSD_PRESET=tiny    embedded tiny model + generated data, CPU budget (8 steps x batch 4);
#                       OPSD_MODEL / OPSD_DATA, when set, still win
#   OPSD_REPORT_TO      where the logs also go, OPSD diagnostics included: none (default), tensorboard
#                       (event files under OPSD_OUTPUT/runs/), wandb, trackio, or all installed ones
#   OPSD_CLIP_MODE, OPSD_PAD_SIDE, OPSD_TEACHER_CONTEXT, OPSD_STUDENT_PROMPT, OPSD_DATA_SELECT: ablation switches
# Paths (RECIPE_FILE, OPSD_OUTPUT, OPSD_DATA, OPSD_MODEL) are relative to the folder you call from.
# Everything is validated before accelerate starts: a bad input is one `error:` line, exit 2; so is
# an OPSD_* variable that is none of these (`python -m opsd.config variables` lists them all).
# A run folder that already holds checkpoint-N of the same configuration resumes from the newest
# one; a folder of another configuration is refused. SIGTERM / SIGUSR1 / Ctrl-C stop at a step
# boundary with a checkpoint (exit 143 / 138 / 130; a repeated SIGTERM is the same request, a second
# Ctrl-C stops at once); re-running resumes. With several processes, SIGUSR1 to the ranks (a
# cluster's --signal=USR1@N reaches them all; the launcher ignores it) gives them all the time the
# step and checkpoint take; a SIGTERM to the launcher gives them 30 s on torch 2.11 (the GPU stack's
# pin, which ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT), TORCH_ELASTIC_SHUTDOWN_TIMEOUT (here 150 s) on
# torch 2.13, then the launcher kills them.
set -euo pipefail
repo="$(cd "$(dirname "$(realpath -- "${BASH_SOURCE[0]}")")" && pwd)"

recipe="${1:-$repo/recipe.env}"
if [[ "$recipe" == "-h" || "$recipe" == "--help" ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"  # the header comment
  exit 0
fi
# The processes run in the caller's folder (scripts by absolute path), so every relative path
# means what it means to the caller.
# First (instant): every OPSD_* variable set is a declared one (a misspelled name would be ignored).
opsd_config() { python -m opsd.config "$@"; }  # from the caller's folder (pip install -e . makes opsd importable)
opsd_config check-env  # and the values of OPSD_PRESET, OPSD_USE_VLLM, OPSD_VLLM_MODE (opsd.config)

# The multi-GPU engine, checked first (instant): its accelerate config file, or one error line.
engine_config=$(opsd_config accelerate-config "${OPSD_ACCELERATE_CONFIG:-}")

if [[ "${OPSD_PRESET:-}" == "tiny" ]]; then
  steps=8; global_batch=4; per_device=2; save_steps=4
  output="${OPSD_OUTPUT:-$repo/outputs/opsd-tiny}"
  model_args=(--preset tiny)
  # Under the preset, explicitly set variables still win over its tiny model and data (as in dev_eval.sh).
  if [[ -n "${OPSD_MODEL:-}" ]]; then model_args+=(--model_name_or_path "$OPSD_MODEL"); fi
  if [[ -n "${OPSD_DATA:-}" ]]; then model_args+=(--dataset_name "$OPSD_DATA"); fi
  extra=(--logging_steps 1)
else
  steps=100; global_batch=32; save_steps=25
  per_device="${OPSD_PER_DEVICE_BATCH:-4}"
  output="${OPSD_OUTPUT:-$repo/outputs/opsd-capped}"
  model_args=(--model_name_or_path "${OPSD_MODEL:-Qwen/Qwen3-1.7B}"
              --dataset_name "${OPSD_DATA:-siyanzhao/Openthoughts_math_30k_opsd}")
  extra=(--logging_steps 1)
fi

# GPUs: the visible ones (CUDA_VISIBLE_DEVICES, else all that nvidia-smi lists; none on a CPU machine).
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  IFS=, read -ra visible <<< "${CUDA_VISIBLE_DEVICES// /}"
elif command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
  mapfile -t visible < <(nvidia-smi -L | sed -n 's/^GPU \([0-9]*\):.*/\1/p')
else
  visible=()
fi
# Rollouts: the own engine unless vLLM is asked for, measured faster and leaner on one GPU
# (BENCHMARKS.md); vLLM server mode on a GPU of its own is not measured against it.
vllm_mode="${OPSD_VLLM_MODE:-colocate}"
if [[ "${OPSD_PRESET:-}" == "tiny" ]]; then
  use_vllm=0; why="the tiny preset never uses vLLM"
elif [[ "${OPSD_USE_VLLM:-}" == "1" ]]; then
  use_vllm=1; why="OPSD_USE_VLLM=1"
elif [[ -n "${OPSD_VLLM_MODE:-}" ]]; then
  use_vllm=1; why="OPSD_VLLM_MODE=$OPSD_VLLM_MODE"
elif [[ -n "${OPSD_USE_VLLM:-}" ]]; then
  use_vllm=0; why="OPSD_USE_VLLM=0"
elif (( ${#visible[@]} > 0 )); then
  use_vllm=0
  why="default on GPUs: 4.1 s a step and 16 GiB against vLLM colocate's 5.1 s and 51 GiB at Qwen3-1.7B, one call, BENCHMARKS.md; OPSD_USE_VLLM=1 for vLLM"
else
  use_vllm=0; why="no GPU visible"
fi
# Printed once every input is checked (below): a bad input's one `error:` line comes alone.
if [[ "$use_vllm" == "1" ]]; then
  extra+=(--use_vllm true --vllm_mode "$vllm_mode")
  rollouts_line="[OPSD] rollouts: vLLM $vllm_mode ($why)"
else
  rollouts_line="[OPSD] rollouts: own engine ($why)"
fi
gpus=("${visible[@]}")
server_gpus="${OPSD_VLLM_SERVER_GPU:-0}"
server_gpus="${server_gpus// /}"
server_mode=0
if [[ "$use_vllm" == "1" && "$vllm_mode" == "server" && "$server_gpus" != "none" ]]; then
  # No training rank on the server's GPUs.
  server_mode=1
  gpus=()
  for gpu in "${visible[@]}"; do
    [[ ",$server_gpus," == *",$gpu,"* ]] || gpus+=("$gpu")
  done
fi
if [[ "${OPSD_PRESET:-}" == "tiny" ]]; then
  nproc=1
else
  nproc="${OPSD_NUM_PROCESSES:-${#gpus[@]}}"
  (( ${#gpus[@]} > 0 )) || nproc="${OPSD_NUM_PROCESSES:-1}"
fi
for value in "$nproc" "$per_device" "${OPSD_TOKEN_MEAN_ROWS:-1}"; do
  if ! [[ "$value" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: OPSD_NUM_PROCESSES, OPSD_PER_DEVICE_BATCH and OPSD_TOKEN_MEAN_ROWS must be positive integers, got '$value'" >&2
    exit 2
  fi
done
if (( server_mode )); then
  left="${#gpus[@]} GPUs left once OPSD_VLLM_SERVER_GPU=$server_gpus is excluded (visible: ${visible[*]:-none})"
  if (( ${#gpus[@]} == 0 )); then
    echo "error: OPSD_VLLM_MODE=server: no training GPU: $left" >&2
    exit 2
  elif (( nproc > ${#gpus[@]} )); then
    echo "error: OPSD_VLLM_MODE=server: OPSD_NUM_PROCESSES=$nproc but $left" >&2
    exit 2
  fi
elif (( ${#gpus[@]} > 0 && nproc > ${#gpus[@]} )); then
  echo "error: OPSD_NUM_PROCESSES=$nproc but ${#gpus[@]} GPUs are visible (${visible[*]})" >&2
  exit 2
fi
if (( server_mode || (${#gpus[@]} > 0 && nproc < ${#gpus[@]}) )); then
  # One GPU per process, the first ones: a process never sees a GPU it does not train on (one
  # process seeing several would fall into nn.DataParallel, which the trainer refuses).
  export CUDA_VISIBLE_DEVICES
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:0:nproc}")
  if (( server_mode )); then
    echo "[OPSD] vLLM server on GPU $server_gpus; training on GPUs $CUDA_VISIBLE_DEVICES"
  else
    echo "[OPSD] $nproc of ${#gpus[@]} visible GPUs: training on GPUs $CUDA_VISIBLE_DEVICES"
  fi
fi

# The launcher's grace for its processes once told to stop (SIGTERM, Ctrl-C): they finish the step
# and write a checkpoint, and it SIGKILLs them after this many seconds. torch 2.13 reads it; torch
# 2.11 (requirements-gpu.txt) does not and kills them after 30 s (measured: TERM to the launcher of
# two gloo ranks, 150 set, ranks killed 29.5 s later). So a cluster's stop goes to the ranks as
# SIGUSR1, which the launcher (and this script) ignores: it never starts that countdown.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-150}"
trap '' USR1  # inherited by the launcher (exec); the ranks install their own handler (opsd_train.py)
if ! [[ "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" =~ ^[0-9]+$ ]]; then
  echo "error: TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be whole seconds, got '$TORCH_ELASTIC_SHUTDOWN_TIMEOUT'" >&2
  exit 2
fi

# Across nodes: inside a SLURM job step of several tasks (`srun`, slurm/train_capped.sbatch), each
# node runs this script once and is one accelerate machine with its processes. Only a step's tasks
# count (SLURM_STEP_*): the batch script itself, outside `srun`, is one machine.
machines=1; machine_rank=0
if [[ -n "${SLURM_STEP_NUM_TASKS:-}" ]] && (( SLURM_STEP_NUM_TASKS > 1 )); then
  nodes="${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-1}}"
  if (( SLURM_STEP_NUM_TASKS == nodes )); then
    machines=$nodes; machine_rank="${SLURM_NODEID:-0}"
  else
    # Several tasks on a node: each would start one process per GPU it sees, so tasks seeing the same
    # GPUs would share them. Only tasks that SLURM gave GPUs of their own (--gpus-per-task binds each
    # task to its share) or that run on CPUs are each one machine.
    per_task="${SLURM_GPUS_PER_TASK:-}"; per_task="${per_task##*:}"  # `4` or `h100:4`
    if (( ${#visible[@]} > 0 )) && ! [[ "$per_task" =~ ^[1-9][0-9]*$ && ${#visible[@]} -le $per_task ]]; then
      echo "error: SLURM runs $SLURM_STEP_NUM_TASKS tasks on $nodes node(s) (SLURM_STEP_TASKS_PER_NODE=${SLURM_STEP_TASKS_PER_NODE:-?}) and this task sees GPUs ${visible[*]}: tasks of one node would train on the same GPUs; run one task a node (srun --ntasks-per-node=1, as slurm/train_capped.sbatch) or give each task GPUs of its own (--gpus-per-task)" >&2
      exit 2
    fi
    machines=$SLURM_STEP_NUM_TASKS; machine_rank="${SLURM_PROCID:-0}"
  fi
  # The main process runs on the step's first node; the other nodes reach it by address. A name that
  # resolves to a loopback address (Debian's /etc/hosts maps the host's own name to 127.0.1.1)
  # works on one node only: elsewhere gloo and NCCL would connect to themselves.
  node_list="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}"
  hosts=$(scontrol show hostnames "$node_list" 2> /dev/null || true)  # not `| head`: pipefail and SIGPIPE
  main_node="${hosts%%$'\n'*}"
  if [[ -z "$main_node" ]]; then
    echo "error: 'scontrol show hostnames $node_list' named no node (SLURM_STEP_NODELIST): is scontrol on PATH?" >&2
    exit 2
  fi
  main_ip=$(getent ahostsv4 "$main_node" | awk 'NR == 1 { print $1 }' || true)
  if [[ -z "$main_ip" ]]; then
    echo "error: the main node $main_node (first of SLURM_STEP_NODELIST=$node_list) has no IPv4 address (getent ahostsv4 $main_node)" >&2
    exit 2
  elif [[ "$main_ip" == 127.* ]] && (( nodes > 1 )); then
    echo "error: the main node $main_node resolves to the loopback address $main_ip (getent ahostsv4 $main_node; /etc/hosts on Debian), which the other nodes cannot reach: map $main_node to its network address in /etc/hosts or DNS" >&2
    exit 2
  fi
  main_port="${OPSD_MAIN_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 2000))}"  # one port a job: jobs may share a node
  echo "[OPSD] SLURM: machine $machine_rank of $machines, main process on $main_node ($main_ip):$main_port"
fi
world=$((nproc * machines))
per_step=$((per_device * world))
if (( global_batch % per_step != 0 )); then
  echo "error: global batch $global_batch is not divisible by per-device batch $per_device x $world processes" >&2
  exit 2
fi
accum=$((global_batch / per_step))

args=("${model_args[@]}" --recipe "$recipe" --output_dir "$output"
      --max_steps "$steps" --per_device_train_batch_size "$per_device" --gradient_accumulation_steps "$accum"
      --save_strategy steps --save_steps "$save_steps" "${extra[@]}")
if [[ -n "${OPSD_TOKEN_MEAN_ROWS:-}" ]]; then
  args+=(--token_mean_rows "$OPSD_TOKEN_MEAN_ROWS")  # the trainer checks that it divides the micro-batch
fi
# OPSD_REPORT_TO and the switches reach opsd_train.py through the environment, which checks them.
# Switches, recipe, model path, data, run folder and lock, checked in one process before the
# launch: accelerate would wrap a child's exit status 2 in its own traceback.
python "$repo/opsd_train.py" --check_only --world_size "$world" "${args[@]}"

echo "$rollouts_line"
if [[ "${OPSD_PRESET:-}" == "tiny" ]]; then
  # At the released learning rate 8 steps leave the model where it was: say so before it runs.
  echo "[OPSD] the tiny preset is a pipeline check: its 8 steps at the released learning rate leave the model at base accuracy; bash quickstart.sh shows a run that learns"
fi
echo "[OPSD] budget: $steps steps x global batch $global_batch = $per_device per device x $accum accumulation x $world processes -> $output"
if (( machines > 1 )); then
  # Every machine runs the same launcher; accelerate joins them at the main process (rank 0's node).
  # Without GPUs (a CPU test of this path) the ranks join over gloo.
  (( ${#gpus[@]} > 0 )) || export ACCELERATE_USE_CPU=true OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  exec accelerate launch --config_file "$engine_config" --num_processes "$world" --num_machines "$machines" \
    --machine_rank "$machine_rank" --main_process_ip "$main_ip" --main_process_port "$main_port" \
    "$repo/opsd_train.py" "${args[@]}"
fi
if (( nproc == 1 )) && [[ "$engine_config" == "$repo/configs/ddp.yaml" ]]; then
  # One process needs no launcher: the trainer itself receives SIGTERM / Ctrl-C (accelerate's
  # single-process launcher does not pass SIGTERM on) and its exit status is this script's.
  export ACCELERATE_MIXED_PRECISION=no ACCELERATE_DYNAMO_BACKEND=NO
  exec python "$repo/opsd_train.py" "${args[@]}"
fi
# Several processes, or a sharded engine chosen for one (it needs the launcher to set it up).
echo "[OPSD] engine: accelerate launch --config_file $engine_config"
exec accelerate launch --config_file "$engine_config" --num_processes "$nproc" --num_machines 1 \
  "$repo/opsd_train.py" "${args[@]}"

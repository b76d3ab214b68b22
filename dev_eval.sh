#!/usr/bin/env bash
# Evaluate a LoRA checkpoint, or the base model, with the frozen protocol
# (docs/SPEC.md §5). The last line printed is the FINAL avg@k line; for a run
# folder (every checkpoint-N of a run), the FINAL line of its best checkpoint.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: dev_eval.sh CHECKPOINT|RUN_FOLDER|base

  CHECKPOINT   a LoRA checkpoint folder (holding adapter_config.json), or 'base'
  RUN_FOLDER   a training run's folder (OPSD_OUTPUT, holding checkpoint-N folders): evaluates
               every checkpoint in step order, one report each (a checkpoint whose report
               exists with the same settings is skipped: re-run to resume), then writes
               sweep_<run>.md/.json (accuracy vs step) and sweep_<run>.png beside the reports;
               the last line is the best checkpoint's FINAL line, with whether it is
               distinguishable from the last checkpoint (FINAL best checkpoint-N avg@k ...)

environment:
  OPSD_MODEL         base model: hub id or local folder   (default the run's, else Qwen/Qwen3-1.7B)
  OPSD_EVAL_DATA     eval set: hub name, .json/.jsonl/.parquet  (default HuggingFaceH4/aime_2024)
  OPSD_EVAL_BACKEND  transformers | vllm | auto           (default auto: vllm with CUDA, else transformers)
  OPSD_EVAL_ENGINE   the transformers backend's engine: auto | dynamic | paged | static | graph | graph_compiled
                     (default auto: paged with CUDA, else and with OPSD_PRESET=tiny dynamic;
                     python -m opsd.evaluation -h says more)
  OPSD_EVAL_PAGED_GIB  the paged engine's KV pool in GiB (default half the GPU's total memory, a quarter of RAM on CPU)
  OPSD_EVAL_OUT      output folder for eval_<name>.json   (default <repo>/outputs/eval/<dataset>)
  OPSD_PRESET=tiny   embedded tiny model and its 30-problem eval set, 8 samples of at most 96 tokens each
                     (OPSD_MODEL / OPSD_EVAL_DATA, when set, still win)

  A checkpoint or run folder is evaluated on its run's base model (run_config.json), and a run of
  the tiny preset on the tiny preset's eval set, unless the variables above say otherwise (one line
  says so).
  Any other OPSD_* variable set is an error (python -m opsd.config variables lists them all).
USAGE
}

if [[ $# -eq 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
  usage
  exit 0
fi
if [[ $# -ne 1 ]]; then
  usage >&2
  exit 2
fi
repo="$(cd "$(dirname "$(realpath -- "${BASH_SOURCE[0]}")")" && pwd)"
# The argument first: nothing else is printed before a bad one is refused.
if [[ "$1" != base ]]; then
  given="$(realpath -m -- "$1")"
  if [[ -f "$given" ]]; then
    echo "error: $given is a file, not a checkpoint folder (holding adapter_config.json) or a run folder (holding checkpoint-N folders)" >&2
    exit 2
  elif [[ ! -e "$given" ]]; then
    echo "error: checkpoint folder not found: $given" >&2
    exit 2
  elif [[ ! -f "$given/adapter_config.json" ]] && ! compgen -G "$given/checkpoint-*/trainer_state.json" > /dev/null; then
    echo "error: $given is neither a LoRA checkpoint (no adapter_config.json) nor a run folder (no checkpoint-N folder)" >&2
    exit 2
  fi
fi
# Every OPSD_* variable set is a declared one (a misspelled name would be ignored): one error line.
python -m opsd.config check-env

# Paths the caller gave are relative to the caller's folder; make them absolute
# before moving to the repository (hub names, which are not existing paths, pass as is).
absolute_if_path() {
  if [[ -e "$1" ]]; then realpath -- "$1"; else printf '%s\n' "$1"; fi
}

checkpoint="$1"
[[ "$checkpoint" == base ]] || checkpoint="$(realpath -m -- "$checkpoint")"  # always a local folder

args=("$checkpoint" --backend "${OPSD_EVAL_BACKEND:-auto}" --engine "${OPSD_EVAL_ENGINE:-auto}")
if [[ -n "${OPSD_PRESET:-}" ]]; then args+=(--preset "$OPSD_PRESET"); fi
# Only variables that are set are passed: the rest is python -m opsd.evaluation's to decide (the
# defaults above, the preset's, or those of the run a checkpoint's run_config.json records).
if [[ -n "${OPSD_MODEL:-}" ]]; then args+=(--model "$(absolute_if_path "$OPSD_MODEL")"); fi
if [[ -n "${OPSD_EVAL_DATA:-}" ]]; then args+=(--dataset "$(absolute_if_path "$OPSD_EVAL_DATA")"); fi
if [[ -n "${OPSD_EVAL_OUT:-}" ]]; then args+=(--output-dir "$(realpath -m -- "$OPSD_EVAL_OUT")"); fi

# A run of the tiny preset (its run_config.json, the run folder's or the checkpoint's) learns
# nothing at the released learning rate: say so, lest its +0.00 read as the method's result.
if [[ "$checkpoint" != base ]] && grep -qs '"preset": "tiny"' "$checkpoint/run_config.json" "$checkpoint/../run_config.json"; then
  echo "[eval] the tiny preset is a pipeline check: its 8 steps at the released learning rate leave the model at base accuracy; bash quickstart.sh shows a run that learns"
fi
cd "$repo"
exec python -m opsd.evaluation "${args[@]}"

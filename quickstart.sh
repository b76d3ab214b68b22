#!/usr/bin/env bash
# Install, then run the embedded default end to end (README "Quick start"): one grid
# (opsd/research/grid.py) that evaluates the learned tiny model as it is (base), trains it with OPSD
# and evaluates the trained checkpoint on the same held-out set, then prints each cell's FINAL
# line and each trained arm's verdict against base (opsd.analysis.stats).
# - on a machine with a CUDA GPU, grids/quickstart_gpu.json: the released recipe and the arm that
#   learns here (token clip + left padding), each at the full capped budget (100 steps x batch 32),
#   on 200 held-out problems;
# - elsewhere (CPU), grids/quickstart_cpu.json: a budget two CPU cores afford in minutes, not the
#   capped recipe: token clip + left padding, 12 steps x batch 16, trained and evaluated on one
#   problem family of the task (a x b + c x d, the family this model learns fastest), 40 held-out
#   problems.
# It ends with the trained checkpoint's path and a two-line command that loads it.
#   usage: bash quickstart.sh [--skip-install]     (OPSD_OUTPUT: the grid folder)
set -euo pipefail
cd "$(dirname "$0")"
python -m opsd.config check-env  # a misspelled OPSD_* variable stops here, before the install (stdlib only)
case "${1:-}" in
  "") bash install.sh ;;
  --skip-install) ;;
  *) echo "usage: bash quickstart.sh [--skip-install]" >&2; exit 2 ;;
esac

if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  grid=grids/quickstart_gpu.json out="${OPSD_OUTPUT:-outputs/quickstart-gpu}" options=(--cells-per-gpu 3)
  echo "[quickstart] GPU: base, released recipe and token clip + left padding, 100 steps x batch 32 each ($grid -> $out)"
else
  grid=grids/quickstart_cpu.json out="${OPSD_OUTPUT:-outputs/quickstart-cpu}" options=()
  echo "[quickstart] CPU: base and token clip + left padding, 12 steps x batch 16 on one problem family ($grid -> $out)"
fi
python -m opsd.research.grid "$grid" --out "$out" "${options[@]}"  # ends with the FINAL lines and the verdicts

# The trained arm that learns here (token clip + left padding): its last checkpoint, and how to load it.
checkpoint="$( (ls -d "$out"/token_left/seed-*/run/checkpoint-* 2> /dev/null || true) | sort -V | tail -n 1)"
if [[ -n "$checkpoint" ]]; then
  checkpoint="$(realpath -- "$checkpoint")"
  echo "[quickstart] trained checkpoint (token clip + left padding): $checkpoint"
  echo "[quickstart] load it (its README.md, the model card, has a snippet that also generates):"
  echo "python -W ignore::FutureWarning -c 'from peft import AutoPeftModelForCausalLM"
  echo "model = AutoPeftModelForCausalLM.from_pretrained(\"$checkpoint\"); print(type(model).__name__, \"on\", model.peft_config[\"default\"].base_model_name_or_path)'"
fi

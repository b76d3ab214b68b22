#!/usr/bin/env bash
# Install, then run the embedded default end to end (README "Quick start"):
# - on a machine with a CUDA GPU: the learned tiny model as it is (base), trained with the
#   released recipe and with the arm that learns here (token clip + left padding), each at the
#   full capped budget (100 steps x batch 32, one seed), all three evaluated on one held-out set
#   (grids/quickstart_gpu.json through research/grid.py); prints the three FINAL lines and the
#   verdicts against base;
# - elsewhere (CPU): evaluate the base model on a small held-out set, train it with the tiny
#   preset (8 steps x batch 4), evaluate the checkpoint, compare the two (one verdict line).
#   usage: bash quickstart.sh [--skip-install]
set -euo pipefail
cd "$(dirname "$0")"
python -m opsd.config check-env  # a misspelled OPSD_* variable stops here, before the install (stdlib only)
case "${1:-}" in
  "") bash install.sh ;;
  --skip-install) ;;
  *) echo "usage: bash quickstart.sh [--skip-install]" >&2; exit 2 ;;
esac

if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  out="${OPSD_OUTPUT:-outputs/quickstart-gpu}"
  echo "[quickstart] GPU: base, released recipe and token clip + left padding on the learned tiny default (grid in $out)"
  python -m research.grid grids/quickstart_gpu.json --out "$out" --cells-per-gpu 3
  echo
  for cell in base released/seed-10 token_left/seed-10; do
    printf '%-12s %s\n' "${cell%%/*}:" "$(tail -n 1 "$out/$cell/eval.log")"
  done
  python - "$out/results.json" <<'PY'
import json, sys
for name, arm in json.load(open(sys.argv[1]))["arms"].items():
    if "verdict" in arm:
        print(f"{name + ':':<12} {arm['verdict']}")
PY
  exit 0
fi

export OPSD_PRESET=tiny OPSD_EVAL_DATA="${OPSD_EVAL_DATA:-tiny:7:16}"
out="${OPSD_OUTPUT:-outputs/opsd-tiny}"
evals="outputs/eval/quickstart"
OPSD_EVAL_OUT="$evals" bash dev_eval.sh base | tee /tmp/opsd_quickstart_base.log
OPSD_OUTPUT="$out" bash train_capped.sh recipe.env
OPSD_EVAL_OUT="$evals" bash dev_eval.sh "$out/checkpoint-8" | tee /tmp/opsd_quickstart_trained.log
echo
echo "base:    $(tail -n 1 /tmp/opsd_quickstart_base.log)"
echo "trained: $(tail -n 1 /tmp/opsd_quickstart_trained.log)"
python -m analysis.stats compare --a "$evals/eval_base.json" --b "$evals"/eval_*checkpoint-8.json | grep "^verdict:"
echo "(8 CPU steps are far too few to move this model. On a machine with a CUDA GPU this script trains the full"
echo " capped budget instead, where the token clip + left padding arm lands well above base: README \"Quick start\".)"

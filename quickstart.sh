#!/usr/bin/env bash
# Install, then run the embedded default end to end on CPU (README: the measured wall time):
#   1. evaluate the learned tiny model (base) on a held-out generated set,
#   2. train it with OPSD (the tiny preset: 8 steps x batch 4),
#   3. evaluate the checkpoint on the same set,
#   4. compare the two with run_stats (one verdict line).
set -euo pipefail
cd "$(dirname "$0")"
python opsd_config.py check-env  # a misspelled OPSD_* variable stops here, before the install (stdlib only)
bash install.sh
export OPSD_PRESET=tiny OPSD_EVAL_DATA="${OPSD_EVAL_DATA:-tiny:7:16}"
out="${OPSD_OUTPUT:-outputs/opsd-tiny}"
evals="outputs/eval/quickstart"
OPSD_EVAL_OUT="$evals" bash dev_eval.sh base | tee /tmp/opsd_quickstart_base.log
OPSD_OUTPUT="$out" bash train_capped.sh recipe.env
OPSD_EVAL_OUT="$evals" bash dev_eval.sh "$out/checkpoint-8" | tee /tmp/opsd_quickstart_trained.log
echo
echo "base:    $(tail -n 1 /tmp/opsd_quickstart_base.log)"
echo "trained: $(tail -n 1 /tmp/opsd_quickstart_trained.log)"
python run_stats.py compare --a "$evals/eval_base.json" --b "$evals"/eval_*checkpoint-8.json | grep "^verdict:"

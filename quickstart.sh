#!/usr/bin/env bash
# Install, then run the embedded default end to end on CPU:
# tiny OPSD training (8 steps) -> checkpoint -> tiny evaluation with its FINAL line.
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
OPSD_PRESET=tiny OPSD_OUTPUT=outputs/opsd-tiny bash train_capped.sh recipe.env
OPSD_PRESET=tiny bash dev_eval.sh outputs/opsd-tiny/checkpoint-8

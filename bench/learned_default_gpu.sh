#!/usr/bin/env bash
# The learnable embedded default on a GPU machine, in one call (OPSD_EXPERIMENTS.md):
#   bash bench/learned_default_gpu.sh OUT_DIR [GRID.json] [PARALLEL] [GRID2.json PARALLEL2 ...]
# 1. with TRAIN_DEFAULT=1: trains opsd/tiny_default/weights/learned.safetensors and measures it
#    (python -m opsd.research.train_tiny_default); the weights and report land in OUT_DIR;
# 2. with a grid file: runs it with opsd/research/grid.py into runs/<grid name> (resumable: carry
#    that folder back to continue) and packs its reports (a swept cell's report of every checkpoint
#    too: pass@k over steps), logs, each cell's sweep.json (what `opsd.analysis.stats reach` /
#    `equivalence ARM@STEP` read), cell.json and timing.json into OUT_DIR/grid.tgz.
#    GRID_NAME=NAME runs it into runs/NAME instead: parts of one grid (grid files whose cells are
#    subsets of one grid's) share one folder, on a warm machine or once their grid.tgz are unpacked.
#    More GRID PARALLEL pairs run at the same time as the first, each into runs/<its name> (its log
#    OUT_DIR/grid-<name>.log), all packed into the one grid.tgz: small cells leave the GPU and the
#    CPUs room for two grids.
# Everything stops by END_S seconds after the start (default 560). Wheels in .whl/ are
# installed into /tmp/site first (see BENCHMARKS.md for how to fetch them).
set -uo pipefail
OUT_DIR=${1:?usage: learned_default_gpu.sh OUT_DIR [GRID.json] [PARALLEL]}
GRID=${2:-}
PARALLEL=${3:-8}
END_S=${END_S:-560}
source "$(dirname "$0")/gpu_env.sh"  # the GPU machine's environment
gpu_env "$OUT_DIR" || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if [[ "${TRAIN_DEFAULT:-0}" == 1 ]]; then
  timeout $((END_S - SECONDS)) python3 -m opsd.research.train_tiny_default --report "$OUT_DIR/learned_report.json" \
    ${TRAIN_ARGS:-} > "$OUT_DIR/train_learned.log" 2>&1
  echo "train_learned exit $?" | tee -a "$OUT_DIR/train_learned.log"
  cp opsd/tiny_default/weights/learned.safetensors "$OUT_DIR/" 2>/dev/null
  grep -E "^\[(train|measure)\]" "$OUT_DIR/train_learned.log" | tail -12
fi
if [[ -n "$GRID" ]]; then
  name=${GRID_NAME:-$(basename "$GRID" .json)}
  names=("$name")
  shift 3 2>/dev/null || shift $#
  while (( $# >= 2 )); do  # the other grids, in the background
    other=$(basename "$1" .json)
    names+=("$other")
    timeout $((END_S - SECONDS)) python3 -m opsd.research.grid "$1" --out "runs/$other" --cells-per-gpu "$2" \
      > "$OUT_DIR/grid-$other.log" 2>&1 &
    shift 2
  done
  timeout $((END_S - SECONDS)) python3 -m opsd.research.grid "$GRID" --out "runs/$name" --cells-per-gpu "$PARALLEL" \
    > "$OUT_DIR/grid.log" 2>&1
  echo "opsd.research.grid exit $?" | tee -a "$OUT_DIR/grid.log"
  wait
  (cd runs && find "${names[@]}" \( -name 'eval.json' -o -name 'results.json' -o -name '*.log' -o -name '*.md' \
      -o -name 'recipe.env' -o -name 'metrics.jsonl' -o -name 'run_config.json' -o -name 'sweep.json' \
      -o -name 'timing.json' -o -name 'cell.json' -o -path '*/eval/*.json' \) -not -path '*/checkpoint-*' -print0 \
    | tar czf "$OUT_DIR/grid.tgz" --null -T -)
  size=$(stat -c %s "$OUT_DIR/grid.tgz" 2>/dev/null || echo 0)
  if (( size > 16 * 1024 * 1024 )); then  # the device machine returns files of at most 16 MiB
    echo "warning: grid.tgz is $size bytes, over 16 MiB: it will not come back; pack less (e.g. no *.log)" \
      | tee -a "$OUT_DIR/grid.log"
  fi
  for other in "${names[@]:1}"; do tail -4 "$OUT_DIR/grid-$other.log"; done
  tail -30 "$OUT_DIR/grid.log"
fi

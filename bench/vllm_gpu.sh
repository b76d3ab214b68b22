#!/usr/bin/env bash
# vLLM on one GPU machine, in one call (OPSD_EXPERIMENTS.md "vLLM, verified"; BENCHMARKS.md):
#   bash bench/vllm_gpu.sh OUT_DIR
# needs vLLM (0.26.0 with torch 2.11 was run) and the project's packages importable.
# 1. checks/vllm_sync_check.py twice, in the background: as shipped (must pass) and with every
#    weight sync after the first skipped (must fail);
# 2. grids/tiny_engines.json with opsd/research/grid.py into runs/tiny_engines (resumable): the learned
#    tiny default trained 100 x 32 by the own engine and by vLLM colocate (token clip + left
#    padding, seeds 10-12), the released recipe by vLLM, every cell evaluated with vLLM; then
#    python -m opsd.analysis.stats compare of the two engines' arms;
# 3. eval parity: the base model and the vLLM-trained checkpoints evaluated again with the
#    transformers backend, each pair compared problem by problem (python -m opsd.analysis.stats compare).
# Everything stops by END_S seconds after the start (default 560). OUT_DIR gets sync.json,
# sync_skipped.json, results.md, parity.md and vllm_gpu.tgz (every log and report).
set -uo pipefail
OUT_DIR=${1:?usage: vllm_gpu.sh OUT_DIR}
END_S=${END_S:-560}
source "$(dirname "$0")/gpu_env.sh"
gpu_env "$OUT_DIR" || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
work=runs/vllm_gpu
mkdir -p "$work"
python3 -c "import vllm, torch, transformers, trl; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)" | tee -a "$OUT_DIR/machine.txt"

python3 -m checks.vllm_sync_check --json "$OUT_DIR/sync.json" > "$work/sync.log" 2>&1 &
sync_pid=$!
python3 -m checks.vllm_sync_check --skip-sync --json "$OUT_DIR/sync_skipped.json" > "$work/sync_skipped.log" 2>&1 &
stale_pid=$!

grid=runs/tiny_engines
timeout $((END_S - SECONDS - 150)) python3 -m opsd.research.grid grids/tiny_engines.json --out "$grid" --cells-per-gpu 10 \
  > "$work/grid.log" 2>&1
echo "opsd.research.grid exit $?" | tee -a "$work/grid.log"
cp "$grid/results.md" "$OUT_DIR/results.md" 2>/dev/null
{ echo; echo "## Engines: own engine (A) vs vLLM colocate (B), token clip + left padding, seeds 10-12"
  python3 -m opsd.analysis.stats compare --a "$grid"/own_token_left/seed-*/eval.json --b "$grid"/vllm_token_left/seed-*/eval.json 2>&1
} >> "$OUT_DIR/results.md"

parity=runs/tiny_engines_parity
mkdir -p "$parity"
pids=()
for cell in base vllm_token_left/seed-10 vllm_token_left/seed-11 vllm_token_left/seed-12; do
  [[ -f "$grid/$cell/eval.json" ]] || continue
  ckpt=base; [[ "$cell" == base ]] || ckpt="$grid/$cell/run/checkpoint-100"
  name=${cell//\//_}
  compgen -G "$parity/$name/eval_*.json" > /dev/null && continue  # done in an earlier call
  timeout $((END_S - SECONDS - 20)) python3 -m opsd.evaluation "$ckpt" --preset tiny --dataset tiny:27182:200 \
    --backend transformers --output-dir "$parity/$name" > "$work/parity_$name.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}" 2>/dev/null
{
  echo "# Eval parity: vLLM backend (A) vs transformers backend (B), same checkpoint and set"
  for cell in base vllm_token_left/seed-10 vllm_token_left/seed-11 vllm_token_left/seed-12; do
    name=${cell//\//_}
    hf=$(ls "$parity/$name"/eval_*.json 2>/dev/null | head -1)
    [[ -n "$hf" ]] || { echo "$cell: no transformers report"; continue; }
    echo "## $cell"
    python3 -m opsd.analysis.stats compare --a "$grid/$cell/eval.json" --b "$hf" 2>&1 | grep -E "^(arm|A |B |  per problem|verdict)"
  done
} > "$OUT_DIR/parity.md" 2>&1

wait $sync_pid; echo "sync check exit $?" | tee -a "$work/sync.log"
wait $stale_pid; echo "sync check (skipped syncs) exit $? (1 expected)" | tee -a "$work/sync_skipped.log"
tar czf "$OUT_DIR/vllm_gpu.tgz" "$work" \
  $(find "$grid" "$parity" \( -name 'eval*.json' -o -name '*.log' -o -name '*.md' -o -name 'results.json' \
      -o -name 'metrics.jsonl' -o -name 'run_config.json' \) -not -path '*/checkpoint-*' 2>/dev/null) 2>/dev/null
echo; tail -n 14 "$work/sync.log"; echo; tail -n 12 "$work/sync_skipped.log"; echo
cat "$OUT_DIR/results.md" 2>/dev/null || tail -20 "$work/grid.log"; echo; cat "$OUT_DIR/parity.md"

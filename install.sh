#!/usr/bin/env bash
#   bash install.sh            the CPU-capable core (requirements.txt): what the tests run on
#   bash install.sh --gpu      the GPU stack that ran on an H200 (requirements-gpu.txt, from PyPI): torch
#                              2.11.0 (CUDA 13.0), vLLM 0.26.0, transformers 5.17.0, TRL 1.16.0, ...
#   bash install.sh --system   also into a Python that is not a virtual environment (with or without --gpu)
# Into the `python` on PATH, which must be a virtual environment (venv, virtualenv) or a conda
# environment: python3 -m venv .venv && . .venv/bin/activate makes and activates one.
# CPU: torch goes first with an exact pin: a bare or ranged `torch` requirement would pull a
# multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
gpu=0 system=0
for option in "$@"; do
  case "$option" in
    --gpu) gpu=1 ;;
    --system) system=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "error: install.sh: unknown option '$option'; expected --gpu, --system, -h or nothing" >&2; exit 2 ;;
  esac
done
make_one="python3 -m venv .venv && . .venv/bin/activate"
if ! command -v python > /dev/null; then
  echo "error: install.sh: no python on PATH; make a virtual environment and activate it first: $make_one" >&2
  exit 2
fi
# A shared or system Python is refused: a virtual environment has sys.prefix != sys.base_prefix, a
# conda environment a conda-meta folder in its prefix.
in_environment='import os, sys; sys.exit(sys.prefix == sys.base_prefix and not os.path.isdir(os.path.join(sys.prefix, "conda-meta")))'
if [[ "$system" == 0 ]] && ! python -c "$in_environment"; then
  echo "error: install.sh: $(command -v python) is not a virtual environment; make one and activate it first ($make_one), or pass --system to install into this Python" >&2
  exit 2
fi
if [[ "$gpu" == 1 ]]; then
  # One file from PyPI: its exact pins are the stack that ran (PyPI's torch 2.11.0 for Linux
  # x86-64 is the CUDA 13.0 build; vLLM requires torch, torchvision and torchaudio exactly).
  echo "[install 1/3] requirements-gpu.txt: torch 2.11.0 (CUDA 13.0), vLLM 0.26.0, transformers 5.17.0, TRL, ... as run (several GB)"
  python -m pip install -q --disable-pip-version-check -r requirements-gpu.txt
  echo "[install 2/3] pip check"
  python -m pip check
  echo "[install 3/3] the project's packages: pip install -e ."
  python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  echo "[install] done"
  exit 0
fi
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

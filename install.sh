#!/usr/bin/env bash
# Install the CPU-capable core. torch goes first with an exact pin: a bare or
# ranged `torch` requirement would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine, install the torch build for your CUDA first; this keeps it if it
# already satisfies the pin. GPU extras (vLLM): pip install -r requirements-gpu.txt
set -euo pipefail
cd "$(dirname "$0")"
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
echo "[install] done"

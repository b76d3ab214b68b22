#!/usr/bin/env bash
# Install the CPU-capable core. torch goes first with an exact pin: a bare or
# ranged `torch` requirement would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine, install the torch build for your CUDA first; this keeps it if it
# already satisfies the pin. GPU extras (vLLM): pip install -r requirements-gpu.txt
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install -q --disable-pip-version-check "$(grep -E '^torch==' requirements.txt)"
python -m pip install -q --disable-pip-version-check -r requirements.txt
# torch's CPU wheel comes without Triton (its CUDA wheels bring their own): install the
# version the tests run the rollout's decode-attention kernel with, in Triton's CPU
# interpreter (tests/test_decode_attention.py; elsewhere those tests are skipped).
if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && [[ "$(uname -sm)" == "Linux x86_64" ]]; then
  python -m pip install -q --disable-pip-version-check "triton==3.6.0"
fi

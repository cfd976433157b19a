#!/usr/bin/env bash
# Create .venv with the CPU build of torch and deepinfer_npu (editable, with test extras).
# On a GPU/NPU host install the torch build for your device first (see README), then `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"

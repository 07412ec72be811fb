#!/usr/bin/env bash
# Creates ./.venv with the pinned stack (CPU torch) and the package, editable. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned here, not in pyproject: GPU nodes bring their own CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[workflow,onnx,test]"

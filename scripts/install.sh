#!/usr/bin/env bash
# Creates ./.venv with the pinned stack (CPU torch) and the package, editable. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch and torchvision are pinned in envs/quantstudy.txt (the conda env quantstudy.yaml installs
# the same list), not in pyproject: a GPU node brings its own CUDA build
# (on torch 2.11, install torchvision==0.26.0 before this package: its exact torch pin keeps
# pip from replacing that torch). PyPI's torch 2.14.1 is a CUDA 13 build (about 5.5 GB
# installed) that runs on the CPU; it is the newest torch beside which PyPI's torchvision
# imports (timm needs torchvision), and no CPU-only 2.14.1 wheel exists.
.venv/bin/python -m pip install -q -r envs/quantstudy.txt
.venv/bin/python -m pip install -q -e ".[workflow,onnx,test,lint]"

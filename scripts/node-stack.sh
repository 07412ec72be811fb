#!/usr/bin/env bash
# The suite on the GPU node's software stack, on any machine: torch 2.11.0, torchvision 0.26.0 and
# onnxruntime 1.30.0, as the device calls record them (results/h200-build-once/*/machine.txt), and
# the project's pins for everything else. What `QUANTSTUDY_REQUIRE_GPU=1 pytest` on the node tests
# beyond its GPU: the same code on the node's versions, here without device time. Makes ./.venv-node
# (idempotent), then runs pytest with any arguments given (default: the whole suite, -ra).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-node
[ -x $venv/bin/python ] || python3 -m venv $venv
$venv/bin/python -m pip install -q --upgrade pip
printf 'torch==2.11.0\ntorchvision==0.26.0\nonnxruntime==1.30.0\n' > $venv/node-pins.txt
# The package's own requirements and extras, its onnxruntime pin left to node-pins.txt.
$venv/bin/python - > $venv/requirements.txt <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [r for name in ("workflow", "onnx", "test") for r in project["optional-dependencies"][name]]
print("\n".join(r for r in project["dependencies"] + extras if not r.startswith("onnxruntime")))
PY
$venv/bin/python -m pip install -q -r $venv/node-pins.txt -r $venv/requirements.txt -c $venv/node-pins.txt
$venv/bin/python -m pip install -q --no-deps -e .
$venv/bin/python -c "import torch, torchvision, onnxruntime; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'onnxruntime', onnxruntime.__version__)"
exec $venv/bin/python -m pytest "${@:--ra}"

#!/usr/bin/env bash
# The evidence run of results/h200-torch/, as run on one offline H200 node from the repository
# root. ./.whl holds the wheels the node lacks: `bash ../shared/offline-gpu/wheels.sh`, plus
# datasets==5.2.0, dill==0.4.1 and multiprocess==0.70.19 (pip download --no-deps, Python 3.12),
# which that script does not fetch. Writes $OUT/evidence.tar.gz (no engines, ONNX or safetensors).
#   OUT=/some/dir bash results/h200-torch/run.sh [smoke]
set -uo pipefail
mode=${1:-full}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 TORCHINDUCTOR_COMPILE_THREADS=4  # 16 cores shared by parallel jobs
ev=evidence && rm -rf $ev && mkdir -p $ev
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $ev/log.txt; }
{ nvidia-smi; nvidia-smi -q | grep -iE "product name|driver version|cuda version|clocks|power limit" | head -20
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; lscpu | head -20; free -g; } > $ev/machine.txt 2>&1
sm="python3 -m snakemake --configfile config/h200.yaml --cores 16"
if [ "$mode" = smoke ]; then
  stamp pytest; timeout 200 python3 -m pytest tests/test_gpu.py -m gpu -q -s -p no:cacheprovider > $ev/pytest.txt 2>&1
  stamp gemm; timeout 60 python3 benchmarks/fp8_gemm.py > $ev/fp8_gemm.txt 2>&1
  r=results/fnet/h200-torch
  stamp smoke-workflow; timeout 330 $sm $r/fnet-large/w512/fp8/{timing,kernels,quality}.json \
    $r/fnet-base/w128/fp8/timing.json > $ev/snakemake-smoke.txt 2>&1
else
  left() { echo $(( 585 - ($(date +%s) - t0) )); }  # the device call's 600 s, less packing
  # 1: everything but the measurements (parallel, the GPU shared); 2: timing and profiles: each
  # measurement holds the GPU alone while the other jobs' compiles and graph captures wait
  # (quantstudy.timing.device_lock); 3: the candidate's timing again, a separate job per file.
  stamp pass1; timeout $(left) $sm --keep-going --rerun-incomplete --omit-from time profile > $ev/snakemake-1.txt 2>&1
  stamp pass2; timeout $(left) $sm --cores 10 --keep-going --rerun-incomplete > $ev/snakemake-2.txt 2>&1
  mkdir -p $ev/first && cp results/fnet/tables.json results/fnet/README.md $ev/first/
  tar cf $ev/first/timing.tar results/fnet/h200-torch/*/*/*/timing.json
  stamp gemm; timeout 60 python3 benchmarks/fp8_gemm.py --tables $ev/first/tables.json > $ev/fp8_gemm.txt 2>&1
  stamp repeat; timeout $(left) $sm --cores 7 --keep-going --forcerun results/fnet/h200-torch/*/*/fp8/timing.json \
    > $ev/snakemake-3.txt 2>&1
  if [ $(left) -gt 45 ]; then stamp pytest; timeout $(left) python3 -m pytest tests/test_gpu.py -m gpu -q -s \
    -p no:cacheprovider > $ev/pytest.txt 2>&1; fi
fi
stamp pack
find results/fnet logs benchmarks/fnet -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.tsv' \
  | grep -v safetensors | tar czf $OUT/evidence.tar.gz -T - $ev
stamp done; ls -la $OUT

#!/usr/bin/env bash
# The evidence run of results/h200-torch/, on one offline H200 node, from the repository root.
# ./.whl holds the wheels the node lacks: `bash ../shared/offline-gpu/wheels.sh`, plus
# datasets==5.2.0, dill==0.4.1 and multiprocess==0.70.19 (pip download --no-deps, Python 3.12),
# which that script does not fetch.
#   OUT=/some/dir bash results/h200-torch/run.sh
# Resumable: the whole run takes longer than one 10-minute device call, so each stage that
# finishes leaves a marker in results/evidence/ (git-ignored, so it stays on the node between
# calls, like results/fnet and .snakemake); calling the script again goes on with the first
# unfinished stage (Snakemake picks up its half-done pass with --rerun-incomplete). Every call
# ends by packing what exists into $OUT/evidence.tar.gz (no engines, ONNX or safetensors).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 TORCHINDUCTOR_COMPILE_THREADS=4  # 16 cores shared by parallel jobs
ev=results/evidence && mkdir -p $ev
t0=$(date +%s)
left() { echo $(( 555 - ($(date +%s) - t0) )); }  # the device call's 600 s, less packing
log() { echo "[$(date -u +%FT%TZ)] $*" | tee -a $ev/log.txt; }
# stage NAME CMD...: run CMD unless NAME finished in an earlier call; give up when the call's
# time is out (the next call runs it again).
stage() {
  local name=$1; shift
  [ -e $ev/$name.done ] && return 0
  [ $(left) -gt 20 ] || { log "$name: no time left in this call"; return 1; }
  log "$name: start"
  if timeout $(left) bash -c "$*"; then touch $ev/$name.done; log "$name: done"; else log "$name: stopped ($?)"; return 1; fi
}
machine() {
  { nvidia-smi; nvidia-smi -q | grep -iE "product name|driver version|cuda version|clocks|power limit" | head -20
    python3 -c "import torch, transformers, snakemake, modelopt, sys; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers',
transformers.__version__, 'snakemake', snakemake.__version__, 'modelopt', modelopt.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; lscpu | head -20; free -g; } > $ev/machine.txt 2>&1
}
# The family contract suite over every family and backend (torch on CPU, torch-cuda;
# onnxruntime/tensorrt where they import), the FNet backend suite, the GPU unit tests and the
# families' own tests, with QUANTSTUDY_REQUIRE_GPU=1: a GPU test that would skip here fails.
# A failing test is recorded (its exit status ends pytest.txt), and the study still runs.
contract() {
  QUANTSTUDY_REQUIRE_GPU=1 python3 -m pytest tests/test_contract.py tests/test_backends.py tests/test_gpu.py \
    tests/test_family_*.py -q -rs -p no:cacheprovider > $ev/pytest.txt 2>&1
  echo "pytest exit status $?" >> $ev/pytest.txt
}
sm="python3 -m snakemake --configfile config/h200.yaml --cores 16 --keep-going --rerun-incomplete"
r=results/fnet/h200-torch
# 1: everything but the measurements (parallel, the GPU shared). 2: timing and profiles: each
# measurement holds the GPU alone while other jobs compile or capture graphs
# (quantstudy.timing.device_lock). 3: job 1's figures kept aside. 4: the GEMM benchmark next to
# job 1's x. 5: the timing of the candidate and of its baselines again, as new jobs (job 2).
pass1() { $sm --omit-from time profile >> $ev/snakemake-1.txt 2>&1; }
pass2() { $sm --cores 10 >> $ev/snakemake-2.txt 2>&1; }
keep_first() {
  rm -rf $ev/first && mkdir -p $ev/first && cp results/fnet/tables.json results/fnet/README.md $ev/first/ &&
  tar cf $ev/first/timing.tar $r/*/*/*/timing.json
}
gemm() { python3 benchmarks/fp8_gemm.py --tables $ev/first/tables.json > $ev/fp8_gemm.txt 2>&1; }
repeat() {
  shopt -s nullglob
  local again=($r/*/w{128,256}/{fp16,fp8}/timing.json $r/*/{w512,b8-w512}/{fp16-hs,fp8}/timing.json)
  $sm --cores 10 --forcerun "${again[@]}" >> $ev/snakemake-3.txt 2>&1
}
export ev r sm && export -f machine contract pass1 pass2 keep_first gemm repeat
stage machine machine && stage pass1 pass1 && stage pass2 pass2 && stage keep_first keep_first &&
  stage gemm gemm && stage repeat repeat && stage contract contract && log "all stages done"
find results/fnet logs benchmarks/fnet \( -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.tsv' \) \
  ! -path '*/data/*' | tar czf $OUT/evidence.tar.gz -T - $ev
ls -la $OUT

#!/usr/bin/env bash
# The evidence run of results/h200-torch-issue9/: the DeBERTa-v2 and timm XCiT studies at real size
# (random weights) on one offline H200 node, torch backend, from the repository root.
# ./.whl holds the wheels the node lacks (see results/h200-torch/run.sh).
#   OUT=/some/dir bash results/h200-torch-issue9/run.sh
# Resumable like results/h200-torch/run.sh: each stage that finishes leaves a marker in
# results/evidence-issue9/ (git-ignored, kept on the node between calls); calling again goes on
# with the first unfinished stage. Every call ends by packing what exists into $OUT/evidence.tar.gz
# (no engines, ONNX or safetensors).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 TORCHINDUCTOR_COMPILE_THREADS=4  # 16 cores shared by parallel jobs
ev=results/evidence-issue9 && mkdir -p $ev
t0=$(date +%s)
left() { echo $(( ${BUDGET:-555} - ($(date +%s) - t0) )); }  # the device call's 600 s, less packing
log() { echo "[$(date -u +%FT%TZ)] $*" | tee -a $ev/log.txt; }
stage() {
  local name=$1; shift
  [ -e $ev/$name.done ] && return 0
  [ $(left) -gt 20 ] || { log "$name: no time left in this call"; return 1; }
  log "$name: start"
  if timeout $(left) bash -c "$*"; then touch $ev/$name.done; log "$name: done"; else log "$name: stopped ($?)"; return 1; fi
}
machine() {
  nvidia-smi -q -x > $ev/nvidia-smi.xml 2>&1
  { nvidia-smi; nvidia-smi -q | grep -iE "product name|driver version|cuda version|clocks|power limit" | head -20
    python3 -c "import torch, transformers, timm, snakemake, modelopt, sys; print('python', sys.version.split()[0],
'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'timm', timm.__version__,
'snakemake', snakemake.__version__, 'modelopt', modelopt.__version__, torch.cuda.get_device_name(),
torch.cuda.get_device_capability())"; lscpu | head -20; free -g; } > $ev/machine.txt 2>&1
}
# STUDIES (default: both) names the studies of this call: one study's passes fit one device call.
# CALL names a config file layered over config/h200.yaml (config/realsize/calls/) that cuts a study
# to what one call fits.
studies=${STUDIES:-"timm_xcit deberta_v2"}
sm="python3 -m snakemake --configfile config/h200.yaml ${CALL:-} --cores 16 --keep-going --rerun-incomplete"
# 1: everything but the measurements (parallel, the GPU shared). 2: timing and profiles, each
# measurement holding the GPU alone (quantstudy.timing.device_lock), then aggregate, render, audit.
# The targets come first: --omit-from takes every word after it as a rule name.
pass1() { $sm results/$1/README.md results/$1/audit.json --omit-from time profile >> $ev/snakemake-$1-1.txt 2>&1; }
pass2() { $sm --cores 10 results/$1/README.md results/$1/audit.json >> $ev/snakemake-$1-2.txt 2>&1; }
# The GPU tests of the two families and of the torch backend, a GPU test that would skip failing.
gputests() {
  QUANTSTUDY_REQUIRE_GPU=1 python3 -m pytest tests/test_gpu.py tests/test_jobserver.py tests/test_family_deberta_v2.py \
    tests/test_family_timm_xcit.py -q -rs -p no:cacheprovider -p no:warnings > $ev/pytest.txt 2>&1
  echo "pytest exit status $?" >> $ev/pytest.txt
}
export ev sm && export -f machine pass1 pass2 gputests
python3 -m snakemake --unlock --configfile config/h200.yaml > /dev/null 2>&1
ok=1
stage machine machine || ok=0
for st in $studies; do
  [ $ok = 1 ] && stage pass1-$st pass1 $st && stage pass2-$st pass2 $st || ok=0
done
# GPUTESTS=0 leaves the GPU tests out (a call that needs its minutes for the studies).
[ $ok = 1 ] && { [ "${GPUTESTS:-1}" = 0 ] || stage gputests gputests; } && log "all stages done"
find $(for st in $studies; do echo results/$st logs/$st benchmarks/$st; done) \
  \( -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.tsv' \) ! -path '*/data/*' 2>/dev/null |
  tar czf $OUT/evidence.tar.gz -T - $ev
ls -la $OUT

#!/usr/bin/env bash
# The evidence run of results/h200-build-once/ (issue 27, build once, measure that build): the real-size
# timm XCiT study (random weights) on one offline H200 node, torch backend, from the repository root,
# with every torch engine compiled in its build and only opened by the jobs that measure it.
# ./.whl holds the wheels the node lacks (see ../shared/offline-gpu/README.md; for Deformable DETR,
# `bash ../shared/offline-gpu/wheels.sh faster-coco-eval==1.8.0`: the node has no COCO evaluator).
#   OUT=/some/dir bash results/h200-build-once/run.sh
# Both passes of the study (pass 1: everything but `time` and `profile`, builds compiling side by side;
# pass 2: the measurements, one at a time), timed as one; then the GPU tests (GPUTESTS=0: none).
# Every stage and every call end by packing what exists into $OUT/evidence.tar.gz (no engines, ONNX or safetensors).
# Also the GPT-Neo evidence (results/h200-gpt-neo/): STUDY names the study, EV the folder of its log and
# stage markers, CALL a config file layered over config/h200.yaml (config/realsize/calls/).
# TVP (model/setting patterns, e.g. 'xcit-*/b1'): after the study, benchmarks/torch_vs_plain.py on
# those settings, opening the study's own builds (the same config and CALL); TVP_ARGS adds
# options (--profile).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=4 TORCHINDUCTOR_COMPILE_THREADS=4  # 16 cores shared by parallel jobs
ev=${EV:-results/evidence-build-once} && mkdir -p $ev
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }  # the device call's 600 s, less packing
log() { echo "[$(date -u +%FT%TZ)] $*" | tee -a $ev/log.txt; }
study=${STUDY:-timm_xcit}
# What exists, into $OUT/evidence.tar.gz (written whole, then renamed): after every stage too, so that a call
# the device stops at a limit shorter than BUDGET (less device time left than asked) still returns its stages.
pack() {
  find results/$study logs/$study benchmarks/$study \
    \( -name '*.json' -o -name '*.md' -o -name '*.log' -o -name '*.tsv' -o -name '*.png' \) ! -path '*/data/*' 2>/dev/null |
    tar czf $OUT/evidence.tar.gz.part -T - $ev $(ls -d results/torch-vs-plain/compile-workers 2>/dev/null) &&
    mv $OUT/evidence.tar.gz.part $OUT/evidence.tar.gz
}
stage() {
  local name=$1; shift
  [ -e $ev/$name.done ] && return 0
  [ $(left) -gt 20 ] || { log "$name: no time left in this call"; return 1; }
  log "$name: start"
  local rc=0
  timeout $(left) bash -c "$*" || rc=$?
  if [ $rc = 0 ]; then touch $ev/$name.done; log "$name: done"; else log "$name: stopped ($rc)"; fi
  pack
  [ $rc = 0 ]
}
machine() {
  nvidia-smi -q -x > $ev/nvidia-smi.xml 2>&1
  { nvidia-smi; python3 -c "import torch, transformers, timm, snakemake, modelopt, onnxruntime, sys; print('python',
sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
'timm', timm.__version__, 'snakemake', snakemake.__version__, 'modelopt', modelopt.__version__, 'onnxruntime',
onnxruntime.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; lscpu | head -20; free -g
  } > $ev/machine.txt 2>&1
}
sm="python3 -m snakemake --configfile config/h200.yaml ${CALL:-} --cores 16 --keep-going --rerun-incomplete"
# The targets come first: --omit-from takes every word after it as a rule name.
pass1() { $sm results/$1/README.md results/$1/audit.json --omit-from time profile >> $ev/snakemake-$1-1.txt 2>&1; }
pass2() { $sm --cores 10 results/$1/README.md results/$1/audit.json >> $ev/snakemake-$1-2.txt 2>&1; }
gputests() {
  QUANTSTUDY_REQUIRE_GPU=1 python3 -m pytest ${GPUTEST_ARGS:-tests/test_gpu.py tests/test_backends.py tests/test_compiled_engine.py} -q -rs \
    -p no:cacheprovider -p no:warnings > $ev/pytest.txt 2>&1
  echo "pytest exit status $?" >> $ev/pytest.txt
}
tvp() {
  set -f  # TVP's patterns split into words, never globbed against files
  python3 benchmarks/torch_vs_plain.py --config config/h200.yaml ${CALL:-} --settings $TVP --cores 16 --compile-workers ${TVP_ARGS:-} --budget-s $1 \
    --out $ev/torch_vs_plain.json > $ev/torch_vs_plain.md 2> $ev/torch_vs_plain.log
}
export ev sm CALL=${CALL:-} TVP=${TVP:-} TVP_ARGS=${TVP_ARGS:-} && export -f machine pass1 pass2 gputests tvp
python3 -m snakemake --unlock --configfile config/h200.yaml > /dev/null 2>&1
ok=1
stage machine machine || ok=0
[ $ok = 1 ] && stage pass1-$study pass1 $study && stage pass2-$study pass2 $study || ok=0
[ $ok = 1 ] && log "study $study: both passes in $(( $(date +%s) - t0 )) s (this call)"
[ $ok = 1 ] && python3 benchmarks/gpu_cost.py . --study $study > $ev/gpu_cost-$study.txt 2>&1
[ $ok = 1 ] && [ -n "${TVP:-}" ] && { stage tvp tvp $(( $(left) - 40 )) || ok=0; }
[ $ok = 1 ] && { [ "${GPUTESTS:-1}" = 0 ] || stage gputests gputests; } && log "all stages done"
pack
ls -la $OUT

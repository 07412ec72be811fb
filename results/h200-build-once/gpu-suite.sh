#!/usr/bin/env bash
# The whole test suite on the offline GPU node with QUANTSTUDY_REQUIRE_GPU=1 (issue 27: a test that
# would skip for want of a GPU fails there instead), from the repository root, one test file at a time
# so that it spans device calls on a warm node: a file with a result under $ev is not run again, and a
# call starts no file once BUDGET seconds (default 560: the call's 600 s, less packing) are spent.
#   OUT=/some/dir bash results/h200-build-once/gpu-suite.sh            (again until "all files run")
# FILES: the test files or node ids, in order (default: tests/test_*.py). Each file's pytest output is appended to
# $ev/pytest-suite.txt, its exit status to $ev/pytest-suite-status.tsv; $OUT/gpu-suite.tar.gz has both.
# A file that needs more than one call's time never finishes: name its tests in parts in FILES.
# ./.whl holds the wheels the node lacks (see ../shared/offline-gpu/README.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 QUANTSTUDY_REQUIRE_GPU=1
ev=${EV:-results/evidence-gpu-suite} && mkdir -p $ev/done
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }
[ -e $ev/machine.txt ] || { nvidia-smi; python3 -c "import torch, onnxruntime; print('torch', torch.__version__,
'onnxruntime', onnxruntime.__version__, torch.cuda.get_device_name())"; } > $ev/machine.txt 2>&1
for file in ${FILES:-tests/test_*.py}; do
  name=$(echo ${file#tests/} | tr '/:' '__')  # a marker's name
  [ -e $ev/done/$name ] && continue
  [ $(left) -gt 30 ] || { echo "no time left in this call before $name" | tee -a $ev/pytest-suite.txt; break; }
  echo "== $file ($(date -u +%FT%TZ))" >> $ev/pytest-suite.txt
  start=$(date +%s)
  timeout $(left) python3 -m pytest $file -q -rs -p no:cacheprovider -p no:warnings >> $ev/pytest-suite.txt 2>&1
  rc=$?
  # 124: this call's time ran out inside the file; it runs again, whole, in the next call.
  if [ $rc = 124 ]; then echo "$name: stopped by the call's time" >> $ev/pytest-suite.txt; break; fi
  printf '%s\t%s\t%s\n' $name $rc $(( $(date +%s) - start )) >> $ev/pytest-suite-status.tsv
  touch $ev/done/$name
done
all=$(echo ${FILES:-tests/test_*.py} | wc -w) ran=$(ls $ev/done | wc -l)
echo "$ran of $all files run; exit statuses other than 0 (5: nothing collected): $(awk -F'\t' '$2 != 0' \
  $ev/pytest-suite-status.tsv 2>/dev/null | cut -f1,2 | tr '\t\n' '= ' )" | tee $ev/summary.txt
[ $ran = $all ] && echo "all files run" | tee -a $ev/summary.txt
tar czf $OUT/gpu-suite.tar.gz $ev

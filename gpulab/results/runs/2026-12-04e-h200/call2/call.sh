#!/usr/bin/env bash
# session 2026-12-04e, call 2: fused norms on and off (--unfused) in the same call: the prompt after a
# cached 2K-token system prompt and the 1-row decode step (--cached-only), then a mixed step of 120
# decodes and 7 prompts and a 128-row decode step; the new tests compiled. Outputs in one archive.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; mkdir -p $R
pack() { tar czf $OUT/call2.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
for v in fused unfused; do
  flag=""; [ $v = unfused ] && flag="--unfused"
  s=$(date +%s)
  timeout -k 5 120 python3 tools/engine_step_profile.py --cached-only $flag --json $R/cached_$v.json > $R/cached_$v.txt 2>&1; echo "cached $v rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
  pack
done
for v in fused unfused; do
  flag=""; [ $v = unfused ] && flag="--unfused"
  s=$(date +%s)
  timeout -k 5 120 python3 tools/engine_step_profile.py --mixed --decode-batches 128 $flag --json $R/mixed_$v.json > $R/mixed_$v.txt 2>&1; echo "mixed $v rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
  pack
done
s=$(date +%s)
timeout -s INT -k 10 70 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_fused_norms.py tests/test_rope.py tests/test_model.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -3 $R/tests.txt
pack
true

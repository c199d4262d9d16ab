#!/usr/bin/env bash
# session 2026-12-04g, call 1 (main at cc8fd7c): the final build's kernels compiled for the
# first time: the rollout and block-step kernels with their loops (tests, launch options),
# the split-KV merge fix (test_prefill), then the speculative benchmark at batch 1, k = 4.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r1g; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call1.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 220 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 12 --junitxml=$R/junit.xml \
  tests/test_block_step.py tests/test_speculative.py tests/test_prefill.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -6 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 80 python3 tools/rollout_probe.py $R/rollout_probe.json > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 170 python3 tools/speculative_bench.py $R/spec --quick --batches 1 --no-server --ks 4 > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
pack
cat $R/times.txt
true

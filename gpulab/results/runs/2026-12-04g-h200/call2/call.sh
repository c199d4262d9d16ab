#!/usr/bin/env bash
# session 2026-12-04g, call 2 (main at db4f8d1): the rollout kernel's GLU and head chunks
# and pipeline stages (tools/rollout_probe.py); the speculative benchmark at batch 1 and
# 64 with the next step's drafts launched ahead of the host's read (and a row without);
# then compiled tests: test_speculative (the drafting-ahead tests), test_piecewise, test_engine.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2g; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call2.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 90 python3 tools/rollout_probe.py $R/rollout_probe.json > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 200 python3 tools/speculative_bench.py $R/spec --quick --batches 1,64 --no-server --ks 4 > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
pack
s=$(date +%s)
timeout -s INT -k 10 170 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 12 --junitxml=$R/junit.xml \
  tests/test_speculative.py tests/test_piecewise.py tests/test_engine.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -6 $R/tests.txt
pack
cat $R/times.txt
true

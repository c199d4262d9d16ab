#!/usr/bin/env bash
# session 2026-12-04d, call 1: where a decode step of 64 and 128 rows spends its time (continuous
# batching's steps hold ~120 rows); the few-rows kernel against the package's dispatch at 128 and
# 256 rows on the engine's shapes; tests/test_server.py compiled (server wheels carried)
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r1; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 150 python3 tools/engine_step_profile.py --decode-batches 64,128 --json $R/decode_prof.json > $R/decode_prof.txt 2>&1; echo "decode prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 250 python3 tools/few_rows_split_probe.py $R --ms 128,256 --budget 200 > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 170 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 4 --junitxml=$R/junit.xml \
  tests/test_server.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

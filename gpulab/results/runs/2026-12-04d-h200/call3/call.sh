#!/usr/bin/env bash
# session 2026-12-04d, call 3: the final many-rows rule (bitlinear.many_rows_tile): a continuous
# step (120 decodes + 7 prompts) and a 128-row decode step profiled, the engine bench's throughput
# part (to ship), gpulab bench ternary_mm_small (M = 128 added), the bitlinear, model and engine
# tests compiled
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 150 python3 tools/engine_step_profile.py --mixed --decode-batches 128 --json $R/prof.json > $R/prof.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 200 python3 tools/engine_bench.py $R/eb --parts 1 > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 80 python3 -m gpulab bench ternary_mm_small > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 200 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 6 --junitxml=$R/junit.xml \
  tests/test_bitlinear.py tests/test_model.py tests/test_engine.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

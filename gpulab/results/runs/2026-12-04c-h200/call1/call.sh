#!/usr/bin/env bash
# session 2026-12-04c, call 1: the cached step's profile at f3a5ef2; the compiled tests left by the last session
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 170 python3 tools/engine_step_profile.py --cached-only --json $R/prof_full.json > $R/prof_full.txt 2>&1; echo "prof full rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 360 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 6 --junitxml=$R/junit.xml \
  tests/test_piecewise.py tests/test_engine.py tests/test_block_step.py tests/test_prefill.py \
  "tests/test_speculative.py::test_cuda_graph_speculation_equals_the_eager_path" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

#!/usr/bin/env bash
# session 2026-12-04b, call 2: whole-step graphs for small prompt steps: compiled tests, TTFT, the cached step's profile
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 150 python3 tools/engine_bench.py $R/eb --parts 2 > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -k 5 130 python3 tools/engine_step_profile.py --cached-only --json $R/prof_full.json > $R/prof_full.txt 2>&1; echo "prof full rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -k 5 230 python3 -m pytest -o addopts="" -p no:cacheprovider -q -n 4 --junitxml=$R/junit.xml \
  tests/test_piecewise.py tests/test_engine.py tests/test_block_step.py \
  "tests/test_speculative.py::test_cuda_graph_speculation_equals_the_eager_path" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/

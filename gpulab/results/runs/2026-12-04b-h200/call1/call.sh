#!/usr/bin/env bash
# session 2026-12-04b, call 1: mlgru_scan_train's graph row, the tests never passed compiled, the cached-prompt step's profile
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 170 python3 -m gpulab bench mlgru_scan_train --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/mlgru_scan_train.json $R/ 2>/dev/null
s=$(date +%s)
timeout -k 5 180 python3 -m pytest -o addopts="" -p no:cacheprovider -q --junitxml=$R/junit.xml \
  "tests/test_prefill.py::test_split_workspace_shorter_than_q_is_never_overrun" \
  "tests/test_prefill.py::test_kv_split_plan_fills_idle_sms_only" \
  "tests/test_runtime_and_bench.py::test_spec_host_profile_says_what_to_fix_before_it_needs_a_gpu" \
  "tests/test_runtime_and_bench.py::test_host_and_wall_us_times_queued_calls" \
  "tests/test_piecewise.py::test_kv_split_must_be_a_flag_or_a_count" \
  "tests/test_piecewise.py::test_engine_with_split_kv_serves_what_it_does_without" \
  tests/test_block_step.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
cp -r $R/* $OUT/

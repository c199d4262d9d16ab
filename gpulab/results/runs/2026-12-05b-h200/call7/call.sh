#!/usr/bin/env bash
# written in the session of 2026-12-05 (fourteenth), run in the fifteenth (T0=300; the fourteenth's device time was
# spent): the compiled tests calls 5 and 6 did not reach on the current code. Each planted
# rollout compiles kernels of its own (about 40 s each on the H100), so one per worker.
set -u
source tools/gpu-call.sh call7
s=$(date +%s)
timeout -s INT ${T0:-250} python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 4 --junitxml=$R/junit.xml \
  "tests/test_block_step.py::test_the_rollout_check_rejects_wrong_rollouts_and_names_the_cause" \
  "tests/test_multi_step.py::test_the_benchmark_times_the_target_alone_with_windows_too" > $R/tests.txt 2>&1
echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -3 $R/tests.txt
pack
cat $R/times.txt
true

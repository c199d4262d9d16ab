#!/bin/bash
source tools/gpu-env.sh
R=$OUT/c3; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt
t0=$(date +%s)
timeout 90 python3 tools/engine_step_profile.py --reps 8 --cached-only --json $R/profile.json > $R/profile.txt 2>&1
echo "profile $(( $(date +%s)-t0 ))s" >> $R/times.txt
CI=true timeout 150 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_piecewise.py "tests/test_runtime_and_bench.py::test_decode_kernels_launch_directly_once_compiled" --junitxml=$R/junit1.xml > $R/tests1.txt 2>&1
echo "tests1 $(( $(date +%s)-t0 ))s" >> $R/times.txt
CI=true timeout $(( 370 - ($(date +%s)-t0) )) python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_prefill.py tests/test_paged.py --junitxml=$R/junit2.xml > $R/tests2.txt 2>&1
echo "tests2 $(( $(date +%s)-t0 ))s" >> $R/times.txt

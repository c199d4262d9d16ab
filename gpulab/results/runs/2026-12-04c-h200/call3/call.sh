#!/usr/bin/env bash
# session 2026-12-04c, call 3: the few-rows tiles of call 2's sweep (small_mm_config, split-K) and the
# driver's arrival spin: the cached step's profile, TTFT without then with prefix caching, compiled tests
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3; mkdir -p $R
{ git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 110 python3 tools/engine_step_profile.py --cached-only --json $R/prof_full.json > $R/prof_full.txt 2>&1; echo "prof full rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 250 python3 tools/engine_bench.py $R/eb --parts 2 --ttft-order off,on > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/engine_bench.json $R/ttft.json 2>/dev/null; cp $R/eb/engine_ttft.png $R/ 2>/dev/null; rm -rf $R/eb
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 170 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_bitlinear.py tests/test_piecewise.py tests/test_engine.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

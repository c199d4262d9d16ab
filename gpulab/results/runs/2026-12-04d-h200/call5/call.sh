#!/usr/bin/env bash
# session 2026-12-04d, call 5: a mixed step's decode plan no longer reads the layout back (three
# host syncs a step; faults read with each step's tokens instead): the engine bench's throughput
# and TTFT parts, then the paged, engine, speculative and piecewise tests compiled
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r5; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 290 python3 tools/engine_bench.py $R/eb --parts 1,2 --ttft-order off,on > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 190 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 6 --junitxml=$R/junit.xml \
  tests/test_paged.py tests/test_engine.py tests/test_speculative.py tests/test_piecewise.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -5 $R/tests.txt
cp -r $R/* $OUT/
true

#!/usr/bin/env bash
# session 2026-12-04c, call 5: the stage rule fixed (K = N = 8192 at 64 rows back to three stages):
# gpulab bench ternary_mm_small, compiled tests/test_bitlinear.py, TTFT once more (off, then on)
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r5; mkdir -p $R
{ git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 90 python3 -m gpulab bench ternary_mm_small > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 120 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_bitlinear.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 200 python3 tools/engine_bench.py $R/eb --parts 2 --ttft-order off,on > $R/eb.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/engine_bench.json $R/ttft.json 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/ttft.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
true

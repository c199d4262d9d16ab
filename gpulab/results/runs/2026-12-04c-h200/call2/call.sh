#!/usr/bin/env bash
# session 2026-12-04c, call 2: the few-rows ternary matmul's tiles and split-K on the engine bench's shapes
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; mkdir -p $R
s=$(date +%s)
timeout -k 5 540 python3 tools/few_rows_split_probe.py $R --budget 470 > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

#!/usr/bin/env bash
# session 2026-12-04c, call 4: the engine bench's throughput and TTFT parts on the new few-rows tiles
# (one JSON to ship), then gpulab bench ternary_mm_small (its M = 64 tile changed)
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r4; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 400 python3 tools/engine_bench.py $R/eb --parts 1,2 --ttft-order off,on > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 100 python3 -m gpulab bench ternary_mm_small > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

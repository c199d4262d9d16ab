#!/usr/bin/env bash
# session 2026-12-04d, call 2: up to 256 rows on the few-rows kernel (SMALL_MM_MAX_M 64 -> 256, tiles
# for 65-256 rows): the engine bench's throughput part, a decode step of 128 rows profiled again,
# and the same sweep at 128 and 256 rows on the K = N = 8192-class shapes (not the engine's)
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 220 python3 tools/engine_bench.py $R/eb --parts 1 > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 120 python3 tools/engine_step_profile.py --decode-batches 128 --json $R/decode_prof.json > $R/decode_prof.txt 2>&1; echo "decode prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 150 python3 tools/few_rows_split_probe.py $R --ms 128,256 --shapes 8192x8192,14336x4096,4096x14336,4096x4096 --budget 110 > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

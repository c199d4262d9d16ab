#!/usr/bin/env bash
# session 2026-12-04e, call 1: the residual add and SiLU·mul fused into the norms of the projections
# that read them (gpulab/fused_norms.py): the engine bench's throughput and TTFT parts, a mixed and a
# 1- and 128-row decode step profiled, the two kernels' benchmarks, their tests compiled
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r1; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 290 python3 tools/engine_bench.py $R/eb --parts 1,2 --ttft-order off,on > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 150 python3 tools/engine_step_profile.py --mixed --decode-batches 1,128 --json $R/prof.json > $R/prof.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
s=$(date +%s)
timeout -k 5 80 python3 -m gpulab bench add_rmsnorm_quant silu_mul_rmsnorm_quant --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/add_rmsnorm_quant.json gpulab/results/silu_mul_rmsnorm_quant.json $R/ 2>/dev/null
cp -r $R/* $OUT/
s=$(date +%s)
timeout -s INT -k 10 60 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_fused_norms.py tests/test_rope.py tests/test_model.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -3 $R/tests.txt
cp -r $R/* $OUT/
true

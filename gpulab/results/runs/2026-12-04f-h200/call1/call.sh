#!/usr/bin/env bash
# session 2026-12-04f, call 1 (branch full-graph-decode-split): in whole-step graphs above 128 rows the
# one-token requests go through the paged decode kernel, only prompt chunks through the append kernel.
# The engine bench's throughput and TTFT parts, the engine's and graphs' tests compiled, then the fused
# norms' benchmarks with FlashInfer's rows (.peers carried).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r1; mkdir -p $R
pack() { tar czf $OUT/call1.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 270 python3 tools/engine_bench.py $R/eb --parts 1,2 --ttft-order off,on > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
pack
s=$(date +%s)
timeout -s INT -k 10 170 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_engine.py tests/test_piecewise.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -5 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 100 python3 -m gpulab bench add_rmsnorm_quant silu_mul_rmsnorm_quant --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/add_rmsnorm_quant.json gpulab/results/silu_mul_rmsnorm_quant.json $R/ 2>/dev/null
pack
cat $R/times.txt
true

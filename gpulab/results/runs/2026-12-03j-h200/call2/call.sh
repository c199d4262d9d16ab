#!/usr/bin/env bash
# call 2: compiled tests (mlgru with the two-phase backward, bitlinear with the few-rows load
# without `other`, rope never compiled before), the MLGRU train/backward sweep, then the
# benchmarks as called (ternary M = 1/16/4096 and few rows; mlgru fwd+bwd; backward kernels)
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/out/env.txt 2>&1
TT=150 TN=12 NBS= timeout 170 bash tools/gpu-suite.sh $R/suite tests/test_mlgru.py tests/test_bitlinear.py tests/test_rope.py > $R/out/suite.txt 2>&1
cp $R/suite/tests.txt $R/out/tests.txt; cp $R/suite/junit.xml $R/out/junit.xml
echo "tests at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout 90 python3 tools/mlgru_scan_bench.py $R/sweep --quick --train > $R/out/mlgru_train.txt 2>&1
echo "mlgru sweep: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp $R/sweep/mlgru_scan_bench.json $R/out/ 2>/dev/null
timeout 100 python3 -m gpulab bench mlgru_scan_train mlgru_scan_backward_two_phase mlgru_scan_backward_chunked --save > $R/out/bench_mlgru.txt 2>&1
echo "bench mlgru: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/mlgru_scan_train.json gpulab/results/mlgru_scan_backward_two_phase.json gpulab/results/mlgru_scan_backward_chunked.json $R/out/ 2>/dev/null
timeout 130 python3 -m gpulab bench ternary_matmul ternary_mm_small --save > $R/out/bench_ternary.txt 2>&1
echo "bench ternary: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/ternary_matmul.json gpulab/results/ternary_mm_small.json $R/out/ 2>/dev/null
tar -C $R/out -czf $OUT/call2.tgz .
cp $R/out/env.txt $R/out/tests.txt $R/out/mlgru_train.txt $R/out/bench_mlgru.txt $R/out/bench_ternary.txt $OUT/ 2>/dev/null
ls -la $OUT

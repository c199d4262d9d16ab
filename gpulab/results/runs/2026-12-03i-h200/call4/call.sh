#!/usr/bin/env bash
# call 4: compiled bitlinear + mlgru tests (codes + dp4a few-rows kernel; two-phase scan as
# the rule for T >= 2048), then the benchmarks as called, then the few-rows sweep notebook 01 reads
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/out/env.txt 2>&1
TT=110 TN=12 NBS= timeout 125 bash tools/gpu-suite.sh $R/suite tests/test_bitlinear.py tests/test_mlgru.py > $R/out/suite.txt 2>&1
cp $R/suite/tests.txt $R/out/tests.txt; cp $R/suite/junit.xml $R/out/junit.xml
echo "tests at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout 150 python3 -m gpulab bench ternary_matmul ternary_mm_small --save > $R/out/bench_ternary.txt 2>&1
echo "bench ternary: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/ternary_matmul.json gpulab/results/ternary_mm_small.json $R/out/ 2>/dev/null
timeout 100 python3 -m gpulab bench mlgru_scan --save > $R/out/bench_mlgru.txt 2>&1
echo "bench mlgru: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/mlgru_scan.json $R/out/ 2>/dev/null
left=$(( 400 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && timeout $left python3 tools/small_m_probe.py $R/probe --quick > $R/out/probe.txt 2>&1
echo "probe: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp $R/probe/small_m_probe.json $R/out/ 2>/dev/null
tar -C $R/out -czf $OUT/call4.tgz .
cp $R/out/env.txt $R/out/tests.txt $R/out/bench_ternary.txt $R/out/bench_mlgru.txt $R/out/probe.txt $OUT/ 2>/dev/null
ls -la $OUT

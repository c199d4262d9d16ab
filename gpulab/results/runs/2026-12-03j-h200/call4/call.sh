#!/usr/bin/env bash
# call 4: compiled tests and notebooks 02/03 (rmsnorm_quant without masks on even rows and a
# tuner key for few/many programs; the two-phase MLGRU backward), then the benchmarks as called
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/out/env.txt 2>&1
TT=130 TN=10 NBT=150 NBN=2 NBS="02 03" timeout 175 bash tools/gpu-suite.sh $R/suite tests/test_normquant.py tests/test_normquant_grouped.py tests/test_model.py > $R/out/suite.txt 2>&1
cp $R/suite/tests.txt $R/suite/junit.xml $R/suite/notebooks.txt $R/out/ 2>/dev/null
cp $R/suite/notebooks_junit.xml $R/out/ 2>/dev/null
echo "suite at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout 80 python3 -m gpulab bench rmsnorm_quant --save > $R/out/bench_rmsnorm.txt 2>&1
echo "bench rmsnorm: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/rmsnorm_quant.json $R/out/ 2>/dev/null
timeout 80 python3 -m gpulab bench mlgru_scan_train --save > $R/out/bench_train.txt 2>&1
echo "bench train: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp gpulab/results/mlgru_scan_train.json $R/out/ 2>/dev/null
timeout 60 python3 tools/rmsnorm_pieces_probe.py $R/out > $R/out/rmsnorm_pieces.txt 2>&1
echo "rmsnorm probe: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
tar -C $R/out -czf $OUT/call4.tgz .
cp $R/out/env.txt $R/out/tests.txt $R/out/notebooks.txt $R/out/bench_rmsnorm.txt $R/out/bench_train.txt $R/out/rmsnorm_pieces.txt $OUT/ 2>/dev/null
ls -la $OUT

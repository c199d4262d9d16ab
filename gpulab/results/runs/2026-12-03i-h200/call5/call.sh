#!/usr/bin/env bash
# call 5: forward + backward of the MLGRU scan as called (the forward now two-phase at T = 8192)
source tools/gpu-env.sh; mkdir -p /tmp/r
timeout 95 python3 -m gpulab bench mlgru_scan_train --save > /tmp/r/bench_train.txt 2>&1; echo "exit $?" >> /tmp/r/bench_train.txt
cp /tmp/r/bench_train.txt gpulab/results/mlgru_scan_train.json $OUT/ 2>/dev/null; ls $OUT

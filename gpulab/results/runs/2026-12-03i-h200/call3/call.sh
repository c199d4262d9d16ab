#!/usr/bin/env bash
# call 3: the MLGRU two-phase scan launched directly (DirectLaunch), chunks 16..1024 with L2
# windows, each also in a CUDA graph; then T = 512..4096 (where the rule should switch)
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/env.txt 2>&1
timeout 250 python3 tools/mlgru_scan_bench.py $R/scan --first-only --graph > $R/scan.txt 2>&1
echo "scan bench: exit $? at $(( $(date +%s) - t0 )) s" >> $R/env.txt
timeout 150 python3 tools/mlgru_scan_bench.py $R/sweep --t-sweep > $R/sweep.txt 2>&1
echo "t sweep: exit $? at $(( $(date +%s) - t0 )) s" >> $R/env.txt
cp $R/env.txt $R/scan.txt $R/sweep.txt $OUT/
cp $R/scan/mlgru_scan_bench.json $OUT/scan.json 2>/dev/null; cp $R/sweep/mlgru_scan_bench.json $OUT/sweep.json 2>/dev/null
ls -la $OUT

#!/usr/bin/env bash
# call 3: the MLGRU forward+backward as called with the profiler's kernel times; the
# rmsnorm_quant pieces probe (4096 x 14336); the few-rows matmul as called (M = 2..64)
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/out/env.txt 2>&1
timeout 120 python3 tools/mlgru_scan_bench.py $R/out --train-only > $R/out/mlgru_train.txt 2>&1
echo "mlgru train: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout 120 python3 tools/rmsnorm_pieces_probe.py $R/out > $R/out/rmsnorm_pieces.txt 2>&1
echo "rmsnorm pieces: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout 150 python3 tools/small_m_probe.py $R/probe --quick > $R/out/probe.txt 2>&1
echo "probe: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
cp $R/probe/small_m_probe.json $R/out/ 2>/dev/null
tar -C $R/out -czf $OUT/call3.tgz .
cp $R/out/env.txt $R/out/mlgru_train.txt $R/out/rmsnorm_pieces.txt $R/out/probe.txt $OUT/ 2>/dev/null
ls -la $OUT

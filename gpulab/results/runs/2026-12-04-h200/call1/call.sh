#!/usr/bin/env bash
# call 1 (2026-12-04): the decoupled look-back forward scan probe and the rmsnorm_quant pieces
# probe on the H200 (first time for both), then forward + backward as benchmarked in two
# fresh processes with the host-queue / allocator / graph columns
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out $R/a $R/b; t0=$(date +%s)
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/out/env.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/out/env.txt
timeout -k 5 170 python3 tools/mlgru_lookback_probe.py $R/out > $R/out/lookback.txt 2>&1
echo "lookback: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout -k 5 90 python3 tools/rmsnorm_pieces_probe.py $R/out > $R/out/rmsnorm_pieces.txt 2>&1
echo "pieces: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout -k 5 110 python3 tools/mlgru_scan_bench.py $R/a --configs > $R/out/configs_a.txt 2>&1
echo "configs a: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
timeout -k 5 110 python3 tools/mlgru_scan_bench.py $R/b --configs > $R/out/configs_b.txt 2>&1
echo "configs b: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
for d in a b; do for f in $R/$d/*.json; do cp $f $R/out/${d}_$(basename $f); done; done
cp $R/out/* $OUT/ ; ls -la $OUT

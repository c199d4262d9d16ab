#!/bin/bash
source tools/gpu-env.sh
R=/tmp/r; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $R/env.txt
t0=$(date +%s)
timeout 280 python3 tools/speculative_bench.py $R/spec --quick --batches '' --server-modes process,thread > $R/spec.txt 2>&1
echo "spec rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/spec.txt $R/times.txt $OUT/ 2>/dev/null; cp $R/spec/speculative.json $OUT/spec_server.json 2>/dev/null
timeout $(( 560 - ($(date +%s)-t0) )) python3 tools/engine_bench.py $R/eb --parts 2 > $R/eb.txt 2>&1
echo "eb rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/eb.txt $R/times.txt $R/env.txt $OUT/; cp $R/eb/engine_bench.json $OUT/eb_ttft.json 2>/dev/null

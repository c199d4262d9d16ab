#!/bin/bash
source tools/gpu-env.sh
R=/tmp/r; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt; nproc >> $R/env.txt
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv >> $R/env.txt
t0=$(date +%s)
timeout 300 python3 tools/speculative_bench.py $R/spec --quick --batches '' --server-modes process,scaleout --api-servers 4 > $R/spec.txt 2>&1
echo "spec rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/spec.txt $R/times.txt $R/env.txt $OUT/ 2>/dev/null; cp $R/spec/speculative.json $OUT/spec_server.json 2>/dev/null
timeout 120 python3 tools/engine_step_profile.py --cached-only --gap 0.25 --reps 6 --json $R/gap.json > $R/gap.txt 2>&1
echo "gap rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
timeout 60 python3 tools/engine_step_profile.py --cached-only --reps 6 --json $R/nogap.json > $R/nogap.txt 2>&1
echo "nogap rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
(echo "=== no gap"; cat $R/nogap.txt) >> $R/gap.txt; cp $R/gap.txt $R/gap.json $R/times.txt $OUT/ 2>/dev/null
left=$(( 550 - ($(date +%s)-t0) ))
if [ $left -gt 150 ]; then
  timeout $left python3 tools/speculative_bench.py $R/spec16 --quick --batches '' --server-modes scaleout --api-servers 4 --server-rounds 16 > $R/spec16.txt 2>&1
  echo "spec16 rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
  cp $R/spec16.txt $R/times.txt $OUT/; cp $R/spec16/speculative.json $OUT/spec16.json 2>/dev/null
fi

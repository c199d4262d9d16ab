#!/bin/bash
source tools/gpu-env.sh
R=/tmp/r; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt; lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|Model name|MHz" >> $R/env.txt
t0=$(date +%s)
CI=true timeout 90 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_engine.py -k "first_tokens or overlap or n_completions" -rf > $R/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/tests.txt $R/times.txt $R/env.txt $OUT/
timeout 200 python3 tools/speculative_bench.py $R/s8 --quick --batches '' --server-modes scaleout --api-servers 4 --server-rounds 16 > $R/s8.txt 2>&1
echo "s8 rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/s8.txt $R/times.txt $OUT/; cp $R/s8/speculative.json $OUT/s8.json 2>/dev/null
left=$(( 470 - ($(date +%s)-t0) ))
timeout $left python3 tools/speculative_bench.py $R/s2 --quick --batches '' --server-modes scaleout --api-servers 4 --server-rounds 16 --client-processes 2 > $R/s2.txt 2>&1
echo "s2 rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/s2.txt $R/times.txt $OUT/; cp $R/s2/speculative.json $OUT/s2.json 2>/dev/null

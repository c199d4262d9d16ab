#!/bin/bash
source tools/gpu-env.sh
R=/tmp/r; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt
t0=$(date +%s)
CI=true timeout 110 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_piecewise.py -x -rf > $R/tests.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/tests.txt $R/times.txt $R/env.txt $OUT/
timeout 250 python3 tools/engine_bench.py $R/eb --parts 2 --kv-split > $R/eb.txt 2>&1
echo "eb rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
grep -v "continuous:\|static:" $R/eb.txt > $R/eb_short.txt
cp $R/eb_short.txt $R/times.txt $OUT/; cp $R/eb/engine_bench.json $OUT/eb_split.json 2>/dev/null
left=$(( 555 - ($(date +%s)-t0) ))
timeout $left python3 tools/speculative_bench.py $R/spec --quick --batches '' --server-modes profile --api-servers 4 --server-rounds 16 > $R/prof.txt 2>&1
echo "prof rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/prof.txt $R/times.txt $OUT/; cp $R/spec/speculative.json $OUT/spec_prof.json 2>/dev/null

#!/bin/bash
source tools/gpu-env.sh
R=/tmp/r; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt; nproc >> $R/env.txt
t0=$(date +%s)
timeout 320 python3 tools/speculative_bench.py $R/spec --quick --batches '' --server-modes scaleout,process --api-servers 4 > $R/spec.txt 2>&1
echo "spec rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/spec.txt $R/times.txt $OUT/ 2>/dev/null; cp $R/spec/speculative.json $OUT/spec_server.json 2>/dev/null
CI=true timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_server.py --junitxml=$R/junit1.xml > $R/tests1.txt 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
cp $R/tests1.txt $R/junit1.xml $R/times.txt $R/env.txt $OUT/
left=$(( 545 - ($(date +%s)-t0) ))
if [ $left -gt 150 ]; then
  timeout $left python3 tools/speculative_bench.py $R/spec6 --quick --batches '' --server-modes scaleout --api-servers 6 > $R/spec6.txt 2>&1
  echo "spec6 rc=$? $(( $(date +%s)-t0 ))s" >> $R/times.txt
  cp $R/spec6.txt $R/times.txt $OUT/; cp $R/spec6/speculative.json $OUT/spec6.json 2>/dev/null
fi

#!/bin/bash
source tools/gpu-env.sh
R=$OUT/c2; mkdir -p $R
git log --oneline -1 > $R/env.txt; git status --short >> $R/env.txt
t0=$(date +%s)
timeout 270 python3 tools/engine_bench.py $R/eb --parts 2,1 --kv-split > $R/engine_bench.txt 2>&1
echo "engine_bench $(( $(date +%s)-t0 ))s" >> $R/times.txt
timeout 190 python3 tools/speculative_bench.py $R/spec --quick --batches 1 --server-modes process > $R/speculative.txt 2>&1
cp $R/spec/speculative.json $R/speculative_json.txt 2>/dev/null
echo "spec $(( $(date +%s)-t0 ))s" >> $R/times.txt
CI=true timeout 110 python3 -m pytest -q -o addopts="" -p no:cacheprovider -x tests/test_piecewise.py tests/test_runtime_and_bench.py -k "piecewise or direct" > $R/tests.txt 2>&1
echo "tests $(( $(date +%s)-t0 ))s" >> $R/times.txt

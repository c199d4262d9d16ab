#!/usr/bin/env bash
# session 2026-12-04b, call 4: TTFT without prefix caching first, then with; the compiled tests again (report kept on the time limit)
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r; mkdir -p $R
s=$(date +%s)
timeout -k 5 285 python3 tools/engine_bench.py $R/eb2 --parts 2 --ttft-order off,on > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -s INT -k 10 125 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 6 --junitxml=$R/junit.xml \
  tests/test_piecewise.py tests/test_prefill.py tests/test_block_step.py \
  "tests/test_speculative.py::test_cuda_graph_speculation_equals_the_eager_path" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/times.txt $R/tests.txt $R/junit.xml $R/ttft.txt $OUT/ 2>/dev/null; cp $R/eb2/engine_bench.json $OUT/ttft.json 2>/dev/null; cp $R/eb2/engine_ttft.png $OUT/ 2>/dev/null
true

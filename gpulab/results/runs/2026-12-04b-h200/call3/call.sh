#!/usr/bin/env bash
# session 2026-12-04b, call 3: surplus work items return at once; TTFT, throughput, compiled tests, the cached step's profile
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r; mkdir -p $R
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 235 python3 tools/engine_bench.py $R/eb2 --parts 2 > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -k 5 120 python3 tools/engine_bench.py $R/eb1 --parts 1 > $R/thr.txt 2>&1; echo "thr rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -k 5 160 python3 -m pytest -o addopts="" -p no:cacheprovider -q -n 4 --junitxml=$R/junit.xml \
  tests/test_piecewise.py tests/test_prefill.py tests/test_block_step.py \
  "tests/test_speculative.py::test_cuda_graph_speculation_equals_the_eager_path" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
s=$(date +%s)
timeout -k 5 60 python3 tools/engine_step_profile.py --cached-only --json $R/prof_full.json > $R/prof_full.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cd $R && tar czf /tmp/rest.tgz eb1 eb2 env.txt prof_full.json && cd - >/dev/null
cp $R/times.txt $R/ttft.txt $R/thr.txt $R/tests.txt $R/prof_full.txt $R/junit.xml /tmp/rest.tgz $OUT/ 2>/dev/null

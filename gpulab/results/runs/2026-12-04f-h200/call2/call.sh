#!/usr/bin/env bash
# session 2026-12-04f, call 2: k greedy drafts of the MLGRU draft in one kernel
# (gpulab/block_step.py: draft_rollout): its tests and the engine's compiled, its benchmark,
# then the speculative benchmark at batch 1 (k = 4 and 8, adaptive; the stepped draft graph
# and the eager drafter at k = 4 for comparison).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; mkdir -p $R
pack() { tar czf $OUT/call2.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 200 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_block_step.py tests/test_speculative.py tests/test_piecewise.py tests/test_engine.py tests/test_prefill.py \
  > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -8 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 60 python3 -m gpulab bench draft_rollout block_step --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/draft_rollout.json gpulab/results/block_step.json $R/ 2>/dev/null
pack
s=$(date +%s)
timeout -k 5 280 python3 tools/speculative_bench.py $R/spec --quick --batches 1 --no-server > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
pack
cat $R/times.txt
true

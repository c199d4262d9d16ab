#!/usr/bin/env bash
# session 2026-12-05 (tenth), call 1, main at f80f4a2: the compiled tests of everything
# changed since the last GPU run (the eighth session's calls 3 and 4 merged: the rollout's
# wide tiles and drafting ahead, int8 draft weights, the KV store inside RoPE, the fused
# residual quantize, the schedule kernel; then the server and the parallel engine, not run
# compiled since the forward changed), then the speculative benchmark at batch 1 and 64,
# the rollout probe and the draft kernels' and RoPE's benchmarks.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r1; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call1.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 270 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 14 --junitxml=$R/junit.xml \
  tests/test_block_step.py tests/test_speculative.py tests/test_rope.py tests/test_fused_norms.py \
  tests/test_prefill.py tests/test_engine.py tests/test_piecewise.py tests/test_engine_blocks.py \
  tests/test_engine_grading.py tests/test_server.py tests/test_parallel_engine.py > $R/tests.txt 2>&1
echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -5 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 140 python3 tools/speculative_bench.py $R/spec --quick --batches 1,64 --no-server --ks 4 > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
tail -15 $R/spec.txt
pack
s=$(date +%s)
timeout -k 5 60 python3 tools/rollout_probe.py $R/rollout_probe.json > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 70 python3 -m gpulab bench draft_rollout block_step rope_kv --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/draft_rollout.json gpulab/results/block_step.json gpulab/results/rope_kv.json $R/ 2>/dev/null
pack
cat $R/times.txt
true

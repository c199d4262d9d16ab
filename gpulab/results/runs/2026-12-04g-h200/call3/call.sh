#!/usr/bin/env bash
# session 2026-12-04g, call 3 (main at fa8db29; not run: for the next session, on its build):
# the rollout's wide tiles (whole hidden row, 256 logits a chunk, one stage; the hidden row
# made once) and drafting ahead fixed for sequences that reach a special token: compiled
# tests of both, the speculative benchmark at batch 1 and 64, the rollout probe, the two
# kernels' benchmarks, then compiled tests not run since the model's forward changed
# (engine grading and blocks). Since the eighth session the probe, the benchmark and the
# block-step specs also run the draft kernels with int8 weights (block_step.INT8_WEIGHTS),
# and this call measures drafting ahead as fixed then (batch 1 read rewritten drafts; the
# results' copy now goes before the drafts ahead; their start inside the rollout kernel)
# and the rollout's last step on a side stream (the probe times both launches; the
# benchmark's draft_ahead_ms).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3g; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call3.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 100 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 12 --junitxml=$R/junit.xml \
  tests/test_block_step.py tests/test_speculative.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 200 python3 tools/speculative_bench.py $R/spec --quick --batches 1,64 --no-server --ks 4 > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
pack
s=$(date +%s)
timeout -k 5 100 python3 tools/rollout_probe.py $R/rollout_probe.json > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 50 python3 -m gpulab bench draft_rollout block_step --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/draft_rollout.json gpulab/results/block_step.json $R/ 2>/dev/null
pack
s=$(date +%s)
timeout -s INT -k 10 60 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 12 --junitxml=$R/junit2.xml \
  tests/test_engine_grading.py tests/test_engine_blocks.py > $R/tests2.txt 2>&1; echo "tests2 rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests2.txt
pack
cat $R/times.txt
true

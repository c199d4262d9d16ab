#!/usr/bin/env bash
# session 2026-12-05 (tenth), call 3 (.peers carried): speculative decoding with the draft's
# int8 weights at k = 6 and 8 (batch 1: was the step host-bound at k = 4, 0.43 ms against
# 0.27 ms of draft and verify replays?), batch 64 at k = 4, then the peers' tests compiled
# (FlashInfer's rows of the fused norms, not run since the forward changed).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call3.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 ${T1:-150} python3 tools/speculative_bench.py $R/s1 --quick --batches 1 --no-server --ks 6,8 --eager-k 0 > $R/spec_b1.txt 2>&1; echo "spec b1 rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/s1/speculative.json $R/speculative_b1.json 2>/dev/null; rm -rf $R/s1
cat $R/spec_b1.txt
pack
s=$(date +%s)
timeout -k 5 ${T2:-130} python3 tools/speculative_bench.py $R/s64 --quick --batches 64 --no-server --ks 4 --eager-k 0 > $R/spec_b64.txt 2>&1; echo "spec b64 rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/s64/speculative.json $R/speculative_b64.json 2>/dev/null; rm -rf $R/s64
cat $R/spec_b64.txt
pack
s=$(date +%s)
timeout -s INT -k 10 ${T3:-100} python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_peers.py "tests/test_block_step.py::test_the_rollout_check_rejects_wrong_rollouts_and_names_the_cause" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
cat $R/times.txt
true

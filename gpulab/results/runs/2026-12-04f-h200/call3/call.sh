#!/usr/bin/env bash
# session 2026-12-04f, call 3: the rollout kernel's launch options (num_warps, the GLU's
# hidden rows in a workspace; tools/rollout_probe.py), its tests compiled, the speculative
# benchmark at batch 1 with the new defaults (8 warps, workspace), then the engine bench's
# throughput part with the split-KV merge fixed (c3d8512).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3f; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call3.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 120 python3 tools/rollout_probe.py $R/rollout_probe.json > $R/probe.txt 2>&1; echo "probe rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -s INT -k 10 90 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_block_step.py "tests/test_speculative.py::test_the_rollout_kernel_drafts_what_the_stepped_graph_does" \
  "tests/test_speculative.py::test_graph_path_sampled_output_equals_the_eager_path" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 200 python3 tools/speculative_bench.py $R/spec --quick --batches 1 --no-server --ks 4,8 > $R/spec.txt 2>&1; echo "spec rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/spec/* $R/ 2>/dev/null; rm -rf $R/spec
pack
s=$(date +%s)
timeout -k 5 140 python3 tools/engine_bench.py $R/eb --parts 1 > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
pack
cat $R/times.txt
true

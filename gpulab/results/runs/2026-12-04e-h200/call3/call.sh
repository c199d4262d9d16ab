#!/usr/bin/env bash
# session 2026-12-04e, call 3: whole-step CUDA graphs for big steps too (up to 2048 rows, as many
# requests as the engine runs; gpulab/engine/full_graphs.py) with the fused norms: the engine bench's
# throughput and TTFT parts, the engine's and graphs' tests compiled, a mixed step profiled.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r3; mkdir -p $R
pack() { tar czf $OUT/call3.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 300 python3 tools/engine_bench.py $R/eb --parts 1,2 --ttft-order off,on > $R/eb.txt 2>&1; echo "engine_bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/* $R/ 2>/dev/null; rm -rf $R/eb; tr '\r' '\n' < $R/eb.txt | grep -v "it/s\]$" > $R/eb_clean.txt; rm -f $R/eb.txt
pack
s=$(date +%s)
timeout -s INT -k 10 150 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_engine.py tests/test_piecewise.py tests/test_fused_norms.py \
  "tests/test_speculative.py::test_verify_graph_lays_out_rows_and_padding" > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -5 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 95 python3 tools/engine_step_profile.py --mixed --decode-batches 128 --json $R/mixed.json > $R/mixed.txt 2>&1; echo "mixed rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
true

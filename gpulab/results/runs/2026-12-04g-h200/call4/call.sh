#!/usr/bin/env bash
# planned in the eighth session of 2026-12-04 (no device machine was lent then), for the next
# session's build: the KV cache's store inside the RoPE kernel (two index_copy_ launches a
# layer fewer in every engine step) and the last residual add quantizing the next layer's
# QKV input (one more), and the append attention's work list as one kernel (a dozen
# PyTorch ops before, once per step with prompt rows and per verify pass). Compiled tests
# of RoPE, the fused norms, prefill and the engine paths they changed (runner, piecewise
# and whole-step graphs), the RoPE kernel's benchmark against the path it replaced, the
# cached prompt's step and the 1-row decode step profiled (launch counts, first-token ms;
# 320 launches and 1.905 ms before, 2026-12-04e call 2), then the TTFT pair (caching off
# first).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r4; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call4.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; git log --oneline -1; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 200 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 12 --junitxml=$R/junit.xml \
  tests/test_rope.py tests/test_fused_norms.py tests/test_prefill.py tests/test_engine.py tests/test_piecewise.py \
  tests/test_engine_blocks.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 50 python3 -m gpulab bench rope_kv --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/rope_kv.json $R/ 2>/dev/null
pack
s=$(date +%s)
timeout -k 5 110 python3 tools/engine_step_profile.py --cached-only --json $R/prof_full.json > $R/prof_full.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 210 python3 tools/engine_bench.py $R/eb --parts 2 --ttft-order off,on > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/engine_bench.json $R/ttft.json 2>/dev/null; rm -rf $R/eb
pack
cat $R/times.txt
true

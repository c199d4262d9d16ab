#!/usr/bin/env bash
# session 2026-12-05 (tenth), call 2 (.whl carried), after call 1's failures were fixed
# (the rope_kv inputs' permutation drawn on the generator's device; the schedule test's
# indptr on the GPU; the rollout's row slack over state_out's rows; the ahead mutant's
# compiled diagnosis) and the draft's int8 weights turned on: those tests compiled again,
# with test_speculative (the engine's drafter now takes int8 weights); RoPE's benchmark;
# the cached prompt's step profiled (320 launches and 1.905 ms on 2026-12-04e); the TTFT
# pair (caching off first).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call2.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 150 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 14 --junitxml=$R/junit.xml \
  tests/test_block_step.py tests/test_rope.py tests/test_speculative.py \
  "tests/test_prefill.py::test_schedules_cover_every_tile_once_heaviest_first" > $R/tests.txt 2>&1
echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
s=$(date +%s)
timeout -k 5 40 python3 -m gpulab bench rope_kv --save > $R/bench.txt 2>&1; echo "bench rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp gpulab/results/rope_kv.json $R/ 2>/dev/null
cat $R/bench.txt
pack
s=$(date +%s)
timeout -k 5 110 python3 tools/engine_step_profile.py --cached-only --json $R/prof.json > $R/prof.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 215 python3 tools/engine_bench.py $R/eb --parts 2 --ttft-order off,on > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/engine_bench.json $R/ttft.json 2>/dev/null; rm -rf $R/eb
tail -12 $R/ttft.txt
pack
cat $R/times.txt
python3 -c "
import json; d=json.load(open('$R/prof.json'))
for k,v in d.items():
    if isinstance(v,dict): print(k, {a:b for a,b in v.items() if not isinstance(b,list)}); [print('   ',r) for r in v.get('top',[])[:14]]
" 2>&1 | cut -c1-160
true

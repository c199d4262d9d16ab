#!/usr/bin/env bash
# session 2026-12-05 (tenth), call 2 (.peers carried): the cached prompt's step profiled
# (launch counts and first-token ms since the KV store moved into RoPE and the residual add
# quantizes; 320 launches and 1.905 ms on 2026-12-04e), then the TTFT pair (caching off
# first), then the peers' tests compiled (the FlashInfer rows of the fused norms).
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r2; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call2.tgz -C $R .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -k 5 120 python3 tools/engine_step_profile.py --cached-only --json $R/prof.json > $R/prof.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
pack
s=$(date +%s)
timeout -k 5 230 python3 tools/engine_bench.py $R/eb --parts 2 --ttft-order off,on > $R/ttft.txt 2>&1; echo "ttft rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/eb/engine_bench.json $R/ttft.json 2>/dev/null; rm -rf $R/eb
tail -12 $R/ttft.txt
pack
s=$(date +%s)
timeout -s INT -k 10 100 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_peers.py > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
cat $R/times.txt
python3 -c "
import json; d=json.load(open('$R/prof.json'))
for k,v in d.items():
    if isinstance(v,dict): print(k, {a:b for a,b in v.items() if not isinstance(b,list)}); [print('   ',r) for r in v.get('top',[])[:14]]
"
true

#!/usr/bin/env bash
# session 2026-12-05 (eleventh), call 3 (.whl carried): speculative decoding at batch 64 with
# the verify graph's buffers and the drafts ahead filled from row lists (on a 2-core CPU the
# host's work fell from 1.87 to 1.53 ms a step; on the H200, 2026-12-05, a step took 2.02 ms
# against 0.34 ms of replays: 0.40x); then the server with four API servers once more (the
# in-process baseline moved between 77 and 104 K tok/s within call 1).
set -u
source tools/gpu-call.sh call3
s=$(date +%s)
timeout -k 5 ${T1:-230} python3 tools/speculative_bench.py $R/s64 --quick --batches 64 --no-server --ks 4 --eager-k 0 > $R/spec_b64.txt 2>&1; echo "spec b64 rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/s64/speculative.json $R/speculative_b64.json 2>/dev/null; rm -rf $R/s64
grep -v "near tie" $R/spec_b64.txt | tail -12
pack
s=$(date +%s)
timeout -k 5 ${T2:-150} python3 tools/speculative_bench.py $R/sv --quick --batches "" --server-modes scaleout > $R/server.txt 2>&1; echo "server rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/sv/speculative.json $R/speculative_server.json 2>/dev/null; rm -rf $R/sv
tail -4 $R/server.txt
pack
cat $R/times.txt
true

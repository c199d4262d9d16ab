#!/usr/bin/env bash
# written in the session of 2026-12-05 (fifteenth) after call 8: requests of 448 tokens
# streamed at 62% of in-process (128 tokens: 69%), so the HTTP layer's cost is not per
# request. Behind HTTP the engine ran 273 steps, 43 with prompt tokens, in 0.581 s busy;
# in-process 232, 8 with prompt tokens, 0.404 s. The steps' seconds are now split (those
# with prompt tokens apart, /metrics gpulab_engine_prompt_busy_seconds): whether the prompt
# steps of staggered arrivals or slower decode windows cost the difference. Then the
# admission delay (factors 3 and 10: arrivals admitted together) at 448 tokens, and with
# the clients in 4 processes instead of 8 (whether the host's cores are contended).
set -u
source tools/gpu-call.sh call9
s=$(date +%s)
timeout -k 5 ${T2:-330} python3 tools/speculative_bench.py $R/sv --quick --batches "" --server-modes scaleout \
  --multi-step 8 --max-tokens 448 --delay-factors ${FACTORS:-0,3,10} > $R/server.txt 2>&1; echo "server rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/sv/speculative.json $R/speculative_server.json 2>/dev/null; rm -rf $R/sv
grep "API servers" $R/server.txt | tail -4 | cut -c1-900
pack
s=$(date +%s)
timeout -k 5 ${T3:-150} python3 tools/speculative_bench.py $R/sv4 --quick --batches "" --server-modes scaleout \
  --multi-step 8 --max-tokens 448 --client-processes 4 > $R/server_clients4.txt 2>&1; echo "server (clients in 4 processes) rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/sv4/speculative.json $R/speculative_server_clients4.json 2>/dev/null; rm -rf $R/sv4
grep "API servers" $R/server_clients4.txt | tail -2 | cut -c1-900
pack
cat $R/times.txt
true

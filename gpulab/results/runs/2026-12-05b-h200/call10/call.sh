#!/usr/bin/env bash
# run in the session of 2026-12-05 (fifteenth) as the one command below (written after call 9,
# on the same warm H100): the admission delay (factor 3) with the clients in 4 processes, at
# 448-token requests, then factor 0 once more.
source tools/gpu-call.sh call10; s=$(date +%s); timeout -k 5 300 python3 tools/speculative_bench.py $R/sv --quick --batches "" --server-modes scaleout --multi-step 8 --max-tokens 448 --client-processes 4 --delay-factors 3,0 > $R/server.txt 2>&1; echo "server rc $? $(( $(date +%s)-s ))s" >> $R/times.txt; cp $R/sv/speculative.json $R/speculative_server.json; rm -rf $R/sv; grep "of in-process" $R/server.txt | cut -c1-1200; pack; cat $R/times.txt

#!/usr/bin/env bash
# run in the session of 2026-12-05 (fifteenth) as the one command below, on the same warm H100
# after call 10: call 10's best row (factor 3, clients in 4 processes, 448 tokens) once more,
# and at 128-token requests.
source tools/gpu-call.sh call11; s=$(date +%s); timeout -k 5 280 python3 tools/speculative_bench.py $R/sv --quick --batches "" --server-modes scaleout --multi-step 8 --max-tokens 448 --server-max-tokens 448,128 --client-processes 4 --delay-factors 3 > $R/server.txt 2>&1; echo "server rc $? $(( $(date +%s)-s ))s" >> $R/times.txt; cp $R/sv/speculative.json $R/speculative_server.json; rm -rf $R/sv; grep "of in-process" $R/server.txt | cut -c1-1200; pack; cat $R/times.txt

#!/usr/bin/env bash
# written in the session of 2026-12-05 (fifteenth): the server's overhead against the length
# of its requests. Calls 4-6 served 64 clients requests of 128 tokens; behind HTTP each
# request's row stays empty from its last token to the next request's first step (TTFT p50
# 13 ms through HTTP against 1.8 ms in-process on the H100), a cost per request that a
# longer request shares over more tokens. Rows of 128 (as calls 4-6) and 448 tokens (the
# shipped model holds 512 positions; the longest prompt is 39 bytes), as calls 4-6 otherwise.
set -u
source tools/gpu-call.sh call8
s=$(date +%s)
timeout -k 5 ${T2:-290} python3 tools/speculative_bench.py $R/sv --quick --batches "" --server-modes scaleout \
  --multi-step 8 --server-max-tokens ${LENGTHS:-448,128} > $R/server.txt 2>&1; echo "server rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp $R/sv/speculative.json $R/speculative_server.json 2>/dev/null; rm -rf $R/sv
grep "API servers" $R/server.txt | tail -4 | cut -c1-400
pack
cat $R/times.txt
true

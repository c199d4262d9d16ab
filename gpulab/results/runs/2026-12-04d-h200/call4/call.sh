#!/usr/bin/env bash
# session 2026-12-04d, call 4: a continuous step (120 decodes + 7 prompts of 272 tokens) traced,
# host and device, to find where its 2.5 ms between kernels go
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r4; mkdir -p $R
s=$(date +%s)
timeout -k 5 150 python3 tools/engine_step_profile.py --mixed --reps 4 --trace $R/mixed_trace.json --json $R/prof.json > $R/prof.txt 2>&1; echo "prof rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
gzip -9 $R/mixed_trace.json
cp -r $R/* $OUT/
true

#!/bin/bash
source tools/gpu-env.sh
R=$OUT/c1; mkdir -p $R
git log --oneline -1 > $R/env.txt; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> $R/env.txt
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $R/env.txt
t0=$(date +%s)
timeout 120 python3 tools/engine_step_profile.py --reps 8 --json $R/step_profile.json > $R/step_profile.txt 2>&1
timeout 80 python3 tools/engine_step_profile.py --reps 8 --kv-split --json $R/step_profile_split.json > $R/step_profile_split.txt 2>&1
echo "profiles $(( $(date +%s)-t0 ))s" >> $R/times.txt
timeout 220 python3 tools/speculative_bench.py $R/spec --quick --profile > $R/speculative.txt 2>&1
echo "spec $(( $(date +%s)-t0 ))s" >> $R/times.txt
timeout 100 python3 tools/engine_bench.py $R/ttft_split --parts 2 --kv-split > $R/ttft_split.txt 2>&1
echo "ttft $(( $(date +%s)-t0 ))s" >> $R/times.txt
timeout 50 python3 tools/ternary-gemv-bench.py $R/gemv --quick --no-graph --mm-sweep --shapes 40x3072x2048,40x11264x2048,40x2048x5632,40x2048x2048 > $R/gemv.txt 2>&1
echo "gemv $(( $(date +%s)-t0 ))s" >> $R/times.txt

set -x
source tools/gpu-env.sh
mkdir -p /tmp/r
nproc > /tmp/r/env.txt; python3 -c "import os; print(sorted(os.sched_getaffinity(0)))" >> /tmp/r/env.txt
timeout 560 python3 tools/speculative_bench.py /tmp/r/spec --quick --batches '' --server-modes pinned \
  --server-rounds 16 --pin-engine 0 > /tmp/r/server.txt 2>&1
cp /tmp/r/env.txt /tmp/r/server.txt /tmp/r/spec/speculative.json $OUT/

#!/usr/bin/env bash
# call 1: few-rows variants (bit-equality + time at M = 16), ncu of the codes variant and the
# package's kernel, then the MLGRU forward+backward with both forward kernels side by side
source tools/gpu-env.sh; mkdir -p /tmp/r
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > /tmp/r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> /tmp/r/env.txt
timeout 150 python3 tools/few_rows_variants.py /tmp/r > /tmp/r/variants.txt 2>&1; echo "exit $?" >> /tmp/r/variants.txt
for v in codes no_other package; do
  timeout 60 ncu -k regex:probe_small --launch-skip 2 -c 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
    python3 tools/few_rows_variants.py --once $v > /tmp/r/ncu_$v.txt 2>&1; echo "exit $?" >> /tmp/r/ncu_$v.txt
done
timeout 200 python3 tools/mlgru_scan_bench.py /tmp/r --first-only --train > /tmp/r/mlgru_train.txt 2>&1; echo "exit $?" >> /tmp/r/mlgru_train.txt
cd /tmp/r && tar czf ncu.tgz ncu_*.txt && rm ncu_*.txt; ls /tmp/r; cp -r /tmp/r/* $OUT/

set -x
source tools/gpu-env.sh
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > /tmp/r/env.txt
timeout 540 python3 tools/small_m_probe.py /tmp/r > /tmp/r/probe.txt 2>&1
cp /tmp/r/* $OUT/

set -x
source tools/gpu-env.sh
mkdir -p /tmp/r
timeout 190 python3 tools/speculative_bench.py /tmp/r/spec --quick --batches 1 --no-server > /tmp/r/spec_b1.txt 2>&1
cp /tmp/r/spec/speculative.json /tmp/r/spec_b1.json
timeout 250 python3 tools/engine_bench.py /tmp/r/eng --parts 1 > /tmp/r/engine_p1.txt 2>&1
cp /tmp/r/eng/engine_bench.json /tmp/r/engine_p1.json
cp /tmp/r/spec_b1.txt /tmp/r/spec_b1.json /tmp/r/engine_p1.txt /tmp/r/engine_p1.json $OUT/

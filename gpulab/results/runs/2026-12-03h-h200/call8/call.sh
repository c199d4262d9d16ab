source tools/gpu-env.sh
mkdir -p /tmp/r
timeout 250 python3 tools/engine_bench.py /tmp/r/eng --parts 2 > /tmp/r/engine_p2.txt 2>&1
cp /tmp/r/eng/engine_bench.json /tmp/r/engine_p2.json
cp /tmp/r/engine_p2.txt /tmp/r/engine_p2.json $OUT/

#!/usr/bin/env bash
# call 2 (2026-12-04): where the host time of three benchmarked calls goes (forward +
# backward of the MLGRU scan: host 950 µs = wall, graph 409 µs in call 1; the ternary
# matmul at M = 1 and M = 16), then compiled engine/server/normquant tests and notebooks
# 07 + 08 (not re-run since the rmsnorm_quant kernel's EVEN/MANY_ROWS change)
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
export PYTHONPATH=$PWD
timeout -k 5 150 python3 tools/spec_host_profile.py $R/out mlgru_scan_train ternary_matmul:0 ternary_matmul:1 \
  rmsnorm_quant > $R/out/host_profile.txt 2>&1
echo "host profile: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/times.txt
TT=330 NBT=330 NBS="07 08" timeout -k 10 380 bash tools/gpu-suite.sh $R/suite tests/test_engine.py tests/test_server.py \
  tests/test_normquant.py > $R/out/suite.txt 2>&1
echo "suite: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/times.txt
cp $R/suite/tests.txt $R/suite/notebooks.txt $R/out/ 2>/dev/null
tar -C $R/suite -czf $R/out/suite.tgz . 2>/dev/null
cp $R/out/* $OUT/; ls -la $OUT

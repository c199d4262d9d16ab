#!/usr/bin/env bash
# call 1: few-rows sweep with 8-warp programs; ncu of the three kernels short of issue 13's
# targets; then compiled server/engine/speculative tests beside notebooks 07 and 08
source tools/gpu-env.sh; R=/tmp/r;
for d in /usr/local/cuda/bin /opt/nvidia/nsight-compute/*/ /usr/local/cuda/nsight-compute*/; do [ -x "$d/ncu" ] && PATH=$PATH:${d%/}; done; export PATH
 mkdir -p $R/prof; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/env.txt 2>&1
timeout 150 python3 tools/small_m_probe.py $R/sweep --warps 4,8 --sweep-only > $R/sweep.txt 2>&1
echo "sweep $(( $(date +%s) - t0 )) s" >> $R/env.txt
for nc in "ternary_mm_small|M=16 K=N=8192" "rmsnorm_quant|4096x14336" "rmsnorm_quant|8192x8192" "mlgru_scan_chunked|B16 T8192 D512"; do
  name=${nc%%|*}; case=${nc#*|}
  timeout 100 python3 -m gpulab profile "$name" --case "$case" --tool ncu --json > "$R/prof/$name-${case// /_}.json" 2> "$R/prof/$name-${case// /_}.err"
  echo "profile $name $case: exit $? at $(( $(date +%s) - t0 )) s" >> $R/env.txt
done
cp $R/sweep/small_m_probe.json $R/prof/ 2>/dev/null
left=$(( 560 - ($(date +%s) - t0) ))
TT=$(( left - 20 )) NBT=$(( left - 20 )) TN=12 NBN=2 NBS="07 08" timeout $left bash tools/gpu-suite.sh $R/suite tests/test_server.py tests/test_engine.py tests/test_speculative.py > $R/suite.txt 2>&1
echo "suite done at $(( $(date +%s) - t0 )) s" >> $R/env.txt
tar -C $R -czf $OUT/prof.tgz prof
cp $R/env.txt $R/sweep.txt $R/suite.txt $OUT/ 2>/dev/null
cp $R/suite/tests.txt $R/suite/notebooks.txt $R/suite/junit.xml $OUT/ 2>/dev/null
tar -C $R/suite -czf $OUT/suite-rest.tgz . 2>/dev/null
ls -la $OUT

#!/usr/bin/env bash
# call 2: rmsnorm_quant one pass vs two pass on long rows; the MLGRU two-phase scan with
# tiles scanned inside each thread; compiled engine + normquant tests and notebook 07
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R; t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/env.txt 2>&1
timeout 200 python3 tools/norm_quant_probe.py $R/norm > $R/norm.txt 2>&1
echo "norm probe: exit $? at $(( $(date +%s) - t0 )) s" >> $R/env.txt
timeout 240 python3 tools/mlgru_scan_bench.py $R/scan > $R/scan.txt 2>&1
echo "scan bench: exit $? at $(( $(date +%s) - t0 )) s" >> $R/env.txt
left=$(( 570 - ($(date +%s) - t0) ))
TT=$(( left - 15 )) NBT=$(( left - 15 )) TN=12 NBN=1 NBS="07" timeout $left bash tools/gpu-suite.sh $R/suite tests/test_engine.py tests/test_normquant.py > $R/suite.txt 2>&1
echo "suite done at $(( $(date +%s) - t0 )) s" >> $R/env.txt
cp $R/env.txt $R/norm.txt $R/scan.txt $OUT/
cp $R/norm/norm_quant_probe.json $R/scan/mlgru_scan_bench.json $OUT/ 2>/dev/null
cp $R/suite/tests.txt $R/suite/notebooks.txt $OUT/ 2>/dev/null
tar -C $R/suite -czf $OUT/suite.tgz . 2>/dev/null
ls -la $OUT

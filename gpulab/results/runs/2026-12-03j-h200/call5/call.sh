#!/usr/bin/env bash
# call 5: why mlgru_scan_train differs between processes (425 / 512 / 575 µs): in two fresh
# processes, the step as benchmarked, the tuner's choices and every config timed alone
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/a $R/b
timeout 100 python3 tools/mlgru_scan_bench.py $R/a --configs > $R/a/out.txt 2>&1; echo "exit $?" >> $R/a/out.txt
timeout 100 python3 tools/mlgru_scan_bench.py $R/b --configs > $R/b/out.txt 2>&1; echo "exit $?" >> $R/b/out.txt
cp $R/a/out.txt $OUT/configs_a.txt; cp $R/b/out.txt $OUT/configs_b.txt

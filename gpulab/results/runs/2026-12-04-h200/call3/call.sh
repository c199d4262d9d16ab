#!/usr/bin/env bash
# call 3 (2026-12-04): issue 13's peers in the benchmarks (gemlite A16W2, flash-linear-attention
# chunk_hgrn, Liger-Kernel RMSNorm, carried as .peers/), checked against the references first;
# then gpulab bench of the four MatMul-free specs with every row, saved
source tools/gpu-env.sh; R=/tmp/r; mkdir -p $R/out; t0=$(date +%s)
python3 -c "import fla, liger_kernel, gemlite; print('peers import')" > $R/out/env.txt 2>&1
timeout -k 5 150 python3 -m pytest -q -x tests/test_peers.py "tests/test_normquant.py::test_even_rows_take_the_unmasked_path_with_the_same_bits" \
  -p no:cacheprovider > $R/out/tests.txt 2>&1
echo "tests: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
for k in ternary_matmul rmsnorm_quant mlgru_scan mlgru_scan_train; do
  timeout -k 5 140 python3 -m gpulab bench $k --save > $R/out/bench_$k.txt 2>&1
  echo "bench $k: exit $? at $(( $(date +%s) - t0 )) s" >> $R/out/env.txt
  cp gpulab/results/$k.json $R/out/ 2>/dev/null
done
tar -C $R/out -czf $OUT/call3.tgz . ; cp $R/out/*.txt $OUT/; ls -la $OUT

set -x
source tools/gpu-env.sh
mkdir -p /tmp/r
TN=8 TT=200 NBS= timeout 250 tools/gpu-suite.sh /tmp/r/suite tests/test_bitlinear.py tests/test_model.py \
  "tests/test_engine.py::test_greedy_matches_reference_under_any_schedule" \
  "tests/test_engine.py::test_triton_bitlinear_kernels_in_the_engine" \
  "tests/test_engine.py::test_static_batching_baseline_matches_reference" \
  "tests/test_engine.py::test_warm_up_runs_every_prefill_size_and_changes_no_output" > /tmp/r/suite.log 2>&1
cp /tmp/r/suite/tests.txt /tmp/r/tests.txt; cp /tmp/r/suite/junit.xml /tmp/r/junit.xml; cp /tmp/r/suite/env.txt /tmp/r/env.txt
timeout 150 python3 -m gpulab bench ternary_matmul ternary_mm_small --save > /tmp/r/bench.txt 2>&1
cp gpulab/results/ternary_matmul.json gpulab/results/ternary_mm_small.json /tmp/r/
tail -5 /tmp/r/tests.txt
cp /tmp/r/*.txt /tmp/r/*.json /tmp/r/*.xml $OUT/

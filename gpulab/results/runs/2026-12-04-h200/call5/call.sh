#!/usr/bin/env bash
# call 5 (2026-12-04): call 3's tests again (they did not start: pyproject's addopts name nbval,
# which only .whl carries): the peer rows against the references, the EVEN test as rewritten
source tools/gpu-env.sh; R=/tmp/r5; mkdir -p $R
timeout -k 5 200 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_peers.py \
  "tests/test_normquant.py::test_even_rows_take_the_unmasked_path_with_the_same_bits" \
  --junitxml=$R/junit.xml > $R/tests.txt 2>&1; echo "exit $?" >> $R/tests.txt
cp $R/* $OUT/

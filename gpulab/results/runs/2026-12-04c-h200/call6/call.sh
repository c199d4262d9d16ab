#!/usr/bin/env bash
# session 2026-12-04c, call 6: the prompt checks in C, compiled: tests/test_server.py and the engine's bad-request test
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r6; mkdir -p $R
s=$(date +%s)
timeout -s INT -k 10 140 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_server.py "tests/test_engine.py::test_bad_requests_get_their_own_error_and_the_rest_are_served" \
  > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
cp -r $R/* $OUT/
true

#!/usr/bin/env bash
# session 2026-12-04f, call 4 (the session's last device seconds): the rollout kernel as it
# ships (8 warps, no workspace, the head's logits 64 at a time) compiled: its check on the
# GPU cases (float32 and bf16), its wrong kernels, and the graph drafter's rollout test.
set -u
source tools/gpu-env.sh
export OMP_NUM_THREADS=1
R=/tmp/r4f; rm -rf $R; mkdir -p $R
pack() { tar czf $OUT/call4.tgz -C $R .; }
{ python3 -m gpulab env; git log --oneline -1; git status --short; } > $R/env.txt 2>&1
s=$(date +%s)
timeout -s INT -k 10 120 python3 -m pytest -o addopts="" -p no:cacheprovider -q -rf -n 8 --junitxml=$R/junit.xml \
  tests/test_block_step.py -k "rollout or accepts_the_kernel" \
  > $R/tests.txt 2>&1; echo "tests rc $? $(( $(date +%s)-s ))s" >> $R/times.txt
tail -4 $R/tests.txt
pack
true

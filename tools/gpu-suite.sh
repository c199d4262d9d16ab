#!/usr/bin/env bash
# Run gpulab's suite compiled on a GPU host that has torch + triton but no internet:
# tests load-balanced over pytest-xdist workers and the solution notebooks (one worker
# per notebook) side by side, each under a time limit, so that one call of at most
# 10 minutes reports as much as it can.
#
# usage: tools/gpu-suite.sh OUTDIR [TEST_PATHS ...]          (default: tests)
# environment: TN=10 test workers, TT=505 s for the tests; NBN=4 notebook workers,
#   NBT=500 s, NBS="solutions" notebooks to run (paths, or numbers: NBS="05 06"; NBS= none); BENCH="name ..." also
#   benchmarks those specs afterwards; GPULAB_SHARD=k/n runs the k-th of n disjoint parts
#   of the tests (compiled, the whole of tests/ outlasts one 10-minute call: 339 of 938
#   tests in 530 s on 2026-12-01, before autotuning was turned off in tests). A test whose
#   CUDA context breaks (device-side assert) stops its worker; xdist restarts it
#   (tests/conftest.py). GPULAB_PASSED=FILE leaves out the node ids that already passed
#   compiled (tools/compiled_ledger.py writes FILE from earlier calls' junit.xml): the
#   whole suite compiled is about 20 000 worker-seconds, more than one session's GPU time.
#   GPULAB_DURATIONS=FILE.json (the same tool, --durations-out) starts the tests with no
#   known duration first (mostly tests an earlier call stopped), then the longest, and
#   skips a test whose known duration would outlast the time limit (the ledger leaves it
#   for the next call), so that workers spend the last minutes on short tests.
#   TEST_TIMEOUT=300 s per test (pytest-timeout, where installed: the H200 image has it).
#   PACK_CACHE=1 brings the Triton cache back in $OUT (triton-cache.tar.xz.part*); copied to
#   .tritoncache/ and carried, it spares the next session's first call the compiling
#   (tools/gpu-env.sh unpacks it).
# Wheels carried beforehand: .whl/ (nbval & co.: ../shared/gpu/wheels.sh .whl) and, for
# peer baselines, .peers/ (../shared/gpu/peers.sh .peers).
# Writes OUTDIR/env.txt, tests.txt (+ junit.xml: every test's outcome, also when the
# time limit stopped the run), notebooks.txt (+ notebooks_junit.xml) and bench.txt.
set -uo pipefail
out=${1:?usage: tools/gpu-suite.sh OUTDIR [TEST_PATHS ...]}; shift
mkdir -p "$out"
nbs=""
for nb in ${NBS-solutions}; do   # a notebook's number stands for its solution: NBS="05 06"
  case $nb in [0-9][0-9]) nb=$(ls solutions/${nb}_*.ipynb 2>/dev/null || echo "solutions/${nb}_?") ;; esac
  # a misspelt notebook would cost a whole call's notebook workers
  [ -e "$nb" ] || { echo "NBS: no such notebook or folder: $nb" | tee "$out/notebooks.txt"; exit 2; }
  nbs="$nbs $nb"
done
if [ -n "${GPULAB_PASSED:-}" ] && [ ! -r "$GPULAB_PASSED" ]; then
  echo "GPULAB_PASSED: cannot read $GPULAB_PASSED" | tee "$out/tests.txt"; exit 2
fi
source tools/gpu-env.sh
# One CPU thread per process: a dozen test workers, notebook kernels and the processes they
# start share 16 cores, and torch's OpenMP threads, 16 per process by default, then wait on
# each other. On 2026-12-01 (16 threads each) two `import gpulab` took 200 s and MLGRU
# mistake tests 300-450 s (1 s on a CPU).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the cache keeps binaries only (no IR): a quarter of the size, so a session's cache fits
# in what a call can bring back (PACK_CACHE=1 below)
export TRITON_STORE_BINARY_ONLY=${TRITON_STORE_BINARY_ONLY:-1}
t0=$(date +%s)
python3 -m gpulab env > "$out/env.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$out/env.txt" 2>&1
if [ -n "$nbs" ]; then
  # as in CI: the notebooks' long demos shortened (GPULAB_FAST, checks unchanged), and the
  # package's kernels at their first configuration, as in the tests. A notebook is one
  # nbval session that must end inside one call: notebook 04 reached 7 of its 28 code
  # cells in 536 s on 2026-12-01 (a benchmark or profile cell autotunes every shape)
  ( export GPULAB_FAST=${GPULAB_FAST:-1} GPULAB_AUTOTUNE=${NB_AUTOTUNE:-0}
    timeout -s INT "${NBT:-500}" python3 -m pytest -p no:cacheprovider -n "${NBN:-4}" --dist loadfile \
      -rfE --tb=short --durations=30 --junitxml="$out/notebooks_junit.xml" $nbs > "$out/notebooks.txt" 2>&1
    echo "exit $?" >> "$out/notebooks.txt" ) &
fi
# longest first (GPULAB_DURATIONS) needs xdist's round-robin `load`; else steal work. A test
# whose known duration outlasts the limit is skipped, not begun (GPULAB_DEADLINE, conftest)
dist=$([ -n "${GPULAB_DURATIONS:-}" ] && echo load || echo worksteal)
export GPULAB_DEADLINE=$(( $(date +%s) + ${TT:-505} - 5 ))
# A test past TEST_TIMEOUT s (300) fails with every thread's stack in tests.txt, and its
# worker restarts: on 2026-12-01 twelve tests whose diagnoses ran for hours held every
# worker of two calls, and nothing said where they were.
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout="${TEST_TIMEOUT:-300}" --timeout-method=thread)
timeout -s INT "${TT:-505}" python3 -m pytest -p no:cacheprovider -n "${TN:-10}" --dist $dist -rfEs \
    --tb=short --durations=30 "${per_test[@]}" --junitxml="$out/junit.xml" "${@:-tests}" > "$out/tests.txt" 2>&1
echo "exit $?" >> "$out/tests.txt"
# kept on the host while it stays warm: the next call's ledger (tools/compiled_ledger.py)
keep=/tmp/gpulab-runs/$(date +%s) && mkdir -p "$keep" && cp "$out/junit.xml" "$keep/" 2>/dev/null
wait
if [ -n "${BENCH:-}" ]; then
  # benchmarks run alone, in the environment a user has: torch's default threads
  env -u OMP_NUM_THREADS python3 -m gpulab bench $BENCH --save > "$out/bench.txt" 2>&1
  # only the benchmarked specs' tables: a call brings back at most 8 files
  for name in $BENCH; do cp "gpulab/results/$name.json" "$out/" 2>/dev/null; done
fi
if [ -n "${PACK_CACHE:-}" ]; then
  # at most 3 parts of 15 MiB: with the 5 logs, the 8 files a call can bring back
  cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
  tar -C "$cache" -cf - . | xz -T0 -6 | split -b 15M -a 1 - "$out/triton-cache.tar.xz.part"
  n=$(ls "$out"/triton-cache.tar.xz.part* | wc -l)
  echo "packed the Triton cache ($(du -sh "$cache" | cut -f1)) into $n part(s)" >> "$out/env.txt"
  [ "$n" -le 3 ] || { rm -f "$out"/triton-cache.tar.xz.part*; echo "too big to bring back: not packed" >> "$out/env.txt"; }
fi
echo "wall $(( $(date +%s) - t0 )) s" >> "$out/env.txt"
tail -n 3 "$out"/tests.txt "$out"/notebooks.txt 2>/dev/null

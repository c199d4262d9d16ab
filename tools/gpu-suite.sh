#!/usr/bin/env bash
# Run gpulab's suite compiled on a GPU host that has torch + triton but no internet.
# usage: tools/gpu-suite.sh OUTDIR [pytest args...]   (wheels for nbval & co. in .whl/,
# fetched beforehand with ../shared/gpu/wheels.sh .whl)
set -uo pipefail
out=${1:?usage: tools/gpu-suite.sh OUTDIR [pytest args...]}; shift
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m gpulab env | tee "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$out/env.txt" 2>&1
python3 -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.txt"
if [ -n "${BENCH:-}" ]; then
  python3 -m gpulab bench $BENCH --save 2>&1 | tee "$out/bench.txt"
  cp gpulab/results/*.json "$out/" 2>/dev/null
fi

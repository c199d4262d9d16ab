#!/usr/bin/env bash
# Run gpulab's suite compiled on a GPU host that has torch + triton but no internet.
# usage: tools/gpu-suite.sh OUTDIR [pytest args...]
# Wheels carried beforehand: .whl/ (nbval & co.: ../shared/gpu/wheels.sh .whl) and,
# for peer baselines, .peers/ (../shared/gpu/peers.sh .peers). BENCH="name ..." also
# benchmarks those specs and copies the JSON to OUTDIR.
set -uo pipefail
out=${1:?usage: tools/gpu-suite.sh OUTDIR [pytest args...]}; shift
mkdir -p "$out"
for d in .whl .peers; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $d/*.whl
  fi
done
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m gpulab env | tee "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$out/env.txt" 2>&1
if [ $# -gt 0 ]; then
  python3 -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.txt"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.txt"
fi
if [ -n "${BENCH:-}" ]; then
  python3 -m gpulab bench $BENCH --save 2>&1 | tee "$out/bench.txt"
  cp gpulab/results/*.json "$out/" 2>/dev/null
fi

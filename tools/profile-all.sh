#!/usr/bin/env bash
# Profile a few kernels on a GPU host and write the reports CPU learners see
# (`gpulab profile NAME` without a GPU shows gpulab/results/profiles/NAME.json).
# usage: tools/profile-all.sh OUTDIR      (about 3 minutes on an H200)
# then:  cp OUTDIR/*.json gpulab/results/profiles/
# Uses Nsight Compute (ncu) when it is on PATH or in the usual CUDA folders, else
# torch.profiler (kernel times only). Needs access to the GPU's performance counters
# (root, or the driver's NVreg_RestrictProfilingToAdminUsers=0).
set -uo pipefail
out=${1:?usage: tools/profile-all.sh OUTDIR}
mkdir -p "$out"
for d in /usr/local/cuda/bin /opt/nvidia/nsight-compute/*/ /usr/local/cuda/nsight-compute*/; do
  [ -x "$d/ncu" ] && PATH=$PATH:${d%/}
done
export PATH PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m gpulab env | tee "$out/env.txt"
{ command -v ncu && ncu --version; } >> "$out/env.txt" 2>&1 || echo "ncu not found: torch.profiler only" | tee -a "$out/env.txt"
start=$SECONDS
while IFS='|' read -r name case; do
  if ! timeout 150 python3 -m gpulab profile "$name" --case "$case" --out "$out" > "$out/$name.txt" 2>&1; then
    echo "$name: ncu failed (see $out/$name.txt), falling back to torch.profiler"
    mv "$out/$name.txt" "$out/$name.ncu-error.txt"
    timeout 90 python3 -m gpulab profile "$name" --case "$case" --tool torch --out "$out" > "$out/$name.txt" 2>&1
  fi
  echo "== $name ($case): exit $?, $((SECONDS - start)) s so far"; cat "$out/$name.txt"
done <<'LIST'
softmax|8192x8192
ternary_gemv|M=1 K=N=8192
rmsnorm_quant|8192x4096
flash_attention|S=8192
paged_decode_attention|B64 L4096
cascade_decode_attention|P8192 B64 32/8
LIST
ls -l "$out"

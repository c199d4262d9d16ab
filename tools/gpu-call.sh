# Sourced by a GPU call's script (gpulab/results/runs/*/callN/call.sh): `source tools/gpu-call.sh callN`
# sets the GPU host's environment (tools/gpu-env.sh), one CPU thread per process, a fresh
# folder R=/tmp/callN for the call's outputs with the host, GPU and commit in R/env.txt, and
# pack(), which brings R back as $OUT/callN.tgz (call it after each stage: a call cut short
# by its time limit still returns what it measured).
name=${1:?usage: source tools/gpu-call.sh callN}
source tools/gpu-env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
R=/tmp/$name; rm -rf "$R"; mkdir -p "$R"
pack() { tar czf "$OUT/$name.tgz" -C "$R" .; }
{ python3 -m gpulab env; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  git log --oneline -1; } > "$R/env.txt" 2>&1

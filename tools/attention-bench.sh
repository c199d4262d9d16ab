#!/usr/bin/env bash
# Benchmark the attention family on an offline GPU host (H200): paged decode, cascade decode
# and merge_state as a user calls them, run() replayed in a CUDA graph, the validating call,
# SDPA, and FlashInfer when its wheels are carried in .peers/ (fetched beforehand with
# ../shared/gpu/peers.sh .peers; its kernels JIT-compile on first use, under two minutes).
# Writes OUTDIR/NAME.json per kernel (gpulab bench's format), OUTDIR/host_overhead.json
# (host µs per call of each public path) and the printed tables in OUTDIR/bench.txt.
#
# usage: tools/attention-bench.sh OUTDIR [--save] [NAME ...]
#   --save  also write gpulab/results/NAME.json (the figures notebooks show on CPUs)
#   NAME    paged_decode_attention, cascade_decode_attention, merge_state (default: all three)
set -uo pipefail
out=${1:?usage: tools/attention-bench.sh OUTDIR [--save] [NAME ...]}; shift
mkdir -p "$out"
source tools/gpu-env.sh
ls .peers/*.whl >/dev/null 2>&1 || echo "no wheels in .peers/: FlashInfer rows are skipped (../shared/gpu/peers.sh .peers)"
python3 -m gpulab env | tee "$out/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$out/env.txt" 2>&1
python3 tools/attention_bench.py "$out" "$@" 2>&1 | tee "$out/bench.txt"
echo "exit: ${PIPESTATUS[0]}" | tee -a "$out/bench.txt"

#!/usr/bin/env bash
# The GPU benchmarks of this round, one at a time (each alone on the GPU), each under its
# own time limit, packed after every job into OUTDIR/bench.tgz (one file to bring back).
#
# usage: tools/gpu-bench.sh OUTDIR [JOB ...]
# jobs (default: engine attention speculative): engine (tools/engine_bench.py; engine-eager-prefill:
#   the same with steps that carry a prompt chunk run eagerly, not from piecewise graphs;
#   engine-kv-split: with EngineConfig(kv_split=True)), speccheck (tools/speculative_check.py with
#   the direct launch, then with Triton's launch path), host
#   (tools/engine_host_overhead.py: an engine step phase by phase, tiny and big model),
#   attention (tools/attention_bench.py; ANAMES= its kernels), speculative, ternary (GARGS=--quick:
#   no sweep),
#   rerun (tools/rerun-benchmarks.py --memory; RNAMES="spec ..." those specs only, e.g.
#   RNAMES="ternary_matmul rmsnorm_quant"), prefill, lab, profile (tools/profile-all.sh),
#   piecewise (tools/piecewise_bench.py), scan (tools/mlgru_scan_bench.py), rmsnorm-probe
#   (tools/lab_rmsnorm_probe.py: rmsnorm_quant's variants, hand-written and lab), paged-probe
#   (tools/paged_probe.py: paged decode's partitions and tiles in a CUDA graph against FlashInfer). LABARGS= extra
#   arguments of tools/lab-bench.py for `lab`; the lab in parts that each fit a call:
#   lab-planted (the planted kernels, saved batch by batch,
#   LAB_TIMEOUT=90 s each), lab-search (LAB_TASKS=rmsnorm_quant
#   searched for LAB_BUDGET=300 s, then timed against the hand-written kernel; LAB_RESUME=DIR continues
#   the searches of an earlier lab-search output; LAB_PARALLEL=N candidates checked at once (default 4;
#   their timings never overlap, so more at once only needs the host's cores and memory)).
#   Limits in seconds: ET HT AT ST SPT GT RT PT LT PRT PWT SCT RPT PPT (see below). Carry .whl/ and .peers/
#   (FlashInfer's JIT takes minutes on its first use of each module: give `attention` time).
set -uo pipefail
out=${1:?usage: tools/gpu-bench.sh OUTDIR [JOB ...]}; shift
mkdir -p "$out"
source tools/gpu-env.sh
b=$(mktemp -d)/bench; mkdir -p "$b"
t0=$(date +%s)
python3 -m gpulab env > "$b/env.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$b/env.txt" 2>&1
pack() { tar czf "$out/bench.tgz" -C "$(dirname "$b")" bench; }
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name at $(( $(date +%s) - t0 )) s" >> "$b/log.txt"
  timeout "$limit" "$@" > "$b/$name.txt" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$b/$name.txt"
  pack
}
for job in "${@:-engine attention speculative}"; do
  for j in $job; do
    case $j in
      engine) run engine "${ET:-420}" python3 tools/engine_bench.py "$b/engine" ;;
      engine-eager-prefill) run engine-eager-prefill "${ET:-330}" python3 tools/engine_bench.py "$b/engine-eager-prefill" --no-piecewise ;;
      engine-kv-split) run engine-kv-split "${ET:-330}" python3 tools/engine_bench.py "$b/engine-kv-split" --kv-split ;;
      speccheck) run speccheck "${SPT:-200}" bash -c 'python3 tools/speculative_check.py; \
                   GPULAB_DIRECT_LAUNCH=0 python3 tools/speculative_check.py' ;;
      host) mkdir -p "$b/host"
            run host "${HT:-240}" bash -c 'for m in "" "--finished-only"; do python3 tools/engine_host_overhead.py \
              --batch 1 64 256 --prompt 512 --static $m --json "$0/tiny${m:+_finished}.json" || exit 1; done
              python3 tools/engine_host_overhead.py --batch 64 256 --prompt 512 --static \
              --model random:2048,16,16,4,128,5632,4096 --json "$0/big.json"' "$b/host" ;;
      attention) run attention "${AT:-300}" python3 tools/attention_bench.py "$b/attention" ${ANAMES:-} ;;
      speculative) run speculative "${ST:-240}" python3 tools/speculative_bench.py "$b/speculative" --quick ;;
      ternary) run ternary "${GT:-120}" python3 tools/ternary-gemv-bench.py "$b/ternary" ${GARGS:-} ;;
      rerun) if [ -n "${RNAMES:-}" ]; then      # some specs only (no activation-memory run)
               run rerun "${RT:-180}" python3 tools/rerun-benchmarks.py "$b/rerun" $RNAMES
             else
               run rerun "${RT:-180}" python3 tools/rerun-benchmarks.py "$b/rerun" --memory
             fi ;;
      prefill) run prefill "${PT:-120}" python3 tools/prefill_gpu.py "$b/prefill" --quick ;;
      lab) run lab "${LT:-300}" python3 tools/lab-bench.py "$b/lab" ${LABARGS:-} ;;
      lab-planted) run lab-planted "${LT:-300}" python3 tools/lab-bench.py "$b/lab-planted" --tasks "" --no-suite \
                       --planted-timeout "${LAB_TIMEOUT:-90}" ;;
      lab-search) run lab-search "${LT:-420}" python3 tools/lab-bench.py "$b/lab-search" \
                    --tasks "${LAB_TASKS:-rmsnorm_quant}" --budget "${LAB_BUDGET:-300}" --no-suite --no-planted ${LAB_RESUME:+--resume "$LAB_RESUME"} \
                    ${LAB_PARALLEL:+--parallel "$LAB_PARALLEL"} ;;
      piecewise) run piecewise "${PWT:-180}" python3 tools/piecewise_bench.py "$b/piecewise" ;;
      scan) run scan "${SCT:-180}" python3 tools/mlgru_scan_bench.py "$b/scan" ;;
      paged-probe) run paged-probe "${PPT:-240}" python3 tools/paged_probe.py ;;
      rmsnorm-probe) run rmsnorm-probe "${RPT:-150}" python3 tools/lab_rmsnorm_probe.py ;;
      profile) run profile "${PRT:-240}" bash tools/profile-all.sh "$b/profile" ;;
      *) echo "unknown job $j" >> "$b/log.txt" ;;
    esac
  done
done
tail -n 3 "$b"/*.txt

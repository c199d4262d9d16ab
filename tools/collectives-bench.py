#!/usr/bin/env python3
"""Collectives and tensor parallelism on a machine with two (or more) GPUs: the figures
notebook 10 shows. Writes JSON into OUTDIR; copy those files into gpulab/results/parallel/.

usage:  python3 tools/collectives-bench.py OUTDIR [--quick] [--world-size N]

Sections (each is independent; a failing one is recorded and the others still run):

1. agreement   ring (several piece counts) and one-shot all-reduce against NCCL's on the
               GPUs, bf16 and float32, sizes with remainders        -> collectives_agreement.json
2. pieces      ring busbw by pipeline piece count, 16 MB .. 1 GB; the best count at 256 MB
               sets the ring's piece size for section 3           -> collectives_ring_pieces.json
3. busbw       NCCL all-reduce vs the package's ring and one-shot, bf16, 4 KB .. 1 GB,
               nccl-tests conventions (algbw, busbw = algbw·2(n-1)/n)  -> collectives_busbw.json
4. tp          tensor-parallel ternary GLU MLP: TP=n vs TP=1 bit-identity (int32 reduction)
               and non-identity (float reduction); time per forward at 1, 16, 128 rows,
               TP=1 vs TP=n, and the TP=n collectives alone         -> tp_mlp.json
5. faults      a rank killed (SIGKILL) or stalled before an all-reduce; time until the
               survivor reports it (deadline 5 s), with TORCH_NCCL_ASYNC_ERROR_HANDLING=1
                                                                     -> dead_rank.json
(The serving engine's whole model at TP=n against TP=1: tools/tp-engine-bench.py.)
And summary.json with the targets: ring busbw at 256 MB >= 70% of NCCL's; TP=n output
identical to TP=1; dead rank detected within the deadline.

NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Needs torch with NCCL and
gpulab's own dependencies; no internet. Takes 2-5 minutes.
"""
import os
import sys

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from gpulab.parallel import bandwidth as bw  # noqa: E402
from gpulab.parallel import faults, launch  # noqa: E402
from gpulab.parallel.collectives import (PIECE_BYTES, agreement_rank, one_shot_all_reduce,  # noqa: E402
                                         ring_all_reduce)
from gpulab.parallel.tensor_parallel import tp_latency_rank  # noqa: E402

MB = 1 << 20


def write(out: Path, name: str, data) -> None:
    path = out / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"  wrote {path}", flush=True)


def section(summary: dict, name: str, fn):
    print(f"\n== {name}", flush=True)
    t = time.time()
    try:
        fn()
        summary["sections"][name] = {"ok": True, "seconds": round(time.time() - t, 1)}
    except BaseException as e:      # record, go on with the next section
        traceback.print_exc()
        summary["sections"][name] = {"ok": False, "seconds": round(time.time() - t, 1),
                                     "error": f"{type(e).__name__}: {e}"[:2000]}
        if isinstance(e, KeyboardInterrupt):
            raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the JSON results")
    p.add_argument("--quick", action="store_true", help="up to 256 MB, one TP size, shorter timings")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dry-run-gloo", action="store_true",
                   help="rehearse every section on CPU processes (gloo, tiny sizes): figures meaningless")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.world_size
    gpus = torch.cuda.device_count()
    backend = "gloo" if a.dry_run_gloo else "nccl"
    if backend == "nccl" and gpus < n:
        print(f"need {n} GPUs, found {gpus}", file=sys.stderr)
        return 2
    env = bw.environment(backend, n)
    env["env"] = {k: os.environ.get(k) for k in (*launch.MULTICAST_OFF, "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(gpus)] if backend == "nccl" else []
    try:
        env["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                         timeout=30).stdout
    except Exception as e:
        env["topology"] = f"unavailable: {e}"
    print(json.dumps({k: v for k, v in env.items() if k != "topology"}, indent=1))
    print(env["topology"])
    write(out, "env.json", env)
    summary = {"env": {k: v for k, v in env.items() if k != "topology"}, "sections": {}, "targets": {}}
    budget = 0.1 if a.quick else 0.25
    if a.dry_run_gloo:
        global MB
        MB = 1 << 12            # "MB" sizes become 4 KB units: the same code paths, tiny messages
        budget = 0.01
    tuned = {"piece_bytes": PIECE_BYTES}
    top = 256 * MB if a.quick else 1024 * MB

    def agreement():
        sizes = [1, 3, 1001, MB + 7, 64 * MB + 3]
        rows = []
        for dtype in (torch.bfloat16, torch.float32):
            for r in launch.run_ranks(agreement_rank, n, sizes, dtype, (None, 1, 3, 8), backend=backend,
                                      timeout_s=300, collective_timeout_s=120)[0]:
                rows.append({**r, "dtype": str(dtype).replace("torch.", "")})
        write(out, "collectives_agreement.json", {**env, "kind": "all_reduce_agreement", "rows": rows})
        bad = [r for r in rows if r["max_abs_diff"] > 0.02 * max(1.0, r["max_ref"])]
        summary["targets"]["ring_and_one_shot_agree_with_nccl"] = {"ok": not bad, "rows": len(rows),
                                                                   "identical": sum(r["identical_on_all_ranks"] for r in rows),
                                                                   "bad": bad[:5]}
        for r in rows:
            print(f"  {r['dtype']:>8} {r['impl']:>16} numel {r['numel']:>10}: identical {r['identical_on_all_ranks']}, "
                  f"max diff {r['max_abs_diff']:.3g}")

    def pieces():
        sizes = [s for s in (16 * MB, 64 * MB, 256 * MB, 1024 * MB) if s <= top]
        impls = {backend: bw.library_all_reduce}
        for k in (1, 2, 4, 8, 16):
            impls[f"ring pieces={k}"] = functools.partial(ring_all_reduce, pieces=k)
        result = bw.measure(n, backend=backend, sizes=sizes, dtype=torch.bfloat16, impls=impls, budget_s=budget,
                            label="ring all-reduce by pipeline pieces per chunk", timeout_s=580)
        write(out, "collectives_ring_pieces.json", result)
        print(bw.table(result))
        best = max((bw.ratio_at(result, i, backend, 256 * MB) or 0.0, i) for i in impls if i != backend)
        k = int(best[1].split("=")[1])
        tuned["piece_bytes"] = max(MB, (256 * MB // n) // k)      # the best piece size at 256 MB
        summary["targets"]["best_ring_pieces_256MB_vs_nccl"] = {"ratio": best[0], "impl": best[1],
                                                                "piece_bytes": tuned["piece_bytes"]}
        print(f"  best at 256 MB: {best[1]} ({best[0]:.2f} of NCCL): ring pieces of {tuned['piece_bytes'] // MB} MB")

    def busbw():
        sizes = [s for s in bw.GPU_SIZES if s <= top] if backend == "nccl" else [4096, 65536, top]
        impls = {backend: bw.library_all_reduce,
                 "ring": functools.partial(ring_all_reduce, piece_bytes=tuned["piece_bytes"]),
                 "one-shot": one_shot_all_reduce}
        if tuned["piece_bytes"] != PIECE_BYTES:
            impls[f"ring ({PIECE_BYTES // MB} MB pieces, default)"] = ring_all_reduce
        result = bw.measure(n, backend=backend, sizes=sizes, dtype=torch.bfloat16, impls=impls, budget_s=budget,
                            label=f"measured on {env['device']} with NCCL {env.get('nccl', '?')}, NVLink "
                                  f"multicast (NVLS) off", timeout_s=580)
        result.update({k: env[k] for k in ("gpus", "env")})
        result["ring_piece_bytes"] = tuned["piece_bytes"]
        write(out, "collectives_busbw.json", result)
        print(bw.table(result))
        ratio = bw.ratio_at(result, "ring", backend, 256 * MB)
        summary["targets"]["ring_256MB_vs_nccl_busbw"] = {"ratio": ratio, "target": 0.70,
                                                          "ok": ratio is not None and ratio >= 0.70}
        summary["regimes"] = {i: bw.regimes(result, i) for i in impls}
        print(f"  ring / nccl busbw at 256 MB: {ratio}")

    def tp():
        rows = []
        configs = [(4096, 11008, (torch.bfloat16, torch.float32))]
        if a.dry_run_gloo:
            configs = [(32, 48, (torch.float32,))]
        elif not a.quick:
            configs.append((8192, 28672, (torch.bfloat16,)))
        for d, h, dtypes in configs:
            rows += launch.run_ranks(tp_latency_rank, n, d, h, (1,) if a.dry_run_gloo else (1, 16, 128), dtypes, 0,
                                     budget, backend=backend,
                                     timeout_s=580, collective_timeout_s=300)[0]
        write(out, "tp_mlp.json", {**env, "kind": "tp_glu", "rows": rows,
                                   "label": f"ternary GLU MLP, TP={n} vs TP=1 on {env['device']}"})
        for r in rows:
            print(f"  d={r['d_model']} I={r['hidden']} {r['dtype']:>8} rows {r['rows']:>4}: int32 identical "
                  f"{r['int32']['identical']}, float identical {r['float']['identical']} "
                  f"({r['float']['different']} differ); TP=1 {r['tp1_us']:.1f} µs, TP={n} {r['tpn_us']:.1f} µs "
                  f"(comms {r['tpn_comms_us']:.1f} µs, float reduction {r['tpn_float_us']:.1f} µs)")
        summary["targets"]["tp_identical_to_tp1"] = {"ok": all(r["int32"]["identical"] for r in rows),
                                                     "float_reduction_identical": any(r["float"]["identical"] for r in rows)}
        summary["tp_latency_us"] = [{k: r[k] for k in ("d_model", "hidden", "dtype", "rows", "tp1_us", "tpn_us",
                                                        "tpn_comms_us")} for r in rows]

    def dead():
        rows = []
        for mode in ("kill", "stall"):
            t = time.time()
            r = faults.dead_rank_demo(n, victim=n - 1, mode=mode, timeout_s=1.0 if a.dry_run_gloo else 5.0,
                                      backend=backend)
            r["wall_total_s"] = time.time() - t
            rows.append(r)
            print(f"  {mode}: detected {r['detected']} after {r['detect_s']} s ({r['reasons']}); "
                  f"victim: {r['victim_end']}\n    {r['messages'][0][:300]}")
        write(out, "dead_rank.json", {**env, "kind": "dead_rank", "rows": rows})
        summary["targets"]["dead_rank_detected_within_timeout"] = {
            "ok": all(r["detected"] and r["detect_s"] is not None and r["detect_s"] <= r["timeout_s"] + 2
                      for r in rows),
            "detect_s": {r["mode"]: r["detect_s"] for r in rows}}

    section(summary, "agreement", agreement)
    section(summary, "pieces", pieces)
    section(summary, "busbw", busbw)
    section(summary, "tp", tp)
    section(summary, "faults", dead)
    write(out, "summary.json", summary)
    print(json.dumps(summary["targets"], indent=1, default=str))
    return 0 if all(s["ok"] for s in summary["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

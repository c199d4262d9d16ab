"""What a Python call costs the host, next to what its kernels cost the GPU.

    PYTHONPATH=. python3 tools/host_overhead_probe.py OUTDIR      (GPU host, ~1 minute)

For each call: ``host_us`` is the wall time per call of 2000 back-to-back calls on a tiny
problem (the GPU finishes each kernel in a few µs, so the host is the bottleneck and the
time is what Python, gpulab's checks and Triton's launcher cost); ``do_bench_us`` the
median of ``triton.testing.do_bench`` (L2 flushed before each call) on the real shape,
timed twice in alternating order. Issue 12 measured ``ternary_matmul`` as called at
82.5 µs against 21.0 µs for its launcher at M=1, K=N=8192: this says whether the
difference is host time that do_bench's L2 flush no longer hides.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gpulab
from gpulab import bitlinear as bl
from gpulab import normquant as nq
from gpulab import runtime


def problem(m, n, k, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g)
    x_q, x_s = nq.absmax_quantize(x)
    w_t, w_s = bl.ternary_quantize(torch.randn(n, k, device=device, generator=g))
    return {"x_q": x_q.contiguous(), "x_s": x_s.float().contiguous(), "w8": bl.pack_ternary(w_t),
            "w_s": w_s.reshape(1).float(), "x_bf16": x.to(torch.bfloat16),
            "w_bf16": (w_t.float() / w_s).to(torch.bfloat16),
            "y": torch.empty(m, n, dtype=torch.bfloat16, device=device)}


def calls(p):
    return {
        "F.linear bf16": lambda: F.linear(p["x_bf16"], p["w_bf16"]),
        "ternary_matmul (as called)": lambda: bl.ternary_matmul(p["x_q"], p["x_s"], p["w8"], p["w_s"]),
        "ternary_matmul_into (dispatch, no checks)": lambda: bl.ternary_matmul_into(p["x_q"], p["x_s"], p["w8"],
                                                                                    p["w_s"], p["y"]),
        "ternary_gemv_into (launcher)": lambda: bl.ternary_gemv_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], p["y"]),
        "torch.empty [1, N] bf16": lambda: torch.empty((1, p["w8"].shape[0]), dtype=torch.bfloat16,
                                                       device=p["x_q"].device),
    }


def host_us(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "host_probe")
    out.mkdir(parents=True, exist_ok=True)
    gpulab.setup()
    import triton.testing
    dev = runtime.device()
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions(), "date": time.strftime("%Y-%m-%d"),
           "host_us_tiny_M1_K_N_256": {}, "do_bench_us_M1_K_N_8192": {}}
    tiny, big = problem(1, 256, 256, dev), problem(1, 8192, 8192, dev)
    for name, fn in calls(tiny).items():
        res["host_us_tiny_M1_K_N_256"][name] = host_us(fn)
        print(f"host  {name:<45} {res['host_us_tiny_M1_K_N_256'][name]:8.1f} µs", flush=True)
    fns = calls(big)
    for fn in fns.values():
        fn()
    rounds = {name: [] for name in fns}
    for order in (list(fns), list(reversed(fns))):
        for name in order:
            rounds[name].append(1e3 * triton.testing.do_bench(fns[name], warmup=25, rep=100,
                                                              return_mode="median"))
    for name, ts in rounds.items():
        res["do_bench_us_M1_K_N_8192"][name] = ts
        print(f"bench {name:<45} " + "  ".join(f"{t:8.1f}" for t in ts) + " µs", flush=True)
    (out / "host_overhead_probe.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

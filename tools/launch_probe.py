"""Where the host time of one decode call goes (GPU only): ``ternary_matmul`` at M=1
taken apart into its checks, its allocation, Triton's launch path and the compiled
kernel's own launcher. A probe, not a benchmark: it reaches into Triton's
``JITFunction`` and ``CompiledKernel`` internals (3.6-3.8) to time their parts.

    python tools/launch_probe.py [--n 8192] [--out probe.json] [--compare-only]
"""
import argparse
import json
import platform
import subprocess

import torch
import torch.nn.functional as F

from gpulab import bitlinear, runtime
from gpulab.harness.bench import host_us_per_call, time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare-only", action="store_true",
                    help="only ternary_matmul as called against its launcher, first thing in the process")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.compare_only:
        out = {"gpu": torch.cuda.get_device_name(), "as_called_vs_launcher": as_called_vs_launcher(dev)}
        if a.out:
            json.dump(out, open(a.out, "w"), indent=1)
        return
    n = k = a.n
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    w_t, s = bitlinear.ternary_quantize(w)
    wp = bitlinear.pack_ternary(w_t)
    ws = s.reshape(1).float()
    xq = torch.randint(-127, 128, (1, k), device=dev, dtype=torch.int8)
    xs = torch.rand(1, device=dev) + 0.5
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    bitlinear.ternary_matmul(xq, xs, wp, ws)          # tune and compile
    kern = bitlinear._ternary_gemv
    choice = runtime._TUNED_CHOICES[(kern, (n, k, y.dtype))]
    q = wp.shape[1]
    args = (xq, xs, wp, ws, y, n, k, q, xq.stride(0), wp.stride(0), y.stride(0))
    grid = (1, runtime.cdiv(n, choice["BLOCK_N"]))
    compiled = kern.fn[grid](*args, **choice)
    device = torch.cuda.current_device()
    binder = kern.fn.device_caches[device][4]
    bound, spec, opts = binder(*args, **choice)
    vals = list(bound.values())
    stream = torch.cuda.current_stream().cuda_stream
    run = compiled.run
    direct_launch = runtime._DIRECT[(kern, (n, k, y.dtype))]

    def direct():
        run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None,
            None, None, *vals)

    def stubbed(module, name, fn):
        """fn, timed with module.name replaced by a no-op: the host time of what calls it."""
        return fn, (module, name)

    parts = {
        "F.linear bf16 (host)": lambda: F.linear(x, w),
        "ternary_matmul as called": lambda: bitlinear.ternary_matmul(xq, xs, wp, ws),
        "ternary_matmul, ternary_matmul_into stubbed (checks + allocation)":
            stubbed(bitlinear, "ternary_matmul_into", lambda: bitlinear.ternary_matmul(xq, xs, wp, ws)),
        "ternary_matmul_into (dispatch + launch_tuned)": lambda: bitlinear.ternary_matmul_into(xq, xs, wp, ws, y),
        "ternary_matmul_into, ternary_gemv_into stubbed (dispatch)":
            stubbed(bitlinear, "ternary_gemv_into", lambda: bitlinear.ternary_matmul_into(xq, xs, wp, ws, y)),
        "ternary_gemv_into (launch_tuned)": lambda: bitlinear.ternary_gemv_into(xq, xs, wp, ws, y),
        "ternary_gemv_into, launch_tuned stubbed (the launcher's Python)":
            stubbed(runtime, "launch_tuned", lambda: bitlinear.ternary_gemv_into(xq, xs, wp, ws, y)),
        "JITFunction[grid](*args, **choice) (Triton's path)": lambda: kern.fn[grid](*args, **choice),
        "runtime.DirectLaunch": lambda: direct_launch(grid, args, {}),
        "DirectLaunch's key": lambda: direct_launch._key(0, args, {}),
        "CompiledKernel.run direct": direct,
        "binder only": lambda: binder(*args, **choice),
        "torch.empty bf16 [1, N], device=x_q.device": lambda: torch.empty((1, n), dtype=torch.bfloat16, device=xq.device),
        "torch.empty bf16 [1, N], device='cuda'": lambda: torch.empty((1, n), dtype=torch.bfloat16, device=dev),
        "plainly_valid_matmul_args": lambda: bitlinear.plainly_valid_matmul_args(xq, xs, wp, ws, torch.bfloat16),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "driver get_current_stream": lambda: __import__("triton").runtime.driver.active.get_current_stream(device),
    }
    out = {"gpu": torch.cuda.get_device_name(), "cpu": platform.processor() or "",
           "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__, "python": platform.python_version()},
           "host_us_per_call": {}, "us_do_bench": {}}
    try:
        out["cpu"] = subprocess.run(["bash", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    for name, fn in parts.items():
        fn, (module, stub) = fn if isinstance(fn, tuple) else (fn, (None, None))
        saved = module and getattr(module, stub)
        if module:
            setattr(module, stub, lambda *a, **k: None)
        try:
            out["host_us_per_call"][name] = round(host_us_per_call(fn, calls=300, batches=7), 2)
        finally:
            if module:
                setattr(module, stub, saved)
        print(f"{name:50s} host {out['host_us_per_call'][name]:7.2f} us", flush=True)
    for name in ("ternary_matmul as called", "ternary_gemv_into (launch_tuned)", "CompiledKernel.run direct",
                 "JITFunction[grid](*args, **choice) (Triton's path)", "F.linear bf16 (host)"):
        out["us_do_bench"][name] = round(time_ms(parts[name]) * 1e3, 2)
        print(f"{name:50s} do_bench {out['us_do_bench'][name]:7.2f} us", flush=True)
    out["as_called_vs_launcher"] = as_called_vs_launcher(dev)
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


def as_called_vs_launcher(dev, repeats: int = 5) -> list[dict]:
    """``ternary_matmul`` as called against its launcher (``ternary_matmul_into``, output
    preallocated) at M=1 over the decode shapes, with the direct launch and with Triton's
    path (``runtime.set_direct_launch``). The two are timed in alternation, ``repeats``
    times each, so that a slow stretch of the host or a GPU clock change falls on both."""
    rows = []
    for n, k in ((8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336)):
        w_t, s = bitlinear.ternary_quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16))
        wp, ws = bitlinear.pack_ternary(w_t), s.reshape(1).float()
        xq = torch.randint(-127, 128, (1, k), device=dev, dtype=torch.int8)
        xs = torch.rand(1, device=dev) + 0.5
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        for direct in (True, False):
            runtime.set_direct_launch(direct)
            fns = {"as called": lambda: bitlinear.ternary_matmul(xq, xs, wp, ws),
                   "launcher": lambda: bitlinear.ternary_matmul_into(xq, xs, wp, ws, y)}
            row = {"N": n, "K": k, "direct_launch": direct, **{f"{name} us": [] for name in fns}}
            for _ in range(repeats):
                for name, fn in fns.items():
                    row[f"{name} us"].append(round(time_ms(fn) * 1e3, 2))
            for name, fn in fns.items():
                row[f"{name} host us"] = round(host_us_per_call(fn), 2)
            row["apart us (medians)"] = round(sorted(row["as called us"])[repeats // 2]
                                              - sorted(row["launcher us"])[repeats // 2], 2)
            print(row, flush=True)
            rows.append(row)
    runtime.set_direct_launch(True)
    return rows


if __name__ == "__main__":
    main()

"""Ternary decode GEMV on a GPU: the byte layout (uint8x4) against the int32x16 dp4a layout
and bf16 F.linear, on the same tensors.

usage (repository root, on the H200; offline is fine):
    PYTHONPATH=$PWD python tools/ternary-gemv-bench.py OUTDIR [--quick] [--no-graph] [--shapes MxNxK,...] [--mm-sweep]

For each shape (M=1: K=N=8192, K=N=4096, N=14336 K=4096, N=4096 K=14336; M=16 K=N=8192) it
first checks that the int32x16 GEMV (dp4a and portable twin, every split) gives the same
bits as the uint8x4 GEMV and matches the float64 reference, then times, with
``triton.testing.do_bench`` (median, L2 flushed before every call, launched from Python:
"as called"), and where --no-graph is not given also in a CUDA graph (no launch overhead);
each row also gets the host's time per call (``host_us_per_call``), which says whether the
as-called figure was the GPU's or the host's:

* ``ternary_matmul`` as called with uint8x4 weights (today's default path) and with int32x16,
* the launchers ``ternary_gemv_into`` (uint8x4) and ``ternary_gemv_x16_into`` (auto split),
* a sweep of the int32x16 launcher over split-K in (1, 2, 4, 8) and the block configs of
  tools/gemv-instructions.py (--quick: the default config and auto split only),
* the portable twin compiled (asm=False): what the dp4a instruction itself buys,
* at M > 1 also the tensor-core kernels of both layouts (``ternary_matmul`` sends M > 1 there),
* bf16 ``F.linear`` on the same (dequantized) product.

Writes OUTDIR/ternary_gemv_bench.json: date, GPU, versions, and per row the median µs,
GB/s, % of the byte ceiling at 4.8 TB/s (the H200's HBM3e peak) and the ratio to F.linear
(> 1: faster than bf16), plus the best int32x16 config per shape, to copy into
``bitlinear.X16_CONFIG`` / ``x16_split_k`` once measured. Exits with a message and status 2
when there is no CUDA GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from gpulab import bitlinear as bl
from gpulab import normquant as nq
from gpulab import runtime
from gpulab.harness import bench as harness_bench

HBM_BYTES_PER_S = 4.8e12          # H200 HBM3e peak (spec sheet); measured copy ≈ 4.0–4.3 TB/s
SHAPES = [  # (M, N, K)
    (1, 8192, 8192), (1, 4096, 4096), (1, 14336, 4096), (1, 4096, 14336), (16, 8192, 8192),
]
DRY_SHAPES = [(1, 64, 4096), (2, 33, 100)]     # --dry-run: every call path, interpreter-sized
SPLITS = (1, 2, 4, 8)
CONFIGS = [bl.X16_CONFIG] + [c for c in ({"BLOCK_N": 16, "BLOCK_G": 64, "num_warps": 4},
          {"BLOCK_N": 32, "BLOCK_G": 32, "num_warps": 4}, {"BLOCK_N": 8, "BLOCK_G": 128, "num_warps": 4},
          {"BLOCK_N": 32, "BLOCK_G": 64, "num_warps": 4}, {"BLOCK_N": 64, "BLOCK_G": 64, "num_warps": 4},
          {"BLOCK_N": 32, "BLOCK_G": 64, "num_warps": 8}, {"BLOCK_N": 16, "BLOCK_G": 128, "num_warps": 4},
          {"BLOCK_N": 16, "BLOCK_G": 128, "num_warps": 8}, {"BLOCK_N": 32, "BLOCK_G": 128, "num_warps": 8},
          {"BLOCK_N": 8, "BLOCK_G": 256, "num_warps": 4}, {"BLOCK_N": 16, "BLOCK_G": 256, "num_warps": 8})
          if c != bl.X16_CONFIG]   # the default first, once


def parse_shapes(text):
    try:
        shapes = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are MxNxK,... with positive sizes, got {text!r}")
    return shapes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", type=Path, help="directory for ternary_gemv_bench.json")
    ap.add_argument("--quick", action="store_true", help="default config and auto split only")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--mm-sweep", action="store_true",
                    help="at M > 1 also time every tile of the tensor-core kernel (bitlinear.mm_tile_configs), "
                         "one pass and split K")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help='MxNxK,... instead of the default shapes (e.g. "16x4096x14336,16x14336x4096")')
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: call every variant once on tiny shapes in the current mode, time nothing")
    return ap.parse_args(argv)


def make_problem(m, n, k, seed=0, device="cuda"):
    """The same ternary product in every form: int8 x with its scale, ternary W packed both
    ways with its scale, and the dequantized bf16 tensors for F.linear."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    x_q, x_s = nq.absmax_quantize(x)
    w = torch.randn(n, k, device=device, generator=g)
    w = w * (torch.rand(n, k, device=device, generator=g) > 0.3)
    w_t, w_s = bl.ternary_quantize(w)
    return {"x_q": x_q.contiguous(), "x_s": x_s.float().contiguous(), "w_t": w_t,
            "w_s": w_s.reshape(1).float(), "w8": bl.pack_ternary(w_t), "w32": bl.pack_ternary_x16(w_t),
            "x_bf16": (x_q.float() / x_s[:, None]).to(torch.bfloat16),
            "w_bf16": (w_t.float() / w_s).to(torch.bfloat16)}


def bytes_moved(m, n, k, layout):
    weights = n * ((k + 3) // 4) if layout == "uint8x4" else 4 * n * ((k + 15) // 16)
    if layout == "bf16":
        weights = 2 * n * k
        return weights + 2 * m * k + 2 * m * n
    return weights + m * k + 4 * m + 2 * m * n          # int8 x, its scales, bf16 y


def correctness(p, m, n):
    """Exact agreement of every int32x16 variant with the uint8x4 GEMV (same int32 sums,
    same scaling), and of that with the float64 reference."""
    y8 = torch.empty(m, n, dtype=torch.float32, device=p["x_q"].device)
    bl.ternary_gemv_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], y8)
    ref = bl.ternary_matmul_ref(p["x_q"], p["x_s"], p["w_t"], p["w_s"])
    out = {"uint8x4 vs float64 max abs err": float((y8.double() - ref).abs().max())}
    for asm in ((False,) if runtime.interpreting() else (True, False)):
        for split in (None,) + SPLITS:
            y = torch.empty_like(y8)
            bl.ternary_gemv_x16_into(p["x_q"], p["x_s"], p["w32"], p["w_s"], y, split_k=split, asm=asm)
            out[f"int32x16 {'dp4a' if asm else 'portable'} split={split or 'auto'} bit-identical"] = bool(torch.equal(y, y8))
    return out


def timed(fn, graph):
    if graph is None:                    # --dry-run: one call, no timing
        fn()
        return {"dry_run": "called once, not timed"}
    row = {"us_do_bench": 1e3 * harness_bench.time_ms(fn)}
    if graph:
        row["us_cuda_graph"] = 1e3 * harness_bench.time_graph_ms(fn)
    # above the GPU time, the call is host-bound: its do_bench figure is the host's
    row["host_us_per_call"] = harness_bench.host_us_per_call(fn)
    return row


def bench_shape(m, n, k, quick, graph, mm_sweep=False):
    p = make_problem(m, n, k, device=runtime.device())
    out = torch.empty(m, n, dtype=torch.bfloat16, device=runtime.device())
    res = {"M": m, "N": n, "K": k, "correctness": correctness(p, m, n), "rows": []}

    def add(impl, layout, fn, **extra):
        t = time.time()
        try:
            row = {"impl": impl, "layout": layout, **extra, **timed(fn, graph)}
        except Exception as e:           # one failing variant must not hide the others
            row = {"impl": impl, "layout": layout, **extra, "error": f"{type(e).__name__}: {e}"}
        b = bytes_moved(m, n, k, layout)
        if "us_do_bench" in row:
            row["bytes"] = b
            row["GB/s"] = b / (row["us_do_bench"] * 1e-6) / 1e9
            row["pct_of_byte_ceiling_4.8TB/s"] = 100 * (b / HBM_BYTES_PER_S) / (row["us_do_bench"] * 1e-6)
        row["seconds"] = round(time.time() - t, 1)
        res["rows"].append(row)
        print(f"  {impl:<58} {row.get('us_do_bench', float('nan')):9.2f} µs"
              + (f"  graph {row['us_cuda_graph']:8.2f} µs" if "us_cuda_graph" in row else "")
              + (f"  host {row['host_us_per_call']:7.1f} µs" if "host_us_per_call" in row else "")
              + (f"  {row['error']}" if "error" in row else ""), flush=True)

    add("torch bf16 F.linear", "bf16", lambda: F.linear(p["x_bf16"], p["w_bf16"]))
    add("ternary_matmul as called (uint8x4, today's default)", "uint8x4",
        lambda: bl.ternary_matmul(p["x_q"], p["x_s"], p["w8"], p["w_s"]))
    add("ternary_matmul as called (int32x16)", "int32x16",
        lambda: bl.ternary_matmul(p["x_q"], p["x_s"], p["w32"], p["w_s"]))
    add("ternary_gemv_into (uint8x4 launcher, autotuned)", "uint8x4",
        lambda: bl.ternary_gemv_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], out))
    add("ternary_gemv_x16_into (dp4a, default config, auto split)", "int32x16",
        lambda: bl.ternary_gemv_x16_into(p["x_q"], p["x_s"], p["w32"], p["w_s"], out),
        split_k=bl.x16_split_k(m, n, k, bl.X16_CONFIG["BLOCK_N"], bl.X16_CONFIG["BLOCK_G"]),
        config=dict(bl.X16_CONFIG))
    add("ternary_gemv_x16_into (portable twin compiled, auto split)", "int32x16",
        lambda: bl.ternary_gemv_x16_into(p["x_q"], p["x_s"], p["w32"], p["w_s"], out, asm=False))
    if m > 1:   # ternary_matmul sends M > 1 to the tensor-core kernels: time both layouts' own
        add("ternary_mm_into (uint8x4 tensor cores, one pass)", "uint8x4",
            lambda: bl.ternary_mm_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], out), split_k=1)
        add("ternary_mm_into (uint8x4 tensor cores, split_k=4)", "uint8x4",
            lambda: bl.ternary_mm_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], out, split_k=4), split_k=4)
        add("ternary_mm_x16_into (int32x16 tensor cores)", "int32x16",
            lambda: bl.ternary_mm_x16_into(p["x_q"], p["x_s"], p["w32"], p["w_s"], out))
        # the first as-called row autotunes the tensor-core kernel; timed again once tuned
        # (M=16 on 2026-12-02: 49.2 us as called against 31.2 us for its launcher)
        add("ternary_matmul as called (uint8x4), again once tuned", "uint8x4",
            lambda: bl.ternary_matmul(p["x_q"], p["x_s"], p["w8"], p["w_s"]))
    if mm_sweep and m > 1:    # every tile of the tensor-core kernel, one pass and split K
        done = set()
        for cfg in bl.mm_tile_configs():
            for split in (1, 2, 4):
                actual = bl.mm_split(p["w8"].shape[1], split)[1]
                if (tuple(cfg.values()), actual) in done:
                    continue
                done.add((tuple(cfg.values()), actual))
                name = (f"mm sweep BLOCK_M={cfg['BLOCK_M']} BLOCK_N={cfg['BLOCK_N']} BLOCK_Q={cfg['BLOCK_Q']} "
                        f"w{cfg['num_warps']} s{cfg['num_stages']} split={actual}")
                add(name, "uint8x4",
                    lambda c=cfg, s=split: bl.ternary_mm_into(p["x_q"], p["x_s"], p["w8"], p["w_s"], out,
                                                              split_k=s, config=c),
                    split_k=actual, config=dict(cfg))
    if not quick:
        for cfg in CONFIGS:
            for split in SPLITS:
                name = (f"x16 sweep BLOCK_N={cfg['BLOCK_N']} BLOCK_G={cfg['BLOCK_G']} "
                        f"w{cfg['num_warps']} split={split}")
                add(name, "int32x16",
                    lambda c=cfg, s=split: bl.ternary_gemv_x16_into(p["x_q"], p["x_s"], p["w32"], p["w_s"],
                                                                    out, split_k=s, config=c),
                    split_k=split, config=dict(cfg))
    base = next((r for r in res["rows"] if r["impl"] == "torch bf16 F.linear" and "us_do_bench" in r), None)
    for r in res["rows"]:
        if base and "us_do_bench" in r:
            r["speedup_vs_F.linear"] = base["us_do_bench"] / r["us_do_bench"]
            if "us_cuda_graph" in r and "us_cuda_graph" in base:
                r["speedup_vs_F.linear_graph"] = base["us_cuda_graph"] / r["us_cuda_graph"]
    mm = [r for r in res["rows"] if r["impl"].startswith("mm sweep") and "us_cuda_graph" in r]
    if mm:
        best = min(mm, key=lambda r: r["us_cuda_graph"])
        res["best_mm_tile"] = {k: best[k] for k in ("impl", "config", "split_k", "us_do_bench", "us_cuda_graph")}
    x16 = [r for r in res["rows"] if r["layout"] == "int32x16" and "config" in r and "us_do_bench" in r]
    if x16:
        best = min(x16, key=lambda r: r["us_do_bench"])
        res["best_int32x16"] = {k: best[k] for k in ("impl", "config", "split_k", "us_do_bench")}
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if runtime.mode() != "compiled" and not args.dry_run:
        print(f"ternary-gemv-bench needs a CUDA GPU (gpulab mode here: {runtime.mode()}); "
              "nothing was timed. Run it on the H200.", file=sys.stderr)
        return 2
    args.outdir.mkdir(parents=True, exist_ok=True)
    doc = {"what": "ternary decode GEMV: uint8x4 vs int32x16 (dp4a) vs bf16 F.linear",
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": runtime.gpu_name(),
           "versions": runtime.versions(), "byte_ceiling_bytes_per_s": HBM_BYTES_PER_S,
           "method": ("triton.testing.do_bench median (gpulab.harness.bench.time_ms: L2 flushed before "
                      "every call, launched from Python = as called); us_cuda_graph: "
                      "gpulab.harness.bench.time_graph_ms (CUDA graph, L2 flushed, no launch overhead); "
                      "host_us_per_call: gpulab.harness.bench.host_us_per_call (Python and launches, "
                      "unwaited: above the GPU time, the as-called figure is the host's)"),
           "gpulab_x16_config": dict(bl.X16_CONFIG), "shapes": []}
    if args.dry_run:
        doc["what"] = "DRY RUN, nothing timed: " + doc["what"]
    for m, n, k in (DRY_SHAPES if args.dry_run else args.shapes or SHAPES):
        print(f"== M={m} N={n} K={k}", flush=True)
        try:
            doc["shapes"].append(bench_shape(m, n, k, args.quick, None if args.dry_run else not args.no_graph,
                                              args.mm_sweep))
        except Exception as e:
            doc["shapes"].append({"M": m, "N": n, "K": k, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-3000:]})
            print("FAILED", doc["shapes"][-1]["traceback"], flush=True)
        path = args.outdir / "ternary_gemv_bench.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")   # after every shape: partial results survive
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

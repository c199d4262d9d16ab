"""The ternary matmul at a few rows (M = 2..128) on a GPU: the byte layout's per-tile
tensor-core kernel (``ternary_mm_into``, autotuned; what ``ternary_matmul`` ran for 2 to 255
rows before 2026-12-03) against ``ternary_mm_small_kernel`` (four weights unpacked per
instruction group) over a sweep of tiles, and bf16 ``F.linear``, on the same tensors.
The sweep chose ``bitlinear.small_mm_config`` and ``SMALL_MM_MAX_M``.

usage (repository root, on the H200):
    PYTHONPATH=$PWD python tools/small_m_probe.py OUTDIR [--quick]

1. At M = 16, K = N = 8192: every config of the sweep below, checked equal (bits) to
   ``ternary_mm_into`` first, timed as launched (``do_bench`` median, L2 flushed);
   ``--warps 4,8`` sweeps 8-warp programs too (up to 64 columns), ``--sweep-only`` stops here.
2. The three fastest configs on every (M, N, K) of SHAPES x MS, with F.linear, ``ternary_matmul``
   as called, and the best small-kernel config again in a CUDA graph (as the engine replays it).
Writes OUTDIR/small_m_probe.json (rows: shape, implementation, config, µs) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpulab import bitlinear as bl
from gpulab import runtime
from gpulab.harness import bench

SHAPES = [(8192, 8192), (4096, 4096), (14336, 4096), (4096, 14336), (3072, 2048), (11264, 2048), (2048, 5632)]
MS = (2, 5, 16, 40, 64, 128)


def sweep_configs(quick: bool, warps=(4,)) -> list[dict]:
    out = []
    bqs, stages = ((256,), (3, 4)) if quick else ((128, 256, 512), (3, 4, 5))
    for nw, bn, bq, st in itertools.product(warps, (32, 64, 128), bqs, stages):
        if bn * nw <= 512:          # 8-warp programs up to 64 columns
            out.append({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_Q": bq, "num_warps": nw, "num_stages": st})
    return out


def tensors(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randint(-1, 2, (n, k), device="cuda", generator=g, dtype=torch.int8)
    x = torch.randint(-128, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
    xs = torch.rand(m, device="cuda", generator=g) + 0.5
    ws = torch.tensor([0.7], device="cuda")
    return x, xs, bl.pack_ternary(w), ws, w


def with_m(cfg: dict, m: int) -> list[dict]:
    """The config at each BLOCK_M worth trying for m rows."""
    return [{**cfg, "BLOCK_M": bm} for bm in (16, 32, 64, 128) if bm <= max(16, runtime.next_power_of_2(m))
            and (bm >= 64 or bm * 4 >= m)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warps", default="4", help="warps per program to sweep, e.g. 4,8")
    ap.add_argument("--sweep-only", action="store_true", help="only part 1, the sweep at M = 16")
    a = ap.parse_args(argv)
    if runtime.mode() != "compiled":
        print("small_m_probe needs a CUDA GPU")
        return 2
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": datetime.date.today().isoformat(), "gpu": runtime.gpu_name(), "versions": runtime.versions(),
           "rows": []}

    def row(shape, impl, us, cfg=None):
        r = {"m": shape[0], "n": shape[1], "k": shape[2], "impl": impl, "us": round(us, 2), "config": cfg}
        res["rows"].append(r)
        print(f"M{shape[0]:>3} N{shape[1]:>6} K{shape[2]:>6}  {impl:<34} {us:8.2f} us  {cfg or ''}", flush=True)
        (out / "small_m_probe.json").write_text(json.dumps(res, indent=1))

    # 1. the sweep at M = 16, 8192²
    m, n, k = 16, 8192, 8192
    x, xs, wp, ws, _ = tensors(m, n, k)
    want = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    bl.ternary_mm_into(x, xs, wp, ws, want)
    timed = []
    t0 = time.time()
    for cfg in sweep_configs(a.quick, tuple(int(w) for w in a.warps.split(","))):
        portable_too = cfg["BLOCK_N"] == 64 and cfg["BLOCK_Q"] == 256 and cfg["num_stages"] == 4
        for asm in (True, False) if portable_too else (True,):
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            try:
                bl.ternary_mm_small_into(x, xs, wp, ws, y, config=cfg, asm=asm)
                torch.cuda.synchronize()
            except Exception as e:          # a config that does not compile (shared memory)
                print("failed", cfg, type(e).__name__, str(e)[:200], flush=True)
                continue
            if not torch.equal(y, want):
                print("WRONG", cfg, asm, (y.float() - want.float()).abs().max().item(), flush=True)
                res.setdefault("wrong", []).append({"config": cfg, "asm": asm})
                continue
            us = bench.time_ms(lambda: bl.ternary_mm_small_into(x, xs, wp, ws, y, config=cfg, asm=asm)) * 1e3
            row((m, n, k), "small" + ("" if asm else " (portable unpack)"), us, cfg)
            if asm:
                timed.append((us, cfg))
    print(f"sweep: {time.time() - t0:.0f} s", flush=True)
    timed.sort(key=lambda t: t[0])
    best = [c for _, c in timed[:3]]
    res["best_at_16"] = best
    if a.sweep_only:
        return 0

    # 2. every shape and M: baselines and the best configs
    for (n, k), m in itertools.product(SHAPES[:3] if a.quick else SHAPES, MS):
        x, xs, wp, ws, w = tensors(m, n, k, seed=m)
        shape = (m, n, k)
        xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wb = w.to(torch.bfloat16)
        row(shape, "F.linear bf16", bench.time_ms(lambda: F.linear(xb, wb)) * 1e3)
        row(shape, "ternary_matmul as called", bench.time_ms(lambda: bl.ternary_matmul(x, xs, wp, ws)) * 1e3)
        want = bl.ternary_matmul(x, xs, wp, ws)
        per_tile = torch.empty_like(want)
        row(shape, "ternary_mm_into (per tile, autotuned)",
            bench.time_ms(lambda: bl.ternary_mm_into(x, xs, wp, ws, per_tile)) * 1e3)
        y = torch.empty_like(want)
        if m <= bl.SMALL_MM_MAX_M:
            row(shape, "small launcher, default config",
                bench.time_ms(lambda: bl.ternary_mm_small_into(x, xs, wp, ws, y)) * 1e3, bl.small_mm_config(m, n, k))
            assert torch.equal(y, want)
        fastest = None
        for c in [c for cfg in best for c in with_m(cfg, m)]:
            try:
                bl.ternary_mm_small_into(x, xs, wp, ws, y, config=c)
            except Exception as e:
                print("failed", c, type(e).__name__, str(e)[:200], flush=True)
                continue
            if not torch.equal(y, want):
                print("WRONG", shape, c, flush=True)
                continue
            us = bench.time_ms(lambda: bl.ternary_mm_small_into(x, xs, wp, ws, y, config=c)) * 1e3
            row(shape, "small launcher", us, c)
            if fastest is None or us < fastest[0]:
                fastest = (us, c)
        if fastest:
            c = fastest[1]
            row(shape, "small launcher, CUDA graph",
                bench.time_graph_ms(lambda: bl.ternary_mm_small_into(x, xs, wp, ws, y, config=c)) * 1e3, c)
            row(shape, "F.linear bf16, CUDA graph", bench.time_graph_ms(lambda: F.linear(xb, wb)) * 1e3)
    print(f"wrote {out / 'small_m_probe.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

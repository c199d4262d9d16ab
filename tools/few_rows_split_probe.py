"""The few-rows ternary matmul (``bitlinear.ternary_mm_small_into``) on the engine bench's
model shapes, tiles and split-K swept (GPU only; issue 14's TTFT: a cached prompt's step
runs its matmuls at 16, 32 or 64 rows, the whole-step graph's token buckets).

usage (repository root, on the H200):
    PYTHONPATH=$PWD python tools/few_rows_split_probe.py OUTDIR [--budget S] [--ms 64,32,16] [--shapes 3072x2048,...]

For each (N, K) of the engine bench's layers (QKV 3072x2048, O 2048x2048, gate-up
11264x2048, down 2048x5632) and M = 64, 32, 16: every tile of the sweep with SPLIT_K 1, 2,
4, 8, each checked bit-equal to the package's default first; timed in a CUDA graph of
launches that cycle over enough copies of the weights to leave L2 (as the engine's 16
layers do), so a launch reads its weights from HBM. Also the package's default tile, the
unpack-then-int8-GEMM path and bf16 F.linear on the same tensors. Writes
OUTDIR/few_rows_split_probe.json and prints, per shape, the default and the five fastest.
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

SHAPES = [(3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
MS = (64, 32, 16)          # the most common bucket of the TTFT workload first


def tiles(m: int) -> list[dict]:
    bms = (16,) if m <= 16 else (32, 64) if m <= 32 else (64,) if m <= 64 else (64, 128)
    out = []
    for bm, bn, bq, st in itertools.product(bms, (16, 32, 64), (64, 128, 256), (2, 3)):
        if bq == 256 and bm > 16:
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_Q": bq, "num_warps": 4, "num_stages": st})
    return out


def graph_us(fn_of_copy, copies: int, reps: int = 7) -> float:
    """Median time of one launch: a CUDA graph of ``copies`` launches, each on its own
    copy of the weights (out of L2 by the time it comes round again)."""
    fn_of_copy(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(copies):
            fn_of_copy(c)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=400.0, help="stop sweeping after this many seconds")
    ap.add_argument("--ms", default=",".join(map(str, MS)),
                    help="row counts, comma-separated (past SMALL_MM_MAX_M the package's own dispatch is a row too)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="N x K of each layer, comma-separated (default: the engine bench's four)")
    a = ap.parse_args(argv)
    ms = tuple(int(v) for v in a.ms.split(","))
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = []
    res = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__}, "rows": rows}

    def save():
        (out / "few_rows_split_probe.json").write_text(json.dumps(res, indent=1))

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, (n, k) in itertools.product(ms, shapes):
        w = torch.randint(-1, 2, (n, k), device="cuda", generator=g, dtype=torch.int8)
        wp = bl.pack_ternary(w)
        copies = max(2, min(64, int(160e6 // wp.numel())))
        wps = [wp] + [wp.clone() for _ in range(copies - 1)]
        x = torch.randint(-128, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
        xs = torch.rand(m, device="cuda", generator=g) + 0.5
        ws = torch.tensor([0.7], device="cuda")
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(y)
        bl.ternary_mm_small_into(x, xs, wp, ws, ref)

        def row(impl, us, cfg=None):
            rows.append({"m": m, "n": n, "k": k, "impl": impl, "us": round(us, 2), "config": cfg})

        row("default", graph_us(lambda c: bl.ternary_mm_small_into(x, xs, wps[c], ws, y), copies),
            bl.small_mm_config(m, n, k))
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, max(2, int(160e6 // (2 * n * k)))))]
        xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row("F.linear bf16", graph_us(lambda c: F.linear(xb, wb[c]), len(wb)))
        del wb
        if m > bl.SMALL_MM_MAX_M:
            row("package (ternary_matmul_into)",
                graph_us(lambda c: bl.ternary_matmul_into(x, xs, wps[c], ws, y), copies))
            row("ternary_mm_kernel (autotuned)",
                graph_us(lambda c: bl.ternary_mm_into(x, xs, wps[c], ws, y), copies))
        row("unpack + int8 GEMM", graph_us(lambda c: bl.ternary_mm_unpacked_into(x, xs, wps[c], ws, y), copies))
        for cfg, split in itertools.product(tiles(m), (1, 2, 4, 8) if m <= 64 else (1, 2)):
            if time.time() - start > a.budget:
                break
            c = {**cfg, "SPLIT_K": split}
            try:
                y.fill_(float("nan"))
                bl.ternary_mm_small_into(x, xs, wp, ws, y, config=dict(c))
                if not torch.equal(y, ref):
                    row("small", float("nan"), {**c, "error": "differs from the default"})
                    continue
                row("small", graph_us(lambda i: bl.ternary_mm_small_into(x, xs, wps[i], ws, y, config=dict(c)),
                                      copies), c)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                row("small", float("nan"), {**c, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        save()
        mine = [r for r in rows if r["m"] == m and r["n"] == n and r["k"] == k]
        best = sorted((r for r in mine if r["impl"] == "small" and r["us"] == r["us"]), key=lambda r: r["us"])[:5]
        print(f"M={m} N={n} K={k} ({copies} weight copies)", flush=True)
        for r in [r for r in mine if r["impl"] != "small"] + best:
            print(f"  {r['impl']:20s} {r['us']:8.2f} us  {r['config'] or ''}", flush=True)
        del wps
        torch.cuda.empty_cache()
    save()
    print(f"sweep took {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available() or runtime.interpreting():
        sys.exit("few_rows_split_probe needs a GPU (compiled Triton)")
    sys.exit(main())

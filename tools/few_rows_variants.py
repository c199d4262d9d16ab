"""Variants of the few-rows ternary matmul (``bitlinear.ternary_mm_small_kernel``), measured
on an H200 before they go into the package (issue 13's M = 16 line).

* ``with_other``: the weight load with ``other=0x55`` (the package's kernel until the first
  run of 2026-12-04). With ``other`` the compiler splits every loaded word into bytes to
  select it (224 PRMT and 161 SEL in a main loop of 1242 SASS instructions at the M = 16
  tile; 847 without).
* ``package``: the load without ``other`` (a masked weight always meets x = 0 or lands in a
  column that is not stored, so it needs no value of its own). Same bits; on the H200
  16.9 against 18.7 µs at M = 16, K = N = 8192, so the package took it.
* ``codes``: ``package``, and the dots take the codes c = w + 1 themselves (a shift and a
  mask for four weights, no per-byte subtraction), Σ x·w = Σ x·c − Σx, the rows' Σx by dp4a
  on the x tiles the loop loads anyway (508 instructions). Wrong bits on the H200 twice
  (the second time with quarter 3's mask after `shr 6` in place) and slower (28.9 against
  18 µs timed; under Nsight Compute 34.0 against 20.7 µs, DRAM throughput 10%, "memory"
  throughput 76%, a sign that the dp4a sums' layout changes go through shared memory).
  Kept as a record, not fixed.

usage (repository root):
    PYTHONPATH=$PWD python tools/few_rows_variants.py OUTDIR        (H200: check, then time)
    PYTHONPATH=$PWD python tools/few_rows_variants.py --static      (any machine: SASS counts)
    ncu -k probe_small_kernel python tools/few_rows_variants.py --once codes   (one variant)

OUTDIR/few_rows_variants.json: per variant, bit-equality with ``ternary_mm_into`` on ragged
shapes, then µs at M = 16, K = N = 8192 as launched (``do_bench``, L2 flushed) and in a
CUDA graph, next to the package's launcher and bf16 ``F.linear`` on the same tensors.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import sys
from pathlib import Path

if "--static" in sys.argv:      # compile only, before gpulab fixes Triton's mode
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["GPULAB_COMPILE_ONLY"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpulab import bitlinear as bl  # noqa: E402
from gpulab.bitlinear import store_scaled, ternary_bytes_as_int8  # noqa: E402
from gpulab import runtime  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the few-rows probe's problem maker: (x_q, x_scale, packed w, w_scale, w) on the GPU
tensors = runpy.run_path(str(ROOT / "tools" / "small_m_probe.py"), run_name="small_m_probe")["tensors"]
VARIANTS = {"with_other": (False, False), "package": (True, False), "codes": (True, True)}
TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_Q": 256, "num_warps": 4, "num_stages": 4}   # small_mm_config at M 16, N 8192, H200


@triton.jit
def codes_of(b, i: tl.constexpr):
    """(b >> 2i) & 3 for four packed bytes per register: every quarter needs the mask."""
    if i == 0:
        c = tl.inline_asm_elementwise("and.b32 $0, $1, 0x03030303;", "=r,r", [b],
                                      dtype=tl.int8, is_pure=True, pack=4)
    elif i == 1:
        c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }",
                                      "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    elif i == 2:
        c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303; }",
                                      "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    else:
        c = tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303; }",
                                      "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    return c


@triton.jit
def sums_of_four(x):
    """int8 -> int32: each register's four bytes summed (dp4a) into its first element."""
    return tl.inline_asm_elementwise(
        "{ dp4a.s32.s32 $0, $4, 0x01010101, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }",
        "=r,=r,=r,=r,r", [x], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit(do_not_specialize=["M"])
def probe_small_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, Q, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                       NO_OTHER: tl.constexpr, CODES: tl.constexpr):
    """``ternary_mm_small_kernel`` (inline-PTX path, int8 dots) with the two switches
    (NO_OTHER=True, CODES=False: the package's kernel)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    sum_x = tl.zeros([BLOCK_M, BLOCK_Q], dtype=tl.int32)
    for j0 in range(0, Q, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < Q
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + j[:, None]
        if NO_OTHER:
            b = tl.load(w_ptrs, mask=j_mask[:, None] & n_mask[None, :])
        else:
            b = tl.load(w_ptrs, mask=j_mask[:, None] & n_mask[None, :], other=0x55)
        for i in tl.static_range(4):
            k = i * Q + j
            xa = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                         mask=m_mask[:, None] & (j_mask & (k < K))[None, :], other=0)
            if CODES:
                wi = codes_of(b, i)
                sum_x += sums_of_four(xa)
            else:
                wi = ternary_bytes_as_int8(b, i, True)
            acc = tl.dot(xa, wi, acc, out_dtype=tl.int32)
    if CODES:
        acc -= tl.sum(sum_x, axis=1)[:, None]
    store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym)


def launch(variant, x, xs, wp, ws, y):
    no_other, codes = VARIANTS[variant]
    m, k = x.shape
    n, q = wp.shape
    cfg = bl.small_mm_config(m, n, k)            # the package's tile for these sizes (TILE at M = 16)
    if cfg.pop("SPLIT_K", 1) != 1:
        raise ValueError(f"the package splits K at M={m}, N={n}, K={k}; these variants run one pass only")
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    probe_small_kernel[grid](x, xs, wp, ws, y, m, n, k, q, x.stride(0), wp.stride(0), y.stride(0),
                             NO_OTHER=no_other, CODES=codes, **cfg)


def static_counts() -> int:
    """SASS main-loop counts of the three variants for sm_90, no GPU (tools/gemv-instructions.py)."""
    tool = runpy.run_path(str(ROOT / "tools" / "gemv-instructions.py"), run_name="counts")
    sig = {"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32",
           "N": "i32", "K": "i32", "Q": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_Q": "constexpr", "NO_OTHER": "constexpr",
           "CODES": "constexpr"}
    div = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "y_ptr", "N", "K", "Q", "stride_xm", "stride_wn", "stride_ym")
    print(f"static SASS counts, no GPU run: triton {triton.__version__}, sm_90, M = 16 tile")
    for name, (no_other, codes) in VARIANTS.items():
        v = dict(name=name, kernel=probe_small_kernel, signature=sig, divisible=div,
                 constexprs={k: TILE[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_Q")} | {"NO_OTHER": no_other,
                                                                                      "CODES": codes},
                 options={"num_warps": TILE["num_warps"], "num_stages": TILE["num_stages"]},
                 weights_per_iter=TILE["BLOCK_N"] * TILE["BLOCK_Q"] * 4, threads=32 * TILE["num_warps"])
        r = tool["measure"](v)
        print(f"{name:<9} main loop {r['sass_loop_instructions']:5d} instructions, "
              f"{r['sass_per_weight']:.3f} a weight")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--static", action="store_true", help="SASS counts only, no GPU")
    ap.add_argument("--once", choices=list(VARIANTS), help="launch one variant a few times (for ncu)")
    a = ap.parse_args(argv)
    if a.static:
        return static_counts()
    if runtime.mode() != "compiled":
        print("few_rows_variants needs a CUDA GPU (--static counts instructions without one)")
        return 2
    if a.once:
        x, xs, wp, ws, _ = tensors(16, 8192, 8192)
        y = torch.empty(16, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            launch(a.once, x, xs, wp, ws, y)
        torch.cuda.synchronize()
        return 0
    if not a.outdir:
        ap.error("OUTDIR is required (or --static, --once)")
    from gpulab.harness import bench
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": datetime.date.today().isoformat(), "gpu": runtime.gpu_name(), "versions": runtime.versions(),
           "tile": TILE, "checks": {}, "rows": []}
    for name in VARIANTS:           # the same bits as the per-tile kernel, ragged shapes included
        ok = True
        for m, n, k in ((2, 9, 13), (16, 1000, 8191), (16, 65, 1030), (40, 3072, 2048), (64, 3001, 4099)):
            x, xs, wp, ws, _ = tensors(m, n, k, seed=m + k)
            want = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            bl.ternary_mm_into(x, xs, wp, ws, want)
            y = torch.full_like(want, float("nan"))
            launch(name, x, xs, wp, ws, y)
            ok = ok and torch.equal(y, want)
        res["checks"][name] = ok
        print(f"{name:<9} bit-equal to ternary_mm_into on five ragged shapes: {ok}", flush=True)
    x, xs, wp, ws, w = tensors(16, 8192, 8192)
    y = torch.empty(16, 8192, device="cuda", dtype=torch.bfloat16)
    xb, wb = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16), w.to(torch.bfloat16)
    timed = {"F.linear bf16": lambda: F.linear(xb, wb),
             "package launcher": lambda: bl.ternary_mm_small_into(x, xs, wp, ws, y)}
    timed |= {name: (lambda name=name: launch(name, x, xs, wp, ws, y)) for name in VARIANTS if res["checks"][name]}
    for name, fn in timed.items():
        r = {"impl": name, "us": round(bench.time_ms(fn) * 1e3, 2), "graph_us": round(bench.time_graph_ms(fn) * 1e3, 2)}
        res["rows"].append(r)
        print(f"M16 N8192 K8192  {name:<18} {r['us']:8.2f} µs, in a graph {r['graph_us']:8.2f} µs", flush=True)
    (out / "few_rows_variants.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out / 'few_rows_variants.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

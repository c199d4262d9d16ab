"""rmsnorm_quant at 4096 x 14336 (issue 13's 72% row): padding, or rows in flight?

The package kernel holds a row in one power-of-two block: 14336 columns in a 16384-wide
block. Two kernels here, each with the package kernel's arithmetic (one reduction carrying
Σx² and max|x·w|, one conversion per rounding):

* pieces: the row as up to three unmasked power-of-two pieces (14336 = 8192 + 4096 + 2048;
  a remainder that is not such a sum becomes a masked third piece), no padded lanes. On the
  H200 (2026-12-03) no faster: 61.0 µs at 4 warps against the package's 57.3 at 8.
* prefetch: a persistent kernel, 1, 2 or 4 programs per SM, each loading its next row
  before it reduces and stores this one. At 8 warps the package kernel holds one row of
  14336 per program and two programs fit an SM (96 registers a thread): 57 KB in flight per
  SM, against four to eight rows of 8192 (64-128 KB) in the 88% case. Not yet on a GPU;
  compiled for sm_90 on a CPU (triton 3.8, ``ptxas -v``) the second row costs registers one
  for one: 255 a thread at 8 warps, 128 at 16 (the package kernel: 136 and 81).

It checks the codes (within one) and scales of both against the package's, then times
them (``do_bench``, L2 flushed) at 4, 8 and 16 warps on 4096 x 14336 and 8192 x 8192 bf16,
next to the package's kernel and its public function as called.

    PYTHONPATH=$PWD python3 tools/rmsnorm_pieces_probe.py OUTDIR     (a CUDA GPU)
    PYTHONPATH=$PWD python3 tools/rmsnorm_pieces_probe.py --check    (any machine: the pieces
                                                                      against the package, small)

Writes OUTDIR/rmsnorm_pieces_probe.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import gpulab  # first: it fixes Triton's mode
import triton
import triton.language as tl
from gpulab import normquant as nq, runtime


@triton.jit
def sum_and_max(s0, m0, s1, m1):
    return s0 + s1, tl.maximum(m0, m1)


@triton.jit
def _piece_stats(x_ptr, w_ptr, row, start, n_cols, SIZE: tl.constexpr, MASKED: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    if MASKED:
        x = tl.load(x_ptr + row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row + cols).to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
    xw = x * w
    sum_sq, max_xw = tl.reduce((x * x, tl.abs(xw)), 0, sum_and_max)   # one reduction, as the package's
    return x, xw, sum_sq, max_xw


@triton.jit
def _piece_store(q_ptr, qrow, start, n_cols, xw, mult, SIZE: tl.constexpr, MASKED: tl.constexpr):
    cols = start + tl.arange(0, SIZE)
    q = tl.minimum(tl.maximum(nq.round_half_away_int(xw * mult), -128), 127).to(tl.int8)
    if MASKED:
        tl.store(q_ptr + qrow + cols, q, mask=cols < n_cols)
    else:
        tl.store(q_ptr + qrow + cols, q)


@triton.jit
def rmsnorm_quant_pieces_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q, eps,
                                P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, MASK_LAST: tl.constexpr):
    """One row per program, held as pieces of P0, P1, P2 columns (P1, P2 may be 0; the
    last present piece is masked when MASK_LAST)."""
    r = tl.program_id(0).to(tl.int64)
    row = r * stride_x
    qrow = r * stride_q
    x0, xw0, s, m = _piece_stats(x_ptr, w_ptr, row, 0, n_cols, P0, MASK_LAST and P1 == 0)
    if P1 > 0:
        x1, xw1, s1, m1 = _piece_stats(x_ptr, w_ptr, row, P0, n_cols, P1, MASK_LAST and P2 == 0)
        s += s1
        m = tl.maximum(m, m1)
    if P2 > 0:
        x2, xw2, s2, m2 = _piece_stats(x_ptr, w_ptr, row, P0 + P1, n_cols, P2, MASK_LAST)
        s += s2
        m = tl.maximum(m, m2)
    rstd = 1.0 / tl.sqrt(s / n_cols + eps)
    scale = 127.0 / tl.maximum(m * rstd, 1e-5)
    mult = rstd * scale
    _piece_store(q_ptr, qrow, 0, n_cols, xw0, mult, P0, MASK_LAST and P1 == 0)
    if P1 > 0:
        _piece_store(q_ptr, qrow, P0, n_cols, xw1, mult, P1, MASK_LAST and P2 == 0)
    if P2 > 0:
        _piece_store(q_ptr, qrow, P0 + P1, n_cols, xw2, mult, P2, MASK_LAST)
    tl.store(scale_ptr + r, scale)


@triton.jit
def rmsnorm_quant_prefetch_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x, stride_q, eps,
                                  BLOCK_N: tl.constexpr):
    """Persistent: program p takes rows p, p + P, p + 2P, ... (P programs) and loads the
    next row before it reduces and stores this one, so each program keeps two rows in
    flight. The weights are loaded again for every row (from L1/L2), not held."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    # 32-bit row offsets: a probe for inputs under 2**31 elements
    x_next = tl.load(x_ptr + pid * stride_x + cols, mask=cmask & (pid < n_rows), other=0.0)
    for r in range(pid, n_rows, nprog):
        x = x_next.to(tl.float32)
        nxt = r + nprog
        x_next = tl.load(x_ptr + nxt * stride_x + cols, mask=cmask & (nxt < n_rows), other=0.0)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        xw = x * w
        sum_sq, max_xw = tl.reduce((x * x, tl.abs(xw)), 0, sum_and_max)
        rstd = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
        scale = 127.0 / tl.maximum(max_xw * rstd, 1e-5)
        q = tl.minimum(tl.maximum(nq.round_half_away_int(xw * (rstd * scale)), -128), 127).to(tl.int8)
        tl.store(q_ptr + r * stride_q + cols, q, mask=cmask)
        tl.store(scale_ptr + r, scale)


def run_prefetch(x, w, q, scale, num_warps, per_sm, eps=1e-6):
    n_rows, n_cols = x.shape
    grid = (max(1, min(n_rows, per_sm * runtime.num_sms())),)
    rmsnorm_quant_prefetch_kernel[grid](x, w, q, scale, n_rows, n_cols, x.stride(0), q.stride(0), eps,
                                        BLOCK_N=runtime.next_power_of_2(n_cols), num_warps=num_warps)


def pieces(n: int) -> tuple[int, int, int, bool]:
    """n as P0 + P1 + P2 (powers of two, descending), the last masked if it overshoots."""
    out, rest = [], n
    while rest and len(out) < 2:
        p = 1 << (rest.bit_length() - 1)
        out.append(p)
        rest -= p
    if rest:
        out.append(runtime.next_power_of_2(rest))
    masked = sum(out) != n
    return (*out, *[0] * (3 - len(out)), masked)


def run_pieces(x, w, q, scale, num_warps, eps=1e-6):
    n_rows, n_cols = x.shape
    p0, p1, p2, masked = pieces(n_cols)
    rmsnorm_quant_pieces_kernel[(n_rows,)](x, w, q, scale, n_cols, x.stride(0), q.stride(0), eps,
                                           P0=p0, P1=p1, P2=p2, MASK_LAST=masked, num_warps=num_warps)


def run_package(x, w, q, scale, num_warps, eps=1e-6):
    """The package's kernel with a fixed number of warps (its launcher tunes them)."""
    n_rows, n_cols = x.shape
    block_r, block_n = 1, runtime.next_power_of_2(n_cols)      # the launcher's blocks for rows of 4K and more
    nq.rmsnorm_quant_fwd_kernel[(runtime.cdiv(n_rows, block_r),)](
        x, w, q, scale, x, scale, n_rows, n_cols, x.stride(0), q.stride(0), 0, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, FAKE_QUANT=False, ONE_REDUCTION=not runtime.interpreting(),
        num_warps=num_warps)


def spec_inputs(n_rows, n_cols, device, seed=0):
    """The rmsnorm_quant spec's inputs (bf16 rows of different scales, a weight): x, w."""
    inp = gpulab.get_spec("rmsnorm_quant").make_inputs(dict(rows=n_rows, cols=n_cols), torch.bfloat16,
                                                       torch.device(device),
                                                       torch.Generator(device=device).manual_seed(seed))
    return inp["x"], inp["weight"]


def same_bits(shape, device, warps=4, run=None) -> bool:
    x, w = spec_inputs(*shape, device, seed=shape[1])
    q1, q2 = torch.empty(shape, dtype=torch.int8, device=device), torch.empty(shape, dtype=torch.int8, device=device)
    s1, s2 = torch.empty(shape[0], device=device), torch.empty(shape[0], device=device)
    nq.rmsnorm_quant_into(x, w, q1, s1)
    (run or run_pieces)(x, w, q2, s2, warps)
    # one ulp apart at most in the scale (a sum in another order), so codes off by one at most
    return bool((q1.int() - q2.int()).abs().max() <= 1 and torch.allclose(s1, s2, rtol=1e-5, atol=0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--check", action="store_true", help="small shapes against the package, any machine")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.check:
        ok = {f"{r}x{c}": same_bits((r, c), device) for r, c in ((3, 7), (2, 96), (3, 112), (2, 100))}
        # the persistent kernel with fewer programs than rows (each takes several, prefetching)
        ok |= {f"{r}x{c} prefetch": same_bits((r, c), device, run=lambda *a: run_prefetch(*a, per_sm=1))
               for r, c in ((7, 100), (300, 24))}
        print("pieces vs package (codes within 1, scales within 1e-5):", ok)
        return 0 if all(ok.values()) else 1
    if runtime.mode() != "compiled":
        print("rmsnorm_pieces_probe needs a CUDA GPU (--check runs without one)")
        return 2
    if not a.outdir:
        ap.error("OUTDIR is required (or --check)")
    from gpulab.harness.bench import ceilings, time_ms
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings()
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions(), "copy_bytes_per_s": ceil["bytes_per_s"],
           "checks": {}, "rows": []}
    for shape in ((1000, 14336), (7, 8192), (33, 4100)):
        res["checks"][f"{shape[0]}x{shape[1]}"] = same_bits(shape, device)
        res["checks"][f"{shape[0]}x{shape[1]} prefetch"] = same_bits(shape, device,
                                                                   run=lambda *a: run_prefetch(*a, per_sm=2))
    print("checks:", res["checks"], flush=True)
    for n_rows, n_cols in ((4096, 14336), (8192, 8192)):
        x, w = spec_inputs(n_rows, n_cols, device)
        q = torch.empty(n_rows, n_cols, dtype=torch.int8, device=device)
        s = torch.empty(n_rows, device=device)
        moved = n_rows * n_cols * 3 + n_cols * 2 + n_rows * 4
        timed = {"rmsnorm_quant as called": lambda: nq.rmsnorm_quant(x, w)}
        for wps in (4, 8, 16):
            timed[f"package kernel {wps} warps"] = lambda wps=wps: run_package(x, w, q, s, wps)
            timed[f"pieces {pieces(n_cols)[:3]} {wps} warps"] = lambda wps=wps: run_pieces(x, w, q, s, wps)
            for per_sm in (1, 2, 4):
                timed[f"prefetch {per_sm}/SM {wps} warps"] = (
                    lambda wps=wps, per_sm=per_sm: run_prefetch(x, w, q, s, wps, per_sm))
        for name, fn in timed.items():
            us = time_ms(fn) * 1e3
            pct = 100 * moved / (us * 1e-6) / ceil["bytes_per_s"]
            res["rows"].append({"shape": [n_rows, n_cols], "impl": name, "us": round(us, 2),
                                "pct_of_copy": round(pct, 1)})
            print(f"{n_rows}x{n_cols}  {name:<34} {us:8.2f} µs  {pct:5.1f}%", flush=True)
    (out / "rmsnorm_pieces_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

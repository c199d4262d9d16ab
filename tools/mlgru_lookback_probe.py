"""A single-read MLGRU forward scan with decoupled look-back, kept out of the package until
an H200 has measured it (issue 13's 60% line).

The package's two-phase scan reads f and i twice (five passes over [B, T, D]), which caps
it at 60% of the copy roofline. Here every (chunk, batch row, channel block) is one
program that reads its tile once and keeps it in registers:

1. programs take tickets from an atomic counter, chunk by chunk, so a program's
   predecessors in time have always started before it (no deadlock: a program only ever
   waits for lower tickets);
2. each scans its tile from a zero state and publishes the chunk's map h ↦ A·h + B with a
   flag (1: the map is there);
3. it then looks back over ``WINDOW`` predecessors at once: their flags in one load, then
   the maps of those nearer than the nearest one whose state is known (flag 2: the state
   after it, "inclusive"), all loaded before any is used and composed nearest first. They
   give the state entering this chunk; if no flag 2 is in the window (and all are at least
   1) it composes the whole window and moves down. One round trip covers ``WINDOW`` chunks:
   with one predecessor at a time, the known states would advance one chunk per round
   trip, 512 round trips at T = 8192 in chunks of 16;
4. it publishes the state after its own chunk (flag 2) and writes h from its registers.

Not yet run on a GPU. Compiled for sm_90 without one (triton 3.8, ``ptxas -v``), every
configuration in ``CONFIGS`` compiles. Keeping the tile's scan in registers through the
look-back costs most: 176 registers a thread for chunks of 4 steps × 8 channels a thread,
255 (with a small stack) for 8 × 8; reading the tile again from L1/L2 once the carry is
known (``reload=True``; DRAM still reads it once) takes 88-94 and 137-140. The window's
size hardly matters (its maps are composed row by row, never held as a tile; a first
version that held them spilled at every setting).

Writes of a map or a state come before their flag (a barrier, then an atomic exchange
with release semantics); flags are read by atomics with acquire semantics, the maps after
them by volatile loads. Scratch: three [n_chunks, B, n_blocks, BLOCK_D] float32 arrays and
the flags, zeroed per call.

usage (repository root):
    PYTHONPATH=$PWD python3 tools/mlgru_lookback_probe.py --check     (any machine: interpreter,
                                                                       small shapes vs float64)
    PYTHONPATH=$PWD python3 tools/mlgru_lookback_probe.py OUTDIR      (a CUDA GPU: B16 T8192 D512
        bf16, every config checked against the two-phase scan 20 times over, then timed
        next to it with do_bench; OUTDIR/mlgru_lookback_probe.json)
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
from gpulab import mlgru, runtime


@triton.jit
def lookback_scan_kernel(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, map_a_ptr, map_b_ptr, state_ptr, flag_ptr,
                         ticket_ptr, B, T, D, n_chunks, n_blocks,
                         CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
                         PUBLISH_STATE: tl.constexpr = True, RELOAD: tl.constexpr = False):
    """PUBLISH_STATE=False (a test of the look-back's arithmetic): only chunk 0 publishes
    its state, so every other program composes every map down to it, window by window.
    RELOAD: the tile is read again (from L1/L2: this program just read it) and rescanned
    once the carry is known, instead of keeping its scan in registers through the look-back."""
    ticket = tl.atomic_add(ticket_ptr, 1)
    per_chunk = B * n_blocks
    c = ticket // per_chunk
    b = (ticket % per_chunk) // n_blocks
    blk = ticket % n_blocks
    cols = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, CHUNK)
    t = c * CHUNK + rows
    m = (t < T)[:, None] & cmask[None, :]
    offs = b.to(tl.int64) * T * D + t.to(tl.int64)[:, None] * D + cols[None, :]
    # past T: f = 1, i = 0 (identity steps), so the last row holds the chunk's end state
    f = tl.load(f_ptr + offs, mask=m, other=1.0).to(tl.float32)
    x = tl.load(i_ptr + offs, mask=m, other=0.0).to(tl.float32)
    a_cum, h_loc = tl.associative_scan((f, x), 0, mlgru.linear_combine)
    is_last = (rows == CHUNK - 1)[:, None]
    A = tl.sum(tl.where(is_last, a_cum, 0.0), axis=0)
    Bc = tl.sum(tl.where(is_last, h_loc, 0.0), axis=0)
    lane = tl.arange(0, BLOCK_D)
    slot = (c * B + b) * n_blocks + blk                     # this program's flag
    vals = slot.to(tl.int64) * BLOCK_D + lane               # and its maps / state
    if c == 0:
        carry = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0)
    else:
        tl.store(map_a_ptr + vals, A)
        tl.store(map_b_ptr + vals, Bc)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + slot, 1, sem="release")
        w = tl.arange(0, WINDOW)
        acc_a = tl.full([BLOCK_D], 1.0, tl.float32)          # windows passed: state after them -> entering c
        acc_b = tl.zeros([BLOCK_D], tl.float32)
        carry = tl.zeros([BLOCK_D], tl.float32)
        lo = c - WINDOW                                      # the window: chunks lo .. lo + WINDOW - 1
        searching = 1
        while searching == 1:
            js = lo + w                                      # ascending; the last row is the nearest
            valid = js >= 0
            jslot = (js * B + b) * n_blocks + blk
            fl = tl.atomic_add(flag_ptr + jslot, 0, mask=valid, sem="acquire")
            fl = tl.where(valid, fl, 0)
            nearest_known = tl.max(tl.where(fl == 2, w, -1), axis=0)
            ready = tl.min(tl.where(w > nearest_known, fl, 2), axis=0) >= 1
            if ready:
                tl.debug_barrier()
                # compose the maps above the known state nearest first, one row of the window
                # at a time: the rows' loads do not depend on each other (one round trip for
                # all), and no [WINDOW, BLOCK_D] tile is held. (m_a, m_b): the state after the
                # known chunk (or before the window) -> the state entering c.
                m_a, m_b = acc_a, acc_b
                for r in tl.static_range(WINDOW):
                    row = WINDOW - 1 - r
                    ro = (((lo + row) * B + b) * n_blocks + blk).to(tl.int64) * BLOCK_D + lane
                    use_map = (lane < BLOCK_D) & (row > nearest_known)     # below: identity maps
                    ma = tl.load(map_a_ptr + ro, mask=use_map, other=1.0, volatile=True)
                    mb = tl.load(map_b_ptr + ro, mask=use_map, other=0.0, volatile=True)
                    m_b = m_a * mb + m_b
                    m_a = m_a * ma
                if nearest_known >= 0:
                    so = (((lo + nearest_known) * B + b) * n_blocks + blk).to(tl.int64) * BLOCK_D + lane
                    carry = m_a * tl.load(state_ptr + so, volatile=True) + m_b
                    searching = 0
                else:
                    acc_a, acc_b = m_a, m_b
                    lo -= WINDOW
    state = A * carry + Bc
    if PUBLISH_STATE or c == 0:
        tl.store(state_ptr + vals, state)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + slot, 2, sem="release")
    # the store's addresses computed afresh, in another form than the loads' (so that they
    # are not one value kept alive across the look-back: 64-bit addresses and a mask per
    # element cost three registers each)
    tile = (b.to(tl.int64) * T + c * CHUNK) * D
    inside = rows[:, None] * D + cols[None, :]
    keep = ((c * CHUNK + rows) < T)[:, None] & (cols < D)[None, :]
    if RELOAD:
        f2 = tl.load(f_ptr + tile + inside, mask=keep, other=1.0).to(tl.float32)
        x2 = tl.load(i_ptr + tile + inside, mask=keep, other=0.0).to(tl.float32)
        a_cum, h_loc = tl.associative_scan((f2, x2), 0, mlgru.linear_combine)
    h = h_loc + a_cum * carry[None, :]
    tl.store(h_ptr + tile + inside, h.to(h_ptr.dtype.element_ty), mask=keep)
    tl.store(hlast_ptr + b * D + cols, state, mask=cmask & (c == n_chunks - 1))


def scan_lookback_into(f, i, h0, h, h_last, *, chunk=4, block_d=256, window=16, num_warps=1,
                       walk_all=False, reload=False):
    B, T, D = f.shape
    if T == 0:
        h_last.copy_(h0)
        return
    n_chunks, n_blocks = runtime.cdiv(T, chunk), runtime.cdiv(D, block_d)
    slots = n_chunks * B * n_blocks
    scratch = torch.empty(3, slots * block_d, dtype=torch.float32, device=f.device)
    flags = torch.zeros(slots + 1, dtype=torch.int32, device=f.device)     # the last: the ticket counter
    lookback_scan_kernel[(slots,)](f, i, h0, h, h_last, scratch[0], scratch[1], scratch[2], flags, flags[slots:],
                                   B, T, D, n_chunks, n_blocks, CHUNK=chunk, BLOCK_D=block_d, WINDOW=window,
                                   PUBLISH_STATE=not walk_all, RELOAD=reload, num_warps=num_warps)


# 256 channels a warp: 8 a thread (16-byte loads) and every time step of the tile in the
# same thread, so its scan needs no shuffles (at 128 a warp the tile's rows spread over
# threads: 200 shuffles in the PTX of an 8 x 128 tile)
CONFIGS = [dict(chunk=c, block_d=bd, window=w, num_warps=nw, reload=rl)
           for c, bd, nw in ((4, 256, 1), (8, 256, 1), (4, 512, 2), (8, 512, 2))
           for w in (8, 32) for rl in (False, True)]


def _inputs(B, T, D, dtype, device, seed=0):
    """The scan spec's inputs (forget gates mostly near 1, h0 given): f, i, h0."""
    inp = gpulab.get_spec("mlgru_scan").make_inputs(dict(B=B, T=T, D=D), dtype, torch.device(device),
                                                    torch.Generator(device=device).manual_seed(seed))
    return inp["f"], inp["i"], inp["h0"]


def check(device) -> bool:
    ok = True
    for (B, T, D), cfg in [((1, 1, 1), dict(chunk=4, block_d=16, window=2)),
                           ((2, 37, 19), dict(chunk=4, block_d=16, window=2)),
                           ((3, 16, 40), dict(chunk=4, block_d=32, window=4)),
                           ((2, 37, 19), dict(chunk=4, block_d=16, window=2, reload=True)),
                           # every program composes all maps down to chunk 0: 18 chunks, windows of
                           # 4 (several windows, a ragged last one, rows before chunk 0 masked)
                           ((2, 37, 19), dict(chunk=2, block_d=8, window=4, walk_all=True)),
                           ((1, 70, 3), dict(chunk=1, block_d=4, window=8, walk_all=True))]:
        f, i, h0 = _inputs(B, T, D, torch.float32, device, seed=T)
        h, h_last = torch.full_like(f, float("nan")), torch.full_like(h0, float("nan"))
        scan_lookback_into(f, i, h0, h, h_last, **cfg)
        ref = mlgru.scan_reference(f, i, h0)
        good = bool(torch.allclose(h.double(), ref["h"], atol=1e-5, rtol=1e-4)
                    and torch.allclose(h_last.double(), ref["h_last"], atol=1e-5, rtol=1e-4))
        print(f"B{B} T{T} D{D} {cfg}: {'ok' if good else 'WRONG'}", flush=True)
        ok = ok and good
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--check", action="store_true", help="small shapes against float64, any machine")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.check:
        return 0 if check(device) else 1
    if runtime.mode() != "compiled":
        print("mlgru_lookback_probe needs a CUDA GPU (--check runs without one)")
        return 2
    if not a.outdir:
        ap.error("OUTDIR is required (or --check)")
    from gpulab.harness.bench import ceilings, time_ms
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    B, T, D = 16, 8192, 512
    f, i, h0 = _inputs(B, T, D, torch.bfloat16, device)
    moved = 3 * B * T * D * 2
    copy = ceilings()["bytes_per_s"]
    want, want_last = torch.empty_like(f), torch.empty_like(h0)
    mlgru.scan_two_phase_into(f, i, h0, want, want_last)
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions(), "shape": [B, T, D], "rows": []}
    us = time_ms(lambda: mlgru.scan_two_phase_into(f, i, h0, want, want_last)) * 1e3
    res["rows"].append({"impl": "two_phase (package)", "us": round(us, 2),
                        "pct_of_copy": round(100 * moved / us / 1e-6 / copy, 1)})
    print(f"two_phase (package)                          {us:8.1f} µs", flush=True)
    h, h_last = torch.empty_like(f), torch.empty_like(h0)
    for cfg in CONFIGS:
        row = {"impl": "lookback", **cfg}
        try:
            worst = 0.0
            for _ in range(20):                 # a race would show as a wrong carry now and then
                h.fill_(float("nan"))
                scan_lookback_into(f, i, h0, h, h_last, **cfg)
                worst = max(worst, (h.float() - want.float()).abs().max().item())
            row["max_diff_vs_two_phase_20_runs"] = worst
            us = time_ms(lambda: scan_lookback_into(f, i, h0, h, h_last, **cfg)) * 1e3
            row.update(us=round(us, 2), pct_of_copy=round(100 * moved / us / 1e-6 / copy, 1))
            print(f"lookback {cfg}  {us:8.1f} µs  {row['pct_of_copy']:5.1f}%  max diff {worst:.3g}", flush=True)
        except Exception as e:          # a config that does not compile or fit: reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"lookback {cfg}  {row['error']}", flush=True)
        res["rows"].append(row)
    (out / "mlgru_lookback_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

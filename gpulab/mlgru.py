r"""Notebook 03: the MLGRU token mixer and the linear recurrence behind it.

The MatMul-free LM (Zhu et al. 2024) replaces attention by a gated recurrence whose
state has a fixed size. Its core, for every batch row b and channel d independently, is
the elementwise linear recurrence over time

    h_t = f_t ⊙ h_{t-1} + i_t,        t = 0 .. T-1,   h_{-1} = h0 (zeros by default)

with inputs f, i of shape [B, T, D]. Paper form of the layer (the default here):

    f_t = σ(x_t W_f),  c_t = SiLU(x_t W_c),  i_t = (1 - f_t) ⊙ c_t,
    h_t = f_t ⊙ h_{t-1} + i_t,  g_t = σ(x_t W_g),  o_t = (g_t ⊙ h_t) W_o

with every W a ternary BitLinear. The released code (ridgerchu/matmulfreellm,
``hgrn_bit.py``) differs in its output: o_t = W_o (RMSNorm(x_t W_g) ⊙ SiLU(h_t)), and it can
bound the forget gate from below, f ← β + (1 - β) f; ``MLGRU(variant="code")`` builds it.

Forward. Pairs (a, b) meaning "h ↦ a·h + b" compose associatively:
(a1, b1) then (a2, b2) = (a1·a2, a2·b1 + b2). So the recurrence can run

* *recurrent*: one program per (batch row, block of channels), a loop over the T steps;
  each step loads one [BLOCK_D] slice of f and i and stores h. The loads do not depend
  on h, but each step waits for its own before the next is issued, so all programs
  together keep only 2·B·D elements in flight: far too few bytes to cover the memory
  latency, so it runs far below the bandwidth on a GPU.
* *chunked*: the same programs, but each loop iteration loads a [BLOCK_T, BLOCK_D] tile,
  scans it in parallel with ``tl.associative_scan`` over the pairs (starting from zero),
  then adds the carried state: h = h_local + (∏ f) ⊙ h_carry. The carry (last row) goes to
  the next chunk. Still one read of f and i and one write of h, but BLOCK_T times more
  bytes in flight per iteration (and the next tile prefetched while this one is scanned).

Backward. With g_t = ∂L/∂h_t in total (through h_t's own gradient dh_t and through h_{t+1}):

    g_{T-1} = dh_{T-1} + dh_last,     g_t = dh_t + f_{t+1} ⊙ g_{t+1}
    ∂L/∂i_t = g_t,   ∂L/∂f_t = g_t ⊙ h_{t-1},   ∂L/∂h0 = f_0 ⊙ g_0

the same linear recurrence run backwards in time with the gates shifted by one step.

* *two-phase* (``kernel="two_phase"``): the chunked kernel has only
  B·D/BLOCK_D programs (128 at B16 D512: one per SM), each walking all of T. Cutting time
  into chunks of C steps gives T/C times more programs, in three launches: (1) every
  (batch row, chunk, channel block) reduces its chunk to the map h ↦ A·h + Bc (A = ∏ f,
  Bc = the chunk's scan from zero); (2) one small scan per (batch row, channel block)
  over the chunks' maps gives each chunk its carry-in (and h_last); (3) every chunk is
  scanned again from its carry and h written. f and i are read twice: 5 passes over
  [B, T, D] instead of 3, so at best 3/5 of the bandwidth goes to the roofline's bytes.
  Optionally in windows of ``segment`` steps, so phase 3 may reread f and i from L2.
  The backward runs the same three phases on the gradient recurrence, each chunk walked
  from its last step down: dh and f read twice, h once, 7 passes instead of 5.

Which kernel runs (``kernel="auto"``): the recurrent kernel for T ≤ 32 (a chunk would be
mostly padding), the chunked kernel up to T < 2048, the two-phase kernel from there (on
the H200, tools/mlgru_scan_bench.py, 2026-12-03: at B16 D512 57.7 vs 69.4 µs at T = 2048,
178 vs 246 µs at T = 8192; the chunked kernel still wins at T = 1024), in chunks of about
T/32 steps (64 to 256: enough chunks to fill the GPU, each long enough to stream). Its
tiles keep a tile's time steps inside each thread, so that a tile's scan needs no
shuffles. Accumulation is float32 throughout; h is stored in the input dtype, the final
state ``h_last`` in float32.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from . import runtime
from .bitlinear import BitLinear
from .validate import require_float, require_same_device, require_tensor


# -- PyTorch reference ----------------------------------------------------------------------
def scan_reference(f, i, h0):
    """h_t = f_t * h_{t-1} + i_t in float64, a plain loop over time."""
    f64, i64 = f.double(), i.double()
    h = h0.double()
    out = torch.empty_like(f64)
    for t in range(f.shape[1]):
        h = f64[:, t] * h + i64[:, t]
        out[:, t] = h
    return {"h": out, "h_last": h}


def scan_backward_reference(f, h0, h, dh, dh_last):
    """Gradients of the scan in float64 (uses the stored h, as the kernels do)."""
    f64, h64, dh64 = f.double(), h.double(), dh.double()
    T = f.shape[1]
    g = dh_last.double()
    f_next = torch.ones_like(g)
    df, di = torch.empty_like(f64), torch.empty_like(f64)
    for t in range(T - 1, -1, -1):
        g = dh64[:, t] + f_next * g
        di[:, t] = g
        h_prev = h64[:, t - 1] if t > 0 else h0.double()
        df[:, t] = g * h_prev
        f_next = f64[:, t]
    return {"df": df, "di": di, "dh0": f_next * g if T else g}


def scan_torch(f, i, h0=None):
    """The recurrence as a log-step parallel scan (Hillis-Steele) in plain PyTorch:
    ⌈log2 T⌉ rounds of elementwise ops over the whole sequence, differentiable by
    autograd. O(T log T) work: fine for the short sequences of CPU training."""
    B, T, D = f.shape
    a = f.float()
    b = i.float()
    if h0 is not None:
        b = torch.cat([b[:, :1] + a[:, :1] * h0.float()[:, None], b[:, 1:]], 1)
    k = 1
    while k < T:
        b = torch.cat([b[:, :k], b[:, k:] + a[:, k:] * b[:, :-k]], 1)
        a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], 1)
        k *= 2
    h_last = b[:, -1] if T else (h0.float() if h0 is not None else f.new_zeros(B, D, dtype=torch.float32))
    return b.to(f.dtype), h_last


# -- Triton kernels -----------------------------------------------------------------------
def _configs(interp: list, gpu: list):
    return interp if runtime.interpreting() else runtime.tuning_configs(gpu)


_REC_CONFIGS = _configs(
    [triton.Config({"BLOCK_D": 64}, num_warps=1)],
    [triton.Config({"BLOCK_D": bd}, num_warps=w) for bd, w in ((32, 1), (64, 1), (64, 2), (128, 4))])


@triton.autotune(configs=_REC_CONFIGS, key=["B", "D"])
@triton.jit
def scan_recurrent_kernel(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, B, T, D,
                          BLOCK_D: tl.constexpr):
    """One program per (channel block, batch row); a loop over every time step."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    h = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    offs = b * T * D + cols                 # element (b, 0, cols); int64, the tensors are large
    for t in range(T):
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(i_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = f * h + x                       # the carried state stays float32
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        offs += D
    tl.store(hlast_ptr + b * D + cols, h, mask=mask)


@triton.jit
def linear_combine(a1, b1, a2, b2):
    """Compose two steps h -> a1*h + b1, then h -> a2*h + b2."""
    return a1 * a2, a2 * b1 + b2


_CHUNK_CONFIGS = _configs(
    [triton.Config({"BLOCK_T": 8, "BLOCK_D": 16}, num_warps=4)],
    [triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=w)
     for bt, bd, w in ((32, 64, 2), (64, 64, 4), (64, 32, 2), (128, 32, 4), (128, 64, 8), (256, 32, 8))])


@triton.autotune(configs=_CHUNK_CONFIGS, key=["B", "D"])
@triton.jit
def scan_chunked_kernel(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, B, T, D,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (channel block, batch row); a loop over chunks of BLOCK_T steps,
    each scanned in parallel, the state carried from chunk to chunk."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    h = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    base = b * T * D
    # Prefetch: the next tile's loads are issued before this tile's scan, so memory
    # latency overlaps the arithmetic.
    offs = base + rows[:, None] * D + cols[None, :]
    m = (rows < T)[:, None] & cmask[None, :]
    f_next = tl.load(f_ptr + offs, mask=m, other=1.0)
    x_next = tl.load(i_ptr + offs, mask=m, other=0.0)
    for t0 in range(0, T, BLOCK_T):
        # Past the end (and in masked channels): f = 1, i = 0, so h just stays put and
        # the last row of the tile holds h_{T-1}.
        f = f_next.to(tl.float32)
        x = x_next.to(tl.float32)
        m_cur = m
        offs_cur = offs
        offs += BLOCK_T * D
        m = ((t0 + BLOCK_T + rows) < T)[:, None] & cmask[None, :]
        f_next = tl.load(f_ptr + offs, mask=m, other=1.0)
        x_next = tl.load(i_ptr + offs, mask=m, other=0.0)
        a, h_local = tl.associative_scan((f, x), 0, linear_combine)
        h_tile = h_local + a * h[None, :]
        tl.store(h_ptr + offs_cur, h_tile.to(h_ptr.dtype.element_ty), mask=m_cur)
        h = tl.sum(tl.where(is_last_row, h_tile, 0.0), axis=0)
    tl.store(hlast_ptr + b * D + cols, h, mask=cmask)


@triton.autotune(configs=_REC_CONFIGS, key=["B", "D"])
@triton.jit
def scan_backward_recurrent_kernel(f_ptr, h0_ptr, h_ptr, dh_ptr, dhlast_ptr,
                                   df_ptr, di_ptr, dh0_ptr, B, T, D, BLOCK_D: tl.constexpr):
    """Reverse-time loop: g = dh_t + f_{t+1} g; di_t = g; df_t = g h_{t-1}; dh0 = f_0 g_0.
    T >= 1 (the host handles T = 0)."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    g = tl.load(dhlast_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    h0 = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    f_next = tl.full([BLOCK_D], 1.0, tl.float32)       # "f_T" = 1 carries dh_last in
    offs = b * T * D + (T - 1) * D + cols
    for _ in range(T - 1):                             # t = T-1 down to 1
        g = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32) + f_next * g
        tl.store(di_ptr + offs, g.to(di_ptr.dtype.element_ty), mask=mask)
        h_prev = tl.load(h_ptr + offs - D, mask=mask, other=0.0).to(tl.float32)
        tl.store(df_ptr + offs, (g * h_prev).to(df_ptr.dtype.element_ty), mask=mask)
        f_next = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        offs -= D
    # t = 0: the previous state is h0
    g = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32) + f_next * g
    tl.store(di_ptr + offs, g.to(di_ptr.dtype.element_ty), mask=mask)
    tl.store(df_ptr + offs, (g * h0).to(df_ptr.dtype.element_ty), mask=mask)
    f0 = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dh0_ptr + b * D + cols, f0 * g, mask=mask)


@triton.autotune(configs=_CHUNK_CONFIGS, key=["B", "D"])
@triton.jit
def scan_backward_chunked_kernel(f_ptr, h0_ptr, h_ptr, dh_ptr, dhlast_ptr,
                                 df_ptr, di_ptr, dh0_ptr, B, T, D,
                                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """The backward recurrence in chunks, walking time backwards. Each tile is loaded in
    descending time order (row r holds t = t_hi - r), so an ordinary forward scan over
    the rows runs the recurrence g_t = f_{t+1} g_{t+1} + dh_t."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    g = tl.load(dhlast_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    h0 = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    base = b * T * D
    # a_t = f_{t+1}; 1 at t = T-1 (dh_last enters there) and in the padding (t < 0).
    t = T - 1 - rows                                # descending; < 0 past the start
    valid = (t >= 0)[:, None] & cmask[None, :]
    offs = base + t[:, None] * D + cols[None, :]
    dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
    a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
    for _ in range(0, T, BLOCK_T):
        dh = dh_next.to(tl.float32)
        a = a_next.to(tl.float32)
        t_cur, valid_cur, offs_cur = t, valid, offs
        h_prev = tl.load(h_ptr + offs_cur - D, mask=valid_cur & (t_cur > 0)[:, None], other=0.0)
        # Prefetch the next (earlier) tile while this one is scanned.
        t -= BLOCK_T
        valid = (t >= 0)[:, None] & cmask[None, :]
        offs -= BLOCK_T * D
        dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
        a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
        a_cum, g_local = tl.associative_scan((a, dh), 0, linear_combine)
        g_tile = g_local + a_cum * g[None, :]
        h_prev = tl.where((t_cur == 0)[:, None], h0[None, :], h_prev.to(tl.float32))
        tl.store(di_ptr + offs_cur, g_tile.to(di_ptr.dtype.element_ty), mask=valid_cur)
        tl.store(df_ptr + offs_cur, (g_tile * h_prev).to(df_ptr.dtype.element_ty), mask=valid_cur)
        g = tl.sum(tl.where(is_last_row, g_tile, 0.0), axis=0)   # = g at the tile's first t
    f0 = tl.load(f_ptr + base + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(dh0_ptr + b * D + cols, f0 * g, mask=cmask)


# -- the two-phase (parallel-in-time) forward scan ------------------------------------------
# Three launches over chunks of CHUNK time steps, every (channel block, chunk, batch row)
# its own program: T/CHUNK times the chunked kernel's parallelism, for two more passes
# over f and i (5 instead of 3). Scratch: [B, n_chunks, D] float32 maps and carries.
# The last five put a whole tile's time steps in each thread (BLOCK_D = 256 per warp: 32
# threads × 8 channels of 16 bytes), so a tile's scan runs in registers; the first four
# spread time steps over threads and warps, and their scans cost shuffles and barriers
# (112 shuffles and 22 barriers per tile at (16, 128, 4) in the compiled PTX).
_TWO_PHASE_CONFIGS = _configs(
    [triton.Config({"BLOCK_T": 4, "BLOCK_D": 16}, num_warps=1)],
    [triton.Config({"BLOCK_T": bt, "BLOCK_D": bd}, num_warps=w)
     for bt, bd, w in ((32, 64, 4), (16, 128, 4), (32, 128, 8), (64, 64, 8),
                       (4, 256, 1), (8, 256, 1), (16, 256, 1), (4, 512, 2), (8, 512, 2))])


@triton.jit
def load_with_l2_policy(ptr, mask, other, L2_POLICY: tl.constexpr):
    """tl.load with an L2 eviction hint: 0 none, 1 "evict_last" (read again soon: keep),
    2 "evict_first" (the last read)."""
    if L2_POLICY == 1:
        x = tl.load(ptr, mask=mask, other=other, eviction_policy="evict_last")
    elif L2_POLICY == 2:
        x = tl.load(ptr, mask=mask, other=other, eviction_policy="evict_first")
    else:
        x = tl.load(ptr, mask=mask, other=other)
    return x


@triton.autotune(configs=_TWO_PHASE_CONFIGS, key=["B", "D", "CHUNK", "L2_POLICY"])
@triton.jit
def scan_chunk_summary_kernel(f_ptr, i_ptr, a_ptr, bc_ptr, B, T, D, t_begin, t_end, n_chunks,
                              CHUNK: tl.constexpr, L2_POLICY: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Phase 1: program (channel block, c, b) reduces time steps
    [t_begin + c·CHUNK, min(t_begin + (c+1)·CHUNK, t_end)) to the map h ↦ A·h + Bc
    (A = ∏ f, Bc = the chunk's scan from a zero state), in sub-tiles of BLOCK_T steps.
    L2_POLICY 1 asks L2 to keep f and i for phase 3 (when a segment fits in it)."""
    pid_d = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    t_lo = t_begin + c * CHUNK
    t_hi = tl.minimum(t_lo + CHUNK, t_end)
    offs = b * T * D + t_lo.to(tl.int64) * D + rows[:, None] * D + cols[None, :]
    # Past the chunk's end f = 1, i = 0: the map of a padded step is the identity, and the
    # last row of every tile holds the composition up to the last valid step.
    m = ((t_lo + rows) < t_hi)[:, None] & cmask[None, :]
    f_next = load_with_l2_policy(f_ptr + offs, m, 1.0, L2_POLICY)
    x_next = load_with_l2_policy(i_ptr + offs, m, 0.0, L2_POLICY)
    A = tl.full([BLOCK_D], 1.0, tl.float32)
    Bc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(0, CHUNK, BLOCK_T):
        f = f_next.to(tl.float32)
        x = x_next.to(tl.float32)
        offs += BLOCK_T * D             # prefetch the next tile while this one is scanned
        m = ((t_lo + k + BLOCK_T + rows) < t_hi)[:, None] & cmask[None, :]
        f_next = load_with_l2_policy(f_ptr + offs, m, 1.0, L2_POLICY)
        x_next = load_with_l2_policy(i_ptr + offs, m, 0.0, L2_POLICY)
        a, h_local = tl.associative_scan((f, x), 0, linear_combine)
        a_tile = tl.sum(tl.where(is_last_row, a, 0.0), axis=0)
        b_tile = tl.sum(tl.where(is_last_row, h_local, 0.0), axis=0)
        Bc = a_tile * Bc + b_tile       # (A, Bc) then (a_tile, b_tile)
        A = A * a_tile
    out = (b * n_chunks + c) * D + cols
    tl.store(a_ptr + out, A, mask=cmask)
    tl.store(bc_ptr + out, Bc, mask=cmask)


@triton.jit
def scan_chunk_carry_kernel(a_ptr, bc_ptr, carry_ptr, h0_ptr, hlast_ptr, D, n_chunks,
                            CHUNKS_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Phase 2: program (channel block, b) scans the chunks' maps from h0: carry[c] = the
    state entering chunk c (an exclusive scan), h_last = the state after the last chunk.
    CHUNKS_BLOCK maps per load and scan, so a few dozen chunks cost one memory round trip.
    h0_ptr may equal hlast_ptr (a segment continuing the previous one)."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, CHUNKS_BLOCK)
    is_last_row = (rows == CHUNKS_BLOCK - 1)[:, None]
    h = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    base = b * n_chunks * D
    for c0 in range(0, n_chunks, CHUNKS_BLOCK):
        offs = base + (c0 + rows)[:, None] * D + cols[None, :]
        m = ((c0 + rows) < n_chunks)[:, None] & cmask[None, :]
        A = tl.load(a_ptr + offs, mask=m, other=1.0)
        Bc = tl.load(bc_ptr + offs, mask=m, other=0.0)
        a_cum, b_cum = tl.associative_scan((A, Bc), 0, linear_combine)
        h_after = b_cum + a_cum * h[None, :]          # the state after each chunk
        # Chunk c starts from the state after chunk c-1: store row r at c0 + r + 1.
        # (The block's last row is the next block's first carry: stored there, as its h.)
        keep = ((c0 + rows + 1) < n_chunks) & (rows < CHUNKS_BLOCK - 1)
        tl.store(carry_ptr + offs + D, h_after, mask=m & keep[:, None])
        tl.store(carry_ptr + base + c0 * D + cols, h, mask=cmask)
        h = tl.sum(tl.where(is_last_row, h_after, 0.0), axis=0)
    tl.store(hlast_ptr + b * D + cols, h, mask=cmask)


@triton.autotune(configs=_TWO_PHASE_CONFIGS, key=["B", "D", "CHUNK", "L2_POLICY"])
@triton.jit
def scan_chunk_apply_kernel(f_ptr, i_ptr, carry_ptr, h_ptr, B, T, D, t_begin, t_end, n_chunks,
                            CHUNK: tl.constexpr, L2_POLICY: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Phase 3: program (channel block, c, b) scans its chunk again, starting from the
    carry phase 2 computed for it, and writes h. (L2_POLICY 2: f and i are read for the
    last time.)"""
    pid_d = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    h = tl.load(carry_ptr + (b * n_chunks + c) * D + cols, mask=cmask, other=0.0)
    t_lo = t_begin + c * CHUNK
    t_hi = tl.minimum(t_lo + CHUNK, t_end)
    offs = b * T * D + t_lo.to(tl.int64) * D + rows[:, None] * D + cols[None, :]
    m = ((t_lo + rows) < t_hi)[:, None] & cmask[None, :]
    f_next = load_with_l2_policy(f_ptr + offs, m, 1.0, L2_POLICY)
    x_next = load_with_l2_policy(i_ptr + offs, m, 0.0, L2_POLICY)
    for k in range(0, CHUNK, BLOCK_T):
        f = f_next.to(tl.float32)
        x = x_next.to(tl.float32)
        m_cur = m
        offs_cur = offs
        offs += BLOCK_T * D
        m = ((t_lo + k + BLOCK_T + rows) < t_hi)[:, None] & cmask[None, :]
        f_next = load_with_l2_policy(f_ptr + offs, m, 1.0, L2_POLICY)
        x_next = load_with_l2_policy(i_ptr + offs, m, 0.0, L2_POLICY)
        a, h_local = tl.associative_scan((f, x), 0, linear_combine)
        h_tile = h_local + a * h[None, :]
        tl.store(h_ptr + offs_cur, h_tile.to(h_ptr.dtype.element_ty), mask=m_cur)
        h = tl.sum(tl.where(is_last_row, h_tile, 0.0), axis=0)


# -- the two-phase backward -----------------------------------------------------------------
# The same three launches for the gradient recurrence g_t = dh_t + f_{t+1}·g_{t+1}, each chunk
# walked from its last step down (tiles in descending time, as in the chunked backward):
# (1) every chunk reduced to the map g ↦ A·g + Bc from the gradient entering it from above to
# g at its first step, (2) the maps scanned from dh_last in reverse chunk order (phase 2 of
# the forward, on maps stored last chunk first), (3) every chunk rescanned from its carry,
# writing di and df. Reads dh and f twice and h once: 7 passes over [B, T, D], not 5.
@triton.autotune(configs=_TWO_PHASE_CONFIGS, key=["B", "D", "CHUNK"])
@triton.jit
def scan_backward_chunk_summary_kernel(f_ptr, dh_ptr, a_ptr, bc_ptr, B, T, D, n_chunks,
                                       CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Backward phase 1: program (channel block, c, b) reduces chunk c, time steps
    [c·CHUNK, min((c+1)·CHUNK, T)) walked downwards, to A = ∏ f_{t+1} (f_T = 1: dh_last
    enters there) and Bc = the reverse scan of dh from zero; stored at n_chunks - 1 - c."""
    pid_d = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    t_lo = c * CHUNK
    t = tl.minimum(t_lo + CHUNK, T) - 1 - rows        # descending; below t_lo: padding
    offs = b * T * D + t.to(tl.int64)[:, None] * D + cols[None, :]
    # padded steps (a = 1, dh = 0) are the identity map
    valid = (t >= t_lo)[:, None] & cmask[None, :]
    dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
    a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
    A = tl.full([BLOCK_D], 1.0, tl.float32)
    Bc = tl.zeros([BLOCK_D], tl.float32)
    for _ in range(0, CHUNK, BLOCK_T):
        dh = dh_next.to(tl.float32)
        a = a_next.to(tl.float32)
        t -= BLOCK_T                    # prefetch the next (earlier) tile
        offs -= BLOCK_T * D
        valid = (t >= t_lo)[:, None] & cmask[None, :]
        dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
        a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
        a_cum, g_local = tl.associative_scan((a, dh), 0, linear_combine)
        a_tile = tl.sum(tl.where(is_last_row, a_cum, 0.0), axis=0)
        b_tile = tl.sum(tl.where(is_last_row, g_local, 0.0), axis=0)
        Bc = a_tile * Bc + b_tile
        A = A * a_tile
    out = (b * n_chunks + n_chunks - 1 - c) * D + cols
    tl.store(a_ptr + out, A, mask=cmask)
    tl.store(bc_ptr + out, Bc, mask=cmask)


@triton.autotune(configs=_TWO_PHASE_CONFIGS, key=["B", "D", "CHUNK"])
@triton.jit
def scan_backward_chunk_apply_kernel(f_ptr, h0_ptr, h_ptr, dh_ptr, carry_ptr, df_ptr, di_ptr, dh0_ptr,
                                     B, T, D, n_chunks,
                                     CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Backward phase 3: program (channel block, c, b) walks chunk c down from the gradient
    phase 2 carried into it (g at the chunk's end), writing di_t = g_t and df_t = g_t·h_{t-1};
    the first chunk's program also writes dh0 = f_0·g_0."""
    pid_d = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    rows = tl.arange(0, BLOCK_T)
    is_last_row = (rows == BLOCK_T - 1)[:, None]
    g = tl.load(carry_ptr + (b * n_chunks + n_chunks - 1 - c) * D + cols, mask=cmask, other=0.0)
    h0 = tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0).to(tl.float32)
    t_lo = c * CHUNK
    t = tl.minimum(t_lo + CHUNK, T) - 1 - rows
    offs = b * T * D + t.to(tl.int64)[:, None] * D + cols[None, :]
    valid = (t >= t_lo)[:, None] & cmask[None, :]
    dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
    a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
    h_prev_next = tl.load(h_ptr + offs - D, mask=valid & (t > 0)[:, None], other=0.0)
    for _ in range(0, CHUNK, BLOCK_T):
        dh = dh_next.to(tl.float32)
        a = a_next.to(tl.float32)
        h_prev = tl.where((t == 0)[:, None], h0[None, :], h_prev_next.to(tl.float32))
        t_cur, valid_cur, offs_cur = t, valid, offs
        t -= BLOCK_T
        offs -= BLOCK_T * D
        valid = (t >= t_lo)[:, None] & cmask[None, :]
        dh_next = tl.load(dh_ptr + offs, mask=valid, other=0.0)
        a_next = tl.load(f_ptr + offs + D, mask=valid & (t + 1 < T)[:, None], other=1.0)
        h_prev_next = tl.load(h_ptr + offs - D, mask=valid & (t > 0)[:, None], other=0.0)
        a_cum, g_local = tl.associative_scan((a, dh), 0, linear_combine)
        g_tile = g_local + a_cum * g[None, :]
        tl.store(di_ptr + offs_cur, g_tile.to(di_ptr.dtype.element_ty), mask=valid_cur)
        tl.store(df_ptr + offs_cur, (g_tile * h_prev).to(df_ptr.dtype.element_ty), mask=valid_cur)
        g = tl.sum(tl.where(is_last_row, g_tile, 0.0), axis=0)   # g at the tile's lowest step
    f0 = tl.load(f_ptr + b * T * D + cols, mask=cmask & (c == 0), other=0.0).to(tl.float32)
    tl.store(dh0_ptr + b * D + cols, f0 * g, mask=cmask & (c == 0))


# -- launchers (the checks' calling convention: inputs, then preallocated outputs) ----------
def _grid(B, D):
    return lambda meta: (runtime.cdiv(D, meta["BLOCK_D"]), B)


def scan_recurrent_into(f, i, h0, h, h_last):
    B, T, D = f.shape
    scan_recurrent_kernel[_grid(B, D)](f, i, h0, h, h_last, B, T, D)


def scan_chunked_into(f, i, h0, h, h_last):
    B, T, D = f.shape
    scan_chunked_kernel[_grid(B, D)](f, i, h0, h, h_last, B, T, D)


TWO_PHASE_CHUNK = 256             # the longest chunk on a GPU (the H200's fastest at T = 8192)
TWO_PHASE_MIN_CHUNK = 64          # the shortest (fastest at T = 2048)
TWO_PHASE_CHUNK_INTERPRETED = 8   # in the interpreter (~1 ms per program): small shapes, small chunks
CARRY_BLOCK_D = 16 if runtime.interpreting() else 64   # channels per phase-2 program


def two_phase_chunk(T: int | None = None) -> int:
    """The chunk length :func:`scan_two_phase_into` uses unless told: on a GPU about T/32
    steps, between TWO_PHASE_MIN_CHUNK and TWO_PHASE_CHUNK (T = None: the longest)."""
    if runtime.interpreting():
        return TWO_PHASE_CHUNK_INTERPRETED
    if T is None:
        return TWO_PHASE_CHUNK
    return max(TWO_PHASE_MIN_CHUNK, min(TWO_PHASE_CHUNK, runtime.next_power_of_2(max(1, T // 32))))


def scan_two_phase_into(f, i, h0, h, h_last, *, chunk: int | None = None, segment: int | None = None):
    """The forward scan in parallel over time: (1) every chunk of ``chunk`` steps reduced
    to its map h ↦ A·h + Bc, (2) the maps scanned per (batch row, channel) from h0 into
    each chunk's carry and h_last, (3) every chunk rescanned from its carry, writing h.

    ``segment`` (a multiple of ``chunk``; None: all of T) runs the three phases on
    windows of that many steps in turn, each starting from the previous one's h_last, so
    that phase 3 may find a window's f and i still in the L2 cache."""
    B, T, D = f.shape
    chunk = two_phase_chunk(T) if chunk is None else int(chunk)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if T == 0:
        h_last.copy_(h0)
        return
    segment = T if segment is None else max(chunk, int(segment) // chunk * chunk)
    n_max = runtime.cdiv(min(segment, T), chunk)
    scratch = torch.empty(3, B, n_max, D, dtype=torch.float32, device=f.device)
    a, bc, carry = scratch[0], scratch[1], scratch[2]
    keep = segment < T          # windows: hint L2 to keep f and i from phase 1 to phase 3
    state = h0
    # launched through runtime.launch_tuned / launch: three launches per window, and
    # Triton's autotuner wrapper alone costs tens of µs of host time per launch
    summary_key = (B, D, chunk, 1 if keep else 0, f.dtype, i.dtype)
    apply_key = (B, D, chunk, 2 if keep else 0, f.dtype, i.dtype, h.dtype)
    for t0 in range(0, T, segment):
        t1 = min(t0 + segment, T)
        n = runtime.cdiv(t1 - t0, chunk)
        grid = lambda meta: (runtime.cdiv(D, meta["BLOCK_D"]), n, B)  # noqa: E731
        runtime.launch_tuned(scan_chunk_summary_kernel, grid, summary_key, f, i, a, bc, B, T, D, t0, t1, n,
                             CHUNK=chunk, L2_POLICY=1 if keep else 0)
        runtime.launch(scan_chunk_carry_kernel, (runtime.cdiv(D, CARRY_BLOCK_D), B),
                       {"CHUNKS_BLOCK": min(64, runtime.next_power_of_2(n)), "BLOCK_D": CARRY_BLOCK_D,
                        "num_warps": 4}, a, bc, carry, state, h_last, D, n)
        runtime.launch_tuned(scan_chunk_apply_kernel, grid, apply_key, f, i, carry, h, B, T, D, t0, t1, n,
                             CHUNK=chunk, L2_POLICY=2 if keep else 0)
        state = h_last


def scan_backward_recurrent_into(f, h0, h, dh, dh_last, df, di, dh0):
    B, T, D = f.shape
    scan_backward_recurrent_kernel[_grid(B, D)](f, h0, h, dh, dh_last, df, di, dh0, B, T, D)


def scan_backward_chunked_into(f, h0, h, dh, dh_last, df, di, dh0):
    B, T, D = f.shape
    scan_backward_chunked_kernel[_grid(B, D)](f, h0, h, dh, dh_last, df, di, dh0, B, T, D)


def scan_backward_two_phase_into(f, h0, h, dh, dh_last, df, di, dh0, *, chunk: int | None = None):
    """The backward scan in parallel over time (the forward's three phases, time reversed):
    (1) every chunk of ``chunk`` steps reduced to its map from the gradient entering it
    from above, (2) the maps scanned from dh_last, last chunk first, into each chunk's
    carry, (3) every chunk rescanned from its carry, writing di, df (and dh0)."""
    B, T, D = f.shape
    chunk = two_phase_chunk(T) if chunk is None else int(chunk)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if T == 0:
        dh0.copy_(dh_last)
        return
    n = runtime.cdiv(T, chunk)
    scratch = torch.empty(3 * B * n * D + B * D, dtype=torch.float32, device=f.device)
    a, bc, carry = scratch[:3 * B * n * D].view(3, B, n, D)
    g0 = scratch[3 * B * n * D:].view(B, D)           # phase 2's "h_last": g_0 (phase 3 uses its own)
    grid = lambda meta: (runtime.cdiv(D, meta["BLOCK_D"]), n, B)  # noqa: E731
    # the tuners' keys (B, D, CHUNK) and the dtypes of the tensors passed
    summary_key = (B, D, chunk, f.dtype, dh.dtype)
    apply_key = (B, D, chunk, f.dtype, h0.dtype, h.dtype, dh.dtype, df.dtype, di.dtype, dh0.dtype)
    runtime.launch_tuned(scan_backward_chunk_summary_kernel, grid, summary_key, f, dh, a, bc, B, T, D, n,
                         CHUNK=chunk)
    runtime.launch(scan_chunk_carry_kernel, (runtime.cdiv(D, CARRY_BLOCK_D), B),
                   {"CHUNKS_BLOCK": min(64, runtime.next_power_of_2(n)), "BLOCK_D": CARRY_BLOCK_D, "num_warps": 4},
                   a, bc, carry, dh_last, g0, D, n)
    runtime.launch_tuned(scan_backward_chunk_apply_kernel, grid, apply_key, f, h0, h, dh, carry, df, di, dh0,
                         B, T, D, n, CHUNK=chunk)


RECURRENT_MAX_T = 32        # the rule: T <= this -> recurrent kernel,
TWO_PHASE_MIN_T = 2048      # T >= this -> two-phase, chunked in between


def choose_kernel(T: int) -> str:
    """The rule: 'recurrent' for T <= RECURRENT_MAX_T, 'two_phase' for T >= TWO_PHASE_MIN_T,
    else 'chunked' (measured on the H200: see the module's docstring)."""
    return "recurrent" if T <= RECURRENT_MAX_T else "two_phase" if T >= TWO_PHASE_MIN_T else "chunked"


_FORWARD = {"recurrent": scan_recurrent_into, "chunked": scan_chunked_into, "two_phase": scan_two_phase_into}
_BACKWARD = {"recurrent": scan_backward_recurrent_into, "chunked": scan_backward_chunked_into,
             "two_phase": scan_backward_two_phase_into}


def scan_into(f, i, h0, h, h_last):
    """Forward with the kernel the rule picks."""
    _FORWARD[choose_kernel(f.shape[1])](f, i, h0, h, h_last)


class ScanLaunchers(NamedTuple):
    """A forward and a backward scan launcher with the calling convention of
    :func:`scan_recurrent_into` and :func:`scan_backward_recurrent_into` (for instance a
    learner's own, which notebook 03 runs inside the language model)."""
    forward: Callable      # (f, i, h0, h, h_last)
    backward: Callable     # (f, h0, h, dh, dh_last, df, di, dh0)


# -- public API ---------------------------------------------------------------------------
class MLGRUScan(torch.autograd.Function):
    """h, h_last = scan(f, i, h0) with Triton forward and backward kernels
    (``launchers``: a :class:`ScanLaunchers`)."""

    @staticmethod
    def forward(ctx, f, i, h0, launchers):
        B, T, D = f.shape
        h = torch.empty_like(f)
        h_last = torch.empty(B, D, dtype=torch.float32, device=f.device)
        if f.numel():
            launchers.forward(f, i, h0, h, h_last)
        else:
            h_last.copy_(h0)
        ctx.launchers = launchers
        ctx.save_for_backward(f, h0, h)
        return h, h_last

    @staticmethod
    def backward(ctx, dh, dh_last):
        f, h0, h = ctx.saved_tensors
        dh = torch.zeros_like(h) if dh is None else dh.to(h.dtype).contiguous()
        dh_last = torch.zeros_like(h0) if dh_last is None else dh_last.float().contiguous()
        df, di = torch.empty_like(f), torch.empty_like(f)
        dh0 = torch.empty_like(h0)
        if f.numel():
            ctx.launchers.backward(f, h0, h, dh, dh_last, df, di, dh0)
        else:
            dh0.copy_(dh_last)
        return df, di, dh0, None


KERNELS = ("auto", "recurrent", "chunked", "two_phase", "torch")


def require_scan_kernel(name: str, kernel) -> None:
    if isinstance(kernel, ScanLaunchers):
        if not (callable(kernel.forward) and callable(kernel.backward)):
            raise TypeError(f"{name}: both launchers of a ScanLaunchers must be callable")
    elif kernel not in KERNELS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, KERNELS))} or a ScanLaunchers "
                         f"pair, got {kernel!r}")


def _require_scan_inputs(f, i, h0):
    require_tensor("f", f, ndim=3)
    require_float("f", f)
    require_tensor("i", i, shape=f.shape, dtype=f.dtype)
    require_same_device(f=f, i=i, h0=h0)
    if h0 is not None:
        require_tensor("h0", h0, shape=(f.shape[0], f.shape[2]))
        require_float("h0", h0)


def mlgru_scan(f: torch.Tensor, i: torch.Tensor, h0: torch.Tensor | None = None, *,
               kernel: str | ScanLaunchers = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """h_t = f_t ⊙ h_{t-1} + i_t over [batch, time, hidden]; differentiable.

    f, i: [B, T, D], one of float32/float16/bfloat16, contiguous. h0: [B, D] or None
    (zeros). Returns h ([B, T, D], f's dtype) and h_last ([B, D], float32).
    kernel: "auto" (:func:`choose_kernel` picks one by T), "recurrent", "chunked",
    "two_phase" (parallel over time: :func:`scan_two_phase_into` and
    :func:`scan_backward_two_phase_into`), "torch" (a plain-PyTorch log-step scan, the fast
    path on a CPU), or a
    :class:`ScanLaunchers` pair (your own forward and backward launchers)."""
    require_scan_kernel("kernel", kernel)
    _require_scan_inputs(f, i, h0)
    B, T, D = f.shape
    if kernel == "torch":
        return scan_torch(f, i, h0)
    h0 = f.new_zeros(B, D, dtype=torch.float32) if h0 is None else h0.float().contiguous()
    if not isinstance(kernel, ScanLaunchers):
        k = choose_kernel(T) if kernel == "auto" else kernel
        kernel = ScanLaunchers(_FORWARD[k], _BACKWARD[k])
    return MLGRUScan.apply(f, i, h0, kernel)


def mlgru_step(f_t: torch.Tensor, i_t: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """One step of the recurrence for generation: returns f_t ⊙ h + i_t in float32.
    f_t, i_t: [B, D]; h: [B, D] state (None: zeros). Memory per sequence: D numbers."""
    for name, t in (("f_t", f_t), ("i_t", i_t)):
        require_tensor(name, t, ndim=2, contiguous=False)
        require_float(name, t)
    if i_t.shape != f_t.shape:
        raise ValueError(f"i_t must have f_t's shape {tuple(f_t.shape)}, got {tuple(i_t.shape)}")
    if h is None:
        return i_t.float()
    require_tensor("h", h, shape=f_t.shape, contiguous=False)
    require_same_device(f_t=f_t, i_t=i_t, h=h)
    return torch.addcmul(i_t.float(), f_t.float(), h.float())


# The layer.
class MLGRU(nn.Module):
    """The MatMul-free linear GRU token mixer (paper form by default).

    variant="paper": f = σ(x W_f), c = SiLU(x W_c), h_t = f_t h_{t-1} + (1 - f_t) c_t,
                     g = σ(x W_g), out = (g ⊙ h) W_o.
    variant="code":  as released: i = SiLU(x W_i)(1 - f), optional forget-gate lower bound
                     f ← β + (1 - β) f (pass ``lower_bound=β``),
                     out = W_o (RMSNorm(x W_g) ⊙ SiLU(h)).
    scan: "auto" (Triton kernels on a GPU, the PyTorch scan on a CPU), any
    ``mlgru_scan`` kernel name, or a :class:`ScanLaunchers` pair."""

    def __init__(self, d_model: int, variant: str = "paper", lower_bound: float | None = None,
                 scan: str = "auto"):
        super().__init__()
        if variant not in ("paper", "code"):
            raise ValueError(f"variant must be 'paper' or 'code', got {variant!r}")
        if lower_bound is not None and (variant != "code" or not 0 <= lower_bound < 1):
            raise ValueError("lower_bound (a float in [0, 1)) only applies to variant='code'")
        require_scan_kernel("scan", scan)
        self.d_model, self.variant, self.lower_bound, self.scan = d_model, variant, lower_bound, scan
        self.f_proj = BitLinear(d_model, d_model)
        self.c_proj = BitLinear(d_model, d_model)
        self.g_proj = BitLinear(d_model, d_model)
        self.o_proj = BitLinear(d_model, d_model)
        if variant == "code":
            self.g_norm = nn.RMSNorm(d_model, eps=1e-6)

    def gates(self, x):
        f = torch.sigmoid(self.f_proj(x))
        if self.lower_bound is not None:
            f = self.lower_bound + (1 - self.lower_bound) * f
        i = F.silu(self.c_proj(x)) * (1 - f)
        return f, i

    def output(self, x, h):
        h = h.to(x.dtype)
        if self.variant == "paper":
            return self.o_proj(torch.sigmoid(self.g_proj(x)) * h)
        return self.o_proj(self.g_norm(self.g_proj(x)) * F.silu(h))

    def _kernel(self, x):
        if isinstance(self.scan, ScanLaunchers) or self.scan != "auto":
            return self.scan
        return "auto" if x.is_cuda and runtime.mode() == "compiled" else "torch"

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        """x: [B, T, d_model] -> (out [B, T, d_model], h_last [B, d_model] float32).

        ``mask`` [B, T] bool: where False the step keeps the state as it is (f = 1, i = 0),
        so rows of different lengths can share one right-padded batch and h_last is each
        row's state after its own steps (the padded steps' outputs mean nothing)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, time, {self.d_model}], got {tuple(x.shape)}")
        f, i = self.gates(x)
        if mask is not None:
            pad = ~mask[..., None]
            f, i = f.masked_fill(pad, 1.0), i.masked_fill(pad, 0.0)
        h, h_last = mlgru_scan(f.contiguous(), i.contiguous(), h0, kernel=self._kernel(x))
        return self.output(x, h), h_last

    def step(self, x_t: torch.Tensor, h: torch.Tensor | None = None):
        """One token: x_t [B, d_model], state h [B, d_model] -> (out [B, d_model], new h)."""
        f, i = self.gates(x_t)
        h = mlgru_step(f, i, h)
        return self.output(x_t, h), h

r"""Notebook 01: ternary weights, 2-bit packing, and the int8 × ternary matmul.

MatMul-free LM (Zhu et al. 2024) restricts every weight to {-1, 0, +1}: a "multiply"
becomes add, subtract or skip. Weights are quantized per tensor with their mean
absolute value (absmean):

    s_w = 1 / max(mean |W|, 1e-5),      W_t = clamp(round(W · s_w), -1, 1)  ∈ {-1, 0, 1}

and activations per row with their absmax, to int8 (see :mod:`gpulab.normquant`):

    s_x = 127 / max(max |x|, 1e-5),     x_q = clamp(round(x · s_x), -128, 127)

so that  x Wᵀ ≈ (x_q W_tᵀ) / (s_x s_w): an integer matmul, scaled once per output.
Rounding is to nearest, ties away from zero (``normquant.round_half_away``).

2-bit layout (``pack_ternary``). A row of K weights is padded with zeros to
K4 = ceil(K/4)·4 and cut into four quarters of K4/4 weights. Byte j of the packed
row holds weight j of each quarter, quarter i in bits 2i..2i+1, as the code w + 1
(0 → -1, 1 → 0, 2 → +1; code 3 is never used):

    packed[n, j] = Σ_i (W_t[n, i·K4/4 + j] + 1) << 2i,          packed: uint8 [N, K4/4]

A kernel reading bytes j0..j0+B of a row therefore gets four tiles of B weights, each
matching a *contiguous* slice of x (x[i·K4/4 + j0 : ... + B]): no shuffling in
registers, just a shift and a mask per quarter. 2 bits per weight is 1/8 of bf16: at
decode (M = 1..16 rows) the matmul is bound by reading weights, so up to 8× faster.

Decode layout "int32x16" (``pack_ternary_x16``, opt-in: ``BitLinear.pack(layout=
"int32x16")``, or pass its int32 words to ``ternary_matmul``). At M = 1 the byte layout's
GEMV is limited by its unpacking, about 3 SASS instructions per weight (measured on the
compiled code by tools/gemv-instructions.py), not by the bytes. This layout puts 16 weights
in an int32 word so that one AND yields four 2-bit codes as bytes, lined up with four
consecutive int8 x values in one int32 word of x, and one ``dp4a`` multiplies and adds all
four: 0.5 unpack-and-multiply instructions per weight. The byte layout stays the default
until the new GEMV is measured on a GPU (tools/ternary-gemv-bench.py).

A few rows (2 to ``SMALL_MM_MAX_M``: a decode batch, a speculative verify, a prompt's last
chunk) run ``ternary_mm_small_kernel``: the byte layout's tensor-core loop with the weights
unpacked four per 32-bit register, ``((word >> 2i) & 0x03030303 | 0x80808080) − 0x01010101``
then ``^ 0x80808080`` (c − 1 in every byte with no borrow across bytes), in inline PTX with a
portable twin. On the H200 that took M = 16, K = N = 8192 from 31 to 18 µs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from . import runtime
from .normquant import rmsnorm_fakequant, rmsnorm_quant, rmsnorm_quant_into, round_half_away
from .validate import require_float, require_same_device, require_tensor

WEIGHT_FLOOR = 1e-5


# -- PyTorch reference: quantize, pack, unpack, matmul --------------------------------------
def ternary_quantize(w: torch.Tensor):
    """Per-tensor absmean quantization: (w_t int8 in {-1,0,1}, w_scale float32 0-d tensor)."""
    require_tensor("w", w, contiguous=False, any_device=True)   # plain PyTorch: any device
    require_float("w", w)
    if w.numel() == 0:
        raise ValueError("w is empty: a weight matrix needs at least one element")
    wf = w.detach().float()
    scale = 1.0 / wf.abs().mean().clamp_min(WEIGHT_FLOOR)
    w_t = round_half_away(wf * scale).clamp(-1, 1).to(torch.int8)
    return w_t, scale


def _require_ternary(w_t):
    require_tensor("w_t", w_t, ndim=2, dtype=torch.int8, any_device=True)
    if w_t.numel() and (int(w_t.min()) < -1 or int(w_t.max()) > 1):
        bad = ((w_t < -1) | (w_t > 1)).nonzero()[0].tolist()
        raise ValueError(f"w_t{bad} = {int(w_t[tuple(bad)])}: ternary weights must be -1, 0 or 1 "
                         f"(quantize with ternary_quantize first)")


def pack_ternary(w_t: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 ternary -> [N, ceil(K/4)] uint8, four weights per byte (module docstring)."""
    _require_ternary(w_t)
    n, k = w_t.shape
    q = runtime.cdiv(k, 4)
    codes = torch.ones((n, 4 * q), dtype=torch.uint8, device=w_t.device)  # padding: weight 0
    codes[:, :k] = (w_t + 1).to(torch.uint8)
    c = codes.view(n, 4, q)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_ternary(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: [N, ceil(k/4)] uint8 -> [N, k] int8."""
    require_tensor("packed", packed, ndim=2, dtype=torch.uint8, any_device=True)
    if not isinstance(k, int) or k < 1 or runtime.cdiv(k, 4) != packed.shape[1]:
        raise ValueError(f"k={k} does not fit packed rows of {packed.shape[1]} bytes: "
                         f"k must satisfy ceil(k/4) == {packed.shape[1]}")
    shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.uint8)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 3        # [N, 4, q]
    return (codes.reshape(packed.shape[0], -1)[:, :k].to(torch.int8) - 1)


# The decode layout "int32x16": 16 weights per int32 word, unpacked 4 at a time (dp4a).
LAYOUTS = ("uint8x4", "int32x16")


def pack_ternary_x16(w_t: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 ternary -> [N, ceil(K/16)] int32, sixteen weights per word.

    With G = ceil(K/16) words per row, K is padded with zeros to 16·G and cut into four
    quarters of 4·G weights. Word g holds four consecutive weights of each quarter:
    weight k = 4·(i·G + g) + t (quarter i, byte lane t) sits in bits 8t + 2i .. 8t + 2i + 1
    as the code w + 1::

        packed[n, g] = Σ_{i<4} Σ_{t<4} (W_t[n, 4(iG + g) + t] + 1) << (8t + 2i)

    So ``word & (0x03030303 << 2i)`` leaves, in its four bytes, 4^i times the codes of the
    weights matched by x bytes 4(iG+g) .. 4(iG+g)+3, i.e. by int32 word iG + g of the
    int8 row x viewed as int32: one AND per 4 weights, then one dp4a (see
    :func:`ternary_gemv_x16_kernel`). Reading words g0..g0+B of a row pairs them with four
    contiguous slices of x words, as the byte layout does with x bytes."""
    _require_ternary(w_t)
    n, k = w_t.shape
    g = runtime.cdiv(k, 16)
    codes = torch.ones((n, 16 * g), dtype=torch.int32, device=w_t.device)  # padding: weight 0
    codes[:, :k] = (w_t + 1).to(torch.int32)
    c = codes.view(n, 4, g, 4)                                   # [n, quarter i, word g, lane t]
    shifts = (8 * torch.arange(4, device=w_t.device)[None, :]
              + 2 * torch.arange(4, device=w_t.device)[:, None]).to(torch.int32)   # [i, t]
    # disjoint bits: the sum is an OR; int64 first so the top lane does not overflow
    word = (c.to(torch.int64) << shifts[None, :, None, :].to(torch.int64)).sum(dim=(1, 3))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_ternary_x16(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary_x16`: [N, ceil(k/16)] int32 -> [N, k] int8."""
    require_tensor("packed", packed, ndim=2, dtype=torch.int32, any_device=True)
    if not isinstance(k, int) or k < 1 or runtime.cdiv(k, 16) != packed.shape[1]:
        raise ValueError(f"k={k} does not fit packed rows of {packed.shape[1]} int32 words: "
                         f"k must satisfy ceil(k/16) == {packed.shape[1]}")
    n, g = packed.shape
    shifts = (8 * torch.arange(4, device=packed.device)[None, :]
              + 2 * torch.arange(4, device=packed.device)[:, None])               # [i, t]
    codes = (packed.to(torch.int64)[:, None, :, None] >> shifts[None, :, None, :]) & 3   # [n, i, g, t]
    return codes.reshape(n, 16 * g)[:, :k].to(torch.int8) - 1


def ternary_layout(w_packed: torch.Tensor, k: int) -> str:
    """Which packed layout ``w_packed`` is in for rows of K = k weights, or a clear error:
    uint8 [N, ceil(k/4)] is "uint8x4" (:func:`pack_ternary`), int32 [N, ceil(k/16)] is
    "int32x16" (:func:`pack_ternary_x16`)."""
    if not isinstance(w_packed, torch.Tensor):
        raise TypeError(f"w_packed must be a torch.Tensor, got {type(w_packed).__name__}")
    if w_packed.dtype == torch.uint8:
        layout, per = "uint8x4", 4
    elif w_packed.dtype == torch.int32:
        layout, per = "int32x16", 16
    else:
        raise TypeError(f"w_packed must be uint8 (layout uint8x4, from pack_ternary) or int32 "
                        f"(layout int32x16, from pack_ternary_x16), got {w_packed.dtype}")
    require_tensor("w_packed", w_packed, ndim=2, dtype=w_packed.dtype)
    words = -(-k // per)          # ceil(k / per), in plain Python: this runs on every call
    if w_packed.shape[1] != words:
        raise ValueError(f"w_packed ({layout}) has rows of {w_packed.shape[1]} "
                         f"{'bytes' if per == 4 else 'int32 words'} but K={k} needs ceil(K/{per}) = "
                         f"{words}: was it packed from a [N, {k}] matrix?")
    return layout


def ternary_matmul_ref(x_q, x_scale, w_t, w_scale, out_dtype=torch.float64):
    """y = (x_q · W_tᵀ) / (x_scale[:, None] · w_scale), in float64."""
    acc = x_q.double() @ w_t.double().t()
    return (acc / (x_scale.double()[:, None] * w_scale.double())).to(out_dtype)


# -- Triton kernels: the decode GEMV, one program per (row m, block of outputs) ------------
@triton.jit
def ternary_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, N, K, Q,
                         stride_xm, stride_wn, stride_ym,
                         BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """y[m, n] = Σ_k x_q[m, k] W_t[n, k] / (s_x[m] s_w) for BLOCK_N outputs of row m.

    Unpacks in registers, accumulates exactly in int32 and scales once at the end. At 2
    bits per weight the integer work, not the bytes, is the risk, so per weight this
    does one AND and one multiply-add:
    * codes are masked in place, ``b & (3 << 2i) = 4^i·c``, and the x slice is shifted
      the other way, ``x << (6 - 2i)``, so every term is ``64·c·x`` (no shift of b);
    * the −1 of the code is taken out once: Σ (c − 1)·x = Σ c·x − Σ x;
    * products accumulate elementwise in a [BLOCK_N, BLOCK_Q] int32 tile (multiply-add),
      reduced across the row once after the loop.
    |64·c·x| ≤ 192·127, so the int32 sums are exact for K ≤ GEMV_MAX_K."""
    m = tl.program_id(0)              # rows first: programs sharing a weight tile run together
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_Q], dtype=tl.int32)
    x_sum = tl.zeros([BLOCK_Q], dtype=tl.int32)
    for j0 in range(0, Q, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < Q
        b = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + j[None, :],
                    mask=n_mask[:, None] & j_mask[None, :], other=0).to(tl.int32)
        for i in tl.static_range(4):
            k = i * Q + j
            xi = tl.load(x_ptr + m * stride_xm + k, mask=j_mask & (k < K), other=0).to(tl.int32)
            x_sum += xi
            acc += (b & (3 << (2 * i))) * (xi << (6 - 2 * i))[None, :]
    total = (tl.sum(acc, axis=1) >> 6) - tl.sum(x_sum, axis=0)
    scale = tl.load(xs_ptr + m) * tl.load(ws_ptr)
    y = total.to(tl.float32) / scale
    tl.store(y_ptr + m * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


GEMV_MAX_K = 1 << 16


def _gemv_configs():
    if runtime.interpreting():
        return [triton.Config({"BLOCK_N": 128, "BLOCK_Q": 512}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_Q": bq}, num_warps=w, num_stages=st)
            for bn, bq, w, st in ((16, 256, 4, 3), (32, 256, 8, 3), (8, 512, 4, 3), (16, 512, 8, 2),
                                  (32, 128, 4, 4), (64, 128, 8, 3))]


_ternary_gemv = triton.autotune(configs=runtime.tuning_configs(_gemv_configs()), key=["N", "K"])(ternary_gemv_kernel)


# -- Triton kernels: the decode GEMV on the int32x16 layout, four weights per instruction --
@triton.jit
def dot4_u8s8(a, b, acc, USE_ASM: tl.constexpr):
    """acc + Σ_{t<4} a.byte[t] · b.byte[t], a's bytes unsigned, b's signed (int32 lanes).

    USE_ASM: one PTX ``dp4a.u32.s32`` (sm_61 and newer). Otherwise the portable twin, four
    byte extractions and multiply-adds, the same exact integer: the interpreter cannot run
    inline PTX, and the compiled twin lets both branches be checked against each other."""
    if USE_ASM:
        out = tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = acc
        for t in tl.static_range(4):
            out += ((a >> (8 * t)) & 0xFF) * ((b << (24 - 8 * t)) >> 24)   # arithmetic >>: signed byte
    return out


# Sizes that change from one engine step to the next are not specialised on: Triton would
# compile the kernel again (about a second) for each new value class (1, multiple of 16, other).
@triton.jit(do_not_specialize=["M"])
def ternary_gemv_x16_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, G, XW, G_SPLIT,
                            stride_xm, stride_wn, stride_ym,
                            BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EVEN: tl.constexpr,
                            PARTIAL: tl.constexpr, USE_ASM: tl.constexpr):
    """y[m, n] = Σ_k x_q[m, k] W_t[n, k] / (s_x[m] s_w), weights in the int32x16 layout.

    x_ptr is the int8 row viewed as int32 words (XW = ceil(K/4) of them, bytes past K
    zero), so x word iG + g holds the four x bytes that weight word g's quarter i pairs
    with (:func:`pack_ternary_x16`). Per weight word and quarter i the loop does

        acc_i = dp4a(word & (0x03030303 << 2i), x_word[iG + g], acc_i)

    one AND and one dp4a per 4 weights, no shift: bytes are 4^i·c (≤ 128, still an
    unsigned byte), so acc_i holds 4^i Σ c·x and the quarters are combined exactly once at
    the end, acc_0 + acc_1/4 + acc_2/16 + acc_3/64. The code offset is removed once:
    Σ (c − 1)·x = Σ c·x − Σ x, with Σ x from dp4a(0x01010101, x_word) in a short second
    loop over x alone (in the main loop it would cost loads and dp4a per column). EVEN
    (shapes that tile exactly, as every model's do) drops all masks. All sums are exact
    int32 (|64·Σ c·x| ≤ 2^14·K < 2^31 for K ≤ GEMV_MAX_K).

    Split-K (grid axis 2): program s covers words [s·G_SPLIT, (s+1)·G_SPLIT). With
    PARTIAL it stores its exact int32 partial sum to part[s, m, n] and
    :func:`split_k_reduce_kernel` adds the splits in a fixed order and scales:
    deterministic, and bit-identical to the unsplit kernel (integer sums are exact)."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    n_mask = n < N
    g_lo = s * G_SPLIT
    g_hi = tl.minimum(g_lo + G_SPLIT, G)
    acc0 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
    g = g_lo + tl.arange(0, BLOCK_G)
    x_ptrs = x_ptr + m.to(tl.int64) * stride_xm + g
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + g[None, :]
    for g0 in range(g_lo, g_hi, BLOCK_G):
        if EVEN:     # N % BLOCK_N == 0, G % BLOCK_G == 0 and XW == 4G: no masks at all
            word = tl.load(w_ptrs)
            x0 = tl.load(x_ptrs)
            x1 = tl.load(x_ptrs + G)
            x2 = tl.load(x_ptrs + 2 * G)
            x3 = tl.load(x_ptrs + 3 * G)
        else:
            gg = g0 + tl.arange(0, BLOCK_G)
            g_mask = gg < g_hi
            word = tl.load(w_ptrs, mask=n_mask[:, None] & g_mask[None, :], other=0)
            x0 = tl.load(x_ptrs, mask=g_mask & (gg < XW), other=0)
            x1 = tl.load(x_ptrs + G, mask=g_mask & (G + gg < XW), other=0)
            x2 = tl.load(x_ptrs + 2 * G, mask=g_mask & (2 * G + gg < XW), other=0)
            x3 = tl.load(x_ptrs + 3 * G, mask=g_mask & (3 * G + gg < XW), other=0)
        acc0 = dot4_u8s8(word & 0x03030303, x0[None, :], acc0, USE_ASM)
        acc1 = dot4_u8s8(word & 0x0C0C0C0C, x1[None, :], acc1, USE_ASM)
        acc2 = dot4_u8s8(word & 0x30303030, x2[None, :], acc2, USE_ASM)
        acc3 = dot4_u8s8(word & -0x3F3F3F40, x3[None, :], acc3, USE_ASM)   # 0xC0C0C0C0 as int32
        w_ptrs += BLOCK_G
        x_ptrs += BLOCK_G
    # Σ x over this split's x words: a short 1-D pass (K bytes, next to K·BLOCK_N/4 of weights)
    x_sum = tl.zeros([BLOCK_G], dtype=tl.int32)
    ones = tl.full([BLOCK_G], 0x01010101, dtype=tl.int32)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    for g0 in range(g_lo, g_hi, BLOCK_G):
        gg = g0 + tl.arange(0, BLOCK_G)
        for i in tl.static_range(4):
            xi = tl.load(x_row + i * G + gg, mask=(gg < g_hi) & (i * G + gg < XW), other=0)
            x_sum = dot4_u8s8(ones, xi, x_sum, USE_ASM)
    total = (tl.sum(acc0, axis=1) + (tl.sum(acc1, axis=1) >> 2) + (tl.sum(acc2, axis=1) >> 4)
             + (tl.sum(acc3, axis=1) >> 6) - tl.sum(x_sum, axis=0))
    if PARTIAL:
        tl.store(part_ptr + (s * M + m).to(tl.int64) * N + n, total, mask=n_mask)
    else:
        scale = tl.load(xs_ptr + m) * tl.load(ws_ptr)
        y = total.to(tl.float32) / scale
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def split_k_reduce_kernel(part_ptr, xs_ptr, ws_ptr, y_ptr, M, N, SPLIT, stride_ym, BLOCK: tl.constexpr):
    """Second pass of split-K (the int32x16 GEMV's and the tensor-core kernel's):
    y[m, n] = (Σ_s part[s, m, n]) / (s_x[m] s_w), splits added in order s = 0, 1, ...
    (exact int32, so any order would give the same bits)."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = n < N
    total = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(0, SPLIT):
        total += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + n, mask=n_mask, other=0)
    scale = tl.load(xs_ptr + m) * tl.load(ws_ptr)
    y = total.to(tl.float32) / scale
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


# -- Triton kernels: the prefill matmul, int8 tensor-core dots on unpacked tiles -----------
@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and column indices of output tile ``pid`` in grouped order: GROUP_M row tiles
    in turn take each column tile, so a weight tile is reused while it is in L2."""
    n_pid_m = tl.cdiv(M, BLOCK_M)
    n_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * n_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(n_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym):
    """y[rm, rn] = acc / (x_scale[rm] · w_scale): the integer sums scaled once, stored."""
    xs = tl.load(xs_ptr + rm, mask=m_mask, other=1.0)
    y = acc.to(tl.float32) / (xs[:, None] * tl.load(ws_ptr))
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def ternary_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, K, Q, Q_SPLIT,
                       stride_xm, stride_wn, stride_ym, M_BUCKET,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_INT8: tl.constexpr, PARTIAL: tl.constexpr):
    """Tile [BLOCK_M, BLOCK_N] of y; each step reads BLOCK_Q packed bytes per output
    column (4·BLOCK_Q weights) and issues four int8 dots (one per quarter).

    Split-K (grid axis 1, for a few rows): program s covers packed columns
    [s·Q_SPLIT, (s+1)·Q_SPLIT). With PARTIAL it stores its exact int32 sums to
    part[s, m, n] and :func:`split_k_reduce_kernel` adds the splits and scales: the
    same bits as one pass."""
    rm, rn = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    q_lo = tl.program_id(1) * Q_SPLIT
    q_hi = tl.minimum(q_lo + Q_SPLIT, Q)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if DOT_INT8 else tl.float32)
    for j0 in range(q_lo, q_hi, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < q_hi
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + j[:, None],
                    mask=j_mask[:, None] & n_mask[None, :], other=0).to(tl.int32)   # [BLOCK_Q, BLOCK_N]
        for i in tl.static_range(4):
            k = i * Q + j
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=m_mask[:, None] & (j_mask & (k < K))[None, :], other=0)   # int8 [BLOCK_M, BLOCK_Q]
            wi = ((b >> (2 * i)) & 3) - 1
            if DOT_INT8:     # int8 tensor cores (sm_80+): exact int32 accumulation
                acc = tl.dot(a, wi.to(tl.int8), acc, out_dtype=tl.int32)
            else:            # sm_75 has no int8 dot in Triton: fp16 is exact up to |acc| < 2^24
                acc = tl.dot(a.to(tl.float16), wi.to(tl.float16), acc, out_dtype=tl.float32)
    if PARTIAL:      # exact integers either way: the int32 partial sums of this split
        tl.store(part_ptr + (tl.program_id(1) * M + rm)[:, None].to(tl.int64) * N + rn[None, :],
                 acc.to(tl.int32), mask=m_mask[:, None] & n_mask[None, :])
    else:
        store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym)


@triton.jit
def ternary_bytes_as_int8(b, i: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter i's weights in packed bytes b (uint8): ((b >> 2i) & 3) − 1 as int8.

    USE_ASM: four packed bytes per 32-bit register, so four instructions unpack four
    weights: shift and mask give four codes c, and c − 1 in every byte at once, with no
    borrow crossing bytes, is ((c | 0x80) − 1) ^ 0x80 (each byte is at least 0x80 before
    the subtraction). The portable twin goes byte by byte, several instructions per weight
    (and the interpreter cannot run inline PTX)."""
    if USE_ASM:
        if i == 0:
            w = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $1, 0x03030303; or.b32 t, t, 0x80808080; "
                "sub.u32 t, t, 0x01010101; xor.b32 $0, t, 0x80808080; }",
                "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        elif i == 1:
            w = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 t, t, 0x03030303; or.b32 t, t, 0x80808080; "
                "sub.u32 t, t, 0x01010101; xor.b32 $0, t, 0x80808080; }",
                "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        elif i == 2:
            w = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 t, t, 0x03030303; or.b32 t, t, 0x80808080; "
                "sub.u32 t, t, 0x01010101; xor.b32 $0, t, 0x80808080; }",
                "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        else:
            w = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 t, t, 0x03030303; or.b32 t, t, 0x80808080; "
                "sub.u32 t, t, 0x01010101; xor.b32 $0, t, 0x80808080; }",
                "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    else:
        w = ((b >> (2 * i)) & 3).to(tl.int8) - 1
    return w


@triton.jit(do_not_specialize=["M"])
def ternary_mm_small_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, M, N, K, Q, Q_SPLIT,
                            stride_xm, stride_wn, stride_ym,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                            USE_ASM: tl.constexpr, DOT_INT8: tl.constexpr, PARTIAL: tl.constexpr):
    """A few rows (2 to 64: a decode batch, a prompt's last chunk, a speculative verify)
    on the byte layout: tile [BLOCK_M, BLOCK_N] of y, as in :func:`ternary_mm_kernel`, but
    with the weights unpacked four per instruction group (:func:`ternary_bytes_as_int8`):
    at these sizes the unpacking, not the bytes or the tensor cores, is what takes the time.

    Split-K (grid axis 2) as in :func:`ternary_mm_kernel`: where a matrix has few output
    tiles (N = 2048 is 64 tiles of 32 columns on 132 SMs), its packed columns are split so
    that every SM gets work; with PARTIAL the exact int32 sums go to part[s, m, n]."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    n_mask = rn < N
    q_lo = tl.program_id(2) * Q_SPLIT
    q_hi = tl.minimum(q_lo + Q_SPLIT, Q)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if DOT_INT8 else tl.float32)
    for j0 in range(q_lo, q_hi, BLOCK_Q):
        j = j0 + tl.arange(0, BLOCK_Q)
        j_mask = j < q_hi
        # No `other`: a masked weight meets x = 0 (j past its split) or lands in a column that
        # is not stored (n past N), so its value never matters; with other=0x55 the compiler split
        # every loaded word into bytes to select it (SASS main loop 1242 -> 847 instructions,
        # 18.7 -> 16.9 µs at M = 16, K = N = 8192 on the H200: tools/few_rows_variants.py).
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + j[:, None],
                    mask=j_mask[:, None] & n_mask[None, :])                   # [BLOCK_Q, BLOCK_N]
        for i in tl.static_range(4):
            k = i * Q + j
            xa = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                         mask=m_mask[:, None] & (j_mask & (k < K))[None, :], other=0)   # int8 [BLOCK_M, BLOCK_Q]
            wi = ternary_bytes_as_int8(b, i, USE_ASM)
            if DOT_INT8:
                acc = tl.dot(xa, wi, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(xa.to(tl.float16), wi.to(tl.float16), acc, out_dtype=tl.float32)
    if PARTIAL:
        tl.store(part_ptr + (tl.program_id(2) * M + rm)[:, None].to(tl.int64) * N + rn[None, :],
                 acc.to(tl.int32), mask=m_mask[:, None] & n_mask[None, :])
    else:
        store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym)


@triton.jit(do_not_specialize=["M"])
def ternary_mm_x16_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, G, XW,
                          stride_xm, stride_wn, stride_ym, M_BUCKET,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                          GROUP_M: tl.constexpr, DOT_INT8: tl.constexpr):
    """Prefill on the int32x16 layout: tile [BLOCK_M, BLOCK_N] of y; each step reads
    BLOCK_G weight words per output column (16·BLOCK_G weights) and issues 16 dots, one
    per (quarter i, byte lane t). A dot sums over k in any order, so the k's of one
    (i, t), k = 4(iG + g) + t, are taken together: weights ((word >> (8t + 2i)) & 3) − 1,
    x the byte t of x words iG + g (x viewed as int32, as in the GEMV)."""
    rm, rn = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if DOT_INT8 else tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        g_mask = g < G
        word = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + g[:, None],
                       mask=g_mask[:, None] & n_mask[None, :], other=0)            # [BLOCK_G, BLOCK_N]
        for i in tl.static_range(4):
            xw = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (i * G + g)[None, :],
                         mask=m_mask[:, None] & (g_mask & (i * G + g < XW))[None, :], other=0)
            for t in tl.static_range(4):
                a = ((xw << (24 - 8 * t)) >> 24).to(tl.int8)                     # signed byte t
                wi = (((word >> (8 * t + 2 * i)) & 3) - 1).to(tl.int8)
                if DOT_INT8:
                    acc = tl.dot(a, wi, acc, out_dtype=tl.int32)
                else:
                    acc = tl.dot(a.to(tl.float16), wi.to(tl.float16), acc, out_dtype=tl.float32)
    store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym)


# Prefill with the weights unpacked once. At M in the thousands the kernels above unpack
# every weight tile again for each row tile, in registers, and their dots take the weights
# from registers; a plain int8 GEMM loads both operands straight into shared memory, where
# the tensor cores read them while the next tiles arrive. So unpack the whole weight once
# (one pass: 2 bits in, 8 bits out) and run that GEMM on it.
@triton.jit
def unpack_ternary_int8_kernel(w_ptr, out_ptr, N, K, Q, stride_wn, stride_on,
                               BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr):
    """out[n, i·Q + j] = ((w[n, j] >> 2i) & 3) − 1 as int8, for k = i·Q + j < K."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    n_mask = rn < N
    j_mask = j < Q
    b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + j[None, :],
                mask=n_mask[:, None] & j_mask[None, :], other=0).to(tl.int32)
    for i in tl.static_range(4):
        k = i * Q + j
        tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + k[None, :],
                 (((b >> (2 * i)) & 3) - 1).to(tl.int8), mask=n_mask[:, None] & (j_mask & (k < K))[None, :])


@triton.jit(do_not_specialize=["M"])
def int8_mm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K,
                   stride_xm, stride_wn, stride_ym, M_BUCKET,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, DOT_INT8: tl.constexpr):
    """y = (x · wᵀ) / (xs[:, None] · ws) for int8 x [M, K] and int8 w [N, K]: tile
    [BLOCK_M, BLOCK_N] of y, grouped order as in ternary_mm_kernel."""
    rm, rn = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if DOT_INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0)             # int8 [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0)             # int8 [BLOCK_K, BLOCK_N]
        if DOT_INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc, out_dtype=tl.float32)
    store_scaled(y_ptr, acc, xs_ptr, ws_ptr, rm, rn, m_mask, n_mask, stride_ym)


def _int8_mm_configs():
    if runtime.interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            # tiles up to 128x128x128: Turing (no int8 dot) stages them as fp16 in its 64 KB
            for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                                     (128, 128, 64, 4, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4))]


_int8_mm_tuned = triton.autotune(configs=runtime.tuning_configs(_int8_mm_configs()), key=["M_BUCKET", "N", "K"])(
    int8_mm_kernel)


def _mm_x16_configs():
    if runtime.interpreting():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_G": 32, "GROUP_M": 8}, num_warps=4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_G": bg, "GROUP_M": 8}, num_warps=w, num_stages=st)
            for bm, bn, bg, w, st in ((128, 128, 32, 8, 3), (64, 128, 32, 4, 4), (16, 128, 32, 4, 4),
                                      (128, 256, 32, 8, 2))]


_ternary_mm_x16_tuned = triton.autotune(configs=runtime.tuning_configs(_mm_x16_configs()), key=["M_BUCKET", "N", "G"])(
    ternary_mm_x16_kernel)


# Narrow tiles for a few rows (a small decode batch, a short prompt chunk): at M = 16,
# K = N = 8192 the tiles above make 64-128 programs for the H200's 132 SMs (31.8 µs: the
# 16 MB of weights read at 0.5 TB/s). Tried only while M_BUCKET <= SMALL_M_BUCKET.
_MM_SMALL_M = ((16, 32, 128, 2, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3))
SMALL_M_BUCKET = 32


# (BLOCK_M, BLOCK_N, BLOCK_Q, num_warps, num_stages) of the tensor-core kernel's tiles
_MM_TILES = ((128, 128, 32, 8, 3), (128, 256, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
             (16, 128, 64, 4, 4), (32, 64, 128, 4, 4))


def mm_tile_configs() -> list[dict]:
    """Every launch configuration the tensor-core kernel's autotuner may choose on the
    compiled path (the narrow small-M tiles last), for :func:`ternary_mm_into`'s
    ``config`` (tools/ternary-gemv-bench.py --mm-sweep times each one)."""
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_Q": bq, "GROUP_M": 8, "num_warps": w, "num_stages": s}
            for bm, bn, bq, w, s in _MM_TILES + _MM_SMALL_M]


def _mm_configs():
    if runtime.interpreting():
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_Q": 128, "GROUP_M": 8}, num_warps=4)]
    return [triton.Config({k: c[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_Q", "GROUP_M")},
                          num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in mm_tile_configs()]


def _for_m(configs, named_args, **kwargs):
    """The autotuner's candidates for this call: the narrow small-M tiles only for few rows."""
    if named_args["M_BUCKET"] <= SMALL_M_BUCKET:
        return configs
    small = {(bm, bn, bq) for bm, bn, bq, _, _ in _MM_SMALL_M}
    kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_Q"]) not in small]
    return kept or configs


def _m_bucket(m: int) -> int:
    return min(runtime.next_power_of_2(m), 256)


_ternary_mm_tuned = triton.autotune(configs=runtime.tuning_configs(_mm_configs()), key=["M_BUCKET", "N", "K"],
                                    prune_configs_by={"early_config_prune": _for_m})(ternary_mm_kernel)


# -- launchers (the checks' calling convention: inputs, then preallocated outputs) ---------
# One row: the GEMV. From two rows on, tensor-core kernels read each weight tile once for
# all rows, where the GEMV re-reads it per row: at M=16, K=N=8192 about 6× faster on the
# H200 (gpulab/results/ternary_mm.json against ternary_gemv.json).
GEMV_MAX_M = 1


def ternary_gemv_into(x_q, x_scale, w_packed, w_scale, y):
    """Decode launcher (check calling convention): grid (M, cdiv(N, BLOCK_N))."""
    m, k = x_q.shape
    if k > GEMV_MAX_K:
        raise ValueError(f"the GEMV's int32 sums are exact for K <= {GEMV_MAX_K}, got K={k}: "
                         f"use ternary_matmul, which switches to the tensor-core kernel")
    n, q = w_packed.shape
    grid = lambda meta: (m, runtime.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    runtime.launch_tuned(_ternary_gemv, grid, (n, k, y.dtype), x_q, x_scale, w_packed, w_scale, y, n, k, q,
                         x_q.stride(0), w_packed.stride(0), y.stride(0))


# The int32x16 GEMV's launch configuration, from the sweep of tools/ternary-gemv-bench.py on
# the H200 (gpulab/results/bitlinear/ternary_gemv_bench.json, CUDA-graph medians): 32 rows of
# W per program beat 16 at every decode shape swept (K=N=8192: 10.1-10.4 µs against 14.1;
# 4096²: 5.8 against 7.3; 14336x4096: 8.1 against 10.7; 4096x14336: 9.9 against 12.0).
# A sweep with BLOCK_G 128 and 256 (2026-12-03) found other tiles faster at two shapes
# (32 x 128 words with 8 warps 8.36 µs at 8192², 8 x 256 9.0 µs at N 4096 x K 14336), but
# an autotuner choosing among them per (N, G) measured no better than this default in the
# next run (graph medians 8.78 against 8.39 µs at 8192², within 0.2 µs elsewhere): the
# default stays. The interpreter takes big blocks (cost grows with the number of programs).
X16_CONFIG = {"BLOCK_N": 32, "BLOCK_G": 64, "num_warps": 4}
X16_INTERPRETER_CONFIG = {"BLOCK_N": 64, "BLOCK_G": 64, "num_warps": 4}
X16_MAX_SPLIT = 16
SPLIT_REDUCE_BLOCK = 1024


def x16_split_k(m: int, n: int, k: int, block_n: int, block_g: int) -> int:
    """Split-K factor for the int32x16 GEMV: enough programs for about one per SM
    (runtime.num_sms(); 132 without a GPU), each split at least four BLOCK_G steps long.
    A split costs a second launch and a workspace on the host: on the H200 (2026-12-02,
    fourth run) 8192² took 10.2 µs in one pass and 10.0 µs in two replayed in a graph,
    but 13.7 against 27.5 µs as called; short splits lost outright (4096² ran as fast in
    one pass as in four)."""
    programs = m * runtime.cdiv(n, block_n)
    want = runtime.cdiv(runtime.num_sms(), programs)
    most = max(1, runtime.cdiv(k, 16) // (4 * block_g))
    return max(1, min(want, most, X16_MAX_SPLIT))


def int8_rows_as_words(x_q: torch.Tensor) -> torch.Tensor:
    """x_q int8 [M, K] viewed as int32 [M, ceil(K/4)] (a free view when K % 4 == 0 and
    the rows are 4-byte aligned; otherwise a zero-padded copy, so bytes past K are 0)."""
    m, k = x_q.shape
    if (k % 4 == 0 and x_q.stride(1) == 1 and x_q.stride(0) % 4 == 0
            and x_q.storage_offset() % 4 == 0 and x_q.data_ptr() % 4 == 0):
        return x_q.view(torch.int32)
    padded = torch.zeros((m, 4 * runtime.cdiv(k, 4)), dtype=torch.int8, device=x_q.device)
    padded[:, :k] = x_q
    return padded.view(torch.int32)


def ternary_gemv_x16_into(x_q, x_scale, w_packed, w_scale, y, split_k=None, config=None, asm=None):
    """Decode launcher for the int32x16 layout (check calling convention).

    split_k: None chooses with :func:`x16_split_k`; 1 is one pass; s > 1 adds a second,
    deterministic reduce pass over an [s, M, N] int32 workspace. config: BLOCK_N, BLOCK_G,
    num_warps (default X16_CONFIG). asm: dp4a as inline PTX (default on the compiled
    path) or the portable twin (always in the interpreter, which cannot run PTX). Compiled,
    both kernels launch through :func:`gpulab.runtime.launch` (DirectLaunch)."""
    m, k = x_q.shape
    if k > GEMV_MAX_K:
        raise ValueError(f"the GEMV's int32 sums are exact for K <= {GEMV_MAX_K}, got K={k}")
    n, g = w_packed.shape
    if runtime.interpreting():
        if asm:
            raise ValueError("asm=True needs the compiled path: the interpreter cannot run inline PTX")
        asm, cfg = False, dict(X16_INTERPRETER_CONFIG)
    else:
        asm, cfg = (True if asm is None else bool(asm)), dict(X16_CONFIG)
    cfg.update(config or {})
    block_n, block_g, warps = cfg["BLOCK_N"], cfg["BLOCK_G"], cfg["num_warps"]
    split = x16_split_k(m, n, k, block_n, block_g) if split_k is None else split_k
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"split_k must be None or an int >= 1, got {split_k!r}")
    g_split = runtime.cdiv(runtime.cdiv(g, split), block_g) * block_g
    split = runtime.cdiv(g, g_split)                          # no empty splits
    xw = int8_rows_as_words(x_q)
    part = torch.empty((split, m, n), dtype=torch.int32, device=y.device) if split > 1 else y
    runtime.launch(ternary_gemv_x16_kernel, (m, runtime.cdiv(n, block_n), split),
                   {"BLOCK_N": block_n, "BLOCK_G": block_g, "num_warps": warps},
                   xw, x_scale, w_packed, w_scale, y, part, m, n, g, xw.shape[1], g_split,
                   xw.stride(0), w_packed.stride(0), y.stride(0),
                   PARTIAL=split > 1, USE_ASM=asm, EVEN=(n % block_n == 0 and g % block_g == 0 and xw.shape[1] == 4 * g))
    if split > 1:
        runtime.launch(split_k_reduce_kernel, (m, runtime.cdiv(n, SPLIT_REDUCE_BLOCK)),
                       {"BLOCK": SPLIT_REDUCE_BLOCK, "num_warps": 4}, part, x_scale, w_scale, y, m, n, split, y.stride(0))


# Split-K for the tensor-core kernel (opt-in): at M = 16, K = N = 8192 its tiles make
# 128-256 programs for 132 SMs, each walking all of K, so splitting K looked like more work
# in flight. Measured on the H200 (2026-12-02, M = 16, in a CUDA graph) it lost at every
# shape tried: 29.7 vs 27.9 µs one pass at 8192 x 8192, 29.0 vs 25.1 µs at N 4096 x K 14336,
# 28.2 vs 27.8 µs at N 14336 x K 4096 (the workspace round trip and the reduce launch cost
# more than the extra programs gain). Splits are multiples of the largest BLOCK_Q.
MM_SPLIT_ALIGN = 256


def mm_split(q: int, split_k: int) -> tuple[int, int]:
    """(packed columns per split, number of splits) of the tensor-core kernel for a
    requested ``split_k``: splits are multiples of MM_SPLIT_ALIGN, none empty."""
    q_split = runtime.cdiv(runtime.cdiv(q, split_k), MM_SPLIT_ALIGN) * MM_SPLIT_ALIGN
    return q_split, runtime.cdiv(q, q_split)


def ternary_mm_into(x_q, x_scale, w_packed, w_scale, y, split_k=1, config=None):
    """Prefill launcher (check calling convention): one program per output tile (and per
    split of K: ``split_k`` 1, the default, is one pass; s > 1 adds a deterministic reduce
    over an [s, M, N] int32 workspace, slower on the H200: see the note above). ``config``:
    one of :func:`mm_tile_configs` instead of the autotuner's choice."""
    m, k = x_q.shape
    n, q = w_packed.shape
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
    q_split, split = mm_split(q, split_k)
    part = torch.empty((split, m, n), dtype=torch.int32, device=y.device) if split > 1 else y
    grid = lambda meta: (runtime.cdiv(m, meta["BLOCK_M"]) * runtime.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    bucket = _m_bucket(m)
    args = (x_q, x_scale, w_packed, w_scale, y, part, m, n, k, q, q_split,
            x_q.stride(0), w_packed.stride(0), y.stride(0), bucket)
    if config is None:
        runtime.launch_tuned(_ternary_mm_tuned, grid, (bucket, n, k, y.dtype, split), *args,
                             DOT_INT8=_int8_dot(), PARTIAL=split > 1)
    else:
        runtime.launch(ternary_mm_kernel, grid, config, *args, DOT_INT8=_int8_dot(), PARTIAL=split > 1)
    if split > 1:
        split_k_reduce_kernel[(m, runtime.cdiv(n, SPLIT_REDUCE_BLOCK))](
            part, x_scale, w_scale, y, m, n, split, y.stride(0), BLOCK=SPLIT_REDUCE_BLOCK, num_warps=4)


# A few rows (2..SMALL_MM_MAX_M): ternary_mm_small_kernel. On the H200 (tools/small_m_probe.py,
# 2026-12-03, as launched) it took 18.2 µs at M = 16, K = N = 8192 against 31.0 µs for
# ternary_mm_kernel's best tile (the same tile with the portable unpacking: 49 µs), and
# 28-29 µs against 58 µs at M = 40 and 64. With 32-row tiles it lost from M = 128 on; with
# 64- and 128-row tiles (tools/few_rows_split_probe.py --ms 128,256, 2026-12-04) it won at
# 128 and 256 rows on every layer of the engine bench's model (a layer's four matmuls 42-48
# against 71 µs at 128 rows, 57-71 against 75 µs at 256), so up to 256 rows go there.
# (Its loop streams the weight bytes through shared memory with cp.async, as the other tiled
# kernels do; static counts of the compiled loop, sm_90: 2.4 instructions per weight, 6.6 with
# the portable unpacking, 5.9 in ternary_mm_kernel.)
SMALL_MM_MAX_M = 256


def small_mm_config(m: int, n: int, k: int) -> dict:
    """The tile (and split of K) of :func:`ternary_mm_small_into` on this machine
    (:func:`small_mm_tile` for its GPU; interpreted: few large programs)."""
    if runtime.interpreting():
        return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_Q": 128, "num_warps": 4, "num_stages": 1}
    return small_mm_tile(m, n, k, runtime.num_sms(), runtime.compute_capability())


def small_mm_tile(m: int, n: int, k: int, num_sms: int, capability: tuple[int, int] | None) -> dict:
    """The tile (and split of K) of :func:`ternary_mm_small_into` for m rows, n outputs and
    k inputs on a GPU of ``num_sms`` SMs and compute capability ``capability``, read off two
    H200 sweeps (tools/small_m_probe.py at K = N = 8192, 2026-12-03; tools/few_rows_split_probe.py
    on the engine model's layers, 2026-12-04):

    * rows: one tile of 16, 32 or 64 rows (a 64-row tile for 32 rows unpacks as many
      weights for half the work: 14.3 against 8.0 µs at N = 11264, K = 2048);
    * columns: 32 (64 for 32-row tiles; 64 for up to 16 rows when K is long and there are
      about as many tiles as SMs), 16 for 32- and 64-row tiles where the wider ones would
      leave half of the SMs idle and 16-column ones still fit in one wave (O-projection
      2048 x 2048 at 32 rows: 6.1 -> 5.5 µs);
    * split-K in four where the tiles would leave half of the SMs idle and K is long
      (down-projection 2048 x 5632: 14.0 -> 9.1 µs at 64 rows);
    * two pipeline stages for 64-row tiles when more than two tiles fall to an SM (three
      programs then fit in an SM's shared memory, not two, so all run in one wave: 14.9 ->
      10.9 µs at N = 11264; at K = N = 8192, two tiles an SM, three stages stay: 24-29 µs,
      30.9 µs with two);
    * past 64 rows (a continuous batch's decode): :func:`many_rows_tile`."""
    small_smem = capability is not None and capability < (8, 0)      # sm_75: 64 KiB of shared memory
    sms, q = num_sms, runtime.cdiv(k, 4)                             # q: packed bytes per weight row
    if m <= 16:
        wide = k >= 4096 and runtime.cdiv(n, 64) * 10 >= 9 * sms
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64 if wide else 32, "BLOCK_Q": 256, "num_warps": 4,
               "num_stages": 4 if wide else 3}
    elif m <= 32:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_Q": 128, "num_warps": 4, "num_stages": 3}
    elif m <= 64:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_Q": 128, "num_warps": 4, "num_stages": 3}
    else:
        cfg = many_rows_tile(m, n, q, sms)
        if small_smem:
            cfg.update(BLOCK_M=64, num_stages=2)
        return cfg
    tiles = runtime.cdiv(n, cfg["BLOCK_N"]) * runtime.cdiv(m, cfg["BLOCK_M"])
    if 2 * tiles <= sms and q >= 1024:
        cfg.update(SPLIT_K=4, BLOCK_Q=128)
    elif 2 * tiles <= sms and cfg["BLOCK_M"] >= 32 and runtime.cdiv(n, 16) * runtime.cdiv(m, cfg["BLOCK_M"]) <= sms:
        cfg["BLOCK_N"] = 16
    elif cfg["BLOCK_M"] == 64 and tiles > 2 * sms:
        cfg["num_stages"] = 2
    if small_smem:
        cfg["num_stages"] = 2
    return cfg


# A layer whose packed weights take this many bytes is "large" for many_rows_tile: a
# 14336 x 4096 layer (14.7 MB) is; the engine bench's gate-up projection (5.8 MB) is not.
LARGE_LAYER_BYTES = 8 << 20


def many_rows_tile(m: int, n: int, q: int, num_sms: int) -> dict:
    """The tile of :func:`small_mm_tile` for 65 to 256 rows (q: packed bytes per weight
    row), read off H200 sweeps at 128 and 256 rows (tools/few_rows_split_probe.py --ms
    128,256, 2026-12-04; µs below at 128 rows unless said):

    * a large layer (:data:`LARGE_LAYER_BYTES`): 128-row tiles, so each weight is read
      from memory once for all the rows, 64 columns on a short K step (8192 x 8192: 31.7
      µs, 55.7 with the 64 x 32 tile); K split in two when those tiles fit in one wave,
      on a deeper K step when they leave half the SMs idle (4096 x 14336: 33.9 µs);
    * a smaller one (the engine bench's layers): 64 x 32 tiles, as for 33-64 rows; 64
      columns where those tiles would be more than two an SM, on a short K step and,
      from 193 rows, with 128 rows and two stages where even those would be (gate-up 11264
      x 2048: 19.1 -> 15.3 µs; at 256 rows 34.2 -> 21.5 µs), else two stages (3072 x 2048
      at 256 rows: 10.5 µs); K split in two where the tiles fit in one wave and K is
      long (down-projection 2048 x 5632: 14.1 -> 12.3 µs)."""
    sms = num_sms
    if n * q >= LARGE_LAYER_BYTES:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_Q": 64, "num_warps": 4, "num_stages": 3}
        tiles = runtime.cdiv(n, 64) * runtime.cdiv(m, 128)
        if tiles <= sms:
            cfg["SPLIT_K"] = 2
            if 2 * tiles <= sms:
                cfg["BLOCK_Q"] = 128
        return cfg
    cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_Q": 128, "num_warps": 4, "num_stages": 3}
    tiles = runtime.cdiv(n, 32) * runtime.cdiv(m, 64)
    if tiles > 2 * sms:
        cfg["BLOCK_N"] = 64
        if runtime.cdiv(n, 64) * runtime.cdiv(m, 64) > 2 * sms:
            cfg["BLOCK_Q"] = 64
            if m > 192:
                cfg.update(BLOCK_M=128, num_stages=2)
        else:
            cfg["num_stages"] = 2
    elif tiles <= sms and q >= 1024:
        cfg["SPLIT_K"] = 2
    return cfg


def ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, y, config=None, asm=None):
    """Launcher for a few rows on the byte layout (check calling convention): grid
    (N tiles, M tiles, K splits) of :func:`ternary_mm_small_kernel`, then the reduce when K
    is split. config: any keys of :func:`small_mm_config` (default: its choice; SPLIT_K: K
    in that many parts, whole BLOCK_Q steps each); asm: unpack four weights per
    instruction group in inline PTX (default on the compiled path) or byte by byte
    (the portable twin; always in the interpreter, which cannot run PTX)."""
    m, k = x_q.shape
    n, q = w_packed.shape
    if runtime.interpreting():
        if asm:
            raise ValueError("asm=True needs the compiled path: the interpreter cannot run inline PTX")
        asm = False
    else:
        asm = True if asm is None else bool(asm)
    cfg = small_mm_config(m, n, k)
    cfg.update(config or {})
    split_k = cfg.pop("SPLIT_K", 1)
    # whole BLOCK_Q steps per split, none empty
    q_split = runtime.cdiv(runtime.cdiv(q, split_k), cfg["BLOCK_Q"]) * cfg["BLOCK_Q"]
    split = runtime.cdiv(q, q_split)
    part = torch.empty((split, m, n), dtype=torch.int32, device=y.device) if split > 1 else y
    grid = (runtime.cdiv(n, cfg["BLOCK_N"]), runtime.cdiv(m, cfg["BLOCK_M"]), split)
    runtime.launch(ternary_mm_small_kernel, grid, cfg, x_q, x_scale, w_packed, w_scale, y, part, m, n, k, q, q_split,
                   x_q.stride(0), w_packed.stride(0), y.stride(0), USE_ASM=asm, DOT_INT8=_int8_dot(),
                   PARTIAL=split > 1)
    if split > 1:
        split_k_reduce_kernel[(m, runtime.cdiv(n, SPLIT_REDUCE_BLOCK))](
            part, x_scale, w_scale, y, m, n, split, y.stride(0), BLOCK=SPLIT_REDUCE_BLOCK, num_warps=4)


UNPACK_BLOCK_N, UNPACK_BLOCK_Q = 32, 128


def unpack_ternary_int8_into(w_packed, w_int8):
    """w_packed uint8 [N, Q] (layout uint8x4) -> w_int8 int8 [N, K] with K <= 4Q: every
    weight as -1, 0 or 1 (one pass over the weights)."""
    n, q = w_packed.shape
    k = w_int8.shape[1]
    grid = (runtime.cdiv(n, UNPACK_BLOCK_N), runtime.cdiv(q, UNPACK_BLOCK_Q))
    unpack_ternary_int8_kernel[grid](w_packed, w_int8, n, k, q, w_packed.stride(0), w_int8.stride(0),
                                     BLOCK_N=UNPACK_BLOCK_N, BLOCK_Q=UNPACK_BLOCK_Q)


def ternary_mm_unpacked_into(x_q, x_scale, w_packed, w_scale, y):
    """Prefill launcher (check calling convention): unpack the weights to int8 once into
    a scratch buffer ([N, K] bytes, from PyTorch's caching allocator, so no host sync),
    then one int8 GEMM that reads them."""
    m, k = x_q.shape
    n = w_packed.shape[0]
    w_int8 = torch.empty((n, k), dtype=torch.int8, device=x_q.device)
    unpack_ternary_int8_into(w_packed, w_int8)
    int8_mm_into(x_q, x_scale, w_int8, w_scale, y)


def int8_mm_into(x_q, x_scale, w_int8, w_scale, y):
    """y = (x_q · w_int8ᵀ) / (x_scale[:, None] · w_scale): the int8 GEMM of the prefill path
    (x_q int8 [M, K], w_int8 int8 [N, K] with unit stride along K). The benchmarks also
    time it alone, as a measured int8 roof (``harness.bench.ceilings``)."""
    m, k = x_q.shape
    n = w_int8.shape[0]
    grid = lambda meta: (runtime.cdiv(m, meta["BLOCK_M"]) * runtime.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    bucket = _m_bucket(m)
    runtime.launch_tuned(_int8_mm_tuned, grid, (bucket, n, k, y.dtype), x_q, x_scale, w_int8, w_scale, y,
                         m, n, k, x_q.stride(0), w_int8.stride(0), y.stride(0), bucket, DOT_INT8=_int8_dot())


# Turing (Colab's T4) has no int8 dots: there the kernel's 16 dots a step are float16
# dots, which ptxas took 57-297 s to compile at the tuned tiles (64-128 x 128-256, for
# sm_75 on a CPU, 2026-12-05) and 10 s at 16 x 128. A T4 takes that tile, untuned: a
# learner's first call would otherwise wait minutes (the whole list, tuning: longer).
TURING_X16_TILE = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_G": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}


def ternary_mm_x16_into(x_q, x_scale, w_packed, w_scale, y):
    """Prefill launcher on the int32x16 layout (check calling convention)."""
    m, k = x_q.shape
    n, g = w_packed.shape
    xw = int8_rows_as_words(x_q)
    grid = lambda meta: (runtime.cdiv(m, meta["BLOCK_M"]) * runtime.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    bucket = _m_bucket(m)
    args = (xw, x_scale, w_packed, w_scale, y, m, n, g, xw.shape[1], xw.stride(0), w_packed.stride(0),
            y.stride(0), bucket)
    if _int8_dot() or runtime.interpreting():
        runtime.launch_tuned(_ternary_mm_x16_tuned, grid, (bucket, n, g, y.dtype), *args, DOT_INT8=_int8_dot())
    else:
        runtime.launch(ternary_mm_x16_kernel, grid, TURING_X16_TILE, *args, DOT_INT8=False)


def _int8_dot() -> bool:
    """int8 tensor-core dots need sm_80+; Turing (Colab's T4) takes the fp16 path. Without a
    GPU (interpreter, compile check) the fp16 path is used: it compiles for every target."""
    cc = runtime.compute_capability()
    return cc is not None and cc >= (8, 0)


# From this many rows on, the byte layout's prefill unpacks the weights once and runs a
# plain int8 GEMM (ternary_mm_unpacked_into). On the H200 (K = N = 8192, `gpulab bench
# ternary_mm_unpacked`, 2026-12-01) that was 1.24x faster than unpacking per tile at
# M = 256 and 1.9x at M = 1024 and 4096; below 256 rows it was not timed. None: never.
UNPACK_MIN_M: int | None = 256


def unpack_min_m() -> int | None:
    """:data:`UNPACK_MIN_M`, on a GPU. In the interpreter the unpacking pass costs several
    times the per-tile kernel (its grid has a program per 32 x 512 weights), so there the
    prefill always unpacks per tile."""
    return None if runtime.interpreting() else UNPACK_MIN_M


def ternary_matmul_into(x_q, x_scale, w_packed, w_scale, y):
    """Dispatch on the layout, then on M: the GEMV for one row, tensor-core dots from two
    rows on (a few rows: :func:`ternary_mm_small_into`; many: unpack once, then int8 GEMM)."""
    if w_packed.dtype == torch.int32:
        if x_q.shape[0] <= GEMV_MAX_M and x_q.shape[1] <= GEMV_MAX_K:
            ternary_gemv_x16_into(x_q, x_scale, w_packed, w_scale, y)
        else:
            ternary_mm_x16_into(x_q, x_scale, w_packed, w_scale, y)
    elif x_q.shape[0] <= GEMV_MAX_M and x_q.shape[1] <= GEMV_MAX_K:
        ternary_gemv_into(x_q, x_scale, w_packed, w_scale, y)
    elif x_q.shape[0] <= SMALL_MM_MAX_M:
        ternary_mm_small_into(x_q, x_scale, w_packed, w_scale, y)
    elif (threshold := unpack_min_m()) is not None and x_q.shape[0] >= threshold:
        ternary_mm_unpacked_into(x_q, x_scale, w_packed, w_scale, y)
    else:
        ternary_mm_into(x_q, x_scale, w_packed, w_scale, y)


# -- public API ----------------------------------------------------------------------------
def _as_scale_tensor(w_scale, device):
    if isinstance(w_scale, (int, float)):
        return torch.tensor([float(w_scale)], dtype=torch.float32, device=device)
    require_tensor("w_scale", w_scale, dtype=torch.float32)
    if w_scale.numel() != 1:
        raise ValueError(f"w_scale must hold one number (a per-tensor scale), got shape {tuple(w_scale.shape)}")
    return w_scale.reshape(1)


OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def plainly_valid_matmul_args(x_q, x_scale, w_packed, w_scale, out_dtype) -> bool:
    """True when :func:`ternary_matmul`'s arguments pass every one of its checks, tested
    with a few attribute reads: a decode step calls it once per layer, and the full
    checks (which name what is wrong) cost a GPU host ~60 µs a call. False means "run
    the full checks", never "valid"."""
    try:
        dev, k = x_q.device, x_q.shape[-1]
        per = 4 if w_packed.dtype is torch.uint8 else 16 if w_packed.dtype is torch.int32 else 0
        return bool(per and k > 0 and x_q.dtype is torch.int8 and x_scale.dtype is torch.float32
                    and x_scale.shape == x_q.shape[:-1] and w_packed.dim() == 2
                    and w_packed.shape[1] == (k + per - 1) // per and out_dtype in OUT_DTYPES
                    and x_q.is_contiguous() and x_scale.is_contiguous() and w_packed.is_contiguous()
                    and x_scale.device == dev and w_packed.device == dev
                    and isinstance(w_scale, torch.Tensor) and w_scale.dtype is torch.float32
                    and w_scale.numel() == 1 and w_scale.is_contiguous() and w_scale.device == dev
                    and not runtime.COMPILE_ONLY and runtime.runs_on(dev))
    except (AttributeError, IndexError, TypeError):
        return False


def ternary_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_packed: torch.Tensor, w_scale,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = (x_q · W_tᵀ) / (x_scale[:, None] · w_scale) reading 2-bit packed weights.

    x_q: int8 [..., K]; x_scale: float32 [...]; w_packed: uint8 [N, ceil(K/4)] from
    :func:`pack_ternary` (layout "uint8x4", the default) or int32 [N, ceil(K/16)] from
    :func:`pack_ternary_x16` (layout "int32x16", opt-in: the dp4a GEMV for one row, its
    own tensor-core kernel above);
    w_scale: float or float32 tensor of one element.
    Returns [..., N] in out_dtype (float32, float16 or bfloat16)."""
    if plainly_valid_matmul_args(x_q, x_scale, w_packed, w_scale, out_dtype):
        ws = w_scale
    else:                                   # the full checks: each failure says what to fix
        require_tensor("x_q", x_q, dtype=torch.int8)
        if x_q.dim() < 1 or x_q.shape[-1] == 0:
            raise ValueError(f"x_q must be [..., K] with K >= 1, got shape {tuple(x_q.shape)}")
        require_tensor("x_scale", x_scale, shape=x_q.shape[:-1], dtype=torch.float32)
        ternary_layout(w_packed, x_q.shape[-1])
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
        ws = _as_scale_tensor(w_scale, x_q.device)
        require_same_device(x_q=x_q, x_scale=x_scale, w_packed=w_packed, w_scale=ws)
    n = w_packed.shape[0]
    if x_q.dim() == 2:                      # the usual [M, K]: no views to make
        y = torch.empty((x_q.shape[0], n), dtype=out_dtype, device=x_q.device)
        if y.numel():
            ternary_matmul_into(x_q, x_scale, w_packed, ws if ws.dim() == 1 else ws.view(1), y)
        return y
    y = torch.empty((*x_q.shape[:-1], n), dtype=out_dtype, device=x_q.device)
    if y.numel():
        ternary_matmul_into(x_q.view(-1, x_q.shape[-1]), x_scale.view(-1), w_packed, ws.view(1), y.view(-1, n))
    return y


@dataclass(frozen=True)
class PackedKernels:
    """The functions a packed :class:`BitLinear` runs: gpulab's by default. Notebook 03
    passes a learner's own (from notebooks 01 and 02) with the same calling conventions."""
    quantize: Callable = ternary_quantize           # w -> (w_t int8 in {-1, 0, 1}, scale)
    pack: Callable = pack_ternary                   # w_t [N, K] -> uint8 [N, ceil(K/4)]
    norm_quant_into: Callable = rmsnorm_quant_into  # (x [M, K], weight, x_q, x_scale, eps)
    matmul_into: Callable = ternary_matmul_into     # (x_q, x_scale, w_packed, w_scale, y [M, N])


# The layer.
class BitLinear(nn.Module):
    """Linear layer with ternary weights and int8 activations (MatMul-free LM's BitLinear).

    forward(x): x [..., in_features] float -> [..., out_features], same dtype. The layer
    applies its own RMSNorm (learnable ``norm_weight``, eps 1e-8 as in the released code)
    before quantizing, as the paper's BitLinear does.

    * Training (default): RMSNorm + int8 fake quantization of x and absmean ternary fake
      quantization of ``weight``, both with the straight-through estimator. On a GPU the
      norm+quant runs as the fused Triton forward/backward (``normquant``); elsewhere as
      the PyTorch reference (``fused=True`` forces the kernels).
    * Inference: ``.pack()`` stores the weights as 2 bits each plus one scale, drops the
      float weights, and forward runs ``rmsnorm_quant`` then ``ternary_matmul`` (Triton
      kernels: compiled on a GPU, interpreted on a CPU). Packing is one-way.
      ``.pack(layout="int32x16")`` opts in to the decode layout (16 weights per int32 word,
      dp4a GEMV); the default "uint8x4" stays the default until the new GEMV is measured.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, eps: float = 1e-8,
                 device=None, dtype=None, fused: bool | None = None):
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        self.in_features, self.out_features, self.eps, self.fused = in_features, out_features, eps, fused
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.norm_weight = nn.Parameter(torch.ones(in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.register_buffer("w_packed", None)
        self.register_buffer("w_scale", None)
        self.kernels: PackedKernels | None = None     # None: the validated public functions

    @property
    def packed(self) -> bool:
        return self.w_packed is not None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {f'packed (2-bit, {self.layout})' if self.packed else 'training'}")

    def ternary_weight(self) -> torch.Tensor:
        """Fake-quantized weight W_t / s_w with the straight-through estimator."""
        w = self.weight
        scale = 1.0 / w.abs().mean().clamp_min(WEIGHT_FLOOR)
        wq = round_half_away(w * scale).clamp(-1, 1) / scale
        return w + (wq - w).detach()

    @property
    def layout(self) -> str | None:
        """The packed weights' layout ("uint8x4" or "int32x16"), None while training."""
        if not self.packed:
            return None
        return "int32x16" if self.w_packed.dtype == torch.int32 else "uint8x4"

    @torch.no_grad()
    def pack(self, layout: str = "uint8x4", kernels: PackedKernels | None = None) -> "BitLinear":
        """Switch to inference: 2-bit weights + one scale; the float weights are dropped.

        layout: "uint8x4" (default; :func:`pack_ternary`) or "int32x16" (opt-in decode
        layout, :func:`pack_ternary_x16`: the dp4a GEMV for one row). Both take the
        GEMV for one row and int8 tensor-core dots for more.
        kernels: the functions that quantize, pack and later run the layer (default
        gpulab's; "uint8x4" only), e.g. a learner's own in notebook 03."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
        if kernels is not None and not isinstance(kernels, PackedKernels):
            raise TypeError(f"kernels must be a PackedKernels, got {type(kernels).__name__}")
        if kernels is not None and layout != "uint8x4":
            raise ValueError("PackedKernels run the 'uint8x4' layout: pack with layout='uint8x4'")
        if self.packed:
            if layout != self.layout:
                raise ValueError(f"this layer is already packed as {self.layout!r}; packing is "
                                 f"one-way, so it cannot be repacked as {layout!r}")
            self.kernels = kernels
            return self
        if kernels is not None:
            w_t, s = kernels.quantize(self.weight)
            self.w_packed = kernels.pack(w_t)
            self.w_scale = torch.as_tensor(s, device=self.w_packed.device).reshape(1).float()
        else:
            w_t, s = ternary_quantize(self.weight)
            self.w_packed = pack_ternary_x16(w_t) if layout == "int32x16" else pack_ternary(w_t)
            self.w_scale = s.reshape(1).float()
        self.weight = None
        self.kernels = kernels
        return self

    def _check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"BitLinear expects a torch.Tensor, got {type(x).__name__}")
        require_float("x", x)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"BitLinear({self.in_features}, {self.out_features}) expects input "
                             f"[..., {self.in_features}], got shape {tuple(x.shape)}")
        ref = self.norm_weight
        if x.device != ref.device:
            raise ValueError(f"x is on {x.device} but the layer is on {ref.device}: move one of them")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self.packed and self.kernels is not None:
            y = self._run_kernels(x)
        elif self.packed:
            x_q, x_s = rmsnorm_quant(x.contiguous(), self.norm_weight, self.eps)
            # .float(): module.to(bf16) also converts float buffers such as the scale
            y = ternary_matmul(x_q, x_s, self.w_packed, self.w_scale.float(), out_dtype=x.dtype)
        else:
            xq = rmsnorm_fakequant(x.contiguous(), self.norm_weight, self.eps, fused=self.fused)
            y = F.linear(xq.to(x.dtype), self.ternary_weight().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @property
    def takes_quantized_input(self) -> bool:
        """Packed, on gpulab's own kernels, without a bias: a caller that normalised and
        quantized this layer's input itself (a fused kernel of :mod:`gpulab.fused_norms`,
        with this layer's ``norm_weight`` and ``eps``) may call :meth:`forward_quantized`."""
        return self.packed and self.kernels is None and self.bias is None

    def forward_quantized(self, x_q: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The packed forward after its norm: x_q int8 [..., in_features] and x_scale
        float32 [...], this layer's RMSNorm + int8 quantization of an input, -> [...,
        out_features] in ``out_dtype`` (see :attr:`takes_quantized_input`)."""
        return ternary_matmul(x_q, x_scale, self.w_packed, self.w_scale.float(), out_dtype=out_dtype)

    def _run_kernels(self, x):
        """The packed forward through ``self.kernels``' launchers (rows flattened)."""
        k, n = self.in_features, self.out_features
        x2 = x.reshape(-1, k).contiguous()
        x_q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
        x_s = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            self.kernels.norm_quant_into(x2, self.norm_weight.float(), x_q, x_s, self.eps)
            self.kernels.matmul_into(x_q, x_s, self.w_packed, self.w_scale.float(), y)
        return y.view(*x.shape[:-1], n)


def model_bytes(n_params: int, bits: float) -> float:
    """Bytes to store n_params weights at ``bits`` bits each."""
    return n_params * bits / 8

r"""Rotary position embeddings (RoPE) of q and k in one kernel.

The serving engine's transformer (:mod:`gpulab.engine.model`) rotates every token's query
and key heads by angles that depend on its position (Su et al. 2021, "RoFormer"), in the
rotate-half layout (GPT-NeoX's): a head x of even size D is cut into halves
x1 = x[:D/2] and x2 = x[D/2:], and pair i, (x1_i, x2_i), is turned by the angle
θ_i = p · base^(−2i/D) of the token's position p::

    out1 = x1 · cos θ − x2 · sin θ
    out2 = x2 · cos θ + x1 · sin θ

q [T, Hq, D] and k [T, Hkv, D] of a token share its cos, sin [D/2]. In PyTorch ops
(:func:`rope_reference`) that is a cast, four products, a difference, a sum, a concat
and a cast back, once for q and once for k: about sixteen small kernels per layer, each a
launch of ~2 µs even replayed from a CUDA graph, while the data they move is a few KB a
token. Here one program rotates BLOCK_T tokens, all their q and k heads: cos and sin are
loaded once for both, every element of q and k is read and written once.

Rounding: the kernel computes in float32 and stores in the tensor's dtype, rounding the
products, the sums and the result as :func:`rope_reference` does (FMA contraction off),
so the two agree bit for bit (but in Triton's interpreter, which truncates to bfloat16
where it should round to nearest: one unit in the last place). Each program loads both halves of a head before it stores
either, and touches only its own tokens: the rotation may be in place (q and k views of
the QKV projection's output [T, (Hq + 2 Hkv)·D], v beside them untouched).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import runtime
from .validate import FLOAT_DTYPES, require_rows, require_same_device

TILE = 4096          # elements of q and k (padded) a program rotates: 32 a thread in 4 warps
MAX_BLOCK_T = 64
# compiled without FMA contraction: x1·c − x2·s rounds each product, as PyTorch's ops do
CONFIG = {"num_warps": 4, "enable_fp_fusion": False}


# -- PyTorch reference ----------------------------------------------------------------------
def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated by the angles of its position (cos, sin: [..., D/2]), in float32
    (float64 for a float64 x), returned in x's dtype."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


# -- Triton kernels -------------------------------------------------------------------------
@triton.jit
def _rotate_heads(x_ptr, o_ptr, rows, T, s_xt, s_xh, s_ot, s_oh, c, s,
                  H: tl.constexpr, H_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Heads [0, H) of tokens ``rows`` of x [T, H, 2·HALF] rotated into o (x itself for in
    place): both halves are loaded before either is stored. c, s: [BLOCK_T, 1, HALF_P]."""
    t = rows.to(tl.int64)[:, None, None]
    h = tl.arange(0, H_P)[None, :, None]
    j = tl.arange(0, HALF_P)[None, None, :]
    mask = (t < T) & (h < H) & (j < HALF)
    x = x_ptr + t * s_xt + h * s_xh + j
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    o = o_ptr + t * s_ot + h * s_oh + j
    tl.store(o, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def rope_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T,
                   s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_ct, s_st,
                   HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens [pid·BLOCK_T, (pid+1)·BLOCK_T) of q [T, HQ, D] and k [T, HKV, D] rotated into
    qo and ko (s_*t, s_*h: token and head strides; the last dimension contiguous).
    *_P: the sizes padded to powers of two (tl.arange's), masked."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, HALF_P)[None, :]
    mask = (rows < T)[:, None] & (j < HALF)
    t = rows.to(tl.int64)[:, None]
    c = tl.load(cos_ptr + t * s_ct + j, mask=mask, other=0.0)[:, None, :]
    s = tl.load(sin_ptr + t * s_st + j, mask=mask, other=0.0)[:, None, :]
    _rotate_heads(q_ptr, qo_ptr, rows, T, s_qt, s_qh, s_qot, s_qoh, c, s, HQ, HQ_P, HALF, HALF_P)
    _rotate_heads(k_ptr, ko_ptr, rows, T, s_kt, s_kh, s_kot, s_koh, c, s, HKV, HKV_P, HALF, HALF_P)


# -- launchers ------------------------------------------------------------------------------
@functools.cache
def tile_sizes(hq: int, hkv: int, head_dim: int) -> dict:
    """The kernel's constexprs for a model's heads: the padded sizes, and BLOCK_T, as many
    tokens (a power of two, at most 64) as fill :data:`TILE` elements. Fixed per model,
    not per T: a decode step and a prefill chunk run the same compiled kernel."""
    hq_p, hkv_p, half_p = (runtime.next_power_of_2(n) for n in (hq, hkv, head_dim // 2))
    fit = max(1, TILE // (2 * half_p * (hq_p + hkv_p)))
    return dict(HQ=hq, HKV=hkv, HALF=head_dim // 2, HQ_P=hq_p, HKV_P=hkv_p, HALF_P=half_p,
                BLOCK_T=min(MAX_BLOCK_T, 1 << (fit.bit_length() - 1)))


def rope_qk_into(q, k, cos, sin, q_out=None, k_out=None):
    """Launcher (no validation): q [T, Hq, D] and k [T, Hkv, D] rotated by cos, sin
    [T, D/2] (float32) into q_out and k_out (their shapes and dtypes; None: in place).
    Any token and head strides; every last dimension contiguous."""
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    t, hq, d = q.shape
    if t == 0:
        return
    sizes = tile_sizes(hq, k.shape[1], d)
    runtime.launch(rope_qk_kernel, (runtime.cdiv(t, sizes["BLOCK_T"]),), CONFIG,
                   q, k, q_out, k_out, cos, sin, t,
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                   q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                   cos.stride(0), sin.stride(0), **sizes)


# -- public API -----------------------------------------------------------------------------
MAX_HEAD_ROW = 1 << 14       # a token's heads (padded) in one tile: registers, not spills


def require_rope_inputs(q, k, cos, sin, q_out=None, k_out=None) -> None:
    """Shapes, dtypes, strides and devices of :func:`rope_qk`'s arguments."""
    require_rows("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    require_rows("k", k, ndim=3, dtype=q.dtype)
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same tokens and head_dim: "
                         f"q [T, Hq, D], k [T, Hkv, D]")
    if d % 2 or d == 0:
        raise ValueError(f"head_dim must be even and positive (rotate-half pairs element i with i + D/2), got {d}")
    heads = max(hq, k.shape[1])
    if runtime.next_power_of_2(heads) * 2 * runtime.next_power_of_2(d // 2) > MAX_HEAD_ROW:
        raise ValueError(f"a token's {heads} heads of {d} elements (padded to powers of two) exceed "
                         f"{MAX_HEAD_ROW} elements, one program's tile: rotate the heads in groups")
    for name, c in (("cos", cos), ("sin", sin)):
        require_rows(name, c, shape=(t, d // 2), dtype=torch.float32)
    for name, out, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        if out is not None:
            require_rows(name, out, shape=x.shape, dtype=x.dtype)
    require_same_device(q=q, k=k, cos=cos, sin=sin, q_out=q_out, k_out=k_out)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """Rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] (one float dtype; any token and
    head strides, e.g. views of a fused QKV projection's output) by the tokens' angles
    cos, sin [T, D/2] (float32), in place, or into q_out and k_out where given. Returns
    (rotated q, rotated k).

    >>> qkv = torch.randn(3, (4 + 2 * 2) * 16)
    >>> q, k = qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16)
    >>> cos, sin = torch.ones(3, 8), torch.zeros(3, 8)       # angle 0: nothing turns
    >>> rope_qk(q, k, cos, sin)[0] is q
    True
    """
    require_rope_inputs(q, k, cos, sin, q_out, k_out)
    rope_qk_into(q, k, cos, sin, q_out, k_out)
    return (q if q_out is None else q_out), (k if k_out is None else k_out)

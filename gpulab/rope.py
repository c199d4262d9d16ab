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

The same program can also store the token's rotated k and its v into the paged KV cache
(:func:`rope_qk_store_kv`): row t goes to slot ``slots[t]`` (page · page_size + offset)
of a layer's cache viewed as [slots, Hkv, D]. That is the serving engine's next step
after RoPE, otherwise two more kernels a layer (``index_copy_`` of k, then of v), a few
µs each in every decode step, verify pass and prompt chunk.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import runtime
from .validate import FLOAT_DTYPES, require_index_range, require_rows, require_same_device

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
def _load_halves(x_ptr, rows, live, s_xt, s_xh,
                 H: tl.constexpr, H_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Heads [0, H) of tokens ``rows`` (where ``live``) of x [T, H, 2·HALF]: (first halves,
    second halves), float32 [BLOCK_T, H_P, HALF_P]."""
    t = rows.to(tl.int64)[:, None, None]
    h = tl.arange(0, H_P)[None, :, None]
    j = tl.arange(0, HALF_P)[None, None, :]
    mask = live[:, None, None] & (h < H) & (j < HALF)
    x = x_ptr + t * s_xt + h * s_xh + j
    return (tl.load(x, mask=mask, other=0.0).to(tl.float32),
            tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _store_halves(o_ptr, rows, live, s_ot, s_oh, o1, o2,
                  H: tl.constexpr, H_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """o1, o2 [BLOCK_T, H_P, HALF_P] into the two halves of heads [0, H) of rows ``rows``
    of o (where ``live``), rounded to o's dtype."""
    t = rows.to(tl.int64)[:, None, None]
    h = tl.arange(0, H_P)[None, :, None]
    j = tl.arange(0, HALF_P)[None, None, :]
    mask = live[:, None, None] & (h < H) & (j < HALF)
    o = o_ptr + t * s_ot + h * s_oh + j
    tl.store(o, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "num_slots"])
def rope_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T,
                   s_qt, s_qh, s_kt, s_kh, s_qot, s_qoh, s_kot, s_koh, s_ct, s_st,
                   v_ptr, slots_ptr, kc_ptr, vc_ptr, num_slots, s_vt, s_vh, s_kct, s_kch, s_vct, s_vch,
                   HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
                   STORE_KV: tl.constexpr):
    """Tokens [pid·BLOCK_T, (pid+1)·BLOCK_T) of q [T, HQ, D] and k [T, HKV, D] rotated into
    qo and ko (s_*t, s_*h: token and head strides; the last dimension contiguous).
    *_P: the sizes padded to powers of two (tl.arange's), masked. With STORE_KV, also
    token t's rotated k and its v [T, HKV, D] into row slots[t] of the caches kc and vc
    [num_slots, HKV, D] (a slot outside [0, num_slots) stores nothing)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    j = tl.arange(0, HALF_P)[None, :]
    mask = live[:, None] & (j < HALF)
    t = rows.to(tl.int64)[:, None]
    c = tl.load(cos_ptr + t * s_ct + j, mask=mask, other=0.0)[:, None, :]
    s = tl.load(sin_ptr + t * s_st + j, mask=mask, other=0.0)[:, None, :]
    # both halves of a head loaded before either is stored: the rotation may be in place
    x1, x2 = _load_halves(q_ptr, rows, live, s_qt, s_qh, HQ, HQ_P, HALF, HALF_P)
    _store_halves(qo_ptr, rows, live, s_qot, s_qoh, x1 * c - x2 * s, x2 * c + x1 * s, HQ, HQ_P, HALF, HALF_P)
    x1, x2 = _load_halves(k_ptr, rows, live, s_kt, s_kh, HKV, HKV_P, HALF, HALF_P)
    k1, k2 = x1 * c - x2 * s, x2 * c + x1 * s
    _store_halves(ko_ptr, rows, live, s_kot, s_koh, k1, k2, HKV, HKV_P, HALF, HALF_P)
    if STORE_KV:
        slot = tl.load(slots_ptr + rows, mask=live, other=-1)
        ok = live & (slot >= 0) & (slot < num_slots)
        _store_halves(kc_ptr, slot, ok, s_kct, s_kch, k1, k2, HKV, HKV_P, HALF, HALF_P)
        v1, v2 = _load_halves(v_ptr, rows, live, s_vt, s_vh, HKV, HKV_P, HALF, HALF_P)
        _store_halves(vc_ptr, slot, ok, s_vct, s_vch, v1, v2, HKV, HKV_P, HALF, HALF_P)


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


def rope_qk_into(q, k, cos, sin, q_out=None, k_out=None, v=None, slots=None, k_cache=None, v_cache=None):
    """Launcher (no validation): q [T, Hq, D] and k [T, Hkv, D] rotated by cos, sin
    [T, D/2] (float32) into q_out and k_out (their shapes and dtypes; None: in place).
    Any token and head strides; every last dimension contiguous. With ``slots`` (int64
    [T]) also the rotated k and v [T, Hkv, D] into rows slots[t] of k_cache and v_cache
    [S, Hkv, D] (:func:`rope_qk_store_kv`)."""
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    t, hq, d = q.shape
    if t == 0:
        return
    sizes = tile_sizes(hq, k.shape[1], d)
    store = slots is not None
    kv = ((v, slots, k_cache, v_cache, k_cache.shape[0], v.stride(0), v.stride(1), k_cache.stride(0),
           k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)) if store else (None,) * 4 + (0,) * 7)
    runtime.launch(rope_qk_kernel, (runtime.cdiv(t, sizes["BLOCK_T"]),), CONFIG,
                   q, k, q_out, k_out, cos, sin, t,
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                   q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                   cos.stride(0), sin.stride(0), *kv, **sizes, STORE_KV=store)


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


def rope_qk_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     q_out: torch.Tensor | None = None):
    """:func:`rope_qk` (q in place or into q_out, k in place), and token t's rotated k and
    its v [T, Hkv, D] stored into row ``slots[t]`` of ``k_cache`` and ``v_cache``
    [S, Hkv, D] (a layer's paged cache viewed as slots: page · page_size + offset), in
    one launch. Returns (rotated q, rotated k).

    >>> qkv = torch.randn(2, (2 + 2 * 1) * 8)
    >>> q, k, v = qkv[:, :16].view(2, 2, 8), qkv[:, 16:24].view(2, 1, 8), qkv[:, 24:].view(2, 1, 8)
    >>> cache_k, cache_v = torch.zeros(6, 1, 8), torch.zeros(6, 1, 8)
    >>> cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    >>> _ = rope_qk_store_kv(q, k, v, cos, sin, torch.tensor([5, 0]), cache_k, cache_v)
    >>> torch.equal(cache_v[5], v[0]) and torch.equal(cache_k[0], k[1])
    True
    """
    require_rope_inputs(q, k, cos, sin, q_out)
    require_rows("v", v, shape=k.shape, dtype=k.dtype)
    require_rows("slots", slots, shape=k.shape[:1], dtype=torch.long)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        require_rows(name, cache, ndim=3, dtype=k.dtype)
        if cache.shape[1:] != k.shape[1:]:
            raise ValueError(f"{name} must be [slots, {k.shape[1]}, {k.shape[2]}] (k's heads and head_dim), "
                             f"got {tuple(cache.shape)}")
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(f"k_cache and v_cache must have the same slots, got {k_cache.shape[0]} and "
                         f"{v_cache.shape[0]}")
    require_same_device(q=q, v=v, slots=slots, k_cache=k_cache, v_cache=v_cache)
    require_index_range("slots", slots, 0, k_cache.shape[0], "a slot of the cache (page · page_size + offset)")
    rope_qk_into(q, k, cos, sin, q_out, None, v, slots, k_cache, v_cache)
    return (q if q_out is None else q_out), k

r"""Notebook 04: from softmax to FlashAttention, with FlashAttention-4's two tricks.

Online softmax
--------------
Safe softmax needs the row maximum before it can exponentiate, so a naive kernel reads
the row three times (max, sum of exponentials, normalise). The *online* softmax keeps a
running state (m, d) while it streams the row block by block:

    m' = max(m, max_j x_j),      d' = d · e^{m - m'} + \sum_j e^{x_j - m'}

and reads the row a second time only to write y_j = e^{x_j - m} / d. Two partial states
of disjoint parts of a row merge the same way (associative and commutative):

    m = max(m_a, m_b),           d = d_a e^{m_a - m} + d_b e^{m_b - m}.

With values riding along, the state is (o, lse) and merges exactly: the convention
(float32, natural-log LSE, -inf for an empty state) and the kernels' shared helpers live
in :mod:`gpulab.attention_state`.

FlashAttention forward
----------------------
q [B, Hq, S_q, D], k and v [B, Hkv, S_kv, D], Hq a multiple of Hkv (grouped-query
attention: query head h reads key/value head h // (Hq / Hkv)). One program owns BLOCK_M
query rows of one (batch, head) and streams BLOCK_N keys at a time, keeping the running
max m, the running sum l and the unnormalised output acc in registers: the S_q × S_kv
score matrix never exists in memory. Inside the kernel everything is in base 2: the
scores are multiplied by scale · log2(e) so that e^{s} = 2^{s·log2 e} and ``exp2`` (one
hardware instruction) replaces ``exp``; the returned LSE is converted back to natural log
(lse = (m + log2 l) · ln 2).

Causal masking is aligned to the bottom right (as FlashAttention ≥ 2.1 and KV caches
need): query i sees keys j ≤ i + S_kv - S_q. With S_q = S_kv this is the usual lower
triangle; with S_q > S_kv the first S_q - S_kv rows see nothing (empty states).

FlashAttention-4 options
------------------------
* ``exp2_impl="poly3"``: 2^x without the special-function unit: clamp x ≥ -127, split
  x = j + f with j = floor(x), f ∈ [0, 1), evaluate the cubic
  p(f) = 1 + 0.695146143 f + 0.227564394 f² + 0.0771190897 f³ (max relative error 8.8e-5
  on [0, 1)), and add j to the exponent field of p's float32 bits (bits(p) + (j << 23)).
  FA4 uses it for a fraction of the elements to balance the SFU against the FMA units;
  here it replaces every exponential of the score tile.
* ``rescale_threshold`` τ (log2 units): keep the stale running max while the new block's
  maximum exceeds it by at most τ (the probabilities then stay ≤ 2^τ, 256 for τ = 8).
  The final normalisation uses the same stale max, so the result is exact; only the
  rescale of the accumulator (and its cost) is skipped. τ = 0 rescales whenever the
  max grows.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime
from .attention_state import LN2, LOG2E, exp2_poly3, exp2_poly3_torch, online_update, state_epilogue
from .validate import require_float, require_same_device, require_tensor


# =========================================================================================
# 1. PyTorch references: softmax three ways, the two-state merge, attention
# =========================================================================================
def softmax_unsafe(x: torch.Tensor) -> torch.Tensor:
    """e^x / sum e^x without subtracting the max: overflows once a score exceeds ~88 (float32)."""
    e = torch.exp(x.float())
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


def softmax_safe(x: torch.Tensor) -> torch.Tensor:
    """Subtract the row max first: three passes over the row (max, sum, normalise)."""
    x = x.float()
    m = x.max(-1, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(-1, keepdim=True)


def softmax_online_torch(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The online softmax as the kernel runs it: one pass for (m, d), one to write y."""
    x = x.float()
    m = torch.full(x.shape[:-1], -math.inf, dtype=torch.float32, device=x.device)
    d = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block):
        blk = x[..., start:start + block]
        m_new = torch.maximum(m, blk.max(-1).values)
        d = d * torch.exp(m - m_new) + torch.exp(blk - m_new[..., None]).sum(-1)
        m = m_new
    return torch.exp(x - m[..., None]) / d[..., None]


def merge_softmax_states(m_a, d_a, m_b, d_b):
    """Merge two softmax partial states (m, d) of disjoint parts of the same rows."""
    m = torch.maximum(m_a, m_b)
    safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    return m, d_a * torch.exp(m_a - safe) + d_b * torch.exp(m_b - safe)


def merge_state_torch(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets into the state over their union,
    in PyTorch (notebook 04's exercise; :func:`gpulab.cascade.merge_state` is the kernel).

    o_* [..., D] (any float dtype), lse_* [...] float32 natural-log LSE (the convention of
    :mod:`gpulab.attention_state`). An empty state (lse = -inf, o = 0) merges to the other
    one. Returns (o in o_a's dtype, lse float32). Associative and commutative, so any
    number of partial states can be folded in any order.
    """
    for name, o, lse in (("a", o_a, lse_a), ("b", o_b, lse_b)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"o_{name} and lse_{name} must be torch.Tensors")
        require_float(f"o_{name}", o)
        if lse.dtype != torch.float32:
            raise TypeError(f"lse_{name} must be float32 (gpulab's LSE convention), got "
                            f"{str(lse.dtype).replace('torch.', '')}: convert with .float()")
        if o.dim() < 1 or tuple(o.shape[:-1]) != tuple(lse.shape):
            raise ValueError(f"o_{name} must have shape lse_{name}.shape + (D,): got o_{name} "
                             f"{tuple(o.shape)} and lse_{name} {tuple(lse.shape)}")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have one shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    require_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    lse = torch.maximum(lse_a, lse_b)
    empty = torch.isneginf(lse)                        # both states empty
    m = torch.where(empty, torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - m)                          # e^{-inf} = 0 for an empty state
    wb = torch.exp(lse_b - m)
    total = wa + wb
    out_lse = torch.where(empty, lse, m + torch.log(torch.where(empty, torch.ones_like(total), total)))
    inv = torch.where(empty, torch.zeros_like(total), 1.0 / torch.where(empty, torch.ones_like(total), total))
    o = (wa * inv)[..., None] * o_a.float() + (wb * inv)[..., None] * o_b.float()
    return o.to(o_a.dtype), out_lse


def repeat_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, hq, S, D]: each kv head repeated for the query heads that read it."""
    return t.repeat_interleave(hq // t.shape[1], dim=1)


def causal_mask(s_q: int, s_kv: int, device=None) -> torch.Tensor:
    """[S_q, S_kv] bool, True where query i may see key j: j ≤ i + S_kv - S_q (bottom right)."""
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_kv, device=device)[None, :]
    return j <= i + (s_kv - s_q)


def attention_reference(q, k, v, causal=False, scale=None):
    """float64 attention and natural-log LSE; rows without keys: o = 0, lse = -inf."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qd, kd, vd = q.double(), repeat_kv(k.double(), q.shape[1]), repeat_kv(v.double(), q.shape[1])
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    return {"o": p @ vd, "lse": lse}


def attention_tiled_torch(q, k, v, causal=False, scale=None, block_m=64, block_n=64,
                          exp2_impl="native", rescale_threshold=0.0, stats: dict | None = None):
    """The kernel's algorithm in PyTorch, loop for loop (all batches and heads at once).

    Returns (o, lse). If ``stats`` is a dict it receives counts: ``tiles`` (row-block ×
    key-block updates), ``rescales`` (updates after the first where some row's max moved,
    so the accumulator had to be rescaled) and ``row_rescales`` (the same per row)."""
    B, Hq, Sq, D = q.shape
    Skv = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    exp2 = exp2_poly3_torch if exp2_impl == "poly3" else torch.exp2
    kk, vv = repeat_kv(k.float(), Hq), repeat_kv(v.float(), Hq)
    o = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    counts = {"tiles": 0, "rescales": 0, "row_rescales": 0}
    for m0 in range(0, Sq, block_m):
        qb = q[:, :, m0:m0 + block_m].float()
        rows = torch.arange(m0, min(m0 + block_m, Sq), device=q.device)
        m_i = torch.full(qb.shape[:-1], -math.inf, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(qb)
        for n0 in range(0, Skv, block_n):
            cols = torch.arange(n0, min(n0 + block_n, Skv), device=q.device)
            if causal and bool((cols[0] > rows + (Skv - Sq)).all()):
                break                                     # every row of the block is done
            s = (qb @ kk[:, :, n0:n0 + block_n].transpose(-1, -2)) * (scale * LOG2E)
            if causal:
                s = s.masked_fill(cols[None, :] > rows[:, None] + (Skv - Sq), -math.inf)
            m_cand = torch.maximum(m_i, s.max(-1).values)
            grow = m_cand > m_i + rescale_threshold if rescale_threshold > 0 else m_cand > m_i
            m_new = torch.where(grow, m_cand, m_i)
            m_use = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m_i - m_use)
            p = exp2(s - m_use[..., None])
            p = torch.where(torch.isneginf(s), torch.zeros_like(p), p)
            moved = grow & ~torch.isneginf(m_i)          # the first tile needs no rescale
            counts["tiles"] += B * Hq
            counts["rescales"] += int(moved.any(-1).sum())
            counts["row_rescales"] += int(moved.sum())
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p.to(v.dtype).float() @ vv[:, :, n0:n0 + block_n]
            m_i = m_new
        o[:, :, m0:m0 + block_m] = acc / torch.where(l_i == 0, torch.ones_like(l_i), l_i)[..., None]
        lse[:, :, m0:m0 + block_m] = (m_i + torch.log2(l_i)) * LN2
    if stats is not None:
        stats.update(counts)
    return o.to(q.dtype), lse


def running_max_trace(scores: torch.Tensor, block_n: int = 128, rescale_threshold: float = 0.0):
    """For one row of scores (natural units), the running max (log2 units) the kernel keeps
    after each key block and whether that block forced a rescale. Returns
    (true running max per block, max in use per block, rescale flags) as lists."""
    s = scores.double().flatten() * LOG2E
    true_max, used, flags = [], [], []
    m = -math.inf
    best = -math.inf
    for n0 in range(0, s.numel(), block_n):
        blk = float(s[n0:n0 + block_n].max())
        best = max(best, blk)
        cand = max(m, blk)
        grow = cand > m + rescale_threshold if rescale_threshold > 0 else cand > m
        flags.append(bool(grow and m != -math.inf))
        if grow:
            m = cand
        true_max.append(best)
        used.append(m)
    return true_max, used, flags


# =========================================================================================
# 2. Triton kernels
# =========================================================================================
@triton.jit
def _exp2_poly3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, exp2_poly3(x), mask=mask)


@triton.jit
def _online_softmax_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max m and running sum d (rescaled whenever m grows).
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    # Pass 2: normalise with the final state.
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) / d
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE,
                     sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m,
                     H, GROUP, S_q, S_kv, qk_scale,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, EXP2_POLY: tl.constexpr,
                     RESCALE_THRESHOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:   # heaviest row blocks first: they finish last otherwise
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP                                    # GQA: GROUP query heads share a KV head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :],
                mask=offs_m[:, None] < S_q, other=0.0)
    k_ptrs = K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_n + offs_d[None, :]
    v_ptrs = V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_n + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Keys [0, full_end) are visible to every row of the block: no mask needed there.
    # Keys [full_end, hi) need the tail mask (j < S_kv) and, if causal, j <= i + S_kv - S_q.
    diag = S_kv - S_q
    if CAUSAL:
        full_end = tl.minimum(S_kv, pid_m * BLOCK_M + diag + 1)
        hi = tl.maximum(tl.minimum(S_kv, (pid_m + 1) * BLOCK_M + diag), 0)
    else:
        full_end = S_kv
        hi = S_kv
    full_end = (tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N

    for start_n in range(0, full_end, BLOCK_N):
        k = tl.load(k_ptrs + start_n * sk_n)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        v = tl.load(v_ptrs + start_n * sv_n)
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, v, False, EXP2_POLY, RESCALE_THRESHOLD, False)
    for start_n in range(full_end, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_ptrs + start_n * sk_n, mask=cols[:, None] < S_kv, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = cols[None, :] < S_kv
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
        v = tl.load(v_ptrs + start_n * sv_n, mask=cols[:, None] < S_kv, other=0.0)
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, v, True, EXP2_POLY, RESCALE_THRESHOLD, False)

    o, lse = state_epilogue(m_i, l_i, acc)
    row_ok = offs_m < S_q
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_m + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * S_q + offs_m, lse, mask=row_ok)


# H100/H200 configurations (Triton's tutorial kernel sits at BLOCK_M 128, BLOCK_N 64-128);
# the compile check verifies their shared memory on sm_75/80/90.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
]
_attn_fwd_tuned = triton.autotune(
    configs=runtime.tuning_configs(_GPU_CONFIGS),
    key=["S_q", "S_kv", "HEAD_DIM", "CAUSAL", "EXP2_POLY", "RESCALE_THRESHOLD"])(_attn_fwd_kernel)

# The interpreter costs ~1 ms per program: one config with modest blocks (several key
# blocks per row on the small CPU cases, so the loop and its tail are exercised).
CPU_BLOCK_M, CPU_BLOCK_N = 32, 32
HEAD_DIMS = (16, 32, 64, 128)
EXP2_IMPLS = ("native", "poly3")


# =========================================================================================
# 3. Launchers (no validation: the public functions below validate)
# =========================================================================================
def exp2_poly3_into(x, y):
    """FA4's polynomial 2^x of every element of x, written into y (float32)."""
    n = x.numel()
    _exp2_poly3_kernel[(runtime.cdiv(n, 1024),)](x, y, n, BLOCK=1024)


ONLINE_SOFTMAX_BLOCK = 1024


def online_softmax_into(x, y, block: int | None = None):
    """Launcher with the check's calling convention: one program per row, any row length."""
    n_rows, n_cols = x.shape
    block = block or min(ONLINE_SOFTMAX_BLOCK, runtime.next_power_of_2(n_cols))
    _online_softmax_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)


def flash_attention_into(q, k, v, causal, o, lse, scale=None, exp2_impl="native",
                         rescale_threshold=0.0, block_m=None, block_n=None):
    """Launcher with the check's calling convention (q, k, v, causal, o, lse): writes the
    attention output into ``o`` [B, Hq, S_q, D] and the natural-log LSE into ``lse``
    [B, Hq, S_q] (float32). No input checks: :func:`flash_attention` does them."""
    B, Hq, S_q, D = q.shape
    Hkv, S_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    args = (q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            Hq, Hq // Hkv, S_q, S_kv, scale * LOG2E)
    consts = dict(HEAD_DIM=D, CAUSAL=bool(causal), EXP2_POLY=exp2_impl == "poly3",
                  RESCALE_THRESHOLD=float(rescale_threshold))
    cc = runtime.compute_capability()
    small_gpu = cc is not None and cc < (8, 0)     # a T4: 64 KiB of shared memory per block
    if runtime.interpreting() or block_m is not None or q.dtype == torch.float32 or D <= 32 or small_gpu:
        # One fixed configuration: the interpreter, explicit blocks, small heads (not worth
        # tuning), float32 on a GPU (tiles twice the size of 16-bit ones; TF32 dots), or a
        # pre-Ampere GPU, where the H100 configurations below do not fit in shared memory.
        bm, bn = (block_m or CPU_BLOCK_M, block_n or CPU_BLOCK_N) if runtime.interpreting() else \
            (block_m or 64, block_n or 32)
        _attn_fwd_kernel[(runtime.cdiv(S_q, bm), B * Hq)](*args, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                         num_warps=4, num_stages=2)
    else:
        grid = lambda meta: (runtime.cdiv(S_q, meta["BLOCK_M"]), B * Hq)  # noqa: E731
        _attn_fwd_tuned[grid](*args, **consts)


def flash_attention_fa4_into(q, k, v, causal, o, lse):
    """Both FA4 options on: polynomial exp2 and lazy rescaling with τ = 8."""
    flash_attention_into(q, k, v, causal, o, lse, exp2_impl="poly3", rescale_threshold=8.0)


# =========================================================================================
# 4. Public functions: validate, allocate, launch
# =========================================================================================
def online_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of a 2-D tensor with rows of any length (running max and sum)."""
    require_tensor("x", x, ndim=2)
    require_float("x", x)
    if x.shape[1] == 0:
        raise ValueError("x has rows of length 0: softmax of an empty row is undefined")
    y = torch.empty_like(x)
    if x.shape[0]:
        online_softmax_into(x, y)
    return y


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, return_lse: bool = False,
                    exp2_impl: str = "native", rescale_threshold: float = 0.0):
    """softmax(scale · q kᵀ [+ causal mask]) v in one Triton kernel (FlashAttention forward).

    q [B, Hq, S_q, D]; k, v [B, Hkv, S_kv, D] with Hq a multiple of Hkv (GQA); D in
    {16, 32, 64, 128}; float16/bfloat16 on a GPU, float32/float16 in the interpreter.
    ``scale`` defaults to 1/sqrt(D). Causal masking is bottom-right aligned (query i sees
    keys j ≤ i + S_kv - S_q). Returns o (q's dtype), and with ``return_lse`` also the
    float32 natural-log LSE [B, Hq, S_q] (-inf for rows that see no key; FlashInfer's base-2
    LSE is lse / ln 2). FA4 options: ``exp2_impl`` "native" or "poly3", ``rescale_threshold``
    τ ≥ 0 in log2 units (0: rescale whenever the max grows; 8: FA4's rule).
    """
    require_tensor("q", q, ndim=4)
    require_tensor("k", k, ndim=4)
    require_tensor("v", v, ndim=4)
    require_same_device(q=q, k=k, v=v)
    allowed = ((torch.float16, torch.bfloat16) if runtime.mode() != "interpreter"
               else (torch.float32, torch.float16))
    if q.dtype not in allowed:
        hint = ("bfloat16 tl.dot is wrong in Triton's interpreter" if runtime.interpreting()
                else "the tensor-core path needs 16-bit inputs")
        raise TypeError(f"q must be {' or '.join(str(d).replace('torch.', '') for d in allowed)} here "
                        f"({hint}), got {str(q.dtype).replace('torch.', '')}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, S_q, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape [B, Hkv, S_kv, D], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, Hkv, S_kv, D={D}] to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the number of "
                         f"key/value heads ({Hkv}) for grouped-query attention")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dimension D={D} is not supported: use one of {HEAD_DIMS} "
                         f"(pad the head dimension with zeros otherwise)")
    if exp2_impl not in EXP2_IMPLS:
        raise ValueError(f"exp2_impl must be one of {EXP2_IMPLS}, got {exp2_impl!r}")
    if not (isinstance(rescale_threshold, (int, float)) and 0 <= rescale_threshold <= 16):
        raise ValueError(f"rescale_threshold must be a number in [0, 16] (log2 units; 8 is FA4's "
                         f"rule, larger risks overflowing 16-bit probabilities), got {rescale_threshold!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(D)), got {scale!r}")
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, S_q), dtype=torch.float32, device=q.device)
    if o.numel():
        if k.shape[2] == 0:
            o.zero_()
            lse.fill_(-math.inf)
        else:
            flash_attention_into(q, k, v, causal, o, lse, scale=scale, exp2_impl=exp2_impl,
                                 rescale_threshold=rescale_threshold)
    return (o, lse) if return_lse else o


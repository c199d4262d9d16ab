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

Attention states and the LSE convention (a contract: paged and cascade attention rely on it)
-----------------------------------------------------------------------------------------
For one query q and keys/values (k_j, v_j), j ∈ I, with scores s_j = scale · q·k_j:

    lse_I = log \sum_{j∈I} e^{s_j}            (NATURAL log, float32)
    o_I   = \sum_{j∈I} e^{s_j - lse_I} v_j

gpulab returns ``lse`` as float32 of shape [B, Hq, S_q] in base e. An *empty* state
(no keys, e.g. a causal row that sees nothing) has lse = -inf and o = 0. Two states over
disjoint key sets merge into the state over their union (``merge_states``):

    lse = log(e^{lse_a} + e^{lse_b}),   o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})

computed as lse = M + log(e^{lse_a - M} + e^{lse_b - M}) with M = max(lse_a, lse_b), and an
empty state merges to the other state (never NaN). FlashInfer stores the LSE in base 2;
convert with lse2 = lse / ln 2 (and lse = lse2 · ln 2).

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
from .harness.checking import CheckFailure, Guarded
from .harness.checking import check as _check
from .harness.spec import Case, KernelSpec, bytes_of, randn
from .validate import require_float, require_same_device, require_tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# FA4's degree-3 minimax fit of 2^f on [0, 1) (Horner form: 1 + f(C1 + f(C2 + f C3))).
POLY3 = (1.0, 0.695146143, 0.227564394, 0.0771190897)
POLY3_MAX_REL_ERROR = 8.8e-5


# =========================================================================================
# 1. Softmax: naive, safe, online (PyTorch references)
# =========================================================================================
def softmax_reference(x):
    return {"y": torch.softmax(x.double(), dim=-1)}


def softmax_naive(x: torch.Tensor) -> torch.Tensor:
    """e^x / sum e^x: overflows once a score exceeds ~88 (float32)."""
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


# =========================================================================================
# 2. Merging attention states (natural-log LSE)
# =========================================================================================
def merge_partials_reference(o_part, lse_part):
    """Merge S partial states in float64: o_part [..., S, D], lse_part [..., S] ->
    {"o": [..., D], "lse": [...]}. Empty states (lse = -inf) weigh 0; all empty gives
    o = 0, lse = -inf. The one reference behind split-KV reduces and cascade merges."""
    lse_part = lse_part.double()
    m = lse_part.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m)
    total = w.sum(-1)
    o = (w[..., None] * o_part.double()).sum(-2) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m[..., 0] + torch.log(total), -math.inf)
    return {"o": o, "lse": lse}


def merge_states_reference(o_a, lse_a, o_b, lse_b):
    """Two states over disjoint keys -> the state over their union (float64)."""
    return merge_partials_reference(torch.stack([o_a, o_b], dim=-2), torch.stack([lse_a, lse_b], dim=-1))


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets into the state over their union.

    o_* [..., D] (any float dtype), lse_* [...] float32 natural-log LSE (gpulab's
    convention; FlashInfer's base-2 LSE converts as lse = lse2 · ln 2). An empty state
    (lse = -inf, o = 0) merges to the other one. Returns (o in o_a's dtype, lse float32).
    Associative and commutative, so any number of partial states can be folded in any order.
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


# =========================================================================================
# 3. Attention references: float64 math, and a tiled PyTorch mirror of the kernel
# =========================================================================================
def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
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
    qd, kd, vd = q.double(), _expand_kv(k.double(), q.shape[1]), _expand_kv(v.double(), q.shape[1])
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    return {"o": p @ vd, "lse": lse}


def exp2_poly3_torch(x: torch.Tensor) -> torch.Tensor:
    """FA4's 2^x for float32 tensors: cubic on the fraction, integer part into the exponent bits."""
    x = x.float().clamp(min=-127.0)
    j = torch.floor(x)
    f = x - j
    p = POLY3[0] + f * (POLY3[1] + f * (POLY3[2] + f * POLY3[3]))
    return (p.view(torch.int32) + (j.to(torch.int32) << 23)).view(torch.float32)


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
    kk, vv = _expand_kv(k.float(), Hq), _expand_kv(v.float(), Hq)
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
# 4. Triton kernels
# =========================================================================================
@triton.jit
def exp2_poly3(x):
    """2^x for float32 x (FA4): Horner cubic on f = x - floor(x), floor(x) added to the exponent."""
    x = tl.maximum(x, -127.0)
    j = tl.floor(x)
    f = x - j
    p = 1.0 + f * (0.695146143 + f * (0.227564394 + f * 0.0771190897))
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_poly3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, exp2_poly3(x), mask=mask)


def exp2_poly3_into(x, y):
    n = x.numel()
    _exp2_poly3_kernel[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)


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


ONLINE_SOFTMAX_BLOCK = 1024


def online_softmax_into(x, y, block: int | None = None):
    """Launcher with the check's calling convention: one program per row, any row length."""
    n_rows, n_cols = x.shape
    block = block or min(ONLINE_SOFTMAX_BLOCK, triton.next_power_of_2(n_cols))
    _online_softmax_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)


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


@triton.jit
def online_update(acc, m_i, l_i, s, v, MASKED: tl.constexpr, EXP2_POLY: tl.constexpr,
                  RESCALE_THRESHOLD: tl.constexpr):
    """One key block of the online softmax for a block of query rows (all in base 2).

    s [BLOCK_M, BLOCK_N]: scores × scale × log2(e), -inf where masked; v [BLOCK_N, D].
    Returns the new (acc, m_i, l_i); acc is the unnormalised output relative to m_i."""
    m_cand = tl.maximum(m_i, tl.max(s, 1))
    if RESCALE_THRESHOLD > 0:
        # FA4: keep the stale max unless the block's max exceeds it by more than τ.
        grow = m_cand > m_i + RESCALE_THRESHOLD
        m_new = tl.where(grow, m_cand, m_i)
    else:
        m_new = m_cand
    if MASKED:
        # A row that has seen only masked keys keeps m = -inf: subtract 0 instead (no NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    if EXP2_POLY:
        p = exp2_poly3(s - m_use[:, None])
        if MASKED:
            p = tl.where(s == float("-inf"), 0.0, p)     # the polynomial never returns 0
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if RESCALE_THRESHOLD > 0:
        if tl.max(grow.to(tl.int32), 0) > 0:           # skipped when no row's max moved
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def attention_epilogue(acc, m_i, l_i):
    """Final normalisation: o = acc / l (0 for rows that saw no key) and the natural-log
    LSE (m + log2 l) · ln 2 (-inf for those rows). m_i and l_i are in base 2."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453   # m_i = -inf for those rows
    return o, lse


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
        acc, m_i, l_i = online_update(acc, m_i, l_i, s, v, False, EXP2_POLY, RESCALE_THRESHOLD)
    for start_n in range(full_end, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(k_ptrs + start_n * sk_n, mask=cols[:, None] < S_kv, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = cols[None, :] < S_kv
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
        v = tl.load(v_ptrs + start_n * sv_n, mask=cols[:, None] < S_kv, other=0.0)
        acc, m_i, l_i = online_update(acc, m_i, l_i, s, v, True, EXP2_POLY, RESCALE_THRESHOLD)

    o, lse = attention_epilogue(acc, m_i, l_i)
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
    configs=_GPU_CONFIGS,
    key=["S_q", "S_kv", "HEAD_DIM", "CAUSAL", "EXP2_POLY", "RESCALE_THRESHOLD"])(_attn_fwd_kernel)

# The interpreter costs ~1 ms per program: one config with modest blocks (several key
# blocks per row on the small CPU cases, so the loop and its tail are exercised).
CPU_BLOCK_M, CPU_BLOCK_N = 32, 32
HEAD_DIMS = (16, 32, 64, 128)
EXP2_IMPLS = ("native", "poly3")


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
        _attn_fwd_kernel[(triton.cdiv(S_q, bm), B * Hq)](*args, **consts, BLOCK_M=bm, BLOCK_N=bn,
                                                         num_warps=4, num_stages=2)
    else:
        grid = lambda meta: (triton.cdiv(S_q, meta["BLOCK_M"]), B * Hq)  # noqa: E731
        _attn_fwd_tuned[grid](*args, **consts)


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


def flash_attention_fa4_into(q, k, v, causal, o, lse):
    """Both FA4 options on: polynomial exp2 and lazy rescaling with τ = 8."""
    flash_attention_into(q, k, v, causal, o, lse, exp2_impl="poly3", rescale_threshold=8.0)


# =========================================================================================
# 5. Specs
# =========================================================================================
def _softmax_inputs(p, dtype, device, gen):
    x = randn((p["rows"], p["cols"]), torch.float32, device, gen, scale=4.0)
    # A row-dependent offset (an unsafe softmax overflows) and a trend along the row, so
    # the running max keeps moving and a missing rescale shows.
    x = x + torch.linspace(-50, 70, p["rows"], device=device)[:, None]
    x = x + torch.linspace(0, 6, p["cols"], device=device)[None, :]
    return {"x": x.to(dtype)}


ONLINE_SOFTMAX = KernelSpec(
    name="online_softmax",
    summary="row softmax of any length: running max and sum, then normalise",
    args=("x", "y"),
    make_inputs=_softmax_inputs,
    reference=softmax_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=online_softmax_into,
    cases={
        "cpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("several blocks + tail", dict(rows=4, cols=2 * ONLINE_SOFTMAX_BLOCK + 333)),
                Case("long row", dict(rows=2, cols=5 * ONLINE_SOFTMAX_BLOCK))],
        "gpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("blocks + tail", dict(rows=37, cols=3 * ONLINE_SOFTMAX_BLOCK + 5)),
                Case("very long rows", dict(rows=5, cols=200_001))],
        "bench": [Case("4096x4096", dict(rows=4096, cols=4096)),
                  Case("1024x65536", dict(rows=1024, cols=65536)),
                  Case("128x1048576", dict(rows=128, cols=1 << 20))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (4e-3, 1e-2)},
    bytes_moved=lambda p, dtype: 3 * p["rows"] * p["cols"] * bytes_of(dtype),
    flops=lambda p, dtype: 6 * p["rows"] * p["cols"],
    baselines={"torch": lambda inp: torch.softmax(inp["x"], dim=-1)},
    read_inputs=("x",),
    bench_dtypes=[torch.bfloat16],
)


def _merge_inputs(p, dtype, device, gen):
    n, h, d = p["n"], p["heads"], p["dim"]
    o_a = randn((n, h, d), torch.float32, device, gen)
    o_b = randn((n, h, d), torch.float32, device, gen, offset=0.3)
    lse_a = randn((n, h), torch.float32, device, gen, scale=4.0, offset=3.0)
    lse_b = randn((n, h), torch.float32, device, gen, scale=4.0, offset=2.0)
    # Empty states (lse = -inf, o = 0): one side, the other side, and both.
    r = torch.rand((n, h), generator=gen, device=device)
    ea, eb = r < 0.15, (r > 0.85)
    both = (r > 0.45) & (r < 0.55)
    ea, eb = ea | both, eb | both
    lse_a = lse_a.masked_fill(ea, -math.inf)
    lse_b = lse_b.masked_fill(eb, -math.inf)
    o_a = o_a.masked_fill(ea[..., None], 0.0)
    o_b = o_b.masked_fill(eb[..., None], 0.0)
    return {"o_a": o_a.to(dtype), "lse_a": lse_a, "o_b": o_b.to(dtype), "lse_b": lse_b}


MERGE_STATES = KernelSpec(
    name="merge_attention_states",
    summary="merge two attention states (o, natural-log lse) over disjoint key sets (PyTorch)",
    args=("o_a", "lse_a", "o_b", "lse_b"),
    make_inputs=_merge_inputs,
    reference=merge_states_reference,
    returns=("o", "lse"),
    implementation=merge_states,
    cases={
        "cpu": [Case("one state", dict(n=1, heads=1, dim=1)), Case("odd", dict(n=7, heads=3, dim=5)),
                Case("many", dict(n=64, heads=8, dim=64))],
        "gpu": [Case("one state", dict(n=1, heads=1, dim=1)), Case("odd", dict(n=7, heads=3, dim=5)),
                Case("many", dict(n=1000, heads=32, dim=128))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    read_inputs=("o_a", "o_b", "lse_a", "lse_b"),
)


def _attn_inputs(p, dtype, device, gen):
    B, Hq, Hkv, Sq, Skv, D = p["B"], p["Hq"], p.get("Hkv", p["Hq"]), p["Sq"], p["Skv"], p["D"]
    # q carries a per-(batch) spread and a trend over positions, so scores vary in range
    # across rows and the running max moves along a row.
    q = randn((B, Hq, Sq, D), torch.float32, device, gen, scale=1.5)
    k = randn((B, Hkv, Skv, D), torch.float32, device, gen)
    k = k + 0.3 * torch.linspace(-1, 1, Skv, device=device)[None, None, :, None] * q.mean((1, 2))[:, None, None, :]
    v = randn((B, Hkv, Skv, D), torch.float32, device, gen, offset=0.2)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "causal": bool(p.get("causal", False))}


def _attn_ref(q, k, v, causal):
    return attention_reference(q, k, v, causal)


def _attn_outputs(inp, dtype):
    q = inp["q"]
    return {"o": (q.shape, dtype), "lse": (q.shape[:3], torch.float32)}


def _attn_flops(p, dtype):
    f = 4 * p["B"] * p["Hq"] * p["Sq"] * p["Skv"] * p["D"]
    return f / 2 if p.get("causal") else f


def _attn_bytes(p, dtype):
    B, Hq, Hkv, Sq, Skv, D = p["B"], p["Hq"], p.get("Hkv", p["Hq"]), p["Sq"], p["Skv"], p["D"]
    return (2 * B * Hq * Sq * D + 2 * B * Hkv * Skv * D) * bytes_of(dtype) + 4 * B * Hq * Sq


def _sdpa(inp):
    q, k, v = inp["q"], inp["k"], inp["v"]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=inp["causal"], enable_gqa=k.shape[1] != q.shape[1])


def _case(label, B, Hq, Sq, Skv, D, Hkv=None, causal=False):
    return Case(label, dict(B=B, Hq=Hq, Hkv=Hkv or Hq, Sq=Sq, Skv=Skv, D=D, causal=causal))


ATTN_CPU_NONCAUSAL = [
    _case("one query, one key", 1, 1, 1, 1, 16),
    _case("ragged S_q ≠ S_kv", 1, 2, 37, 45, 32),
    _case("decode: one query", 2, 2, 1, 70, 64),
    _case("D=128, tail", 1, 1, 33, 40, 128),
]
ATTN_CPU_MORE = [
    _case("causal square", 1, 2, 50, 50, 16, causal=True),
    _case("causal + cache (S_q < S_kv), GQA 4/2", 1, 4, 20, 67, 32, Hkv=2, causal=True),
    _case("causal, S_q > S_kv: empty rows", 1, 1, 40, 9, 16, causal=True),
    _case("GQA 6/2, non-causal", 2, 6, 9, 33, 64, Hkv=2),
]
ATTN_GPU_NONCAUSAL = [
    _case("one query, one key", 1, 1, 1, 1, 64),
    _case("ragged", 2, 3, 1000, 777, 128),
    _case("decode: one query", 4, 8, 1, 4097, 128),
    _case("D=64, tail", 1, 4, 513, 1031, 64),
    _case("D=16", 1, 2, 77, 200, 16),
]
ATTN_GPU_MORE = [
    _case("causal square", 2, 4, 1000, 1000, 128, causal=True),
    _case("causal + cache, GQA 8/2", 1, 8, 300, 2049, 128, Hkv=2, causal=True),
    _case("causal, S_q > S_kv", 1, 2, 260, 100, 128, causal=True),
    _case("GQA 32/8", 1, 32, 129, 1000, 128, Hkv=8),
    _case("D=32 causal", 1, 2, 100, 100, 32, causal=True),
]
_BENCH = [_case("S=8192", 4, 32, 8192, 8192, 128), _case("S=8192 causal", 4, 32, 8192, 8192, 128, causal=True)]
_SWEEP = [_case(f"S={s // 1024}K" + (" causal" if c else ""), 4, 32, s, s, 128, causal=c)
          for c in (False, True) for s in (1024, 2048, 4096, 8192, 16384)]

_ATTN_COMMON = dict(
    args=("q", "k", "v", "causal", "o", "lse"),
    make_inputs=_attn_inputs,
    reference=_attn_ref,
    outputs=_attn_outputs,
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float16, torch.bfloat16]},
    tolerances={torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)},
    output_tolerances={"lse": {torch.float32: (2e-5, 1e-6), torch.float16: (1e-4, 1e-5),
                               torch.bfloat16: (1e-4, 1e-5)}},
    bytes_moved=_attn_bytes,
    flops=_attn_flops,
    read_inputs=("q", "k", "v"),
    bench_dtypes=[torch.bfloat16],
)

FLASH_ATTENTION = KernelSpec(
    name="flash_attention",
    summary="FlashAttention forward: causal or not, GQA, natural-log LSE",
    implementation=flash_attention_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL + ATTN_CPU_MORE, "gpu": ATTN_GPU_NONCAUSAL + ATTN_GPU_MORE,
           "bench": _BENCH},
    baselines={"torch SDPA": _sdpa},
    **_ATTN_COMMON,
)

FLASH_ATTENTION_SWEEP = KernelSpec(
    name="flash_attention_sweep",
    summary="FlashAttention forward, B=4 H=32 D=128, S = 1K..16K (the notebook's sweep)",
    implementation=flash_attention_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL[:1], "gpu": ATTN_GPU_NONCAUSAL[:1], "bench": _SWEEP},
    baselines={"torch SDPA": _sdpa},
    **_ATTN_COMMON,
)

# FA4's options: the polynomial adds ≤ 8.8e-5 relative error to each probability; the
# lazy rescale is exact up to rounding (probabilities up to 2^8 before the final divide).
FA4_TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)}
FLASH_ATTENTION_FA4 = KernelSpec(
    name="flash_attention_fa4",
    summary="FlashAttention forward with FA4's poly-3 exp2 and lazy rescaling (τ = 8)",
    implementation=flash_attention_fa4_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL[1:2] + ATTN_CPU_MORE[:3],
           "gpu": ATTN_GPU_NONCAUSAL[:2] + ATTN_GPU_MORE[:3],
           "bench": _BENCH},
    baselines={"torch SDPA": _sdpa,
               "gpulab, native exp2, always rescale": lambda inp: flash_attention(
                   inp["q"], inp["k"], inp["v"], causal=inp["causal"])},
    compile_baselines=("torch SDPA",),   # the other baseline is gpulab's own Triton kernel
    **{**_ATTN_COMMON, "tolerances": FA4_TOLERANCES,
       "output_tolerances": {"lse": {d: (3e-4, 1e-4) for d in FA4_TOLERANCES}}},
)


def _exp2_inputs(p, dtype, device, gen):
    n = p["n"]
    # Attention feeds it s - m ≤ τ ≤ 8 (lazy rescaling); beyond that only the range grows.
    x = (torch.randn(n, generator=gen, device=device) * 4.0).clamp(max=8.0)
    # Very negative arguments (masked scores end up here) and a few past the clamp.
    x[::7] = -torch.rand(x[::7].shape, generator=gen, device=device) * 140.0
    return {"x": x.to(dtype)}


EXP2_POLY3 = KernelSpec(
    name="exp2_poly3",
    summary="2^x from a cubic polynomial and exponent-bit insertion (FA4)",
    args=("x", "y"),
    make_inputs=_exp2_inputs,
    reference=lambda x: {"y": torch.exp2(x.double())},
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=exp2_poly3_into,
    cases={"cpu": [Case("one", dict(n=1)), Case("tail", dict(n=3000))],
           "gpu": [Case("one", dict(n=1)), Case("tail", dict(n=100_003))]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
    tolerances={torch.float32: (1e-37, 1e-4)},
    read_inputs=("x",),
)


# =========================================================================================
# 6. Checks for the notebook's exercises
# =========================================================================================
def _explain(fn, cases, hypotheses, dtype=torch.float32):
    """After a failed attention check: does the output match a recognisable mistake?"""
    from .harness.spec import _gen
    dev = runtime.device()
    dtype = dtype if runtime.mode() != "compiled" else torch.float16
    for case in cases:
        inp = _attn_inputs(case.params, dtype, dev, _gen(1, dev))
        B, Hq, Sq, D = inp["q"].shape
        # Guarded buffers, as in the check: a wrong kernel may read or write out of bounds.
        g = {n: Guarded.wrap(inp[n].shape, dtype, dev, like=inp[n]) for n in ("q", "k", "v")}
        o = Guarded.wrap(inp["q"].shape, dtype, dev).inner
        lse = Guarded.wrap((B, Hq, Sq), torch.float32, dev).inner
        try:
            fn(g["q"].inner, g["k"].inner, g["v"].inner, inp["causal"], o, lse)
        except Exception:
            return None
        for text, alt in hypotheses:
            ref = alt(inp)
            if ref is not None and torch.allclose(o.double().cpu(), ref.double().cpu(), atol=5e-3, rtol=5e-3):
                return text
        exp = attention_reference(inp["q"], inp["k"], inp["v"], inp["causal"])
        lse_ok = torch.allclose(lse.double().cpu(), exp["lse"].cpu(), atol=1e-3, rtol=1e-4, equal_nan=False) or \
            bool((torch.isneginf(lse.cpu()) == torch.isneginf(exp["lse"].cpu())).all()
                 and torch.allclose(lse.double().cpu().nan_to_num(neginf=0), exp["lse"].cpu().nan_to_num(neginf=0),
                                    atol=1e-3, rtol=1e-4))
        o_ok = torch.allclose(o.double().cpu(), exp["o"].cpu(), atol=5e-3, rtol=5e-3)
        if lse_ok and not o_ok:
            return ("the LSE is right, so the running max m and sum l are; the output is not: is acc "
                    "rescaled by alpha = exp2(m_old - m_new) whenever the max changes, and are p (for "
                    "acc) and l computed against the same max?")
    return None


def _hypotheses():
    def sc(f):
        return lambda inp: attention_reference(inp["q"], inp["k"], inp["v"], inp["causal"],
                                               scale=f / math.sqrt(inp["q"].shape[-1]))["o"]

    def causal_flip(inp):
        return attention_reference(inp["q"], inp["k"], inp["v"], not inp["causal"])["o"]

    def top_left(inp):
        if not inp["causal"] or inp["q"].shape[2] == inp["k"].shape[2]:
            return None
        q, k = inp["q"], inp["k"]
        pad = q.shape[2] - k.shape[2]
        s = (q.double() @ _expand_kv(k.double(), q.shape[1]).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return p @ _expand_kv(inp["v"].double(), q.shape[1]) if pad else None

    def gqa_mod(inp):
        q, k, v = inp["q"], inp["k"], inp["v"]
        if k.shape[1] == q.shape[1] or k.shape[1] == 1:
            return None
        idx = torch.arange(q.shape[1], device=q.device) % k.shape[1]
        return attention_reference(q, k[:, idx], v[:, idx], inp["causal"])["o"]

    return [
        ("the output equals attention with the scale × ln 2: exp2 needs the scores multiplied by "
         "scale · log2(e) (qk_scale), not just scale.", sc(1 / LOG2E)),
        ("the output equals attention without the 1/sqrt(D) softmax scale.",
         lambda inp: attention_reference(inp["q"], inp["k"], inp["v"], inp["causal"], scale=1.0)["o"]),
        ("the output equals attention with scores × scale × log2(e) fed to exp (natural): use "
         "exp2 with qk_scale, or exp with scale, not a mix.", sc(LOG2E)),
        ("the output equals attention with the causal mask the wrong way round (applied when "
         "causal=False or missing when causal=True).", causal_flip),
        ("the output equals a causal mask aligned top-left (j ≤ i): gpulab aligns it bottom-right, "
         "j ≤ i + S_kv - S_q.", top_left),
        ("the output equals GQA with kv head = h % Hkv: query head h uses kv head h // (Hq // Hkv).",
         gqa_mod),
    ]


def _attention_check(spec, fn, cases=None, **kw):
    try:
        return _check(spec, fn, cases=cases, **kw)
    except CheckFailure as e:
        if "past the end" in str(e) or "before the start" in str(e) or "NaN" in str(e):
            raise          # the harness's own diagnosis says it all
        pool = cases if cases is not None else spec.cases["gpu" if runtime.mode() == "compiled" else "cpu"]
        text = _explain(fn, [c for c in pool if c.params["Sq"] > 1][:1] or pool[:1], _hypotheses())
        msg = str(e)
        generic_rows = "check how program_id maps to rows" in msg
        if text or generic_rows:
            # The harness's row-pattern hint rarely fits attention: replace it.
            msg = "\n".join(line for line in msg.split("\n") if not line.startswith("  Hint:"))
            text = text or ("some rows are right and others wrong: that is the signature of the "
                            "online update. Rows whose max moved after their first key block need "
                            "acc and l rescaled by alpha = exp2(m_old - m_new), and p, l and acc "
                            "must all use the same max.")
            raise CheckFailure(f"{msg}\n  Hint: {text}") from None
        raise


def check_online_softmax(fn, **kw):
    """Check a launcher ``fn(x, y)`` writing the row softmax of x into y."""
    return _check(ONLINE_SOFTMAX, fn, **kw)


def check_merge_states(fn, **kw):
    """Check ``fn(o_a, lse_a, o_b, lse_b) -> (o, lse)`` (natural-log LSE, empty = -inf)."""
    return _check(MERGE_STATES, fn, **kw)


def check_exp2_poly3(fn, **kw):
    """Check a launcher ``fn(x, y)`` writing FA4's polynomial 2^x of x into y."""
    return _check(EXP2_POLY3, fn, **kw)


def check_attention_noncausal(fn, cases=None, **kw):
    """Check ``fn(q, k, v, causal, o, lse)`` on non-causal cases with Hq = Hkv."""
    if cases is None:
        cases = ATTN_GPU_NONCAUSAL if runtime.mode() == "compiled" else ATTN_CPU_NONCAUSAL
    return _attention_check(FLASH_ATTENTION, fn, cases=cases, **kw)


def check_flash_attention(fn, **kw):
    """Check ``fn(q, k, v, causal, o, lse)`` on every case: causal, GQA, empty rows."""
    return _attention_check(FLASH_ATTENTION, fn, **kw)

r"""The attention state (o, lse): the one idea behind FlashAttention, split-KV and cascade.

Attention, paged decode and cascade attention all build on this module; it holds the
convention, the float64 references, and the ``@triton.jit`` helpers their kernels share.

The state and its convention
----------------------------
For one query q and a set I of keys/values (k_j, v_j) with scores s_j = scale · q·k_j:

    lse_I = log \sum_{j∈I} e^{s_j}             (NATURAL log, float32)
    o_I   = \sum_{j∈I} e^{s_j - lse_I} v_j

gpulab's public functions return ``lse`` as float32 in base e. An *empty* state (no keys:
a causal row that sees nothing, a partition past the end of a sequence) has lse = -inf
and o = 0. FlashInfer stores the LSE in base 2: lse2 = lse / ln 2 = lse · log2(e)
(:func:`lse_to_base2`, :func:`lse_from_base2`).

Merging
-------
Two states over disjoint key sets merge into the state over their union:

    lse = log(e^{lse_a} + e^{lse_b}),   o = (e^{lse_a} o_a + e^{lse_b} o_b) / e^{lse}

computed with M = max(lse_a, lse_b): w_a = e^{lse_a - M}, w_b = e^{lse_b - M},
o = (w_a o_a + w_b o_b) / (w_a + w_b), lse = M + log(w_a + w_b). The merge is associative
and commutative with the empty state as identity, so S states fold the same way
(M = max_p lse_p, w_p = e^{lse_p - M}); if every state is empty the result is empty
(o = 0, lse = -inf), never NaN.

The running state inside a kernel
---------------------------------
Kernels keep the state of a block of query rows unnormalised and in base 2: a running max
m (of scores already multiplied by scale · log2 e), a running sum l = Σ 2^{s - m} and an
accumulator acc = Σ 2^{s - m} v. One key tile updates it (:func:`online_update`):

    m' = max(m, rowmax(s)),   α = 2^{m - m'},   p = 2^{s - m'},
    l' = α l + rowsum(p),     acc' = α acc + p v

and :func:`state_epilogue` turns it into the convention above: o = acc / l,
lse = (m + log2 l) · ln 2 (and the empty state where l = 0). ``exp2`` is one hardware
instruction where ``exp`` is two; FlashAttention-4 replaces even that by a cubic
polynomial (:func:`exp2_poly3`) and lets the max go stale by up to τ (lazy rescaling).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634          # log2(e): scores × scale × LOG2E feed exp2
LN2 = 0.6931471805599453            # ln(2): base-2 LSE × LN2 = natural-log LSE
# FA4's degree-3 minimax fit of 2^f on [0, 1) (Horner form: 1 + f(C1 + f(C2 + f C3))).
POLY3 = (1.0, 0.695146143, 0.227564394, 0.0771190897)
POLY3_MAX_REL_ERROR = 8.8e-5


# =========================================================================================
# Conversions and float64 references
# =========================================================================================
def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """gpulab's natural-log LSE -> FlashInfer's base-2 LSE (-inf stays -inf)."""
    return lse * LOG2E


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 LSE -> gpulab's natural-log LSE (-inf stays -inf)."""
    return lse2 * LN2


def merge_states_reference(o_states: torch.Tensor, lse_states: torch.Tensor) -> dict:
    """Merge S states in float64: o_states [..., S, D], lse_states [..., S] ->
    {"o": [..., D], "lse": [...]}. Empty states (lse = -inf) weigh 0; all empty gives
    o = 0, lse = -inf. The reference behind split-KV reduces and cascade merges."""
    lse_states = lse_states.double()
    m = lse_states.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_states - m)
    total = w.sum(-1)
    has = total > 0
    o = (w[..., None] * o_states.double()).sum(-2) / torch.where(has, total, 1.0)[..., None]
    lse = torch.where(has, m[..., 0] + torch.log(torch.where(has, total, 1.0)), -math.inf)
    return {"o": o, "lse": lse}


def merge_state_reference(o_a, lse_a, o_b, lse_b) -> dict:
    """Two states over disjoint keys -> the state over their union (float64)."""
    return merge_states_reference(torch.stack([o_a, o_b], dim=-2), torch.stack([lse_a, lse_b], dim=-1))


def attention_state_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(o, lse) in float64 of queries q [Hq, D] over keys/values [N, Hkv, D] with grouped
    query attention (head h reads kv head h // (Hq / Hkv)); N = 0 gives the empty state."""
    hq, hkv = q.shape[0], k.shape[1]
    if k.shape[0] == 0:
        return (torch.zeros(q.shape, dtype=torch.float64, device=q.device),
                torch.full((hq,), -math.inf, dtype=torch.float64, device=q.device))
    qg = q.double().reshape(hkv, hq // hkv, -1)                # query heads grouped by kv head: [Hkv, G, D]
    s = torch.einsum("kgd,nkd->kgn", qg, k.double()) * scale   # [Hkv, G, N]
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("kgn,nkd->kgd", torch.exp(s - lse[..., None]), v.double())
    return o.reshape(hq, -1), lse.reshape(hq)


def exp2_poly3_torch(x: torch.Tensor) -> torch.Tensor:
    """FA4's 2^x for float32 tensors: cubic on the fraction, integer part into the exponent bits."""
    x = x.float().clamp(min=-127.0)
    j = torch.floor(x)
    f = x - j
    p = POLY3[0] + f * (POLY3[1] + f * (POLY3[2] + f * POLY3[3]))
    return (p.view(torch.int32) + (j.to(torch.int32) << 23)).view(torch.float32)


# =========================================================================================
# @triton.jit helpers shared by the attention, paged-decode and cascade kernels
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
def online_update(m, l, acc, s, v, MASKED: tl.constexpr, EXP2_POLY: tl.constexpr,
                  RESCALE_THRESHOLD: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the online softmax for a block of query rows, in base 2.

    (m, l, acc): running max [M], running sum [M], unnormalised output [M, D] (float32).
    s [M, N]: scores × scale × log2(e), -inf where masked (``MASKED``: some may be, so a
    row whose every key so far is masked keeps m = -inf without producing NaN).
    v [N, D]. ``EXP2_POLY``: FA4's polynomial for the probabilities. ``RESCALE_THRESHOLD``
    τ > 0: keep the stale max unless the tile's max exceeds it by more than τ (FA4).
    ``IEEE``: full float32 products (fp32 dots default to TF32 on a GPU).
    Returns the new (m, l, acc)."""
    m_cand = tl.maximum(m, tl.max(s, 1))
    if RESCALE_THRESHOLD > 0:
        grow = m_cand > m + RESCALE_THRESHOLD
        m_new = tl.where(grow, m_cand, m)
    else:
        m_new = m_cand
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # never -inf - (-inf)
    else:
        m_use = m_new
    alpha = tl.exp2(m - m_use)
    if EXP2_POLY:
        p = exp2_poly3(s - m_use[:, None])
        if MASKED:
            p = tl.where(s == float("-inf"), 0.0, p)            # the polynomial never returns 0
    else:
        p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, 1)
    if RESCALE_THRESHOLD > 0:
        if tl.max(grow.to(tl.int32), 0) > 0:                    # skipped when no row's max moved
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l, acc


@triton.jit
def state_epilogue(m, l, acc):
    """(o, natural-log lse) from the base-2 running state (m, l, acc): o = acc / l and
    lse = (m + log2 l) · ln 2; rows with l = 0 (no key) give the empty state o = 0,
    lse = -inf. log2 is never evaluated at 0."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    lse = tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return acc / l_safe[:, None], lse


@triton.jit
def merge_max(m):
    """The shift M of a merge: the largest LSE, or 0 when every state is empty (-inf), so
    that each weight e^{lse - M} is 0 for an empty state instead of e^{-inf + inf} = NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def merge_epilogue(m, total):
    """(1 / total, lse) of a merge whose weights e^{lse_p - m} sum to ``total``; the empty
    result (total = 0) gives (0, -inf). log is never evaluated at 0."""
    has = total > 0
    safe = tl.where(has, total, 1.0)
    return tl.where(has, 1.0 / safe, 0.0), tl.where(has, m + tl.log(safe), float("-inf"))

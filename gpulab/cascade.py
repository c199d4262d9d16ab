r"""Notebook 06: attention states, their merge, and cascade attention over a shared prefix.

**Attention state.** For a query q and a set I of keys/values, the *state* is the pair

    lse_I = log Σ_{j∈I} exp(s_j),          o_I = Σ_{j∈I} exp(s_j − lse_I) · v_j,

with s_j = scale · q · k_j (lse: float32, natural log; the empty set has lse = −inf and
o = 0). Attention over I ∪ J (disjoint) follows from the two states alone:

    lse = log(e^{lse_I} + e^{lse_J}),      o = (e^{lse_I} o_I + e^{lse_J} o_J) / e^{lse}

evaluated stably with M = max(lse_I, lse_J): w_I = e^{lse_I − M}, w_J = e^{lse_J − M},
o = (w_I o_I + w_J o_J)/(w_I + w_J), lse = M + log(w_I + w_J). The merge is commutative
and associative, with the empty state as its identity; if both states are empty the
result is empty (o = 0, lse = −inf), never NaN.

FlashInfer's ``merge_state`` uses base-2 LSE (``lse2 = m·log2 e + log2 d``): convert
with ``lse2 = lse / ln 2`` and ``lse = lse2 · ln 2`` (empty states stay −inf).

**Cascade attention.** B requests share one prefix of P tokens (a system prompt, a
document) and each has its own suffix. Per kv head, non-cascade paged decode reads the
prefix's KV once *per request*: B·P·Hkv·D·2 elements. Cascade attention splits the
key set into prefix ∪ suffix:

1. a multi-query kernel takes the queries of all B requests (and all G query heads
   of a kv head) as the rows of one matrix and streams the prefix's KV once for all
   of them (a prefill-style tile loop with ``tl.dot``): prefix states;
2. paged decode over each request's own suffix: suffix states;
3. merge the two states per (request, head).

The prefix is then read once instead of B times, and its arithmetic runs on tensor
cores at B·G rows per tile instead of G.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import paged, runtime
from .attention import merge_states_reference as _merge_two_reference
from .paged import LN2, LOG2E
from .harness.spec import Case, KernelSpec, bytes_of, randn
from .validate import require_float, require_same_device, require_tensor

# =========================================================================================
# References (float64)
# =========================================================================================
# Two states: notebook 04's float64 reference (empty states, lse = -inf, are the identity).
merge_state_reference = _merge_two_reference


def merge_states_reference(o_states, lse_states):
    """Merge S states: o_states [N, S, H, D], lse_states [N, S, H] -> o [N, H, D], lse [N, H]."""
    return paged.split_reduce_reference(o_states.transpose(1, 2), lse_states.transpose(1, 2))


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """gpulab's natural-log LSE -> FlashInfer's base-2 LSE."""
    return lse / LN2


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 LSE -> gpulab's natural-log LSE."""
    return lse2 * LN2


def prefix_kv(k_cache, v_cache, prefix_pages, prefix_len: int):
    """The shared prefix's keys and values, contiguous [prefix_len, Hkv, D]."""
    return paged.gather_kv(k_cache, v_cache, prefix_pages[None, :], prefix_len, 0)


def shared_prefix_reference(q, k_cache, v_cache, prefix_pages, prefix_len, scale=None, **_):
    """Every query's state over the shared prefix only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = prefix_kv(k_cache, v_cache, prefix_pages, int(prefix_len))
    states = [paged.attention_state_reference(q[b], k, v, scale) for b in range(q.shape[0])]
    return {"o": torch.stack([s[0] for s in states]), "lse": torch.stack([s[1] for s in states])}


def cascade_reference(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                      scale=None, **_):
    """Plain attention of request b's query over prefix ++ suffix_b (no merging)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kp, vp = prefix_kv(k_cache, v_cache, prefix_pages, int(prefix_len))
    outs, lses = [], []
    for b in range(q.shape[0]):
        ks, vs = paged.gather_kv(k_cache, v_cache, block_table, int(seq_lens[b]), b)
        o, lse = paged.attention_state_reference(q[b], torch.cat([kp, ks]), torch.cat([vp, vs]), scale)
        outs.append(o)
        lses.append(lse)
    return {"o": torch.stack(outs), "lse": torch.stack(lses)}


# =========================================================================================
# Triton kernels
# =========================================================================================
@triton.jit
def _merge_state_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, n_rows, head_dim,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_R rows (one row = one (token, head) state of head_dim values) per program."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_mask = r < n_rows
    mask = r_mask[:, None] & (d[None, :] < head_dim)
    la = tl.load(la_ptr + r, mask=r_mask, other=float("-inf"))
    lb = tl.load(lb_ptr + r, mask=r_mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)      # both empty: both weights become 0
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = wa + wb
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    offs = r[:, None] * head_dim + d[None, :]
    oa = tl.load(oa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = (oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None])
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(l_ptr + r, tl.where(total > 0, m + tl.log(total), float("-inf")), mask=r_mask)


@triton.jit
def _shared_prefix_kernel(
        q_ptr, k_ptr, v_ptr, pages_ptr, o_ptr, lse_ptr, qk_scale,
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh, stride_ls,
        n_rows, prefix_len, part_len, page_size, head_dim,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Multi-query attention over the shared prefix. Rows of the query tile are
    (request, query head of kv head pid(1)) pairs: row r is request r // GROUP, head
    kvh·GROUP + r % GROUP. pid(2) picks a partition of the prefix."""
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_mask = r < n_rows
    d_mask = d < head_dim
    b = r // GROUP
    head = kvh * GROUP + r % GROUP
    q = tl.load(q_ptr + b[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    start = split * part_len
    end = tl.minimum(prefix_len, start + part_len)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        page = tl.load(pages_ptr + t // page_size, mask=t_mask, other=0)
        m, l, acc = paged.paged_block_update(
            q, m, l, acc, k_ptr, v_ptr, page, t % page_size, t_mask, d, d_mask, kvh,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
            UPCAST, IEEE)
    out, lse = paged.finish_state(m, l, acc)
    tl.store(o_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + split * stride_ls, lse, mask=r_mask)


# (BLOCK_M, BLOCK_N, warps, stages): the first list fits sm_75's 64 KiB of shared memory,
# the second is for sm_80+ (see gpulab.paged.big_smem).
_PREFIX_SMALL = ((64, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 3))
_PREFIX_SMALL_FP32 = ((32, 32, 4, 2), (32, 32, 2, 2))
_PREFIX_BIG = ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
               (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4))

_prefix_tuned = paged._autotuned(
    _shared_prefix_kernel,
    {"small": _PREFIX_SMALL, "small_fp32": _PREFIX_SMALL_FP32, "big": _PREFIX_BIG},
    lambda bm, bn, w, st: triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st),
    key=["GROUP", "BLOCK_D", "UPCAST", "IEEE"], interp=(32, 32, 4, 1))

_PLAN_BLOCK_M = 128   # the tile height assumed when planning prefix partitions


def plan_prefix_splits(n_rows: int, kv_heads: int, prefix_len: int, num_sms: int | None = None):
    """(num_splits, part_len) for the prefix kernel: enough programs for every SM, in
    a number of waves that leaves few SMs idle, partitions ≥ min_part_len() tokens."""
    sms = runtime.num_sms() if num_sms is None else num_sms
    bm = 32 if runtime.interpreting() else _PLAN_BLOCK_M if paged.big_smem() else 64
    programs = max(1, -(-n_rows // bm) * kv_heads)
    most = max(1, prefix_len // paged.min_part_len())
    best, best_eff = 1, 0.0
    for s in range(1, min(most, 64) + 1):
        total = programs * s
        waves = -(-total // sms)
        eff = total / (waves * sms)
        if eff > best_eff + 0.05:
            best, best_eff = s, eff
        if total >= sms and eff >= 0.9:
            best = s
            break
    return paged.fixed_splits(prefix_len, best)


def prefix_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len, o_part, lse_part,
                         part_len: int, scale=None):
    """Launch the multi-query prefix kernel writing o_part.shape[2] partial states."""
    B, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    splits = o_part.shape[2]
    if B == 0 or splits == 0:
        return
    n_rows = B * group
    grid = lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]), hkv, splits)  # noqa: E731
    _prefix_tuned[paged.config_list(q.dtype)][grid](
        q, k_cache, v_cache, prefix_pages, o_part, lse_part, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        n_rows, prefix_len, part_len, k_cache.shape[1], d,
        GROUP=group, BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=runtime.interpreting() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32)


# -- launchers (no validation) -------------------------------------------------------------
def merge_state_into(o_a, lse_a, o_b, lse_b, o, lse):
    rows = lse.numel()
    d = o.shape[-1]
    if rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, 4096 // block_d))
    _merge_state_kernel[(triton.cdiv(rows, block_r),)](o_a, lse_a, o_b, lse_b, o, lse, rows, d,
                                                        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)


def merge_states_into(o_states, lse_states, o, lse):
    """o_states [N, S, H, D], lse_states [N, S, H] -> o [N, H, D], lse [N, H] (split-KV reduce)."""
    paged.split_reduce_into(o_states.transpose(1, 2), lse_states.transpose(1, 2), o, lse)


def shared_prefix_into(q, k_cache, v_cache, prefix_pages, prefix_len, o, lse, scale=None):
    """Every query's state over the shared prefix (partitions planned, then reduced)."""
    B, hq, d = q.shape
    splits, part = plan_prefix_splits(B * (hq // k_cache.shape[2]), k_cache.shape[2], prefix_len)
    if splits == 1:
        prefix_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len,
                             o[:, :, None, :], lse[:, :, None], part, scale)
        return
    o_part = torch.empty((B, hq, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, hq, splits), dtype=torch.float32, device=q.device)
    prefix_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len, o_part, lse_part, part, scale)
    paged.split_reduce_into(o_part, lse_part, o, lse)


def cascade_decode_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                        o, lse, scale=None):
    """Prefix partitions and suffix partitions write into one buffer of partial
    states; a single reduce merges them all (so merge = split-KV reduce)."""
    B, hq, d = q.shape
    hkv = k_cache.shape[2]
    sp, part_p = plan_prefix_splits(B * (hq // hkv), hkv, prefix_len)
    capacity = block_table.shape[1] * k_cache.shape[1]
    ss, part_s = paged.plan_splits(B, hkv, capacity)
    o_part = torch.empty((B, hq, sp + ss, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, hq, sp + ss), dtype=torch.float32, device=q.device)
    prefix_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len,
                         o_part[:, :, :sp], lse_part[:, :, :sp], part_p, scale)
    paged.decode_partials_into(q, k_cache, v_cache, block_table, seq_lens,
                               o_part[:, :, sp:], lse_part[:, :, sp:], part_s, scale)
    paged.split_reduce_into(o_part, lse_part, o, lse)


# =========================================================================================
# Public functions
# =========================================================================================
def _check_state(name_o, o, name_l, lse):
    require_tensor(name_o, o)
    require_float(name_o, o)
    if o.dim() < 1:
        raise ValueError(f"{name_o} must have at least one dimension (head_dim last)")
    require_tensor(name_l, lse, shape=o.shape[:-1], dtype=torch.float32)


def merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets.

    o_a, o_b : [..., D] (same shape and dtype); lse_a, lse_b : float32 [...] (natural log,
    -inf for an empty state). Returns (o [..., D] in o_a's dtype, lse float32 [...]).
    """
    _check_state("o_a", o_a, "lse_a", lse_a)
    require_tensor("o_b", o_b, shape=o_a.shape, dtype=o_a.dtype)
    require_tensor("lse_b", lse_b, shape=lse_a.shape, dtype=torch.float32)
    require_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if not bool((lse_a != math.inf).all() and (lse_b != math.inf).all()) or \
            bool(torch.isnan(lse_a).any() or torch.isnan(lse_b).any()):
        raise ValueError("lse contains NaN or +inf: an LSE is finite, or -inf for an empty state")
    o = torch.empty_like(o_a)
    lse = torch.empty_like(lse_a)
    merge_state_into(o_a, lse_a, o_b, lse_b, o, lse)
    return o, lse


def merge_states(o_states, lse_states):
    """Merge S states per row: o_states [N, S, H, D], lse_states float32 [N, S, H]
    (FlashInfer's ``merge_states`` layout) -> (o [N, H, D], lse [N, H])."""
    require_tensor("o_states", o_states, ndim=4)
    require_float("o_states", o_states)
    require_tensor("lse_states", lse_states, shape=o_states.shape[:3], dtype=torch.float32)
    require_same_device(o_states=o_states, lse_states=lse_states)
    if o_states.shape[1] == 0:
        raise ValueError("o_states has no states to merge (dim 1 is 0)")
    n, _, h, d = o_states.shape
    o = torch.empty((n, h, d), dtype=o_states.dtype, device=o_states.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=o_states.device)
    merge_states_into(o_states, lse_states, o, lse)
    return o, lse


def _check_prefix(k_cache, prefix_pages, prefix_len):
    require_tensor("prefix_pages", prefix_pages, ndim=1, dtype=torch.int32)
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or prefix_len < 0:
        raise ValueError(f"prefix_len must be a non-negative int, got {prefix_len!r}")
    ps, num_pages = k_cache.shape[1], k_cache.shape[0]
    need = -(-prefix_len // ps)
    if need > prefix_pages.shape[0]:
        raise ValueError(f"prefix_len {prefix_len} needs {need} pages of {ps} tokens, "
                         f"but prefix_pages lists only {prefix_pages.shape[0]}")
    used = prefix_pages[:need]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        j = int(((used < 0) | (used >= num_pages)).nonzero()[0, 0])
        raise IndexError(f"prefix_pages[{j}] = {int(used[j])} is not a page of the cache "
                         f"(valid pages: 0..{num_pages - 1})")


def shared_prefix_attention(q, k_cache, v_cache, prefix_pages, prefix_len: int, scale=None):
    """Each query's attention state over one shared, paged prefix: (o [B, Hq, D], lse [B, Hq])."""
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
    empty_bt = torch.zeros((B, 1), dtype=torch.int32, device=getattr(q, "device", None))
    paged.require_paged_inputs(q, k_cache, v_cache, empty_bt,
                             torch.zeros(B, dtype=torch.int32, device=empty_bt.device))
    require_same_device(q=q, prefix_pages=prefix_pages)
    _check_prefix(k_cache, prefix_pages, prefix_len)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if B:
        shared_prefix_into(q, k_cache, v_cache, prefix_pages, prefix_len, o, lse, scale)
    return o, lse


def cascade_decode_attention(q, k_cache, v_cache, prefix_pages, prefix_len: int, block_table,
                             seq_lens, scale: float | None = None, return_lse: bool = False):
    """Decode attention for B requests that share a prefix, the prefix read once.

    Parameters
    ----------
    q : [B, Hq, D], one query token per request.
    k_cache, v_cache : [num_pages, page_size, Hkv, D] paged cache holding everything.
    prefix_pages : int32 [n]: the shared prefix's pages, in order (the last may be partial).
    prefix_len : tokens in the shared prefix (≤ n · page_size).
    block_table, seq_lens : each request's own suffix, as in
        :func:`gpulab.paged.paged_decode_attention` (seq_lens may be 0).

    Returns o [B, Hq, D] (and lse [B, Hq] if ``return_lse``): attention of request b over
    prefix ++ suffix_b.
    """
    paged.require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens)
    require_same_device(q=q, prefix_pages=prefix_pages)
    _check_prefix(k_cache, prefix_pages, prefix_len)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if q.shape[0]:
        cascade_decode_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                            o, lse, scale)
    return (o, lse) if return_lse else o


# =========================================================================================
# Specs
# =========================================================================================
def make_states(p, dtype, device, gen):
    """Two states per (row, head) with a wide LSE spread (exp without a max overflows)
    and empty states (-inf, o = 0) on either side, sometimes both."""
    n, h, d = p["n"], p["h"], p["d"]
    out = {}
    for side, off in (("a", 20.0), ("b", -10.0)):
        o = randn((n, h, d), torch.float32, device, gen)
        lse = randn((n, h), torch.float32, device, gen, scale=p.get("spread", 40.0), offset=off)
        empty = torch.rand((n, h), generator=gen, device=device) < p.get("empty", 0.2)
        lse = torch.where(empty, -math.inf, lse)
        out[f"o_{side}"] = torch.where(empty[..., None], 0.0, o).to(dtype)
        out[f"lse_{side}"] = lse
    if p.get("both_empty") and n * h:
        out["lse_a"][0, 0] = -math.inf
        out["lse_b"][0, 0] = -math.inf
        out["o_a"][0, 0] = 0
        out["o_b"][0, 0] = 0
    return {"o_a": out["o_a"], "lse_a": out["lse_a"], "o_b": out["o_b"], "lse_b": out["lse_b"]}


MERGE = KernelSpec(
    name="merge_state",
    expected_fp_warnings=("divide",),   # log(0) = -inf: an empty state, in the interpreter
    summary="merge two attention states (o, lse) over disjoint key sets",
    args=("o_a", "lse_a", "o_b", "lse_b", "o", "lse"),
    make_inputs=make_states,
    reference=merge_state_reference,
    outputs=lambda inp, dtype: {"o": (inp["o_a"].shape, dtype), "lse": (inp["lse_a"].shape, torch.float32)},
    implementation=merge_state_into,
    cases={
        "cpu": [Case("one state", dict(n=1, h=1, d=16, empty=0.0)),
                Case("empty states", dict(n=5, h=3, d=24, empty=0.4, both_empty=True)),
                Case("wide spread", dict(n=37, h=4, d=128, spread=80.0))],
        "gpu": [Case("one state", dict(n=1, h=1, d=16, empty=0.0)),
                Case("empty states", dict(n=5, h=3, d=24, empty=0.4, both_empty=True)),
                Case("batch", dict(n=1000, h=32, d=128, spread=80.0))],
        "bench": [Case("256 x 32 x 128", dict(n=256, h=32, d=128, empty=0.0)),
                  Case("8192 x 32 x 128", dict(n=8192, h=32, d=128, empty=0.0))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    bytes_moved=lambda p, dt: p["n"] * p["h"] * (3 * p["d"] * bytes_of(dt) + 12),
    baselines={"torch": lambda inp: _torch_merge(inp)},
    read_inputs=("o_a", "lse_a", "o_b", "lse_b"),
    bench_dtypes=[torch.bfloat16],
)


def _torch_merge(inp):
    lse = torch.logaddexp(inp["lse_a"], inp["lse_b"])
    wa = torch.exp(inp["lse_a"] - lse)[..., None]
    wb = torch.exp(inp["lse_b"] - lse)[..., None]
    return (wa * inp["o_a"] + wb * inp["o_b"]).to(inp["o_a"].dtype), lse


def make_multi_states(p, dtype, device, gen):
    n, s, h, d = p["n"], p["s"], p["h"], p["d"]
    parts = paged.make_partials(dict(b=n, h=s, s=h, d=d, empty=p.get("empty", 0.25),
                                     all_empty_row=p.get("all_empty_row", False)),
                                dtype, device, gen)
    # make_partials builds [B, H, S, D]-shaped data; here dims 1 and 2 are (states, heads)
    return {"o_states": parts["o_part"].to(dtype), "lse_states": parts["lse_part"]}


MERGE_STATES = KernelSpec(
    name="merge_states",
    summary="merge S attention states per row (FlashInfer's merge_states layout)",
    args=("o_states", "lse_states", "o", "lse"),
    make_inputs=make_multi_states,
    reference=merge_states_reference,
    outputs=lambda inp, dtype: {"o": ((inp["o_states"].shape[0],) + tuple(inp["o_states"].shape[2:]), dtype),
                                "lse": ((inp["o_states"].shape[0], inp["o_states"].shape[2]), torch.float32)},
    implementation=merge_states_into,
    cases={
        "cpu": [Case("one state", dict(n=1, s=1, h=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(n=3, s=5, h=6, d=24)),
                Case("many states", dict(n=2, s=17, h=4, d=128))],
        "gpu": [Case("one state", dict(n=1, s=1, h=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(n=33, s=5, h=6, d=24)),
                Case("many states", dict(n=256, s=17, h=32, d=128))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    read_inputs=("o_states", "lse_states"),
)


def make_cascade_inputs(p, dtype, device, gen):
    """A shared prefix of ``prefix`` tokens and per-request suffixes of ``lens`` tokens,
    all in one pool of shuffled pages. With ``full=True`` (benchmarks) also the block
    tables of the same requests without sharing (prefix pages ++ suffix pages), for
    the non-cascade baseline."""
    ps = p["page"]
    P = p["prefix"]
    n_pre = -(-P // ps)
    base = paged.make_paged_inputs({**p, "spare": p.get("spare", 2) + n_pre}, dtype, device, gen)
    total = base["k_cache"].shape[0]
    # The suffix pages are perm[:sum]; the prefix takes pages from the spare ones.
    n_suffix_pages = sum(-(-n // ps) for n in p["lens"])
    in_use = torch.zeros(total, dtype=torch.bool, device=device)
    for b, n in enumerate(p["lens"]):
        in_use[base["block_table"][b, :-(-n // ps)].long()] = True
    free = (~in_use).nonzero().flatten()
    pick = free[torch.randperm(free.numel(), generator=gen, device=device)[:n_pre]]
    assert pick.numel() == n_pre and n_suffix_pages + n_pre <= total
    inputs = {"q": base["q"], "k_cache": base["k_cache"], "v_cache": base["v_cache"],
              "prefix_pages": pick.to(torch.int32), "prefix_len": P,
              "block_table": base["block_table"], "seq_lens": base["seq_lens"]}
    if p.get("full"):
        if P % ps:
            raise ValueError("the non-cascade baseline needs prefix % page == 0")
        bt = torch.cat([inputs["prefix_pages"][None, :].expand(len(p["lens"]), -1),
                        base["block_table"]], dim=1).contiguous()
        inputs["full_block_table"] = bt
        inputs["full_seq_lens"] = base["seq_lens"] + P
    return inputs


def _noncascade_baseline(inp):
    """gpulab's paged decode on the same requests, each reading the prefix itself."""
    q = inp["q"]
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    paged.paged_decode_into(q, inp["k_cache"], inp["v_cache"], inp["full_block_table"],
                            inp["full_seq_lens"], o, lse)
    return o


def _cascade_bytes(p, dtype):
    kv = (p["prefix"] + sum(p["lens"])) * p["hkv"] * p["d"] * 2
    return (kv + 2 * len(p["lens"]) * p["hq"] * p["d"]) * bytes_of(dtype)


def _cascade_flops(p, dtype):
    return 4 * p["hq"] * p["d"] * (len(p["lens"]) * p["prefix"] + sum(p["lens"]))


def _bench_lens(n, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, hi + 1, (n,), generator=g).tolist()


_CASCADE_CPU = [
    Case("one request", dict(prefix=20, lens=[3], page=16, hq=4, hkv=2, d=16)),
    Case("ragged suffixes, partial prefix page",
         dict(prefix=37, lens=[0, 1, 16, 17, 40], page=16, hq=4, hkv=2, d=16)),
    Case("MHA, D=24, page 5", dict(prefix=23, lens=[5, 11, 2], page=5, hq=3, hkv=3, d=24)),
    Case("no prefix", dict(prefix=0, lens=[4, 9], page=8, hq=4, hkv=1, d=32)),
]
_CASCADE_GPU = [
    Case("one request", dict(prefix=20, lens=[3], page=16, hq=32, hkv=8, d=128)),
    Case("ragged suffixes, partial prefix page",
         dict(prefix=3000 + 7, lens=[0, 1, 16, 17, 256] * 9, page=16, hq=32, hkv=8, d=128)),
    Case("MHA, D=24, page 5", dict(prefix=2323, lens=[5, 11, 2], page=5, hq=3, hkv=3, d=24)),
    Case("no prefix", dict(prefix=0, lens=[4, 900], page=8, hq=4, hkv=1, d=64)),
    Case("long prefix, many requests", dict(prefix=16384, lens=_bench_lens(130, 256), page=16,
                                            hq=32, hkv=8, d=128)),
]

CASCADE = KernelSpec(
    name="cascade_decode_attention",
    expected_fp_warnings=("divide",),   # log(0) = -inf: an empty state, in the interpreter
    graph_timing=True,
    summary="decode for requests sharing a prefix: prefix read once (multi-query), suffixes paged, merged",
    args=("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_cascade_inputs,
    reference=cascade_reference,
    outputs=paged._decode_outputs,
    implementation=cascade_decode_into,
    cases={
        "cpu": _CASCADE_CPU,
        "gpu": _CASCADE_GPU,
        # The sizes first (GQA 32/8 and MHA 32/32), then a sweep over batch and
        # prefix length for the speed-up plot of notebook 06.
        "bench": [Case(f"P{P} B{B} {hq}/{hkv}",
                       dict(prefix=P, lens=_bench_lens(B, 256), page=16, hq=hq, hkv=hkv, d=128,
                            spare=0, pad=0, full=True))
                  for P, B, hq, hkv in ((32768, 256, 32, 8), (32768, 256, 32, 32), (32768, 64, 32, 8),
                                        (32768, 16, 32, 8), (8192, 256, 32, 8), (8192, 64, 32, 8),
                                        (8192, 16, 32, 8), (2048, 256, 32, 8))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=paged._DECODE_TOL,
    output_tolerances={"lse": paged._LSE_TOL},
    bytes_moved=_cascade_bytes,
    flops=_cascade_flops,
    baselines={"paged decode (no cascade)": _noncascade_baseline},
    compile_baselines=False,   # the baseline is gpulab's own Triton kernel
    read_inputs=("q", "k_cache", "v_cache"),
    bench_dtypes=[torch.bfloat16],
    notes="baseline: gpulab's paged decode on the same requests, prefix pages in every block table",
)


def _prefix_outputs(inp, dtype):
    B, hq, d = inp["q"].shape
    return {"o": ((B, hq, d), dtype), "lse": ((B, hq), torch.float32)}


SHARED_PREFIX = KernelSpec(
    name="shared_prefix_attention",
    summary="multi-query attention of all requests' queries over one shared paged prefix",
    args=("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "o", "lse"),
    make_inputs=make_cascade_inputs,
    reference=shared_prefix_reference,
    outputs=_prefix_outputs,
    implementation=shared_prefix_into,
    cases={"cpu": _CASCADE_CPU[:3], "gpu": _CASCADE_GPU[1:3] + _CASCADE_GPU[4:]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=paged._DECODE_TOL,
    output_tolerances={"lse": paged._LSE_TOL},
    read_inputs=("q", "k_cache", "v_cache"),
)

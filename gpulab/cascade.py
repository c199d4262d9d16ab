r"""Notebook 06: attention states, their merge, and cascade attention over a shared prefix.

**Attention state.** For a query q and a set I of keys/values, the *state* is the pair

    lse_I = log Σ_{j∈I} exp(s_j),          o_I = Σ_{j∈I} exp(s_j − lse_I) · v_j,

with s_j = scale · q · k_j (lse: float32, natural log; the empty set has lse = −inf and
o = 0; the convention of :mod:`gpulab.attention_state`). Attention over I ∪ J (disjoint)
follows from the two states alone:

    lse = log(e^{lse_I} + e^{lse_J}),      o = (e^{lse_I} o_I + e^{lse_J} o_J) / e^{lse}

evaluated stably with M = max(lse_I, lse_J): w_I = e^{lse_I − M}, w_J = e^{lse_J − M},
o = (w_I o_I + w_J o_J)/(w_I + w_J), lse = M + log(w_I + w_J). The merge is commutative
and associative, with the empty state as its identity; if both states are empty the
result is empty (o = 0, lse = −inf), never NaN.

FlashInfer's ``merge_state`` uses base-2 LSE (``lse2 = m·log2 e + log2 d``): convert
with ``lse_to_base2`` and ``lse_from_base2`` (empty states stay −inf).

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
cores at B·G rows per tile instead of G. Like paged decode, the public functions read no
device data unless asked (``validate=True``, ``GPULAB_DEBUG=1``); a bad prefix page or
block-table entry is clamped into the pool by the kernels (no read outside the cache; the
output is then wrong) and recorded in :func:`gpulab.paged.fault_flag`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .attention_state import LOG2E, attention_state_reference, merge_epilogue, merge_max, state_epilogue
from .attention_state import lse_from_base2, lse_to_base2  # noqa: F401  (the notebook's conversions)
from .paged import (autotuned_variants, big_smem, config_list, decode_partials_into, decode_partitioning,
                    fault_flag, fixed_splits, gather_kv, keep_or_allocate, min_part_len,
                    paged_tile_update, raise_recorded_faults, require_block_table,
                    require_paged_inputs, require_paged_layout, require_plan_shapes,
                    require_query_and_cache, require_run_inputs, require_scale, split_reduce_into)
from .validate import require_float, require_same_device, require_tensor


# =========================================================================================
# References (float64)
# =========================================================================================
def prefix_kv(k_cache, v_cache, prefix_pages, prefix_len: int):
    """The shared prefix's keys and values, contiguous [prefix_len, Hkv, D]."""
    return gather_kv(k_cache, v_cache, prefix_pages[None, :], prefix_len, 0)


def shared_prefix_reference(q, k_cache, v_cache, prefix_pages, prefix_len, scale=None, **_):
    """Every query's state over the shared prefix only."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = prefix_kv(k_cache, v_cache, prefix_pages, int(prefix_len))
    states = [attention_state_reference(q[b], k, v, scale) for b in range(q.shape[0])]
    return {"o": torch.stack([s[0] for s in states]), "lse": torch.stack([s[1] for s in states])}


def cascade_reference(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                      scale=None, **_):
    """Plain attention of request b's query over prefix ++ suffix_b (no merging)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kp, vp = prefix_kv(k_cache, v_cache, prefix_pages, int(prefix_len))
    outs, lses = [], []
    for b in range(q.shape[0]):
        ks, vs = gather_kv(k_cache, v_cache, block_table, int(seq_lens[b]), b)
        o, lse = attention_state_reference(q[b], torch.cat([kp, ks]), torch.cat([vp, vs]), scale)
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
    m = merge_max(tl.maximum(la, lb))
    wa = tl.exp(la - m)                             # 0 for an empty state
    wb = tl.exp(lb - m)
    inv, lse = merge_epilogue(m, wa + wb)
    offs = r[:, None] * head_dim + d[None, :]
    oa = tl.load(oa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(l_ptr + r, lse, mask=r_mask)


@triton.jit
def _shared_prefix_kernel(
        q_ptr, k_ptr, v_ptr, pages_ptr, o_ptr, lse_ptr, fault_ptr, qk_scale,
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh, stride_ls,
        n_rows, prefix_len, part_len, head_dim, num_pages,
        PAGE_SIZE: tl.constexpr,        # constant: t // PAGE_SIZE is a shift, not a division
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
    bad_pages = tl.zeros([BLOCK_N], tl.int32)   # summed once after the loop (see paged_tile_update)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        page = tl.load(pages_ptr + t // PAGE_SIZE, mask=t_mask, other=0)
        m, l, acc, n_bad = paged_tile_update(
            m, l, acc, q, k_ptr, v_ptr, page, t % PAGE_SIZE, t_mask, d, d_mask, kvh, num_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
            UPCAST, IEEE)
        bad_pages += n_bad
    if tl.sum(bad_pages, 0) > 0:
        tl.atomic_or(fault_ptr, 4)                 # FAULT_PREFIX_PAGE (see gpulab.paged.fault_flag)
    out, lse = state_epilogue(m, l, acc)
    tl.store(o_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + split * stride_ls, lse, mask=r_mask)


# (BLOCK_M, BLOCK_N, warps, stages): the first list fits sm_75's 64 KiB of shared memory,
# the second is for sm_80+ (see gpulab.paged.big_smem).
_PREFIX_SMALL = ((64, 32, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 3))
_PREFIX_SMALL_FP32 = ((32, 32, 4, 2), (32, 32, 2, 2))
_PREFIX_BIG = ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
               (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4))

_prefix_tuned = autotuned_variants(
    _shared_prefix_kernel,
    {"small": _PREFIX_SMALL, "small_fp32": _PREFIX_SMALL_FP32, "big": _PREFIX_BIG},
    lambda bm, bn, w, st: triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st),
    key=["GROUP", "BLOCK_D", "UPCAST", "IEEE"], interp=(32, 32, 4, 1))

PLAN_BLOCK_M = 128   # the tile height assumed when planning prefix partitions


def plan_prefix_splits(n_rows: int, kv_heads: int, prefix_len: int, num_sms: int | None = None):
    """(num_splits, part_len) for the prefix kernel: enough programs for every SM, in
    a number of waves that leaves few SMs idle, partitions ≥ min_part_len() tokens."""
    sms = runtime.num_sms() if num_sms is None else num_sms
    bm = 32 if runtime.interpreting() else PLAN_BLOCK_M if big_smem() else 64
    programs = max(1, -(-n_rows // bm) * kv_heads)
    most = max(1, prefix_len // min_part_len())
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
    return fixed_splits(prefix_len, best)


# =========================================================================================
# Launchers (no validation)
# =========================================================================================
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
    grid = lambda meta: (runtime.cdiv(n_rows, meta["BLOCK_M"]), hkv, splits)  # noqa: E731
    block_d = max(16, runtime.next_power_of_2(d))
    upcast, ieee = runtime.interpreting() and q.dtype == torch.bfloat16, q.dtype == torch.float32
    runtime.launch_tuned(
        _prefix_tuned[config_list(q.dtype)], grid, (q.dtype, o_part.dtype, group, block_d, upcast, ieee),
        q, k_cache, v_cache, prefix_pages, o_part, lse_part, fault_flag(q.device), scale * LOG2E,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],   # tuples: fewer calls into torch
        *o_part.stride()[:3], *lse_part.stride()[:3],
        n_rows, prefix_len, part_len, d, k_cache.shape[0], PAGE_SIZE=k_cache.shape[1],
        GROUP=group, BLOCK_D=block_d, UPCAST=upcast, IEEE=ieee)


def merge_state_into(o_a, lse_a, o_b, lse_b, o, lse):
    """Launcher of the two-state merge: rows of o_* [..., D] and lse_* [...] (contiguous)."""
    rows = lse.numel()
    d = o.shape[-1]
    if rows == 0:
        return
    block_d = runtime.next_power_of_2(d)
    block_r = max(1, min(64, 4096 // block_d))
    _merge_state_kernel[(runtime.cdiv(rows, block_r),)](o_a, lse_a, o_b, lse_b, o, lse, rows, d,
                                                        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)


def merge_states_into(o_states, lse_states, o, lse):
    """o_states [N, S, H, D], lse_states [N, S, H] -> o [N, H, D], lse [N, H] (split-KV reduce)."""
    split_reduce_into(o_states.transpose(1, 2), lse_states.transpose(1, 2), o, lse)


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
    split_reduce_into(o_part, lse_part, o, lse)


def cascade_partitioning(batch: int, num_qo_heads: int, num_kv_heads: int, prefix_len: int,
                         suffix_capacity: int):
    """((prefix splits, prefix part_len), (suffix splits, suffix part_len)) of a cascade launch."""
    prefix = plan_prefix_splits(batch * (num_qo_heads // num_kv_heads), num_kv_heads, prefix_len)
    return prefix, decode_partitioning(batch, num_kv_heads, suffix_capacity)


def cascade_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                          o_part, lse_part, prefix_part: tuple, suffix_part: tuple, scale=None):
    """Prefix partitions into o_part[:, :, :sp] and suffix partitions into the rest."""
    sp, part_p = prefix_part
    prefix_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len,
                         o_part[:, :, :sp], lse_part[:, :, :sp], part_p, scale)
    decode_partials_into(q, k_cache, v_cache, block_table, seq_lens,
                         o_part[:, :, sp:], lse_part[:, :, sp:], suffix_part[1], scale)


def cascade_decode_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                        o, lse, scale=None):
    """Prefix partitions and suffix partitions write into one buffer of partial
    states; a single reduce merges them all (so merge = split-KV reduce)."""
    B, hq, d = q.shape
    prefix_part, suffix_part = cascade_partitioning(B, hq, k_cache.shape[2], prefix_len,
                                                    block_table.shape[1] * k_cache.shape[1])
    splits = prefix_part[0] + suffix_part[0]
    o_part = torch.empty((B, hq, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, hq, splits), dtype=torch.float32, device=q.device)
    cascade_partials_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                          o_part, lse_part, prefix_part, suffix_part, scale)
    split_reduce_into(o_part, lse_part, o, lse)


# =========================================================================================
# Public API: validation, functions, plan/run
# =========================================================================================
def require_attention_state(name_o, o, name_l, lse) -> None:
    """An attention state: o [..., D] float, lse float32 [...] (host-side checks)."""
    require_tensor(name_o, o)
    require_float(name_o, o)
    if o.dim() < 1:
        raise ValueError(f"{name_o} must have at least one dimension (head_dim last)")
    require_tensor(name_l, lse, shape=o.shape[:-1], dtype=torch.float32)


def require_lse_values(**lses) -> None:
    """Every LSE finite or -inf (an empty state): reads device data, a host sync."""
    for name, lse in lses.items():
        if bool(torch.isnan(lse).any() | torch.isposinf(lse).any()):
            raise ValueError(f"{name} contains NaN or +inf: an LSE is finite, or -inf for an empty state")


def merge_state(o_a, lse_a, o_b, lse_b, validate: bool | None = None):
    """Merge two attention states over disjoint key sets.

    o_a, o_b : [..., D] (same shape and dtype); lse_a, lse_b : float32 [...] (natural log,
    -inf for an empty state). Returns (o [..., D] in o_a's dtype, lse float32 [...]).
    ``validate`` (default: :func:`gpulab.runtime.debug_checks`) also rejects NaN or +inf
    LSEs, which reads device data.
    """
    require_attention_state("o_a", o_a, "lse_a", lse_a)
    require_tensor("o_b", o_b, shape=o_a.shape, dtype=o_a.dtype)
    require_tensor("lse_b", lse_b, shape=lse_a.shape, dtype=torch.float32)
    require_same_device(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if runtime.debug_checks() if validate is None else validate:
        require_lse_values(lse_a=lse_a, lse_b=lse_b)
    o = torch.empty_like(o_a)
    lse = torch.empty_like(lse_a)
    merge_state_into(o_a, lse_a, o_b, lse_b, o, lse)
    return o, lse


def merge_states(o_states, lse_states, validate: bool | None = None):
    """Merge S states per row: o_states [N, S, H, D], lse_states float32 [N, S, H]
    (FlashInfer's ``merge_states`` layout) -> (o [N, H, D], lse [N, H])."""
    require_tensor("o_states", o_states, ndim=4)
    require_float("o_states", o_states)
    require_tensor("lse_states", lse_states, shape=o_states.shape[:3], dtype=torch.float32)
    require_same_device(o_states=o_states, lse_states=lse_states)
    if o_states.shape[1] == 0:
        raise ValueError("o_states has no states to merge (dim 1 is 0)")
    if runtime.debug_checks() if validate is None else validate:
        require_lse_values(lse_states=lse_states)
    n, _, h, d = o_states.shape
    o = torch.empty((n, h, d), dtype=o_states.dtype, device=o_states.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=o_states.device)
    merge_states_into(o_states, lse_states, o, lse)
    return o, lse


def require_prefix(prefix_pages, prefix_len, page_size: int) -> None:
    """The prefix's page list and length agree (host-side: shapes only)."""
    require_tensor("prefix_pages", prefix_pages, ndim=1, dtype=torch.int32)
    if not isinstance(prefix_len, int) or isinstance(prefix_len, bool) or prefix_len < 0:
        raise ValueError(f"prefix_len must be a non-negative int, got {prefix_len!r}")
    need = -(-prefix_len // page_size)
    if need > prefix_pages.shape[0]:
        raise ValueError(f"prefix_len {prefix_len} needs {need} pages of {page_size} tokens, "
                         f"but prefix_pages lists only {prefix_pages.shape[0]}")


def require_prefix_pages(prefix_pages, prefix_len: int, page_size: int, num_pages: int) -> None:
    """Every page the prefix uses is a page of the pool: reads device data, a host sync."""
    used = prefix_pages[:-(-prefix_len // page_size)]
    if used.numel():
        bad = (used < 0) | (used >= num_pages)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise IndexError(f"prefix_pages[{j}] = {int(used[j])} is not a page of the cache "
                             f"(valid pages: 0..{num_pages - 1})")


def shared_prefix_attention(q, k_cache, v_cache, prefix_pages, prefix_len: int, scale=None,
                            validate: bool | None = None):
    """Each query's attention state over one shared, paged prefix: (o [B, Hq, D], lse [B, Hq])."""
    require_query_and_cache(q, k_cache, v_cache)
    B = q.shape[0]
    require_same_device(q=q, prefix_pages=prefix_pages)
    require_prefix(prefix_pages, prefix_len, k_cache.shape[1])
    require_scale(scale)
    if runtime.debug_checks() if validate is None else validate:
        raise_recorded_faults(q.device)
        require_prefix_pages(prefix_pages, prefix_len, k_cache.shape[1], k_cache.shape[0])
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if B:
        shared_prefix_into(q, k_cache, v_cache, prefix_pages, prefix_len, o, lse, scale)
    return o, lse


def cascade_decode_attention(q, k_cache, v_cache, prefix_pages, prefix_len: int, block_table,
                             seq_lens, scale: float | None = None, return_lse: bool = False,
                             validate: bool | None = None):
    """Decode attention for B requests that share a prefix, the prefix read once.

    Parameters
    ----------
    q : [B, Hq, D], one query token per request.
    k_cache, v_cache : [num_pages, page_size, Hkv, D] paged cache holding everything.
    prefix_pages : int32 [n]: the shared prefix's pages, in order (the last may be partial).
    prefix_len : tokens in the shared prefix (≤ n · page_size).
    block_table, seq_lens : each request's own suffix, as in
        :func:`gpulab.paged.paged_decode_attention` (seq_lens may be 0).
    validate : check page ids and lengths (reads device data, a host sync); default
        :func:`gpulab.runtime.debug_checks`. Without it bad entries are clamped into range
        (no read outside the cache) and recorded.

    Returns o [B, Hq, D] (and lse [B, Hq] if ``return_lse``): attention of request b over
    prefix ++ suffix_b. :class:`CascadeDecodeWrapper` plans once and runs without syncs.
    """
    require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens)
    require_same_device(q=q, prefix_pages=prefix_pages)
    require_prefix(prefix_pages, prefix_len, k_cache.shape[1])
    require_scale(scale)
    if runtime.debug_checks() if validate is None else validate:
        raise_recorded_faults(q.device)
        require_prefix_pages(prefix_pages, prefix_len, k_cache.shape[1], k_cache.shape[0])
        require_paged_layout(block_table, seq_lens, k_cache.shape[1], k_cache.shape[0])
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if q.shape[0]:
        cascade_decode_into(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens,
                            o, lse, scale)
    return (o, lse) if return_lse else o


class CascadeDecodeWrapper:
    """Cascade decode planned once per batch layout and run without host syncs.

    :meth:`plan` validates the shared prefix's pages and the suffixes' block tables (the
    only reads of device data), chooses the prefix and suffix partitions and allocates the
    buffer of partial states and the outputs; :meth:`run` launches the prefix kernel, the
    suffix decode and one reduce: no host sync, no allocation, capturable in a CUDA graph.

    **What may change between runs without a new plan**: the contents of ``prefix_pages``,
    ``block_table`` and ``seq_lens`` (the tensors given to plan), with the prefix still
    ``prefix_len`` tokens, every suffix length in [0, width × page_size] and every used
    entry a page of the pool (otherwise the kernels stay inside the cache, the output is
    wrong, and a fault is recorded for the next plan); and the contents of q, k_cache,
    v_cache. **What needs a new plan**:
    ``prefix_len``, the batch size, the block table's width, heads, head dim, page size,
    pool size, dtype, ``scale``, or other tensors for the layout.

    Examples
    --------
    >>> import torch, gpulab
    >>> from gpulab.cascade import CascadeDecodeWrapper
    >>> dev = gpulab.device()
    >>> k_cache, v_cache = (torch.randn(12, 4, 2, 16, device=dev) for _ in range(2))
    >>> prefix_pages = torch.tensor([3, 7, 1], dtype=torch.int32, device=dev)      # 10 shared tokens
    >>> block_table = torch.tensor([[0, 2], [5, 6]], dtype=torch.int32, device=dev)
    >>> seq_lens = torch.tensor([3, 6], dtype=torch.int32, device=dev)             # own tokens
    >>> cascade = CascadeDecodeWrapper()
    >>> cascade.plan(prefix_pages, 10, block_table, seq_lens, num_qo_heads=4, num_kv_heads=2,
    ...              head_dim=16, page_size=4, num_pages=12, dtype=torch.float32)
    >>> o = cascade.run(torch.randn(2, 4, 16, device=dev), k_cache, v_cache)
    >>> o.shape
    torch.Size([2, 4, 16])
    """

    def __init__(self):
        self._planned = None
        self._buffers: dict = {}

    def plan(self, prefix_pages: torch.Tensor, prefix_len: int, block_table: torch.Tensor,
             seq_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, num_pages: int, dtype: torch.dtype, scale: float | None = None) -> None:
        """Validate the layout, choose the partitions, allocate the buffers.

        Parameters
        ----------
        prefix_pages : int32 [n] (kept by reference): the shared prefix's pages, in order.
        prefix_len : tokens in the prefix, ≤ n · page_size.
        block_table, seq_lens : int32 [B, width] and [B] (kept by reference): each request's
            own suffix, as for :class:`gpulab.paged.PagedDecodeWrapper`.
        num_qo_heads, num_kv_heads, head_dim, page_size, num_pages : the shapes of q
            [B, num_qo_heads, head_dim] and of the caches [num_pages, page_size, num_kv_heads, head_dim].
        dtype : the dtype of q and the caches. scale : softmax scale (default head_dim ** -0.5).
        """
        require_block_table(block_table, seq_lens)
        require_plan_shapes(num_qo_heads, num_kv_heads, head_dim, page_size, num_pages, dtype, scale)
        require_prefix(prefix_pages, prefix_len, page_size)
        require_same_device(prefix_pages=prefix_pages, block_table=block_table)
        device = block_table.device
        raise_recorded_faults(device)
        require_prefix_pages(prefix_pages, prefix_len, page_size, num_pages)
        require_paged_layout(block_table, seq_lens, page_size, num_pages)
        B, width = block_table.shape
        prefix_part, suffix_part = cascade_partitioning(B, num_qo_heads, num_kv_heads, prefix_len,
                                                        width * page_size)
        splits = prefix_part[0] + suffix_part[0]
        keep_or_allocate(self._buffers, {
            "o": ((B, num_qo_heads, head_dim), dtype), "lse": ((B, num_qo_heads), torch.float32),
            "o_part": ((B, num_qo_heads, splits, head_dim), torch.float32),
            "lse_part": ((B, num_qo_heads, splits), torch.float32)}, device)
        self._planned = dict(prefix_pages=prefix_pages, prefix_len=prefix_len, block_table=block_table,
                             seq_lens=seq_lens, prefix_part=prefix_part, suffix_part=suffix_part,
                             scale=scale, dtype=dtype, device=device, q_shape=(B, num_qo_heads, head_dim),
                             cache_shape=(num_pages, page_size, num_kv_heads, head_dim))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False):
        """Cascade decode for the planned layout: o [B, Hq, D] (and lse with ``return_lse``).
        No host sync, no allocation; without ``out``/``lse`` the plan's buffers are returned
        (overwritten by the next run)."""
        p = self._planned
        if p is None:
            raise RuntimeError("run() before plan(): call plan(prefix_pages, prefix_len, block_table, ...) first")
        out, lse = require_run_inputs(p, self._buffers, q, k_cache, v_cache, out, lse)
        o_part, lse_part = self._buffers["o_part"], self._buffers["lse_part"]
        if q.shape[0]:
            cascade_partials_into(q, k_cache, v_cache, p["prefix_pages"], p["prefix_len"], p["block_table"],
                                  p["seq_lens"], o_part, lse_part, p["prefix_part"], p["suffix_part"], p["scale"])
            split_reduce_into(o_part, lse_part, out, lse)
        return (out, lse) if return_lse else out

r"""Append (paged-prefill) attention: several new query tokens per request over that
request's paged KV history, causal, over a ragged batch. What a serving engine runs for
prefill, chunked prefill and mixed prefill/decode steps (FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper``).

**The batch.** B requests; request b brings n_b new tokens. Their queries are stacked
along one ragged axis, ``q: [total_q, Hq, D]``, described by ``qo_indptr`` (int32,
B+1 entries): request b owns rows ``qo_indptr[b] : qo_indptr[b+1]``. The keys and values
live in the paged cache of :mod:`gpulab.paged` (``k_cache, v_cache: [num_pages,
page_size, Hkv, D]``, row b of ``block_tables`` lists request b's pages in order), and
``kv_lens[b]`` counts request b's tokens *including* its n_b new ones, whose K/V are
already in the cache (:func:`append_kv` writes them there first). So request b has a
history of h_b = kv_lens[b] − n_b tokens, and its KV position p lives in

    page = block_tables[b, p // page_size],      slot = p % page_size.

**The attention.** New token j of request b (0 ≤ j < n_b) is KV position h_b + j. With
a causal mask it sees the positions before it and itself:

    visible(b, j) = { p : p < h_b + j + 1 }                     (causal)
                  = { p : p < kv_lens[b] }                      (causal=False)
    s_p   = sm_scale · q_{b,j,h} · k_{b,p,h // G}              (GQA: G = Hq / Hkv)
    lse   = log Σ_{p visible} exp(s_p)                          (natural log, float32)
    o     = Σ_{p visible} exp(s_p − lse) · v_{b,p,h // G}

This is the bottom-right-aligned causal mask of :mod:`gpulab.attention` (query i sees key
j ≤ i + S_kv − S_q), per request. A square mask (j sees p ≤ j) would ignore the history;
with n_b = 1 the formula is decode attention. A row that sees nothing (kv_lens[b] = 0)
is the empty state: o = 0, lse = −inf. LSE convention: float32, natural log, shape
[total_q, Hq]; FlashInfer's base-2 LSE is lse / ln 2 (cascade merging needs the state).

**The kernel.** One program owns one *work item* — a tile of consecutive new tokens of
one request — and one kv head. The tile's rows are (token, query head) pairs of the G
query heads that share the kv head ("packed GQA", as FlashInfer does): row r is token
t0 + r // G, head kvh·G + r % G, so a tile holds BLOCK_M // G tokens and each K/V block
read from the pages serves all G heads; a request of one new token (decode) fills G rows
instead of one. The program streams the request's KV positions BLOCK_N at a time
through the block table with the online softmax (scores in base 2: scale · log2 e):
positions every row of the tile sees need no mask; the last few blocks are masked per
row by the causal limit.

**The schedule.** Tiles never straddle requests: request b has ⌈n_b / (BLOCK_M // G)⌉
tiles, and the work list (request, tile) for all of them is the launch grid. Two ways to
build it:

* :class:`AppendAttention` (FlashInfer's plan/run): ``plan()`` gets the batch layout on
  the host, validates it once (page ids in range, lengths within capacity, indptr
  monotonic), builds the work list there — heaviest tiles (most KV positions) first, so
  the long ones do not finish last — and copies layout and work list into buffers it
  owns. ``run()`` then launches one kernel: no host sync, no allocation, CUDA-graph
  capturable. With ``max_batch_size``/``max_num_tokens``/``max_pages_per_request`` given
  at construction the buffers and the grid have fixed sizes, so a graph captured over
  ``run()`` replays correctly after every later ``plan()`` of a batch that fits.
* :func:`append_attention` (no plan) builds the work list on the device with a few tensor
  ops (a cumulative sum and a search over the tile counts), for an upper bound of
  ⌈total_q / tile⌉ + B items; surplus items do nothing. No host sync either.

**Split-KV** (opt-in, :class:`KVSplit`). A batch of a few tiles over long histories (one
request's 40 new tokens after a cached 2K-token prompt: 2 tiles × the kv heads) leaves
most SMs idle while each program streams the whole history. A third grid axis then cuts
each tile's KV positions into parts of ``part_len``; each part writes its partial state
(o, lse) to a workspace, and :func:`gpulab.paged.split_reduce_into` merges them, as split-KV
decode does.

**Safety** (as in :mod:`gpulab.paged`). Validation that needs the data (page ids,
lengths, indptr) reads device memory, a host sync: ``plan()`` does it once per batch, and
:func:`append_attention` / :func:`append_kv` do it on request (``validate=True``,
``GPULAB_DEBUG=1`` or :func:`gpulab.runtime.set_debug_checks`). Without it the kernels stay
inside their buffers whatever the layout holds: lengths are clamped to the block table's
capacity, rows to ``q``, and a page id outside the pool is clamped into it by attention
(its tokens read some page of the pool: that output is wrong) and never written through by
:func:`append_kv`; bad page ids and lengths are recorded in the shared
device-side fault flag (:func:`gpulab.paged.fault_flag`) that the next ``plan()`` or
validating call reports as a :class:`gpulab.paged.LayoutFault`.

The attention state (o, lse) follows :mod:`gpulab.attention_state` (its online update and
epilogue run inside the kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from . import runtime
from .attention_state import LOG2E, online_update, state_epilogue
from .paged import (FAULT_PAGE, FAULT_SEQ_LEN, checked_pages, fault_flag, gather_kv, raise_recorded_faults,
                    split_reduce_into)
from .validate import require_float, require_rows, require_same_device, require_tensor

MAX_HEAD_DIM = 256


# =========================================================================================
# References (float64)
# =========================================================================================
def append_attention_reference(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens,
                               causal=True, sm_scale=None, **_):
    """{"o": [total_q, Hq, D], "lse": [total_q, Hq]} in float64, one request at a time:
    gather the request's pages, score every (new token, position) pair, mask, softmax."""
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    o = torch.zeros((total_q, hq, d), dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64, device=q.device)
    indptr = [int(x) for x in qo_indptr.tolist()]
    for b in range(len(indptr) - 1):
        start, end, kv_len = indptr[b], indptr[b + 1], int(kv_lens[b])
        n = end - start
        if n == 0 or kv_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables, kv_len, b)          # [L, Hkv, D]
        k = k.double().repeat_interleave(hq // hkv, dim=1)                    # [L, Hq, D]
        v = v.double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("jhd,phd->hjp", q[start:end].double(), k) * scale    # [Hq, n, L]
        if causal:
            j = torch.arange(n, device=q.device)[:, None]
            p = torch.arange(kv_len, device=q.device)[None, :]
            s = s.masked_fill(p >= kv_len - n + j + 1, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)                                  # [Hq, n]
        w = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)                 # empty rows: 0
        o[start:end] = torch.einsum("hjp,phd->jhd", w, v)
        lse[start:end] = row_lse.transpose(0, 1)
    return {"o": o, "lse": lse}


def append_kv_reference(k, v, k_cache, v_cache, qo_indptr, block_tables, kv_lens, **_):
    """The caches after writing new token j of request b at KV position
    kv_lens[b] − n_b + j: {"k_cache": ..., "v_cache": ...} (copies)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    ps = k_cache.shape[1]
    indptr = [int(x) for x in qo_indptr.tolist()]
    for b in range(len(indptr) - 1):
        start, end, kv_len = indptr[b], indptr[b + 1], int(kv_lens[b])
        pos = torch.arange(kv_len - (end - start), kv_len, device=k.device)
        pages = block_tables[b].long()[pos // ps]
        kc[pages, pos % ps] = k[start:end]
        vc[pages, pos % ps] = v[start:end]
    return {"k_cache": kc, "v_cache": vc}


# =========================================================================================
# Triton kernels
# =========================================================================================
@triton.jit
def _kv_scores(q, qk_scale, k_ptr, v_ptr, bt_row_ptr, t, t_mask, d, d_mask, kvh, num_pages,
               stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
               PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Scores q·Kᵀ (base-2 scaled) and V [BLOCK_N, BLOCK_D] of KV positions t through one
    request's block-table row. Page ids go through :func:`gpulab.paged.checked_pages`:
    a bad one is clamped into the pool and marked in ``bad`` (1 per such token; summed by
    the caller after its loop)."""
    page = tl.load(bt_row_ptr + t // PAGE_SIZE, mask=t_mask, other=0)
    page, bad = checked_pages(page, t_mask, num_pages)
    page = page.to(tl.int64)
    slot = t % PAGE_SIZE
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + kvh * stride_kh
                + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt + kvh * stride_vh
                + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:   # bf16 tl.dot is wrong in the interpreter: compute in fp32 there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    return s, v, bad


# Sizes that change from one engine step to the next are not specialised on: Triton would
# compile the kernel again (about a second) for each new value class (1, multiple of 16, other).
@triton.jit(do_not_specialize=["num_req", "total_q", "bt_width", "stride_btb", "part_len"])
def _append_attention_kernel(
        q_ptr, k_ptr, v_ptr, qo_indptr_ptr, bt_ptr, kv_lens_ptr, work_req_ptr, work_tile_ptr,
        o_ptr, lse_ptr, fault_ptr,
        qk_scale,                          # sm_scale · log2(e): scores in base 2
        num_req, total_q, num_pages, bt_width,
        part_len,                          # KV positions per program along grid axis 2 (split-KV)
        stride_qt, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_btb, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls,
        PAGE_SIZE: tl.constexpr,        # constant: p // PAGE_SIZE is a shift, not a division
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_LSE: tl.constexpr,
        UPCAST: tl.constexpr, IEEE: tl.constexpr, PAGE_FAULT: tl.constexpr, LEN_FAULT: tl.constexpr):
    """Program (w, kvh, p): work item w = (request b, q tile), kv head kvh, and part p of
    the KV positions (positions p·part_len up to (p+1)·part_len; one part unless split-KV,
    whose partial states o, lse then go to slice p of o and lse, merged afterwards). Rows
    of the tile are (new token, query head) pairs: row r = token t0 + r // GROUP of
    request b, query head kvh·GROUP + r % GROUP."""
    TILE: tl.constexpr = BLOCK_M // GROUP           # new tokens per tile
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    b = tl.load(work_req_ptr + w)
    tile = tl.load(work_tile_ptr + w)
    has_work = (b >= 0) & (b < num_req) & (tile >= 0)   # surplus items carry b = -1
    if not has_work:
        return       # a surplus item owns no rows: nothing to write (a list sized for a CUDA
                     # graph's worst case has hundreds of them: they must cost next to nothing)
    b = tl.where(has_work, b, 0)

    # The request's rows and KV length, clamped so that a bad layout stays in bounds.
    q_start = tl.minimum(tl.maximum(tl.load(qo_indptr_ptr + b), 0), total_q)
    q_end = tl.minimum(tl.maximum(tl.load(qo_indptr_ptr + b + 1), q_start), total_q)
    n_new = tl.where(has_work, q_end - q_start, 0)
    kv_len = tl.load(kv_lens_ptr + b)
    faults = tl.where(has_work & ((kv_len < 0) | (kv_len > bt_width * PAGE_SIZE)), LEN_FAULT, 0)
    kv_len = tl.minimum(tl.maximum(kv_len, 0), bt_width * PAGE_SIZE)
    history = kv_len - n_new                      # KV positions before the first new token
    t0 = tile * TILE
    n_tile = tl.where(has_work, tl.maximum(tl.minimum(n_new - t0, TILE), 0), 0)   # its new tokens

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tok = t0 + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < TILE * GROUP) & (tok < t0 + n_tile)
    row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # KV range of the tile: [0, hi). Every row sees [0, full); the rest is masked per row.
    if CAUSAL:
        limit = history + tok + 1                           # row sees positions < limit
        hi = tl.minimum(tl.maximum(history + t0 + n_tile, 0), kv_len)
        full = tl.maximum(history + t0 + 1, 0)
    else:
        limit = tl.zeros([BLOCK_M], tl.int32) + kv_len
        hi = kv_len
        full = kv_len
    hi = tl.where(n_tile > 0, hi, 0)                        # an empty item streams nothing
    full = (tl.minimum(full, hi) // BLOCK_N) * BLOCK_N
    # this program's part of [0, hi): [lo, hi), unmasked up to full (part_len is a multiple
    # of BLOCK_N, so every part starts on a block and full stays one)
    lo = part * part_len
    hi = tl.minimum(hi, lo + part_len)
    full = tl.minimum(tl.maximum(full, lo), hi)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bad_pages = tl.zeros([BLOCK_N], tl.int32)   # summed once after the loops
    cols = tl.arange(0, BLOCK_N)
    # Visible to every row: no score mask. (A bad page's tokens read a clamped page and
    # still get a score: the result is wrong, as it must be for a bad layout, but no
    # address outside the cache is formed, and the fault is recorded.)
    for start in range(lo, full, BLOCK_N):
        t = start + cols
        s, v, n_bad = _kv_scores(q, qk_scale, k_ptr, v_ptr, bt_row_ptr, t, t < hi, d, d_mask, kvh,
                                 num_pages, stride_kp, stride_kt, stride_kh, stride_vp,
                                 stride_vt, stride_vh, PAGE_SIZE, UPCAST, IEEE)
        bad_pages += n_bad
        m, l, acc = online_update(m, l, acc, s, v, False, False, 0.0, IEEE)
    for start in range(full, hi, BLOCK_N):      # the diagonal and the tail: masked per row
        t = start + cols
        s, v, n_bad = _kv_scores(q, qk_scale, k_ptr, v_ptr, bt_row_ptr, t, t < hi, d, d_mask, kvh,
                                 num_pages, stride_kp, stride_kt, stride_kh, stride_vp,
                                 stride_vt, stride_vh, PAGE_SIZE, UPCAST, IEEE)
        bad_pages += n_bad
        visible = (t[None, :] < hi) & (t[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = online_update(m, l, acc, s, v, True, False, 0.0, IEEE)
    faults = faults | tl.where(tl.sum(bad_pages, 0) > 0, PAGE_FAULT, 0)
    if faults != 0:                 # the shared flag of gpulab.paged.fault_flag: [kinds, first request]
        tl.atomic_or(fault_ptr, faults)
        tl.atomic_min(fault_ptr + 1, b)

    out, lse = state_epilogue(m, l, acc)          # an empty part: o = 0, lse = -inf
    tl.store(o_ptr + part * stride_os + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    if HAS_LSE:
        tl.store(lse_ptr + part * stride_ls + row * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_req", "total_new", "bt_width", "stride_btb"])
def _append_kv_kernel(
        k_ptr, v_ptr, qo_indptr_ptr, bt_ptr, kv_lens_ptr, kc_ptr, vc_ptr, fault_ptr,
        num_req, total_new, num_pages, bt_width, page_size,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_btb,
        stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
        HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        PAGE_FAULT: tl.constexpr, LEN_FAULT: tl.constexpr):
    """Program (i, kvh): new tokens i·BLOCK_T ... of kv head kvh. Each token finds its
    request by binary search in qo_indptr, then its page and slot; it is written only if
    its position and page id are valid (otherwise nothing is written and the fault is
    recorded)."""
    kvh = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < total_new
    # b = the largest request in [0, num_req) with qo_indptr[b] <= t
    lo = tl.zeros([BLOCK_T], tl.int32)
    hi = tl.zeros([BLOCK_T], tl.int32) + (num_req - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go_right = tl.load(qo_indptr_ptr + mid, mask=t_ok, other=0) <= t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    b = tl.minimum(tl.maximum(lo, 0), num_req - 1)
    start = tl.load(qo_indptr_ptr + b, mask=t_ok, other=0)
    end = tl.load(qo_indptr_ptr + b + 1, mask=t_ok, other=0)
    pos = tl.load(kv_lens_ptr + b, mask=t_ok, other=0) - (end - t)     # KV position of token t
    mine = t_ok & (t >= start) & (t < end)
    ok = mine & (pos >= 0) & (pos < bt_width * page_size)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + pos // page_size, mask=ok, other=0)
    bad = ok & ((page < 0) | (page >= num_pages))         # never written through
    ok = ok & ~bad
    bad_len = mine & ((pos < 0) | (pos >= bt_width * page_size))
    faults = (tl.where(tl.sum(bad.to(tl.int32), 0) > 0, PAGE_FAULT, 0)
              | tl.where(tl.sum(bad_len.to(tl.int32), 0) > 0, LEN_FAULT, 0))
    if faults != 0:
        tl.atomic_or(fault_ptr, faults)
    page = page.to(tl.int64)
    slot = pos % page_size
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d[None, :] < HEAD_DIM)
    tt = t.to(tl.int64)
    kn = tl.load(k_ptr + tt[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=mask)
    vn = tl.load(v_ptr + tt[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + page[:, None] * stride_kcp + slot[:, None] * stride_kct + kvh * stride_kch
             + d[None, :], kn.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + page[:, None] * stride_vcp + slot[:, None] * stride_vct + kvh * stride_vch
             + d[None, :], vn.to(vc_ptr.dtype.element_ty), mask=mask)


# =========================================================================================
# Launch configuration and schedules
# =========================================================================================
SCHEDULE_BLOCK = 64      # the schedule kernel's work items and requests at a time: [64, 64] comparisons
SCHEDULE_CONFIG = {"num_warps": 4}


def append_tile_config(dtype: torch.dtype, head_dim: int, group: int, max_new: int | None = None) -> dict:
    """Tile sizes and launch options: {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}.

    BLOCK_M rows = BLOCK_M // group new tokens × group heads. Chosen per (GPU, dtype, head
    dim), not autotuned: the schedule depends on BLOCK_M, and a plan must know it. A plan
    that knows the longest request (``max_new`` new tokens) shrinks the tile to fit it, as
    FlashInfer does: a batch of 1-token requests then runs 16-row tiles, not 128."""
    cc = runtime.compute_capability()
    if runtime.interpreting():
        bm, bn, warps, stages = 32, 16, 4, 1     # modest blocks: several KV blocks per tile on CPU
    elif dtype == torch.float32:                 # twice the bytes per tile, ieee dots
        bm, bn, warps, stages = (64, 32, 4, 2) if cc and cc[0] >= 8 else (32, 32, 4, 1)
    elif cc and cc[0] >= 8:
        bm, bn, warps, stages = (128, 64, 8, 2) if head_dim > 64 else (128, 64, 4, 3)
    else:                                        # sm_75: 64 KiB of shared memory
        bm, bn, warps, stages = 64, 32, 4, 2
    if max_new is not None:
        bm = min(bm, max(16, runtime.next_power_of_2(max(1, max_new) * group)))
    bm = max(bm, runtime.next_power_of_2(group))  # at least one token per tile
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def append_schedule(qo_indptr, kv_lens, tile_tokens: int, causal: bool = True):
    """The work list on the host: (request, q tile) of every tile, heaviest first.

    qo_indptr, kv_lens: host arrays (numpy or CPU tensors). Returns two int32 numpy
    arrays (req, tile). A tile's cost is the number of KV positions it streams."""
    indptr = np.asarray(qo_indptr, dtype=np.int64)
    lens = np.asarray(kv_lens, dtype=np.int64)
    n = np.diff(indptr)
    tiles = -(-n // tile_tokens)
    req = np.repeat(np.arange(len(n)), tiles)
    tile = np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    if causal:
        last = np.minimum(n[req], (tile + 1) * tile_tokens)       # tokens up to the tile's end
        cost = lens[req] - n[req] + last
    else:
        cost = lens[req]
    order = np.argsort(-cost, kind="stable")
    return req[order].astype(np.int32), tile[order].astype(np.int32)


def append_schedule_device_ref(qo_indptr: torch.Tensor, total_q: int, tile_tokens: int):
    """:func:`append_schedule_device` in PyTorch ops (about a dozen small kernels)."""
    B = qo_indptr.shape[0] - 1
    bound = -(-total_q // tile_tokens) + B
    n = (qo_indptr[1:] - qo_indptr[:-1]).clamp(0, total_q)
    tiles = (n + tile_tokens - 1) // tile_tokens
    ends = torch.cumsum(tiles, 0)
    i = torch.arange(bound, device=qo_indptr.device)
    req = torch.searchsorted(ends, i, right=True)
    inside = req < B
    safe = req.clamp(max=B - 1)
    tile = ends[safe] - 1 - i                    # counts down from the request's last tile
    return torch.where(inside, req, -1).to(torch.int32), tile.to(torch.int32)


@triton.jit
def _request_ends(indptr_ptr, b0, B, total_q, tile_tokens, carry, BLOCK_B: tl.constexpr):
    """Requests [b0, b0 + BLOCK_B): their indices, which exist, and where their tiles end
    (``carry``: the tiles of the requests before b0), and those tiles' count."""
    b = b0 + tl.arange(0, BLOCK_B)
    real = b < B
    lo = tl.load(indptr_ptr + b, mask=real, other=0)
    hi = tl.load(indptr_ptr + b + 1, mask=real, other=0)
    n = tl.minimum(tl.maximum(hi - lo, 0), total_q).to(tl.int32)
    tiles = (n + tile_tokens - 1) // tile_tokens
    return b, real, carry + tl.cumsum(tiles, 0), tl.sum(tiles, 0)


@triton.jit(do_not_specialize=["B", "total_q", "tile_tokens", "bound"])
def append_schedule_kernel(indptr_ptr, req_ptr, tile_ptr, B, total_q, tile_tokens, bound,
                           BLOCK_B: tl.constexpr, BLOCK_I: tl.constexpr):
    """One program: request b has n_b = clamp(indptr[b+1] − indptr[b], 0, total_q) rows,
    ⌈n_b / tile_tokens⌉ tiles, and its tiles end at ends_b (their running sum). Item i
    belongs to request r = #{b : ends_b ≤ i} (a search by counting) and is its tile
    ends_r − 1 − i; items past the last tile get request −1. Requests BLOCK_B at a time,
    so one compiled kernel serves any batch."""
    for start in range(0, bound, BLOCK_I):
        i = start + tl.arange(0, BLOCK_I)
        req = tl.zeros([BLOCK_I], tl.int32)
        carry = tl.sum(tl.zeros([BLOCK_B], tl.int32), 0)
        for b0 in range(0, B, BLOCK_B):
            b, real, ends, count = _request_ends(indptr_ptr, b0, B, total_q, tile_tokens, carry, BLOCK_B)
            req += tl.sum(((ends[None, :] <= i[:, None]) & real[None, :]).to(tl.int32), axis=1)
            carry += count
        safe = tl.minimum(req, B - 1)
        end = tl.zeros([BLOCK_I], tl.int32)
        carry = tl.sum(tl.zeros([BLOCK_B], tl.int32), 0)
        for b0 in range(0, B, BLOCK_B):
            b, real, ends, count = _request_ends(indptr_ptr, b0, B, total_q, tile_tokens, carry, BLOCK_B)
            end += tl.sum(tl.where(b[None, :] == safe[:, None], ends[None, :], 0), axis=1)
            carry += count
        tl.store(req_ptr + i, tl.where(req < B, req, -1), mask=i < bound)
        tl.store(tile_ptr + i, end - 1 - i, mask=i < bound)


def append_schedule_device(qo_indptr: torch.Tensor, total_q: int, tile_tokens: int):
    """The work list on the device, without a host sync: ⌈total_q / tile⌉ + B items (an
    upper bound on the tiles of any layout of total_q tokens), surplus ones with
    request -1. Within a request the last (heaviest, causal) tile comes first. One
    launch (:func:`append_schedule_kernel`; in PyTorch ops, a dozen:
    :func:`append_schedule_device_ref`), made once per engine step, in its graph."""
    B = qo_indptr.shape[0] - 1
    bound = -(-total_q // tile_tokens) + B
    if B <= 0:                                   # no request: every item surplus
        return (torch.full((bound,), -1, dtype=torch.int32, device=qo_indptr.device),
                torch.zeros(bound, dtype=torch.int32, device=qo_indptr.device))
    req = torch.empty(bound, dtype=torch.int32, device=qo_indptr.device)
    tile = torch.empty(bound, dtype=torch.int32, device=qo_indptr.device)
    runtime.launch(append_schedule_kernel, (1,), SCHEDULE_CONFIG, qo_indptr, req, tile, B, total_q,
                   tile_tokens, bound, BLOCK_B=SCHEDULE_BLOCK, BLOCK_I=SCHEDULE_BLOCK)
    return req, tile


# =========================================================================================
# Launchers (no validation)
# =========================================================================================
@dataclass
class KVSplit:
    """Split-KV for the append kernel: each (work item, kv head) program's KV positions cut
    into parts of ``part_len``, one program each (grid axis 2), so that a batch of few
    tiles over long histories still fills the GPU (one request of 40 new tokens after a
    2K-token cached prompt is 2 tiles × kv heads programs, each streaming 2K positions).
    Each part writes its partial state to ``o_part`` [T, Hq, S, D] and ``lse_part``
    [T, Hq, S] (float32), merged afterwards by :func:`gpulab.paged.split_reduce_into`.
    A workspace, so a plan holds it and its layers reuse it one after another.

    Opt-in (``num_splits`` of :func:`append_attention_into`, ``capacity`` of
    :func:`gpulab.engine.batch_attention.plan_append_attention`): on the H200 it cut the
    append attention of a 40-token prompt after a cached 2K-token one from 70 µs a layer
    to 16 µs plus 3 µs of merge, but in the serving benchmark the cached prompt's step
    did not get faster with it (p50 5.8 ms on, 5.5 ms off, in runs of the same day: that
    step is bound by the host and the GPU's idle clocks, BENCHMARKS.md, seventh run of
    2026-12-03), and the engine's warm-up does not meet the split path's compiled variants
    (the merge's ``BLOCK_S`` follows the number of parts): with it on, the engine compiled
    three to four kernels while serving."""
    part_len: int
    o_part: torch.Tensor
    lse_part: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.o_part.shape[2]


def plan_kv_split(num_items: int, kv_heads: int, capacity: int, num_rows: int, num_qo_heads: int,
                  head_dim: int, block_n: int, device, num_splits: int | None = None) -> KVSplit | None:
    """The split of ``capacity`` KV positions (a block table's width × page size: known on
    the host, no sync) for a launch of ``num_items`` work items, or None for one part.

    Splits only when items × kv heads programs leave SMs idle, aiming at two programs
    per SM, with parts of at least 4·BLOCK_N positions (each part costs a state round
    trip through memory and the merge). ``num_splits`` forces the number of parts (the
    split check; the interpreter pays per program, so it only splits when told)."""
    capacity = max(1, capacity)
    if num_splits is None:
        programs = max(1, num_items * kv_heads)
        sms = runtime.num_sms()
        if runtime.interpreting() or not sms or programs >= sms:
            return None
        num_splits = min(-(-2 * sms // programs), capacity // (4 * block_n))
    if num_splits <= 1:
        return None
    part = -(-capacity // num_splits)
    part = -(-part // block_n) * block_n
    splits = -(-capacity // part)
    if splits <= 1:
        return None
    return KVSplit(part, torch.empty((num_rows, num_qo_heads, splits, head_dim), dtype=torch.float32, device=device),
                   torch.empty((num_rows, num_qo_heads, splits), dtype=torch.float32, device=device))


def launch_append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, work_req, work_tile,
                            o, lse, fault, causal: bool, sm_scale: float | None, config: dict,
                            split: KVSplit | None = None):
    """One launch over the work list (grid: items × kv heads × parts); lse may be None.
    With ``split``, the parts' states are merged into o (and lse) by a second launch;
    rows past the workspace's (padding, say) are then never touched, whatever qo_indptr holds."""
    total_q, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    if work_req.shape[0] == 0 or total_q == 0:
        return
    scale = d ** -0.5 if sm_scale is None else float(sm_scale)
    if split is not None:
        total_q = min(total_q, split.o_part.shape[0])          # the kernel clamps rows to it
        o_part, lse_part = split.o_part[:total_q], split.lse_part[:total_q]
        out, out_lse, parts, part_len = o_part, lse_part, split.num_splits, split.part_len
        o_strides, lse_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2)), lse_part.stride()
    else:
        out, out_lse, parts = o, (lse if lse is not None else o), 1   # out_lse unused without HAS_LSE
        part_len = block_tables.shape[1] * page_size + config["BLOCK_N"]     # every position
        o_strides = (o.stride(0), o.stride(1), 0)
        lse_strides = (lse.stride(0), lse.stride(1), 0) if lse is not None else (0, 0, 0)
    runtime.launch(
        _append_attention_kernel, (work_req.shape[0], hkv, parts),
        {"num_warps": config["num_warps"], "num_stages": config["num_stages"]},
        q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, work_req, work_tile, out, out_lse, fault,
        scale * LOG2E, qo_indptr.shape[0] - 1, total_q, num_pages, block_tables.shape[1], part_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *o_strides, *lse_strides,
        PAGE_SIZE=page_size, GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        BLOCK_D=max(16, runtime.next_power_of_2(d)), CAUSAL=bool(causal), HAS_LSE=split is not None or lse is not None,
        UPCAST=runtime.interpreting() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
        PAGE_FAULT=FAULT_PAGE, LEN_FAULT=FAULT_SEQ_LEN)
    if split is not None:
        # Only the rows requests own (qo_indptr[0] up to qo_indptr[B], read on the device):
        # the others keep what o held (padding, or rows another kernel wrote). Without an lse
        # to return, part 0's slice takes it (the merge reads a row's parts before it writes
        # that row's lse).
        split_reduce_into(o_part, lse_part, o, lse if lse is not None else lse_part[:, :, 0], rows=qo_indptr)


def append_attention_into(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale, o, lse,
                          num_splits: int | None = None):
    """Launcher with the check's calling convention: attention into o [total_q, Hq, D]
    and lse [total_q, Hq] (or None); work list built on the device (no host sync).
    ``num_splits``: split each tile's KV positions in that many parts (opt-in, see
    :class:`KVSplit`; its workspace is allocated here, per call)."""
    B = qo_indptr.shape[0] - 1
    total_q, hq, d = q.shape
    if B <= 0 or total_q == 0:
        return
    group = hq // k_cache.shape[2]
    config = append_tile_config(q.dtype, d, group)
    work_req, work_tile = append_schedule_device(qo_indptr, total_q, config["BLOCK_M"] // group)
    split = None if num_splits is None else plan_kv_split(
        work_req.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], total_q, hq, d,
        config["BLOCK_N"], q.device, num_splits)
    launch_append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, work_req, work_tile,
                            o, lse, fault_flag(q.device), causal, sm_scale, config, split)


def append_attention_split_into(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale, o, lse):
    """The launcher with the KV always split in three parts (the split check's)."""
    append_attention_into(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale, o, lse,
                          num_splits=3)


def append_kv_config() -> dict:
    return {"BLOCK_T": 16 if runtime.interpreting() else 32, "num_warps": 4}


def append_kv_into(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache, search_steps: int | None = None):
    """Launcher: write new token j of request b (rows of k, v [total_new, Hkv, D]) into
    the caches at KV position kv_lens[b] − n_b + j, in place."""
    B = qo_indptr.shape[0] - 1
    total, hkv, d = k.shape
    if B <= 0 or total == 0:
        return
    cfg = append_kv_config()
    steps = max(1, (B - 1).bit_length()) if search_steps is None else search_steps
    _append_kv_kernel[(runtime.cdiv(total, cfg["BLOCK_T"]), hkv)](
        k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache, fault_flag(k.device),
        B, total, k_cache.shape[0], block_tables.shape[1], k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, BLOCK_T=cfg["BLOCK_T"], BLOCK_D=max(16, runtime.next_power_of_2(d)),
        SEARCH_STEPS=steps, PAGE_FAULT=FAULT_PAGE, LEN_FAULT=FAULT_SEQ_LEN, num_warps=cfg["num_warps"])


def append_kv_copy_into(k, v, qo_indptr, block_tables, kv_lens, k_cache_before, v_cache_before,
                        k_cache, v_cache):
    """For checks: copy the old caches into k_cache, v_cache, then append in place."""
    k_cache.copy_(k_cache_before)
    v_cache.copy_(v_cache_before)
    append_kv_into(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache)


# =========================================================================================
# Validation
# =========================================================================================
def require_append_inputs(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens) -> None:
    """Shapes, dtypes and devices of an append-attention call: host-only, no device data
    read (so no sync)."""
    require_rows("q", q, ndim=3)
    require_float("q", q)
    require_rows("k_cache", k_cache, ndim=4, dtype=q.dtype)
    require_rows("v_cache", v_cache, shape=k_cache.shape, dtype=q.dtype)
    require_append_layout_shapes(qo_indptr, block_tables, kv_lens)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr,
                        block_tables=block_tables, kv_lens=kv_lens)
    require_append_heads(q.shape[1], q.shape[2], k_cache)


def require_append_layout_shapes(qo_indptr, block_tables, kv_lens) -> None:
    require_tensor("qo_indptr", qo_indptr, ndim=1, dtype=torch.int32, any_device=True)
    if qo_indptr.shape[0] < 1:
        raise ValueError("qo_indptr must have B + 1 >= 1 entries (request b owns rows "
                         "qo_indptr[b]:qo_indptr[b+1] of q)")
    B = qo_indptr.shape[0] - 1
    require_rows("block_tables", block_tables, ndim=2, dtype=torch.int32, any_device=True)
    require_tensor("kv_lens", kv_lens, ndim=1, dtype=torch.int32, any_device=True)
    if block_tables.shape[0] != B or kv_lens.shape[0] != B:
        raise ValueError(f"qo_indptr describes {B} requests, but block_tables has {block_tables.shape[0]} "
                         f"rows and kv_lens {kv_lens.shape[0]} entries: one row and one length per request")


def require_append_heads(hq: int, d: int, k_cache) -> None:
    _, _, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k_cache has {dk}: caches are [pages, page_size, Hkv, D]")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} > {MAX_HEAD_DIM} is not supported (a tile holds whole query rows)")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} kv heads "
                         f"(GQA needs Hq = G·Hkv)")


def require_append_layout(qo_indptr, block_tables, kv_lens, num_pages: int, page_size: int,
                          total_q: int | None = None) -> None:
    """The data-dependent checks (they read the layout, so on a GPU they sync): qo_indptr
    starts at 0, never decreases and ends within q; each kv_len holds at least its new
    tokens and fits its block table; every page a request uses is a page of the pool."""
    indptr = qo_indptr.detach().cpu().long()
    lens = kv_lens.detach().cpu().long()
    bt = block_tables.detach().cpu().long()
    if int(indptr[0]) != 0:
        raise ValueError(f"qo_indptr[0] = {int(indptr[0])}: it must start at 0")
    n = indptr[1:] - indptr[:-1]
    if bool((n < 0).any()):
        b = int((n < 0).nonzero()[0, 0])
        raise ValueError(f"qo_indptr decreases at request {b}: qo_indptr[{b}] = {int(indptr[b])} > "
                         f"qo_indptr[{b + 1}] = {int(indptr[b + 1])} (it must be non-decreasing)")
    if total_q is not None and int(indptr[-1]) > total_q:
        raise ValueError(f"qo_indptr[-1] = {int(indptr[-1])} but q has only {total_q} rows")
    if bool((lens < n).any()):
        b = int((lens < n).nonzero()[0, 0])
        raise ValueError(f"kv_lens[{b}] = {int(lens[b])} is smaller than request {b}'s {int(n[b])} new "
                         f"tokens: kv_lens counts the history AND the new tokens (append their K/V first)")
    capacity = bt.shape[1] * page_size
    if bool((lens > capacity).any()):
        b = int((lens > capacity).nonzero()[0, 0])
        raise ValueError(f"kv_lens[{b}] = {int(lens[b])} exceeds the block table's capacity of "
                         f"{bt.shape[1]} pages × {page_size} tokens = {capacity}")
    pages_used = (lens + page_size - 1) // page_size
    used = torch.arange(bt.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise IndexError(f"block_tables[{b}, {j}] = {int(bt[b, j])} is not a page of the cache (valid "
                         f"pages: 0..{num_pages - 1}); request {b} has {int(lens[b])} KV tokens, so its "
                         f"first {int(pages_used[b])} entries must all be valid page ids")


def _require_scale(sm_scale) -> None:
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite number or None (1/sqrt(D)), got {sm_scale!r}")


# =========================================================================================
# Public functions
# =========================================================================================
def append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, *, causal: bool = True,
                     sm_scale: float | None = None, out: torch.Tensor | None = None,
                     return_lse: bool = False, validate: bool | None = None):
    """Attention of each request's new query tokens over its paged KV (history + new).

    Parameters
    ----------
    q : [total_q, Hq, D] float tensor; request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1].
    k_cache, v_cache : [num_pages, page_size, Hkv, D], q's dtype, Hq % Hkv == 0. The new
        tokens' K/V must already be in the cache (:func:`append_kv`).
    qo_indptr : int32 [B + 1]. block_tables : int32 [B, max_pages]. kv_lens : int32 [B],
        each request's KV length including its new tokens.
    causal : new token j of request b sees KV positions < kv_lens[b] − n_b + j + 1.
    sm_scale : softmax scale, default D ** -0.5.
    out : optional [total_q, Hq, D] output (q's dtype) to write into.
    return_lse : also return lse [total_q, Hq] (float32, natural log, -inf for no key).
    validate : also run the data-dependent checks (page ids, lengths, indptr) and report
        faults recorded by earlier unvalidated calls; they read the layout, a host sync. The
        default (None) follows :func:`gpulab.runtime.debug_checks` (``GPULAB_DEBUG``): off,
        so only shapes, dtypes and devices are checked, and the kernel stays in bounds
        whatever the layout holds.

    Returns o (and lse). Rows of q past qo_indptr[-1] are left as they are in ``out``.

    >>> o = append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens)  # doctest: +SKIP
    """
    require_append_inputs(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens)
    _require_scale(sm_scale)
    if out is not None:
        require_rows("out", out, shape=q.shape, dtype=q.dtype)
        require_same_device(q=q, out=out)
    if runtime.debug_checks() if validate is None else validate:
        raise_recorded_faults(q.device)
        require_append_layout(qo_indptr, block_tables, kv_lens, k_cache.shape[0], k_cache.shape[1],
                              q.shape[0])
    o = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    append_attention_into(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale, o, lse)
    return (o, lse) if return_lse else o


def append_kv(k, v, k_cache, v_cache, qo_indptr, block_tables, kv_lens, *,
              validate: bool | None = None) -> None:
    """Write the new tokens' keys and values into the paged caches, in place.

    k, v : [total_new, Hkv, D], the caches' dtype; request b's tokens are rows
    qo_indptr[b]:qo_indptr[b+1]; token j of request b goes to KV position
    kv_lens[b] − n_b + j (kv_lens already counts them). Host-only checks by default;
    ``validate=True`` (or ``GPULAB_DEBUG=1``) adds the data-dependent ones. Tokens whose
    page id is outside the pool are not written (and recorded in the fault flag)."""
    require_rows("k_cache", k_cache, ndim=4)
    require_float("k_cache", k_cache)
    require_rows("v_cache", v_cache, shape=k_cache.shape, dtype=k_cache.dtype)
    _, _, hkv, d = k_cache.shape
    require_rows("k", k, ndim=3, dtype=k_cache.dtype)
    require_rows("v", v, shape=k.shape, dtype=k_cache.dtype)
    if tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(f"k must be [total_new, {hkv}, {d}] (tokens, kv heads, head dim) to match the "
                         f"cache, got {tuple(k.shape)}")
    require_append_layout_shapes(qo_indptr, block_tables, kv_lens)
    require_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr,
                        block_tables=block_tables, kv_lens=kv_lens)
    if runtime.debug_checks() if validate is None else validate:
        raise_recorded_faults(k.device)
        require_append_layout(qo_indptr, block_tables, kv_lens, k_cache.shape[0], k_cache.shape[1], k.shape[0])
    append_kv_into(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache)


class AppendAttention:
    """FlashInfer-style plan/run for append attention over a paged KV cache.

    ``plan()`` once per batch (per engine step): it takes the layout (host arrays are
    best: they are validated without touching the GPU), validates it, builds the work
    list and copies everything into buffers this object owns. ``run()`` once per layer:
    one launch, no host sync, no allocation, CUDA-graph capturable.

    What ``run()`` reads: the plan's copies of qo_indptr, block_tables and kv_lens, its
    work list, and the q/k_cache/v_cache passed to it. So between two ``run()`` calls the
    contents of q and of the caches may change freely; any change of the layout (new
    tokens per request, kv lengths, block tables, batch size) needs a ``plan()``, which
    rewrites the same buffers in place. Construct with ``max_batch_size``,
    ``max_num_tokens`` and ``max_pages_per_request`` for CUDA graphs: buffers and launch
    grid then have fixed sizes, and a graph captured over ``run()`` stays valid across
    plans (q must keep the captured shape; pad it to max_num_tokens). Without them the
    buffers are sized by each plan and its tiles fitted to the batch's longest request (a
    batch of short requests gets short tiles), so a graph captured over ``run()`` is only
    valid until the next ``plan()``.

    >>> attn = AppendAttention(32, 8, 128, page_size=16, num_pages=4096)       # doctest: +SKIP
    >>> attn.plan(qo_indptr, block_tables, kv_lens)                           # doctest: +SKIP
    >>> for layer in layers:                                                 # doctest: +SKIP
    ...     attn.append_kv(k[layer], v[layer], k_caches[layer], v_caches[layer])
    ...     o = attn.run(q[layer], k_caches[layer], v_caches[layer])
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                 num_pages: int, dtype: torch.dtype | None = None, device=None,
                 max_batch_size: int | None = None, max_num_tokens: int | None = None,
                 max_pages_per_request: int | None = None):
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("page_size", page_size), ("num_pages", num_pages)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
        maxes = (max_batch_size, max_num_tokens, max_pages_per_request)
        if any(x is not None for x in maxes):
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in maxes):
                raise ValueError("for fixed buffers (CUDA graphs) give all of max_batch_size, max_num_tokens "
                                 f"and max_pages_per_request as positive ints, got {maxes}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.dtype = runtime.default_dtype() if dtype is None else dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {self.dtype}")
        self.device = torch.device(device) if device is not None else runtime.device()
        self.fixed = maxes[0] is not None
        self.group = num_qo_heads // num_kv_heads
        # Fixed buffers keep one tile size for good: a captured graph holds its kernel.
        self._set_config(append_tile_config(self.dtype, head_dim, self.group))
        fault_flag(self.device)             # allocated now, not inside a graph capture
        self._shape = None          # (batch, tokens, pages per request) the buffers hold
        self.planned = False
        if self.fixed:
            self._allocate(*maxes)

    # -- buffers ---------------------------------------------------------------------------
    def _set_config(self, config: dict) -> None:
        self.config = config
        self.tile_tokens = config["BLOCK_M"] // self.group

    def _allocate(self, batch: int, tokens: int, pages: int) -> None:
        dev, i32 = self.device, torch.int32
        work = -(-tokens // self.tile_tokens) + batch          # any layout of `tokens` fits
        self.qo_indptr = torch.zeros(batch + 1, dtype=i32, device=dev)
        self.block_tables = torch.zeros((batch, pages), dtype=i32, device=dev)
        self.kv_lens = torch.zeros(batch, dtype=i32, device=dev)
        self.work_req = torch.full((work,), -1, dtype=i32, device=dev)
        self.work_tile = torch.zeros(work, dtype=i32, device=dev)
        self.out = torch.empty((tokens, self.num_qo_heads, self.head_dim), dtype=self.dtype, device=dev)
        self.lse = torch.empty((tokens, self.num_qo_heads), dtype=torch.float32, device=dev)
        self._shape = (batch, tokens, pages)

    @staticmethod
    def _host(name, t, ndim):
        if isinstance(t, torch.Tensor):
            require_tensor(name, t, ndim=ndim, dtype=torch.int32, contiguous=False, any_device=True)
            return t.detach().to("cpu").contiguous()
        arr = torch.as_tensor(np.asarray(t), dtype=torch.int32)
        if arr.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(arr.shape)}")
        return arr

    # -- plan --------------------------------------------------------------------------------
    def plan(self, qo_indptr, block_tables, kv_lens, *, causal: bool = True,
             sm_scale: float | None = None) -> "AppendAttention":
        """Validate the batch layout, build the work list, copy both into this object's
        buffers. Host arrays (lists, numpy, CPU tensors) avoid any sync; device tensors
        are copied to the host first. Returns self."""
        indptr = self._host("qo_indptr", qo_indptr, 1)
        bt = self._host("block_tables", block_tables, 2)
        lens = self._host("kv_lens", kv_lens, 1)
        require_append_layout_shapes(indptr, bt, lens)
        _require_scale(sm_scale)
        raise_recorded_faults(self.device)
        require_append_layout(indptr, bt, lens, self.num_pages, self.page_size)
        B, width, total = bt.shape[0], bt.shape[1], int(indptr[-1])
        if self.fixed:
            mb, mt, mp = self._shape
            if B > mb or total > mt or width > mp:
                raise ValueError(f"this batch ({B} requests, {total} new tokens, block tables {width} pages "
                                 f"wide) does not fit the fixed buffers (max_batch_size={mb}, "
                                 f"max_num_tokens={mt}, max_pages_per_request={mp})")
        else:   # buffers sized by this plan, tiles fitted to its longest request
            n_max = int((indptr[1:] - indptr[:-1]).max()) if B else 1
            self._set_config(append_tile_config(self.dtype, self.head_dim, self.group, n_max))
            if self._shape != (B, total, width) or self.work_req.shape[0] < -(-total // self.tile_tokens) + B:
                self._allocate(B, total, width)
        req, tile = append_schedule(indptr.numpy(), lens.numpy(), self.tile_tokens, causal)
        nb = self._shape[0]
        # Requests past B (fixed buffers) are empty: indptr repeats its last value, length 0.
        host_indptr = torch.full((nb + 1,), total, dtype=torch.int32)
        host_indptr[:B + 1] = indptr
        host_bt = torch.zeros(self.block_tables.shape, dtype=torch.int32)
        host_bt[:B, :width] = bt
        host_lens = torch.zeros(nb, dtype=torch.int32)
        host_lens[:B] = lens
        host_req = torch.full(self.work_req.shape, -1, dtype=torch.int32)
        host_tile = torch.zeros(self.work_tile.shape, dtype=torch.int32)
        host_req[:len(req)] = torch.from_numpy(req)
        host_tile[:len(tile)] = torch.from_numpy(tile)
        for dst, src in ((self.qo_indptr, host_indptr), (self.block_tables, host_bt), (self.kv_lens, host_lens),
                         (self.work_req, host_req), (self.work_tile, host_tile)):
            dst.copy_(src)
        self.batch_size, self.num_tokens, self.num_work = B, total, len(req)
        self.causal, self.sm_scale = bool(causal), sm_scale
        self.planned = True
        return self

    # -- run -----------------------------------------------------------------------------------
    def _require_run(self, q, k_cache, v_cache, what="q"):
        if not self.planned:
            raise RuntimeError("call plan(qo_indptr, block_tables, kv_lens) before run()")
        require_rows(what, q, ndim=3, dtype=self.dtype)
        t = q.shape[0]
        cache_shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        require_rows("k_cache", k_cache, shape=cache_shape, dtype=self.dtype)
        require_rows("v_cache", v_cache, shape=cache_shape, dtype=self.dtype)
        heads = self.num_qo_heads if what == "q" else self.num_kv_heads
        if t < self.num_tokens or t > self._shape[1] or tuple(q.shape[1:]) != (heads, self.head_dim):
            raise ValueError(f"{what} must be [T, {heads}, {self.head_dim}] with {self.num_tokens} ≤ T ≤ "
                             f"{self._shape[1]} (the planned tokens; rows past them are padding), "
                             f"got {tuple(q.shape)}")
        require_same_device(**{what: q, "k_cache": k_cache, "v_cache": v_cache, "plan buffers": self.kv_lens})

    def run(self, q, k_cache, v_cache, out=None, lse=None, return_lse: bool = False):
        """Append attention of the planned batch: o [T, Hq, D] (and lse [T, Hq] float32,
        natural log, with ``return_lse`` or when ``lse`` is given). Without ``out``/``lse``
        the results are views of this object's buffers, overwritten by the next run()."""
        self._require_run(q, k_cache, v_cache)
        T = q.shape[0]
        if out is None:
            out = self.out[:T]
        else:
            require_rows("out", out, shape=q.shape, dtype=self.dtype)
        if lse is None and return_lse:
            lse = self.lse[:T]
        elif lse is not None:
            require_rows("lse", lse, shape=q.shape[:2], dtype=torch.float32)
        launch_append_attention(q, k_cache, v_cache, self.qo_indptr, self.block_tables, self.kv_lens,
                                self.work_req, self.work_tile, out, lse, fault_flag(self.device), self.causal,
                                self.sm_scale, self.config)
        return (out, lse) if lse is not None else out

    def append_kv(self, k, v, k_cache, v_cache) -> None:
        """Write the planned batch's new K/V ([T, Hkv, D]) into the caches, in place
        (no host sync, no allocation, capturable)."""
        self._require_run(k, k_cache, v_cache, what="k")
        require_rows("v", v, shape=k.shape, dtype=self.dtype)
        append_kv_into(k, v, self.qo_indptr, self.block_tables, self.kv_lens,
                       k_cache, v_cache,
                       search_steps=max(1, (self._shape[0] - 1).bit_length()))


def append_attention_planned_into(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale,
                                  o, lse):
    """The plan/run path with the check's calling convention (plan, then one run)."""
    total_q, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    attn = AppendAttention(hq, hkv, d, page_size=page_size, num_pages=num_pages, dtype=q.dtype, device=q.device)
    attn.plan(qo_indptr, block_tables, kv_lens, causal=causal, sm_scale=sm_scale)
    attn.run(q, k_cache, v_cache, out=o, lse=lse)

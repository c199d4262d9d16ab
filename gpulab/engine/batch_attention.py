r"""Attention for every batch shape the scheduler produces, over the paged KV cache.

A step mixes two shapes (the runner puts decodes first):

* **decode** rows: one new query per sequence over its whole history. That is
  notebook 05's paged decode (``gpulab.paged.paged_decode_attention``), or, when all
  of them share cached prefix pages, notebook 06's cascade
  (``gpulab.cascade.cascade_decode_attention``: the shared prefix is read once).
* **append** rows (prefill and chunked prefill, FlashInfer's "append"/paged-prefill):
  request b brings ``qo_indptr[b+1] - qo_indptr[b]`` new queries whose keys and values
  were just written to the end of its ``kv_lens[b]`` cached tokens. Query i of those T
  sits at position ``kv_lens[b] - T + i`` and attends to keys 0 .. that position:
  a causal mask shifted by the history.

``append_attention_reference`` is the PyTorch definition of the append shape;
:func:`append_attention` runs ``gpulab.prefill``'s Triton kernel for it on a GPU and the
reference on the CPU (the interpreter pays about a millisecond per program).
"""
from __future__ import annotations

import math

import torch

from ..cascade import cascade_decode_attention
from ..paged import fault_flag, gather_kv, paged_decode_attention, paged_decode_into
from ..prefill import append_attention as append_attention_kernel
from ..prefill import append_schedule_device, append_tile_config, launch_append_attention, plan_kv_split
from .. import runtime
from ..validate import require_same_device


def append_attention_reference(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens,
                               scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Ragged multi-query attention over paged history (PyTorch, float32 math).

    q: [total_q, Hq, D]; k_cache, v_cache: [pages, page_size, Hkv, D]; qo_indptr: int32
    [B+1]; block_tables: int32 [B, W]; kv_lens: int32 [B] (history + the new tokens).
    Returns o [total_q, Hq, D] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    indptr, lens = qo_indptr.tolist(), kv_lens.tolist()
    g = q.shape[1] // k_cache.shape[2]
    for b in range(len(lens)):
        lo, hi = indptr[b], indptr[b + 1]
        if hi == lo:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables, lens[b], b)          # [N, Hkv, D]
        qb = q[lo:hi].float().transpose(0, 1)                                  # [Hq, T, D]
        kb = k.float().repeat_interleave(g, 1).transpose(0, 1)
        vb = v.float().repeat_interleave(g, 1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * scale                                    # [Hq, T, N]
        if causal:
            t, n = hi - lo, lens[b]
            seen = torch.arange(n, device=q.device)[None, :] <= (n - t + torch.arange(t, device=q.device))[:, None]
            s = s.masked_fill(~seen, -math.inf)
        out[lo:hi] = (torch.softmax(s, dim=-1) @ vb).transpose(0, 1).to(q.dtype)
    return out


def append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, scale: float | None = None,
                     out: torch.Tensor | None = None, work: tuple | None = None):
    """The append rows of a step (prefill, chunked prefill): gpulab.prefill's kernel when
    compiled (no host sync), the PyTorch reference otherwise. Returns o [total_q, Hq, D]
    (written into ``out`` when given). ``work``: the step's work list from
    :func:`plan_append_attention`, built once for all layers (each layer then launches
    one kernel, instead of also rebuilding the list with a dozen small ones)."""
    if runtime.mode() == "compiled":
        if work is None:
            return append_attention_kernel(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens,
                                           sm_scale=scale, out=out)
        tiles, work_req, work_tile, split = work
        # attribute reads only (no sync): a list left on another device than q is an
        # error here, not a launch on host memory or another GPU's
        require_same_device(q=q, k_cache=k_cache, qo_indptr=qo_indptr, block_tables=block_tables,
                            kv_lens=kv_lens, work_req=work_req, work_tile=work_tile, out=out)
        o = torch.empty_like(q) if out is None else out
        launch_append_attention(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, work_req, work_tile,
                                o, None, fault_flag(q.device), True, scale, tiles, split)
        return o
    o = append_attention_reference(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, scale)
    if out is None:
        return o
    lo, hi = int(qo_indptr[0]), int(qo_indptr[-1])    # as the kernel: only the requests' rows
    out[lo:hi] = o[lo:hi]
    return out


def plan_append_attention(qo_indptr: torch.Tensor, total_q: int, dtype: torch.dtype, n_heads: int,
                          n_kv_heads: int, head_dim: int, device=None, capacity: int | None = None,
                          num_splits: int | None = None) -> tuple:
    """The append kernel's tile sizes, work list and KV split for a step's ``total_q``
    append rows (what :func:`gpulab.prefill.append_attention` builds at every call), built
    on the device without a host sync: (tiles, work_req, work_tile, split).

    ``device``: where the step's q and caches live (default: ``qo_indptr``'s). The work
    list is built there; an indptr on another device (the host) is copied there first,
    once per step (non-blocking), so that every layer's launch finds the list beside q.
    ``capacity``: the KV positions the append rows' block table can hold (its width ×
    page size, known on the host): with it, a step of few tiles over long histories
    splits each tile's KV range (:func:`gpulab.prefill.plan_kv_split`; its workspace is
    allocated here, once for all layers; ``num_splits`` forces the number of parts)."""
    if device is not None and qo_indptr.device != torch.device(device):
        qo_indptr = qo_indptr.to(device, non_blocking=True)
    group = n_heads // n_kv_heads
    tiles = append_tile_config(dtype, head_dim, group)
    work_req, work_tile = append_schedule_device(qo_indptr, total_q, tiles["BLOCK_M"] // group)
    split = None if capacity is None else plan_kv_split(
        work_req.shape[0], n_kv_heads, capacity, total_q, n_heads, head_dim, tiles["BLOCK_N"], qo_indptr.device,
        num_splits)
    return tiles, work_req, work_tile, split


def decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale=None, hook=None, prefix=None):
    """Paged decode for one query per sequence, where the runner holds no decode plan:
    cascade steps, a learner's hook, and CUDA-graph capture (eager steps on gpulab's
    kernels run the runner's :class:`~gpulab.paged.PagedDecodeWrapper` instead).

    ``prefix = (prefix_pages, prefix_len)``: every sequence shares those pages first and
    ``block_table``/``seq_lens`` describe only each one's own suffix; cascade attention
    then reads the prefix once for the whole batch. ``hook`` replaces gpulab's kernel
    (notebook 07 wires in the learner's own). While a CUDA graph is being captured, the
    launcher runs without the public function's host checks (they read seq_lens on the
    host, which a capture forbids); the runner checked the plan when it built it."""
    if prefix is not None:
        return cascade_decode_attention(q, k_cache, v_cache, prefix[0], prefix[1], block_table, seq_lens, scale)
    if hook is not None:
        return hook(q, k_cache, v_cache, block_table, seq_lens)
    if runtime.mode() == "compiled" and torch.cuda.is_current_stream_capturing():
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, scale)
        return o
    # the interpreter pays per program: one partition per sequence is fastest there
    splits = 1 if runtime.interpreting() else None
    return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, num_splits=splits)


def shared_prefix_pages(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> int:
    """How many leading pages every sequence of a decode batch has in common (full
    pages only: each sequence must also have at least one token after them)."""
    if len(block_tables) < 2:
        return 0
    n = min((length - 1) // block_size for length in seq_lens)
    first = block_tables[0]
    k = 0
    while k < n and all(bt[k] == first[k] for bt in block_tables):
        k += 1
    return k

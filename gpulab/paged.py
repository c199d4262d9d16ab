r"""Notebook 05: paged KV cache and paged decode attention (split-KV + reduce).

**The cache.** Keys and values of every sequence live in one pool of fixed-size
pages, ``k_cache, v_cache: [num_pages, page_size, Hkv, D]``. Sequence ``b`` owns the
pages listed in row ``b`` of its *block table*; its token ``t`` sits in

    page = block_table[b, t // page_size],      slot = t % page_size.

Only the last page of a sequence is partly empty, so at most ``page_size - 1``
slots per sequence are wasted, instead of the ``max_len - len`` of a contiguous
reservation. FlashInfer describes the same pages as a block-sparse row structure:
``indptr [B+1]`` (sequence ``b`` owns ``indices[indptr[b]:indptr[b+1]]``), ``indices``
(page ids) and ``last_page_len [B]`` (1..page_size), with
``seq_len = page_size·(n_pages − 1) + last_page_len``.

**Decode attention** (one new query token per sequence, ``q: [B, Hq, D]``, grouped
query attention with ``G = Hq / Hkv`` query heads per kv head, head ``h`` reads kv
head ``h // G``):

    s_j = scale · q · k_j                         for the seq_len tokens j of the sequence
    lse = log Σ_j exp(s_j)                        (natural log, float32, -inf if empty)
    o   = Σ_j exp(s_j − lse) · v_j                (0 if the sequence is empty)

computed in one pass with the online softmax (running max m, running sum l).

**Split-KV.** A batch of a few long sequences has too few (sequence, kv head) pairs
to fill the GPU's SMs. So the tokens are cut into partitions of ``part_len``; each
(sequence, kv head, partition) program writes a partial state (o_p, lse_p), then a
reduce combines them exactly:

    M = max_p lse_p,   w_p = exp(lse_p − M),   o = Σ_p w_p o_p / Σ_p w_p,
    lse = M + log Σ_p w_p

(vLLM v2 splits into 512-token partitions; here the count follows the batch and
the number of SMs). A partition past the end of its sequence is an *empty state*
(lse = −inf, o = 0): its weight is 0, and if every state is empty the result is
o = 0, lse = −inf, never NaN.

Safety without a host sync. Checking page ids and lengths reads device data, which
stalls the host until the GPU catches up, so the public functions do it only when asked
(``validate=True``, ``GPULAB_DEBUG=1``, :func:`gpulab.runtime.set_debug_checks`) and
:meth:`PagedDecodeWrapper.plan` does it once per batch layout. The kernels never rely on
it: a length outside [0, capacity] is clamped into that range and a page id outside the
pool is clamped into it (no address outside the cache or the block table is formed; the
output is then wrong), and either is recorded in a device-side fault flag
(:func:`fault_flag`) that the next validating call or plan reports.

The attention state (o, lse) follows :mod:`gpulab.attention_state`: float32, natural log,
shape [B, Hq], -inf for an empty sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .attention_state import (LOG2E, attention_state_reference, merge_epilogue, merge_max,
                              merge_states_reference, online_update, state_epilogue)
from .validate import FLOAT_DTYPES, require_float, require_same_device, require_tensor


class OutOfPages(RuntimeError):
    """The page pool has no free page left for an allocation or an append."""


class LayoutFault(RuntimeError):
    """A kernel launched without validation met a bad block table, page list or length."""


# =========================================================================================
# The cache: a page pool, an allocator and block tables
# =========================================================================================
class PagedKVCache:
    """A pool of KV pages with a page allocator and per-sequence block tables.

    >>> cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=16)
    >>> s = cache.allocate()                       # a new, empty sequence
    >>> cache.append(s, torch.randn(6, 2, 16), torch.randn(6, 2, 16))   # 6 tokens: 2 pages
    >>> cache.block_table([s]), cache.seq_lens([s])
    (tensor([[7, 6]], dtype=torch.int32), tensor([6], dtype=torch.int32))

    Pages are handed out from a free list; ``free`` returns them. Running out of
    pages raises :class:`OutOfPages` before anything is written: a full pool never
    overwrites another sequence's tokens.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, v in (("num_pages", num_pages), ("page_size", page_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        device = torch.device(device) if device is not None else runtime.device()
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        # Free list as a stack: the most recently freed page is reused first.
        self._free: list[int] = list(range(num_pages))
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    # -- allocator -------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def sequences(self) -> list[int]:
        return list(self._pages)

    def pages_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(self, n_tokens: int = 0) -> int:
        """Start a sequence with room for ``n_tokens`` tokens; returns its id."""
        need = self.pages_needed(n_tokens)
        self._reserve_check(need, f"a new sequence of {n_tokens} tokens")
        sid = self._next_id
        self._next_id += 1
        self._pages[sid] = [self._free.pop() for _ in range(need)]
        self._lens[sid] = 0
        self._reserved = None
        return sid

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens (``k, v: [T, Hkv, D]``) to sequence ``seq``, taking pages as needed."""
        self._known(seq)
        _, ps, hkv, d = self.k_cache.shape
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != (hkv, d):
                raise ValueError(f"{name} must have shape [T, {hkv}, {d}] (tokens, kv heads, head dim), "
                                 f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
        n_old, n_new = self._lens[seq], self._lens[seq] + k.shape[0]
        need = self.pages_needed(n_new) - len(self._pages[seq])
        self._reserve_check(need, f"appending {k.shape[0]} tokens to sequence {seq}")
        self._pages[seq] += [self._free.pop() for _ in range(max(0, need))]
        if k.shape[0]:
            t = torch.arange(n_old, n_new)
            pages = torch.tensor(self._pages[seq], dtype=torch.long)[t // ps]
            slots = t % ps
            dev = self.k_cache.device
            self.k_cache[pages.to(dev), slots.to(dev)] = k.to(self.k_cache.dtype).to(dev)
            self.v_cache[pages.to(dev), slots.to(dev)] = v.to(self.v_cache.dtype).to(dev)
        self._lens[seq] = n_new

    def free(self, seq: int) -> None:
        """Return the pages of ``seq`` to the pool (their contents are left as they are)."""
        self._known(seq)
        self._free += reversed(self._pages.pop(seq))
        del self._lens[seq]

    def _known(self, seq: int) -> None:
        if seq not in self._pages:
            raise KeyError(f"no sequence {seq!r} in this cache (live sequences: {self.sequences})")

    def _reserve_check(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise OutOfPages(f"out of KV pages: {what} needs {need} more page(s) of "
                             f"{self.page_size} tokens, only {len(self._free)} of {self.num_pages} "
                             f"are free. Free finished sequences (cache.free(seq)), or make the pool larger.")

    # -- views -----------------------------------------------------------------------------
    def seq_len(self, seq: int) -> int:
        self._known(seq)
        return self._lens[seq]

    def pages_of(self, seq: int) -> list[int]:
        self._known(seq)
        return list(self._pages[seq])

    def block_table(self, seqs=None, width: int | None = None) -> torch.Tensor:
        """int32 [B, width]: row b lists the pages of seqs[b], padded with 0."""
        seqs = self.sequences if seqs is None else list(seqs)
        rows = [self.pages_of(s) for s in seqs]
        width = max([len(r) for r in rows] + [1]) if width is None else width
        bt = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise ValueError(f"sequence {seqs[i]} has {len(r)} pages, more than width={width}")
            bt[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return bt.to(self.k_cache.device)

    def seq_lens(self, seqs=None) -> torch.Tensor:
        seqs = self.sequences if seqs is None else list(seqs)
        return torch.tensor([self.seq_len(s) for s in seqs], dtype=torch.int32,
                            device=self.k_cache.device)

    def flashinfer_view(self, seqs=None):
        """FlashInfer's (kv_indptr, kv_indices, kv_last_page_len), int32, for ``seqs``."""
        seqs = self.sequences if seqs is None else list(seqs)
        rows = [self.pages_of(s) for s in seqs]
        indptr = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.tensor([p for r in rows for p in r], dtype=torch.int32)
        last = torch.tensor([(self.seq_len(s) - 1) % self.page_size + 1 if self.seq_len(s) else 0
                             for s in seqs], dtype=torch.int32)
        dev = self.k_cache.device
        return indptr.to(dev), indices.to(dev), last.to(dev)

    def page_owners(self) -> torch.Tensor:
        """int [num_pages]: the sequence owning each page, -1 for a free page (for plots)."""
        owner = torch.full((self.num_pages,), -1, dtype=torch.int64)
        for s, pages in self._pages.items():
            owner[pages] = s
        return owner

    def utilization(self) -> float:
        """Fraction of the slots in used pages that hold a token."""
        used = self.used_pages * self.page_size
        return sum(self._lens.values()) / used if used else 1.0


def from_flashinfer(indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                    page_size: int):
    """(block_table, seq_lens) from FlashInfer's (indptr, indices, last_page_len)."""
    counts = (indptr[1:] - indptr[:-1]).long()
    width = max(1, int(counts.max()) if counts.numel() else 1)
    bt = torch.zeros((counts.numel(), width), dtype=torch.int32, device=indices.device)
    for b in range(counts.numel()):
        bt[b, :counts[b]] = indices[int(indptr[b]):int(indptr[b + 1])]
    lens = torch.where(counts > 0, page_size * (counts - 1) + last_page_len.long(), 0)
    return bt, lens.to(torch.int32)


def to_flashinfer(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """FlashInfer's (indptr, indices, last_page_len) from (block_table, seq_lens)."""
    n_pages = (seq_lens.long() + page_size - 1) // page_size
    indptr = torch.zeros(n_pages.numel() + 1, dtype=torch.int32, device=block_table.device)
    indptr[1:] = n_pages.cumsum(0)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < n_pages[:, None]
    indices = block_table[used].to(torch.int32)
    last = torch.where(seq_lens > 0, (seq_lens.long() - 1) % page_size + 1, 0).to(torch.int32)
    return indptr, indices, last


# =========================================================================================
# Reference (float64)
# =========================================================================================
def gather_kv(k_cache, v_cache, block_table, seq_len: int, b: int):
    """The first seq_len keys and values of sequence b, contiguous: [seq_len, Hkv, D]."""
    ps = k_cache.shape[1]
    n_pages = -(-seq_len // ps)
    pages = block_table[b, :n_pages].long()
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:seq_len]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:seq_len]
    return k, v


def paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale=None, **_):
    """{"o": [B, Hq, D] float64, "lse": [B, Hq] float64 (natural log)}: each sequence's
    pages gathered into contiguous keys and values, then plain attention."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = gather_kv(k_cache, v_cache, block_table, int(seq_lens[b]), b)
        o, lse = attention_state_reference(q[b], k, v, scale)
        outs.append(o)
        lses.append(lse)
    return {"o": torch.stack(outs), "lse": torch.stack(lses)}


def split_reduce_reference(o_part, lse_part):
    """Merge the partial states along dim 2: o_part [B, H, S, D], lse_part [B, H, S]."""
    return merge_states_reference(o_part, lse_part)


# =========================================================================================
# Triton kernels
# =========================================================================================
@triton.jit
def checked_pages(page, t_mask, num_pages):
    """Page ids read from a table the kernel does not trust: (the ids clamped into
    [0, num_pages), so no address outside the cache is ever formed, and bad: int32, 1 per
    live token whose id was outside). A bad id's tokens then read some page of the pool:
    the output is wrong and the caller records the fault. Paged decode, cascade's prefix
    kernel and append attention use it.

    Why clamp rather than mask the bad tokens out: a mask computed from the loaded page
    ids makes Triton (3.6 and 3.9, sm_90) pipeline those loads through shared memory with
    extra barriers in every tile. With it the prefix kernel took 595 µs on the H200,
    against 407 µs for the 2026-11-29 kernel without a check (2026-12-02,
    ``tools/cascade_ab.py``). Clamping touches only the addresses: the loop compiles as
    that kernel's did, plus one unsigned min per page id."""
    as_unsigned = page.to(tl.uint32)     # a negative id becomes a huge one: one compare, one min
    bad = t_mask & (as_unsigned >= num_pages)
    return tl.minimum(as_unsigned, num_pages - 1).to(tl.int32), bad.to(tl.int32)


@triton.jit
def paged_tile_update(m, l, acc, q, k_ptr, v_ptr, page, slot, t_mask, d, d_mask, kvh, num_pages,
                      stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                      qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step (:func:`gpulab.attention_state.online_update`) over a tile of
    tokens stored in pages: token i of the tile is slot ``slot[i]`` of page ``page[i]`` of
    kv head ``kvh``; tokens with ``t_mask`` False are skipped. q [M, D] holds the query rows.
    Page ids come from a table the kernel does not trust: one outside [0, num_pages) is
    clamped into the pool, so no address outside the cache is formed (its tokens read some
    page of the pool: the output is wrong, and the caller records the fault), and counted.
    Returns (m, l, acc, bad: 1 per token whose page id was out of range, else 0). Callers
    add ``bad`` up over their loop and sum it once after: a sum per tile is a reduction
    across warps, a barrier in every iteration. Shared by paged decode and cascade's
    shared-prefix kernel."""
    page, bad = checked_pages(page, t_mask, num_pages)
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt
                + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt
                + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:   # bf16 tl.dot is wrong in the interpreter: compute in fp32 there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
    m, l, acc = online_update(m, l, acc, s, v, True, False, 0.0, IEEE)
    return m, l, acc, bad


# Sizes that change from one engine step to the next are not specialised on: Triton would
# compile the kernel again (about a second) for each new value class (1, multiple of 16, other).
@triton.jit(do_not_specialize=["stride_btb", "max_pages"])
def _decode_partition_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr, fault_ptr,
        qk_scale,                       # softmax scale · log2(e): scores in base 2
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_btb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh, stride_ls,
        part_len, head_dim, num_pages, max_pages,
        PAGE_SIZE: tl.constexpr,        # constant: t // PAGE_SIZE is a shift, not a division
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One program: one sequence, one kv head (all GROUP query heads that read it), one
    partition of part_len tokens. Writes the partition's (o, lse) at index pid(2)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # A length outside [0, capacity] would read past the block table's row: clamp it.
    seq_len = tl.load(seq_lens_ptr + b)
    capacity = max_pages * PAGE_SIZE
    faults = tl.where((seq_len < 0) | (seq_len > capacity), 2, 0)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), capacity)
    start = split * part_len
    end = tl.minimum(seq_len, start + part_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < head_dim
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max (base-2 units)
    l = tl.zeros([BLOCK_G], tl.float32)                  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bad_pages = tl.zeros([BLOCK_N], tl.int32)   # summed once after the loop (see paged_tile_update)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        # Through the block table: token t lives in page bt[b, t // PAGE_SIZE].
        page = tl.load(bt_ptr + b * stride_btb + t // PAGE_SIZE, mask=t_mask, other=0)
        m, l, acc, n_bad = paged_tile_update(
            m, l, acc, q, k_ptr, v_ptr, page, t % PAGE_SIZE, t_mask, d, d_mask, kvh, num_pages,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
            UPCAST, IEEE)
        bad_pages += n_bad
    faults = faults | tl.where(tl.sum(bad_pages, 0) > 0, 1, 0)
    if faults != 0:                 # 1: FAULT_PAGE, 2: FAULT_SEQ_LEN (see fault_flag)
        tl.atomic_or(fault_ptr, faults)
        tl.atomic_min(fault_ptr + 1, b)

    # An empty partition (no tokens) is the empty state: o = 0, lse = -inf.
    out, lse = state_epilogue(m, l, acc)
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _split_reduce_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, rows_ptr, rows_last, num_splits, num_heads,
                         stride_pb, stride_ph, stride_ps,
                         stride_lpb, stride_lph, stride_lps,
                         stride_ob, stride_oh, stride_lb, stride_lh, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr):
    """One program per (sequence, query head): merge num_splits partial states. With
    HAS_ROWS, only rows from rows_ptr[0] up to rows_ptr[rows_last] (int32 on the device:
    a qo_indptr) are written; the others are left alone."""
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    live = True
    if HAS_ROWS:
        live = (b >= tl.load(rows_ptr)) & (b < tl.load(rows_ptr + rows_last))
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = (s < num_splits) & live
    lse_p = tl.load(lse_part_ptr + b * stride_lpb + h * stride_lph + s * stride_lps,
                    mask=s_mask, other=float("-inf"))
    m = merge_max(tl.max(lse_p, axis=0))
    w = tl.exp(lse_p - m)                            # 0 for an empty state
    inv, lse = merge_epilogue(m, tl.sum(w, axis=0))
    o_p = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < head_dim), other=0.0).to(tl.float32)
    o = tl.sum(w[:, None] * o_p, axis=0) * inv
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=(d < head_dim) & live)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse, mask=live)


# -- launch configuration --------------------------------------------------------------------
# Tile configurations: the first list fits the 64 KiB of shared memory of sm_75 (Colab's
# T4) for every dtype; the second, for sm_80+ (A100, H100/H200), adds deeper pipelines,
# 128-token tiles and two warps (the H200's fastest at B64 L4096 unsplit, by 1 µs).
# Compile-only checks (no GPU) use the first list.
_DECODE_SMALL = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3))
_DECODE_SMALL_FP32 = ((32, 4, 2), (32, 4, 3), (32, 8, 2))
_DECODE_BIG = ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (64, 8, 4), (64, 2, 3))


def big_smem() -> bool:
    """True on GPUs with ≥ 100 KiB of shared memory per block (sm_80 and newer)."""
    cc = runtime.compute_capability()
    return bool(cc) and cc[0] >= 8


def autotuned_variants(kernel, lists: dict, make, key, interp):
    """{list name: ``kernel`` autotuned over that list of configs} (``make(*config)`` builds
    a ``triton.Config``); in the interpreter, which cannot autotune, the one config
    ``interp`` for every name. Paged decode and cascade's prefix kernel use it."""
    if runtime.interpreting():
        one = triton.autotune(configs=[make(*interp)], key=key)(kernel)
        return {name: one for name in lists}
    return {name: triton.autotune(configs=runtime.tuning_configs([make(*c) for c in cs]), key=key)(kernel)
            for name, cs in lists.items()}

def config_list(dtype) -> str:
    """Which config list fits this GPU and dtype: "big" for 16-bit tiles on sm_80+,
    "small" for 16-bit tiles on smaller GPUs and for float32 on sm_80+, "small_fp32"
    for float32 on smaller GPUs."""
    if dtype == torch.float32:   # twice the bytes per tile: the big tiles overflow even sm_90
        return "small" if big_smem() else "small_fp32"
    return "big" if big_smem() else "small"


# The tuning key holds no shape (an engine step must not meet a new key), so one choice
# would serve every launch. A launch with few programs per SM wants other tiles than a
# full one: on the H200 the choice made at B64 L4096 (BLOCK_N 32, 64 or 128 from one
# run to the next: a few percent apart there) took B4 L32768 from 144 µs (32) to 165
# (64). So each list is tuned twice, once for each regime (launch_regime).
_DECODE_LISTS = {"small": _DECODE_SMALL, "small_fp32": _DECODE_SMALL_FP32, "big": _DECODE_BIG}
_decode_tuned = autotuned_variants(
    _decode_partition_kernel,
    {(name, regime): configs for name, configs in _DECODE_LISTS.items() for regime in ("full", "few")},
    lambda bn, w, st: triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st),
    key=["BLOCK_G", "BLOCK_D", "UPCAST", "IEEE"], interp=(32, 4, 1))
FEW_PROGRAMS_PER_SM = 6


def launch_regime(programs: int) -> str:
    """"few" when a launch has fewer than FEW_PROGRAMS_PER_SM programs per SM (long
    contexts at small batch, split into partitions; batches of a few hundred kv-head
    programs, unsplit), else "full". On the H200 both kinds of "few" launch ranked the
    tiles alike (tools/paged_probe.py)."""
    return "few" if programs < FEW_PROGRAMS_PER_SM * runtime.num_sms() else "full"


def part_align() -> int:
    """Partition lengths are multiples of this (a multiple of every BLOCK_N config)."""
    return 32 if runtime.interpreting() else 128


def min_part_len() -> int:
    """Shortest partition worth a program of its own (the reduce is not free)."""
    return 32 if runtime.interpreting() else 512


# Splitting costs a second launch and a round trip of the partial states through memory.
# On the H200 (2026-12-02, tools/paged_probe.py, CUDA graph), B64 L4096 with 32/8 heads
# (512 programs, 3.9 per SM) took 254-256 µs unsplit and 259-267 µs in two partitions.
UNSPLIT_PROGRAMS_PER_SM = 2


def plan_splits(batch: int, kv_heads: int, capacity: int, num_sms: int | None = None) -> tuple[int, int]:
    """(num_splits, part_len) for a decode launch.

    Sequences are split only when batch·kv_heads programs would leave SMs idle (fewer
    than ``UNSPLIT_PROGRAMS_PER_SM`` per SM); then aim at ≥ 4 programs per SM, partitions
    of at least ``min_part_len()`` tokens. Planned from the block table's capacity (no
    device sync), like FlashInfer's plan()."""
    sms = runtime.num_sms() if num_sms is None else num_sms
    capacity = max(1, capacity)
    programs = max(1, batch * kv_heads)
    if programs >= UNSPLIT_PROGRAMS_PER_SM * sms:
        return fixed_splits(capacity, 1)
    want = -(-4 * sms // programs)
    splits = max(1, min(want, capacity // min_part_len()))
    return fixed_splits(capacity, splits)


def fixed_splits(capacity: int, num_splits: int) -> tuple[int, int]:
    """(num_splits, part_len) for roughly num_splits aligned partitions of capacity tokens."""
    align = part_align()
    part = -(-max(1, capacity) // max(1, num_splits))
    part = -(-part // align) * align
    return -(-max(1, capacity) // part), part


def group_block(group: int) -> int:
    """Rows of the query tile for GROUP query heads: tl.dot needs at least 16."""
    return max(16, runtime.next_power_of_2(group))


# -- the fault flag --------------------------------------------------------------------------
FAULT_PAGE = 1          # a block-table entry that a sequence uses is not a page of the pool
FAULT_SEQ_LEN = 2       # a length below 0 or above the block table's capacity
FAULT_PREFIX_PAGE = 4   # a page of a shared prefix (gpulab.cascade) is not a page of the pool
_NO_SEQUENCE = 2 ** 31 - 1
_FAULT_FLAGS: dict = {}


def _flag_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def fault_flag(device) -> torch.Tensor:
    """The fault flag of ``device``: int32 [2] = [bitmask of the faults kernels met
    (FAULT_PAGE, FAULT_SEQ_LEN, FAULT_PREFIX_PAGE), lowest sequence index that met one].
    Allocated on first use without a host sync, then shared by every launch on the device
    (a captured CUDA graph keeps pointing at it)."""
    key = _flag_key(device)
    flag = _FAULT_FLAGS.get(key)
    if flag is None:
        flag = torch.empty(2, dtype=torch.int32, device=key)
        flag[0:1].fill_(0)
        flag[1:2].fill_(_NO_SEQUENCE)
        _FAULT_FLAGS[key] = flag
    return flag


def raise_recorded_faults(device) -> None:
    """Raise :class:`LayoutFault` if a kernel on ``device`` met a bad layout since the last
    report, and clear the flag. Reads the flag: a host sync (plan and validating calls only)."""
    flag = _FAULT_FLAGS.get(_flag_key(device))
    if flag is None:
        return
    kinds, seq = flag.tolist()
    if kinds == 0:
        return
    flag[0:1].fill_(0)
    flag[1:2].fill_(_NO_SEQUENCE)
    what = [text for bit, text in ((FAULT_PAGE, "a block-table entry was not a page of the cache"),
                                   (FAULT_SEQ_LEN, "a sequence length was negative or above the block "
                                                   "table's capacity (width × page_size)"),
                                   (FAULT_PREFIX_PAGE, "a shared-prefix page was not a page of the cache"))
            if kinds & bit]
    where = f" (first sequence affected: {seq})" if seq != _NO_SEQUENCE else ""
    raise LayoutFault(
        "an earlier paged attention call ran without validation on a bad layout: " + "; ".join(what)
        + where + ". The kernels clamped those entries into range (nothing outside the cache was "
        "read), so that "
        "call's output is wrong for the sequences affected. Re-run it with validate=True, or "
        "GPULAB_DEBUG=1, to get the exact entry; a serving engine re-plans after changing the layout.")


# =========================================================================================
# Launchers (no validation: the public functions and plan() validate)
# =========================================================================================
def decode_partials_into(q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part,
                         part_len: int, scale: float | None = None):
    """Launch the partition kernel: o_part [B, Hq, S, D] and lse_part [B, Hq, S] (any
    strides, last dim of o_part contiguous) receive S = o_part.shape[2] partial states."""
    B, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d ** -0.5 if scale is None else scale
    splits = o_part.shape[2]
    if B == 0 or splits == 0:
        return
    upcast = runtime.interpreting() and q.dtype == torch.bfloat16
    ieee = q.dtype == torch.float32
    block_g, block_d = group_block(hq // hkv), max(16, runtime.next_power_of_2(d))
    # each .stride() is one call into torch: the tuples, sliced, cost a decode call less host time
    runtime.launch_tuned(
        _decode_tuned[config_list(q.dtype), launch_regime(B * hkv * splits)], (B, hkv, splits),
        (q.dtype, o_part.dtype, block_g, block_d, upcast, ieee),
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, fault_flag(q.device), scale * LOG2E,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        *o_part.stride()[:3], *lse_part.stride()[:3],
        part_len, d, k_cache.shape[0], block_table.shape[1], PAGE_SIZE=k_cache.shape[1],
        GROUP=hq // hkv, BLOCK_G=block_g, BLOCK_D=block_d, UPCAST=upcast, IEEE=ieee)


def split_reduce_into(o_part, lse_part, o, lse, rows=None):
    """Merge o_part [B, H, S, D], lse_part [B, H, S] into o [B, H, D], lse [B, H]; when
    ``rows`` (an int32 qo_indptr on the device, read there) is given, only rows from
    rows[0] up to rows[-1]: the rest of o and lse stay as they are."""
    B, h, s, d = o_part.shape
    if B * h == 0:
        return
    runtime.launch(
        _split_reduce_kernel, (B * h,), {"num_warps": 4},
        o_part, lse_part, o, lse, rows if rows is not None else lse, 0 if rows is None else rows.shape[0] - 1, s, h,
        *o_part.stride()[:3], *lse_part.stride()[:3], *o.stride()[:2], *lse.stride()[:2], d,
        BLOCK_S=runtime.next_power_of_2(max(1, s)), BLOCK_D=runtime.next_power_of_2(d),
        HAS_ROWS=rows is not None)


def decode_partitioning(batch: int, kv_heads: int, capacity: int, num_splits: int | None = None):
    """(num_splits, part_len): planned from the batch and the SMs, or ``num_splits`` forced."""
    if num_splits is None:
        return plan_splits(batch, kv_heads, capacity)
    return fixed_splits(capacity, num_splits)


def paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, scale=None,
                      num_splits: int | None = None):
    """Launcher (no validation): decode attention into o [B, Hq, D] and lse [B, Hq]."""
    B, hq, d = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1]
    splits, part = decode_partitioning(B, k_cache.shape[2], capacity, num_splits)
    if splits == 1:   # one partition: the kernel writes the final state directly
        decode_partials_into(q, k_cache, v_cache, block_table, seq_lens,
                             o[:, :, None, :], lse[:, :, None], part, scale)
        return
    o_part = torch.empty((B, hq, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, hq, splits), dtype=torch.float32, device=q.device)
    decode_partials_into(q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, part, scale)
    split_reduce_into(o_part, lse_part, o, lse)


def paged_decode_split_into(q, k_cache, v_cache, block_table, seq_lens, num_splits, o, lse):
    """Launcher with a forced number of partitions (for the split-KV check)."""
    paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, num_splits=num_splits)


# =========================================================================================
# Public API: validation, the convenience function, plan/run
# =========================================================================================
def require_block_table(block_table, seq_lens, batch: int | None = None) -> None:
    """Dtypes, shapes and devices of a block table and its lengths (host-side only)."""
    require_tensor("block_table", block_table, ndim=2, dtype=torch.int32)
    require_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32)
    require_same_device(block_table=block_table, seq_lens=seq_lens)
    if batch is not None and (block_table.shape[0] != batch or seq_lens.shape[0] != batch):
        raise ValueError(f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} "
                         f"entries; both must equal the batch size {batch} (q.shape[0])")
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} "
                         f"entries: one row and one length per sequence")


def plainly_valid_paged_inputs(q, k_cache, v_cache, block_table, seq_lens) -> bool:
    """True when :func:`require_paged_inputs` passes, tested with a few attribute reads
    in one expression (its full checks, one helper call per tensor, cost a decode-sized
    call a good part of its host time). False means "run the full checks", never
    "invalid"."""
    try:
        dev = q.device
        return bool(q.dim() == 3 and q.dtype in FLOAT_DTYPES and k_cache.dim() == 4
                    and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype and v_cache.shape == k_cache.shape
                    and block_table.dim() == 2 and block_table.dtype == torch.int32
                    and seq_lens.dim() == 1 and seq_lens.dtype == torch.int32
                    and q.shape[0] == block_table.shape[0] == seq_lens.shape[0]
                    and q.shape[2] == k_cache.shape[3] <= 256 and k_cache.shape[2] > 0
                    and q.shape[1] % k_cache.shape[2] == 0
                    and k_cache.device == dev and v_cache.device == dev and block_table.device == dev
                    and seq_lens.device == dev
                    and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                    and block_table.is_contiguous() and seq_lens.is_contiguous()
                    and not runtime.COMPILE_ONLY and runtime.runs_on(dev))
    except (AttributeError, TypeError, IndexError):
        return False


def require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens) -> None:
    """Shapes, dtypes and devices of a paged decode call. Host-side only: reads no device
    data, so it never waits for the GPU (:func:`require_paged_layout` checks the values)."""
    if plainly_valid_paged_inputs(q, k_cache, v_cache, block_table, seq_lens):
        return
    require_query_and_cache(q, k_cache, v_cache)
    require_block_table(block_table, seq_lens, q.shape[0])
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)


def require_query_and_cache(q, k_cache, v_cache) -> None:
    """Queries [B, Hq, D] and a paged cache [pages, page_size, Hkv, D] that fit each other."""
    require_tensor("q", q, ndim=3)
    require_float("q", q)
    require_tensor("k_cache", k_cache, ndim=4, dtype=q.dtype)
    require_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=q.dtype)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    _, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k_cache has {dk}: caches are [pages, page_size, Hkv, D]")
    if d > 256:
        raise ValueError(f"head_dim {d} > 256 is not supported (one program holds a query row in registers)")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} kv heads (GQA needs Hq = G·Hkv)")


def require_paged_layout(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                         num_pages: int) -> None:
    """Every length in [0, capacity] (capacity = block-table width × page_size) and every
    block-table entry a sequence uses (its first ceil(len / page_size)) a page of the pool.
    Entries past a sequence's pages are padding and never read. Reads device data: a host
    sync, so plan() and validating calls run it, not the hot path."""
    if seq_lens.numel() == 0:
        return
    width = block_table.shape[1]
    capacity = width * page_size
    lo, hi = (int(x) for x in torch.stack([seq_lens.min(), seq_lens.max()]).tolist())
    if lo < 0:
        b = int((seq_lens < 0).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} is negative")
    if hi > capacity:
        b = int((seq_lens > capacity).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} exceeds the block table's capacity of "
                         f"{width} pages × {page_size} tokens = {capacity}")
    n_pages = (seq_lens.long() + page_size - 1) // page_size
    used = torch.arange(width, device=block_table.device)[None, :] < n_pages[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise IndexError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache "
                         f"(valid pages: 0..{num_pages - 1}); sequence {b} has {int(seq_lens[b])} tokens, "
                         f"so its first {int(n_pages[b])} entries must all be valid page ids")


def require_scale(scale) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not scale == scale or abs(scale) == float("inf")):
        raise ValueError(f"scale must be a finite number or None (head_dim ** -0.5), got {scale!r}")


def require_num_splits(num_splits) -> None:
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale: float | None = None,
                           return_lse: bool = False, num_splits: int | None = None,
                           validate: bool | None = None):
    """Decode attention over a paged KV cache.

    Parameters
    ----------
    q : [B, Hq, D] float tensor, one query token per sequence.
    k_cache, v_cache : [num_pages, page_size, Hkv, D], same dtype as q; Hq % Hkv == 0.
    block_table : int32 [B, max_pages]; row b lists the pages of sequence b in order.
    seq_lens : int32 [B], 0 ≤ seq_lens[b] ≤ max_pages · page_size.
    scale : softmax scale, default D ** -0.5.
    return_lse : also return lse [B, Hq] (float32, natural log; -inf for an empty sequence).
    num_splits : partitions per sequence (default: planned from the batch and the SM count).
    validate : check the layout's values (page ids in range, lengths within capacity) and
        report faults recorded by earlier unvalidated calls. This reads device data, a host
        sync; the default (None) follows :func:`gpulab.runtime.debug_checks` (``GPULAB_DEBUG``).
        Without it a bad entry never makes the kernel read outside the cache; it is
        recorded in :func:`fault_flag`.

    Returns o [B, Hq, D] (q's dtype), and lse if ``return_lse``. For repeated calls on one
    batch layout (a serving loop), :class:`PagedDecodeWrapper` plans once and runs with no
    allocation, capturable in a CUDA graph.
    """
    require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens)
    require_num_splits(num_splits)
    require_scale(scale)
    if runtime.debug_checks() if validate is None else validate:
        raise_recorded_faults(q.device)
        require_paged_layout(block_table, seq_lens, k_cache.shape[1], k_cache.shape[0])
    B, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, hq), dtype=torch.float32, device=q.device)
    if B:
        paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, scale, num_splits)
    return (o, lse) if return_lse else o


def require_plan_shapes(num_qo_heads, num_kv_heads, head_dim, page_size, num_pages, dtype, scale) -> None:
    """The sizes a plan is made for: positive ints, Hq a multiple of Hkv, a float dtype."""
    for name, v in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("page_size", page_size), ("num_pages", num_pages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads = {num_qo_heads} is not a multiple of num_kv_heads = "
                         f"{num_kv_heads} (GQA needs Hq = G·Hkv)")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    require_scale(scale)


def plan_buffer_shapes(batch: int, num_qo_heads: int, head_dim: int, splits: int, dtype) -> dict:
    """{name: (shape, dtype)} of the buffers a decode plan owns: outputs, and partial
    states when there is more than one partition."""
    shapes = {"o": ((batch, num_qo_heads, head_dim), dtype), "lse": ((batch, num_qo_heads), torch.float32)}
    if splits > 1:
        shapes["o_part"] = ((batch, num_qo_heads, splits, head_dim), torch.float32)
        shapes["lse_part"] = ((batch, num_qo_heads, splits), torch.float32)
    return shapes


def keep_or_allocate(buffers: dict, shapes: dict, device) -> None:
    """Allocate the buffers of a plan, keeping those whose shape, dtype and device did not
    change (so a CUDA graph captured before a re-plan of the same shapes stays valid)."""
    for name, (shape, dt) in shapes.items():
        old = buffers.get(name)
        if old is None or tuple(old.shape) != tuple(shape) or old.dtype != dt or old.device != device:
            buffers[name] = torch.empty(shape, dtype=dt, device=device)
    fault_flag(device)                  # allocated at plan time too, never inside a capture


def require_run_inputs(plan: dict, buffers: dict, q, k_cache, v_cache, out, lse):
    """run()'s host-side checks against the plan (no device data read); returns (out, lse),
    the plan's own buffers where None was given."""
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != plan["q_shape"] or q.dtype != plan["dtype"]:
        raise ValueError(f"q must be {plan['dtype']} of the planned shape {plan['q_shape']}, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != plan["cache_shape"] or c.dtype != plan["dtype"]:
            raise ValueError(f"{name} must be {plan['dtype']} of the planned shape {plan['cache_shape']}, "
                             f"got {getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}"
                             ": plan again for another cache")
    out = buffers["o"] if out is None else out
    lse = buffers["lse"] if lse is None else lse
    if out.shape != q.shape or out.dtype != q.dtype or lse.shape != q.shape[:2] or lse.dtype != torch.float32:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} and lse float32 {tuple(q.shape[:2])}")
    if any(t.device != plan["device"] for t in (q, k_cache, v_cache, out, lse)):
        raise ValueError(f"q, k_cache, v_cache, out and lse must be on {plan['device']}, where the plan is")
    return out, lse


class PagedDecodeWrapper:
    """Paged decode attention planned once per batch layout and run without host syncs.

    :meth:`plan` takes the batch layout, validates it (the only place that reads device
    data), chooses the split-KV partitioning and allocates the workspace and the outputs.
    :meth:`run` then only launches kernels: no host sync, no allocation, so a serving loop
    can capture it in a CUDA graph and replay it every step, for every layer.

    **What may change between runs without a new plan**: the *contents* of the
    ``block_table`` and ``seq_lens`` tensors given to :meth:`plan` (a serving engine
    appends a token or gives a sequence a new page in place), provided every length stays
    in [0, width × page_size] and every used entry is a page of the pool (otherwise the
    kernel stays inside the cache, its output is wrong, and it records a fault that the
    next checking plan reports: see ``check_layout``); and the contents of q, k_cache and v_cache (eagerly, any tensors
    of the planned shapes; in a graph, the captured ones). **What needs a new plan**: the batch size, the block table's
    width, the numbers of heads, the head dim, the page size, the pool size, the dtype,
    ``scale``, ``num_splits``, or other ``block_table`` / ``seq_lens`` tensors (the plan keeps
    the two it was given). Re-planning with unchanged shapes keeps every buffer, so a graph
    captured before stays valid.

    Examples
    --------
    >>> import torch, gpulab
    >>> from gpulab.paged import PagedDecodeWrapper, PagedKVCache
    >>> dev = gpulab.device()
    >>> cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=16, device=dev)
    >>> seqs = [cache.allocate() for _ in range(2)]
    >>> for s, n in zip(seqs, (5, 9)):
    ...     cache.append(s, torch.randn(n, 2, 16), torch.randn(n, 2, 16))
    >>> block_table, seq_lens = cache.block_table(seqs, width=4), cache.seq_lens(seqs)
    >>> decode = PagedDecodeWrapper()
    >>> decode.plan(block_table, seq_lens, num_qo_heads=4, num_kv_heads=2, head_dim=16,
    ...             page_size=4, num_pages=8, dtype=torch.float32)
    >>> o = decode.run(torch.randn(2, 4, 16, device=dev), cache.k_cache, cache.v_cache)
    >>> o.shape
    torch.Size([2, 4, 16])
    >>> seq_lens += 1                     # one more token each (its K, V written to the cache)
    >>> o = decode.run(torch.randn(2, 4, 16, device=dev), cache.k_cache, cache.v_cache)
    """

    def __init__(self):
        self._planned = None
        self._buffers: dict = {}

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
             dtype: torch.dtype, scale: float | None = None, num_splits: int | None = None,
             check_layout: bool = True) -> None:
        """Validate the batch layout, choose the partitioning, allocate the buffers.

        Parameters
        ----------
        block_table : int32 [B, width]; row b lists the pages of sequence b (kept by reference).
        seq_lens : int32 [B] (kept by reference): 0 ≤ seq_lens[b] ≤ width · page_size.
        num_qo_heads, num_kv_heads, head_dim, page_size, num_pages : the shapes of q
            [B, num_qo_heads, head_dim] and of the caches [num_pages, page_size, num_kv_heads, head_dim].
        dtype : the dtype of q and the caches (float32, float16 or bfloat16).
        scale : softmax scale (default head_dim ** -0.5). num_splits : forced partitions per
            sequence (default: planned from the batch and the number of SMs).
        check_layout : read the layout's values and check them (every length within the
            block table's capacity, every used entry a page of the pool), and report the
            faults kernels recorded since the last check (:func:`raise_recorded_faults`).
            Both read device data: a host sync. A caller that builds the layout on the
            host from its own page pool, and plans every step, passes False (the serving
            engine: a sync per step would stall its pipeline) and reads the fault flag
            where it waits anyway; the kernels stay inside the cache either way.
        """
        require_block_table(block_table, seq_lens)
        require_plan_shapes(num_qo_heads, num_kv_heads, head_dim, page_size, num_pages, dtype, scale)
        require_num_splits(num_splits)
        device = block_table.device
        if check_layout:
            raise_recorded_faults(device)
            require_paged_layout(block_table, seq_lens, page_size, num_pages)
        B, width = block_table.shape
        splits, part = decode_partitioning(B, num_kv_heads, width * page_size, num_splits)
        keep_or_allocate(self._buffers, plan_buffer_shapes(B, num_qo_heads, head_dim, splits, dtype), device)
        self._planned = dict(block_table=block_table, seq_lens=seq_lens, splits=splits, part=part,
                             scale=scale, dtype=dtype, device=device,
                             q_shape=(B, num_qo_heads, head_dim),
                             cache_shape=(num_pages, page_size, num_kv_heads, head_dim))

    @property
    def num_splits(self) -> int:
        """Partitions per sequence chosen by the last plan."""
        return self._require_plan()["splits"]

    def _require_plan(self) -> dict:
        if self._planned is None:
            raise RuntimeError("run() before plan(): call plan(block_table, seq_lens, ...) first")
        return self._planned

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False):
        """Decode attention for the planned layout: o [B, Hq, D] (and lse [B, Hq] with
        ``return_lse``). No host sync and no allocation: without ``out``/``lse`` the plan's
        own buffers are returned (overwritten by the next run). Shapes and dtypes are
        checked against the plan on the host; the layout's values are not (see the class)."""
        p = self._require_plan()
        out, lse = require_run_inputs(p, self._buffers, q, k_cache, v_cache, out, lse)
        bt, sl = p["block_table"], p["seq_lens"]
        if p["splits"] == 1:
            decode_partials_into(q, k_cache, v_cache, bt, sl, out[:, :, None, :], lse[:, :, None],
                                 p["part"], p["scale"])
        else:
            o_part, lse_part = self._buffers["o_part"], self._buffers["lse_part"]
            decode_partials_into(q, k_cache, v_cache, bt, sl, o_part, lse_part, p["part"], p["scale"])
            split_reduce_into(o_part, lse_part, out, lse)
        return (out, lse) if return_lse else out

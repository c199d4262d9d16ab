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

LSE convention (shared with :mod:`gpulab.attention` and :mod:`gpulab.cascade`):
float32, natural log, shape [B, Hq]. FlashInfer stores base-2 LSE:
``lse2 = lse / ln 2`` and ``lse = lse2 · ln 2``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime
from .harness.spec import Case, KernelSpec, bytes_of, randn
from .validate import FLOAT_DTYPES, require_float, require_same_device, require_tensor

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


class OutOfPages(RuntimeError):
    """The page pool has no free page left for an allocation or an append."""


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


def attention_state_reference(q, k, v, scale):
    """(o, lse) of queries q [Hq, D] over keys/values [N, Hkv, D], float64, GQA."""
    hq, hkv = q.shape[0], k.shape[1]
    if k.shape[0] == 0:
        return (torch.zeros(q.shape, dtype=torch.float64, device=q.device),
                torch.full((hq,), -math.inf, dtype=torch.float64, device=q.device))
    k = k.double().repeat_interleave(hq // hkv, dim=1)        # [N, Hq, D]
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale   # [Hq, N]
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("hn,nhd->hd", torch.exp(s - lse[:, None]), v)
    return o, lse


def paged_decode_reference(q, k_cache, v_cache, block_table, seq_lens, scale=None, **_):
    """{"o": [B, Hq, D] float64, "lse": [B, Hq] float64 (natural log)}."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = gather_kv(k_cache, v_cache, block_table, int(seq_lens[b]), b)
        o, lse = attention_state_reference(q[b], k, v, scale)
        outs.append(o)
        lses.append(lse)
    return {"o": torch.stack(outs), "lse": torch.stack(lses)}


def split_reduce_reference(o_part, lse_part):
    """Merge partial states along dim 2: o_part [B, H, S, D], lse_part [B, H, S]."""
    from .attention import merge_partials_reference
    return merge_partials_reference(o_part, lse_part)


# =========================================================================================
# Triton kernels
# =========================================================================================
@triton.jit
def paged_block_update(q, m, l, acc, k_ptr, v_ptr, page, slot, t_mask, d, d_mask, kvh,
                       stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                       qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a block of tokens stored in pages: token i of the block
    is slot ``slot[i]`` of page ``page[i]``. Scores are in base 2 (qk_scale includes
    log2 e); returns the updated running max m, sum l and accumulator acc. Shared by the
    paged decode kernel and cascade's shared-prefix kernel."""
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt
                + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt
                + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv


@triton.jit
def finish_state(m, l, acc):
    """(o, natural-log lse) from a running max m (base 2), sum l and accumulator acc;
    no tokens (l = 0) gives the empty state o = 0, lse = -inf."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    lse = tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return acc / l_safe[:, None], lse


@triton.jit
def _decode_partition_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
        qk_scale,                       # softmax scale · log2(e): scores in base 2
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_btb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh, stride_ls,
        part_len, page_size, head_dim,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One program: one sequence, one kv head (all GROUP query heads that read it), one
    partition of part_len tokens. Writes the partition's (o, lse) at index pid(2)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * part_len
    end = tl.minimum(seq_len, start + part_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < head_dim
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:   # bf16 tl.dot is wrong in the interpreter: compute in fp32 there
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max (base-2 units)
    l = tl.zeros([BLOCK_G], tl.float32)                  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        # Through the block table: token t lives in page bt[b, t // page_size].
        page = tl.load(bt_ptr + b * stride_btb + t // page_size, mask=t_mask, other=0)
        m, l, acc = paged_block_update(
            q, m, l, acc, k_ptr, v_ptr, page, t % page_size, t_mask, d, d_mask, kvh,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, qk_scale,
            UPCAST, IEEE)

    # An empty partition (no tokens) is the empty state: o = 0, lse = -inf.
    out, lse = finish_state(m, l, acc)
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_mask)


@triton.jit
def _split_reduce_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, num_splits, num_heads,
                         stride_pb, stride_ph, stride_ps,
                         stride_lpb, stride_lph, stride_lps,
                         stride_ob, stride_oh, stride_lb, stride_lh, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head): merge num_splits partial states."""
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse_p = tl.load(lse_part_ptr + b * stride_lpb + h * stride_lph + s * stride_lps,
                    mask=s_mask, other=float("-inf"))
    m = tl.max(lse_p, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)        # all empty: weights exp(-inf) = 0
    w = tl.exp(lse_p - m)
    total = tl.sum(w, axis=0)
    o_p = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < head_dim), other=0.0).to(tl.float32)
    o = tl.sum(w[:, None] * o_p, axis=0) / tl.where(total > 0, total, 1.0)
    lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=d < head_dim)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse)


# -- launch configuration --------------------------------------------------------------------
# Tile configurations: the first list fits the 64 KiB of shared memory of sm_75 (Colab's
# T4) for every dtype; the second, for sm_80+ (A100, H100/H200), adds deeper pipelines
# and 128-token tiles. Compile-only checks (no GPU) use the first list.
_DECODE_SMALL = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3))
_DECODE_SMALL_FP32 = ((32, 4, 2), (32, 4, 3), (32, 8, 2))
_DECODE_BIG = ((32, 4, 3), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3), (64, 8, 4))


def big_smem() -> bool:
    """True on GPUs with ≥ 100 KiB of shared memory per block (sm_80 and newer)."""
    cc = runtime.compute_capability()
    return bool(cc) and cc[0] >= 8


def _autotuned(kernel, lists: dict, make, key, interp):
    """{name: autotuned ``kernel``} for each config list (one config in the interpreter)."""
    if runtime.interpreting():
        one = triton.autotune(configs=[make(*interp)], key=key)(kernel)
        return {name: one for name in lists}
    return {name: triton.autotune(configs=[make(*c) for c in cs], key=key)(kernel)
            for name, cs in lists.items()}


def config_list(dtype) -> str:
    """Which config list fits this GPU and dtype: "big" for 16-bit tiles on sm_80+,
    "small" for 16-bit tiles on smaller GPUs and for float32 on sm_80+, "small_fp32"
    for float32 on smaller GPUs."""
    if dtype == torch.float32:   # twice the bytes per tile: the big tiles overflow even sm_90
        return "small" if big_smem() else "small_fp32"
    return "big" if big_smem() else "small"


_decode_tuned = _autotuned(
    _decode_partition_kernel,
    {"small": _DECODE_SMALL, "small_fp32": _DECODE_SMALL_FP32, "big": _DECODE_BIG},
    lambda bn, w, st: triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st),
    key=["BLOCK_G", "BLOCK_D", "UPCAST", "IEEE"], interp=(32, 4, 1))


def part_align() -> int:
    """Partition lengths are multiples of this (a multiple of every BLOCK_N config)."""
    return 32 if runtime.interpreting() else 128


def min_part_len() -> int:
    """Shortest partition worth a program of its own (the reduce is not free)."""
    return 32 if runtime.interpreting() else 512


def plan_splits(batch: int, kv_heads: int, capacity: int, num_sms: int | None = None) -> tuple[int, int]:
    """(num_splits, part_len) for a decode launch.

    Sequences are split when batch·kv_heads programs would leave SMs idle: aim at
    ≥ 4 programs per SM, partitions of at least ``min_part_len()`` tokens. Planned
    from the block table's capacity (no device sync), like FlashInfer's plan()."""
    sms = runtime.num_sms() if num_sms is None else num_sms
    capacity = max(1, capacity)
    programs = max(1, batch * kv_heads)
    want = -(-4 * sms // programs)
    splits = max(1, min(want, capacity // min_part_len()))
    return fixed_splits(capacity, splits)


def fixed_splits(capacity: int, num_splits: int) -> tuple[int, int]:
    """(num_splits, part_len) for roughly num_splits aligned partitions of capacity tokens."""
    align = part_align()
    part = -(-max(1, capacity) // max(1, num_splits))
    part = -(-part // align) * align
    return -(-max(1, capacity) // part), part


def _block_g(group: int) -> int:
    return max(16, triton.next_power_of_2(group))     # tl.dot needs M ≥ 16


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
    _decode_tuned[config_list(q.dtype)][(B, hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        part_len, k_cache.shape[1], d,
        GROUP=hq // hkv, BLOCK_G=_block_g(hq // hkv), BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=upcast, IEEE=ieee)


def split_reduce_into(o_part, lse_part, o, lse):
    """Merge o_part [B, H, S, D], lse_part [B, H, S] into o [B, H, D], lse [B, H]."""
    B, h, s, d = o_part.shape
    if B * h == 0:
        return
    _split_reduce_kernel[(B * h,)](
        o_part, lse_part, o, lse, s, h,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), d,
        BLOCK_S=triton.next_power_of_2(max(1, s)), BLOCK_D=triton.next_power_of_2(d), num_warps=4)


def paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, scale=None,
                      num_splits: int | None = None):
    """Launcher (no validation): decode attention into o [B, Hq, D] and lse [B, Hq]."""
    B, hq, d = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1]
    if num_splits is None:
        splits, part = plan_splits(B, k_cache.shape[2], capacity)
    else:
        splits, part = fixed_splits(capacity, num_splits)
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
# Public function: validate, allocate, launch
# =========================================================================================
def require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens) -> None:
    """Shapes, dtypes, devices and index ranges of a paged decode call, checked on the host."""
    require_tensor("q", q, ndim=3)
    require_float("q", q)
    require_tensor("k_cache", k_cache, ndim=4, dtype=q.dtype)
    require_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=q.dtype)
    require_tensor("block_table", block_table, ndim=2, dtype=torch.int32)
    require_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    B, hq, d = q.shape
    num_pages, ps, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k_cache has {dk}: caches are [pages, page_size, Hkv, D]")
    if d > 256:
        raise ValueError(f"head_dim {d} > 256 is not supported (one program holds a query row in registers)")
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} kv heads (GQA needs Hq = G·Hkv)")
    if block_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows and seq_lens {seq_lens.shape[0]} "
                         f"entries; both must equal the batch size {B} (q.shape[0])")
    if B == 0:
        return
    capacity = block_table.shape[1] * ps
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0:
        b = int((seq_lens < 0).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} is negative")
    if hi > capacity:
        b = int((seq_lens > capacity).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} exceeds the block table's capacity of "
                         f"{block_table.shape[1]} pages × {ps} tokens = {capacity}")
    n_pages = (seq_lens.long() + ps - 1) // ps
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < n_pages[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise IndexError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache "
                         f"(valid pages: 0..{num_pages - 1}); sequence {b} has {int(seq_lens[b])} tokens, "
                         f"so its first {int(n_pages[b])} entries must all be valid page ids")


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale: float | None = None,
                           return_lse: bool = False, num_splits: int | None = None):
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

    Returns o [B, Hq, D] (q's dtype), and lse if ``return_lse``.
    """
    require_paged_inputs(q, k_cache, v_cache, block_table, seq_lens)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    B, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, hq), dtype=torch.float32, device=q.device)
    if B:
        paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, o, lse, scale, num_splits)
    return (o, lse) if return_lse else o


# =========================================================================================
# Specs
# =========================================================================================
def make_paged_inputs(p, dtype, device, gen):
    """A paged cache with the given sequence lengths, its pages in shuffled order, spare
    pages full of other data, and block-table padding past each sequence's pages."""
    lens = list(p["lens"])
    ps, hq, hkv, d = p["page"], p["hq"], p["hkv"], p["d"]
    n_pages = [-(-n // ps) for n in lens]
    total = sum(n_pages) + p.get("spare", 3)
    width = max(n_pages + [1]) + p.get("pad", 1)
    perm = torch.randperm(total, generator=gen, device=device).to(torch.int32)
    bt = torch.randint(0, total, (len(lens), width), generator=gen, device=device, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    k = randn((total, ps, hkv, d), dtype, device, gen)
    v = randn((total, ps, hkv, d), dtype, device, gen, offset=0.3)
    q = randn((len(lens), hq, d), dtype, device, gen, scale=1.5)
    inputs = {"q": q, "k_cache": k, "v_cache": v, "block_table": bt,
              "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device)}
    if "splits" in p:
        inputs["num_splits"] = p["splits"]
    return inputs


def sdpa_contiguous_baseline():
    """SDPA on the same KV stored contiguously [B, Hkv, L, D] (built once per input dict,
    outside the timing): what a paged kernel has to match."""
    cache = {}

    def run(inp):
        key = id(inp)
        if key not in cache:
            cache.clear()
            B = inp["q"].shape[0]
            L = int(inp["seq_lens"].max())
            ks, vs = [], []
            for b in range(B):
                k, v = gather_kv(inp["k_cache"], inp["v_cache"], inp["block_table"], L, b)
                ks.append(k.transpose(0, 1))
                vs.append(v.transpose(0, 1))
            cache[key] = (torch.stack(ks).contiguous(), torch.stack(vs).contiguous())
        kc, vc = cache[key]
        return torch.nn.functional.scaled_dot_product_attention(
            inp["q"][:, :, None, :], kc, vc, enable_gqa=True)
    return run


def _decode_bytes(p, dtype):
    B, L = len(p["lens"]), sum(p["lens"])
    return (2 * L * p["hkv"] * p["d"] + 2 * B * p["hq"] * p["d"]) * bytes_of(dtype) + 4 * B * p["hq"]


def _decode_flops(p, dtype):
    return 4 * sum(p["lens"]) * p["hq"] * p["d"]


def _decode_outputs(inp, dtype):
    B, hq, d = inp["q"].shape
    return {"o": ((B, hq, d), dtype), "lse": ((B, hq), torch.float32)}


# float32: one program that sums a 16K-token context in 512 sequential steps (the
# notebooks' kernels do not split) is off by up to ~4e-5 relative: rounding, not a bug.
_DECODE_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 2e-2)}
_LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 5e-3)}

_CPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=4, hkv=2, d=16)),
    Case("ragged: 1, page, page+1, long", dict(lens=[1, 16, 17, 75], page=16, hq=4, hkv=2, d=16)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 31], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 40], page=8, hq=3, hkv=3, d=32)),
]
_GPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=32, hkv=8, d=128)),
    Case("ragged", dict(lens=[1, 16, 17, 1000, 4099], page=16, hq=32, hkv=8, d=128)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 310], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 4000], page=8, hq=12, hkv=12, d=64)),
    Case("few long", dict(lens=[20000, 777], page=16, hq=32, hkv=8, d=128)),
]

DECODE = KernelSpec(
    name="paged_decode_attention",
    graph_timing=True,
    summary="decode attention through a block table (GQA, split-KV planned from the batch)",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=_decode_outputs,
    implementation=paged_decode_into,
    cases={
        "cpu": _CPU_DECODE,
        "gpu": _GPU_DECODE,
        "bench": [Case("B64 L4096", dict(lens=[4096] * 64, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
                  Case("B4 L32768", dict(lens=[32768] * 4, page=16, hq=32, hkv=8, d=128, spare=0, pad=0))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances=_DECODE_TOL,
    output_tolerances={"lse": _LSE_TOL},
    bytes_moved=_decode_bytes,
    flops=_decode_flops,
    baselines={"SDPA, contiguous KV": sdpa_contiguous_baseline()},
    read_inputs=("q", "k_cache", "v_cache"),
    bench_dtypes=[torch.bfloat16],
    notes="baseline: SDPA on the same KV copied into a contiguous [B, Hkv, L, D] tensor",
)


def _split_cases(cases, splits):
    return [Case(c.label, {**c.params, "splits": s}) for c, s in zip(cases, splits)]


DECODE_SPLIT = KernelSpec(
    name="paged_decode_split",
    expected_fp_warnings=("divide",),   # log(0) = -inf: an empty split, in the interpreter
    summary="paged decode with a forced number of KV partitions and a reduce",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "num_splits", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=_decode_outputs,
    implementation=paged_decode_split_into,
    cases={
        "cpu": _split_cases(_CPU_DECODE, [1, 3, 2, 4]),
        "gpu": _split_cases(_GPU_DECODE, [1, 7, 2, 5, 16]),
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=_DECODE_TOL,
    output_tolerances={"lse": _LSE_TOL},
    read_inputs=("q", "k_cache", "v_cache"),
)


def make_partials(p, dtype, device, gen):
    """Partial states of a split-KV decode: normalised outputs and LSEs with a wide
    spread (an exp without the max subtracted overflows) and empty states (-inf)."""
    B, h, s, d = p["b"], p["h"], p["s"], p["d"]
    o = randn((B, h, s, d), torch.float32, device, gen)
    lse = randn((B, h, s), torch.float32, device, gen, scale=p.get("spread", 30.0), offset=40.0)
    empty = torch.rand((B, h, s), generator=gen, device=device) < p.get("empty", 0.25)
    if p.get("all_empty_row", False):
        empty[0, 0, :] = True
    lse = torch.where(empty, -math.inf, lse)
    o = torch.where(empty[..., None], 0.0, o)
    return {"o_part": o.contiguous(), "lse_part": lse.contiguous()}


SPLIT_REDUCE = KernelSpec(
    name="split_kv_reduce",
    expected_fp_warnings=("divide",),   # log(0) = -inf: an empty state, in the interpreter
    summary="merge split-KV partial states (o_p, lse_p) into (o, lse)",
    args=("o_part", "lse_part", "o", "lse"),
    make_inputs=make_partials,
    reference=split_reduce_reference,
    outputs=lambda inp, dtype: {"o": (inp["o_part"].shape[:2] + inp["o_part"].shape[3:], torch.float32),
                                "lse": (inp["lse_part"].shape[:2], torch.float32)},
    implementation=split_reduce_into,
    cases={
        "cpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=3, h=5, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=2, h=4, s=33, d=128, spread=60.0))],
        "gpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=33, h=32, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=4, h=32, s=64, d=128, spread=60.0))],
    },
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
    tolerances={torch.float32: (1e-5, 1e-5)},
    read_inputs=("o_part", "lse_part"),
)

"""Notebook 05: paged decode attention, the split-KV reduce, split decode, plan/run."""
import torch
import triton
import triton.language as tl

from gpulab import paged

from . import Mistake


# -- ex1: the decode kernel (partitions of the block table; one partition = plain decode) --
@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr, qk_scale,
            stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_btb,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
            part_len, page_size, head_dim,
            GROUP: tl.constexpr, NUM_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * part_len
    if MUT == 5:                                  # attends one token too many
        end = tl.minimum(seq_len + 1, start + part_len)
    elif MUT == 6:                                # leaves out the last token
        end = tl.minimum(seq_len - 1, start + part_len)
    elif MUT == 10:                               # partition end not clamped to seq_len
        end = start + part_len
    else:
        end = tl.minimum(seq_len, start + part_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < head_dim
    if MUT == 1:                                  # GQA map h % Hkv
        heads = g * NUM_KV + kvh
    else:
        heads = kvh * GROUP + g
    if MUT == 8:                                  # q loaded without the group mask
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=d_mask[None, :], other=0.0)
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        if MUT == 2:                              # block-table index + 1
            page = tl.load(bt_ptr + b * stride_btb + t // page_size + 1, mask=t_mask, other=0)
        else:
            page = tl.load(bt_ptr + b * stride_btb + t // page_size, mask=t_mask, other=0)
        slot = t % page_size
        kv_off = page[:, None] * stride_kp + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m = m_new
    if MUT == 7:                                  # no guard for the empty state
        out = acc / l[:, None]
        lse = (m + tl.log2(l)) * 0.6931471805599453
    else:
        has = l > 0
        l_safe = tl.where(has, l, 1.0)
        out = acc / l_safe[:, None]
        if MUT == 4:                              # LSE left in base 2
            lse = tl.where(has, m + tl.log2(l_safe), float("-inf"))
        else:
            lse = tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_mask)


def decode_partitions(q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, part_len, mut=0):
    B, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = d ** -0.5 * (1.0 if mut == 3 else 1.4426950408889634)     # MUT 3: exp2 without log2(e)
    _decode[(B, hkv, o_part.shape[2])](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, scale,
        *((hq * d, d) if mut == 9 else (q.stride(0), q.stride(1))), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), part_len, k_cache.shape[1], d,
        GROUP=hq // hkv, NUM_KV=hkv, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=32,
        BLOCK_D=max(16, triton.next_power_of_2(d)), MUT=mut)


def _decode_launcher(mut):
    def my_decode(q, k_cache, v_cache, block_table, seq_lens, o, lse):
        capacity = block_table.shape[1] * k_cache.shape[1]
        decode_partitions(q, k_cache, v_cache, block_table, seq_lens, o[:, :, None], lse[:, :, None],
                          capacity, mut)
    return my_decode


# -- ex2: the split-KV reduce -------------------------------------------------------------
@triton.jit
def _reduce(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, num_splits, num_heads,
            stride_pb, stride_ph, stride_ps, stride_lpb, stride_lph, stride_lps,
            stride_ob, stride_oh, stride_lb, stride_lh, head_dim,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lse_p = tl.load(lse_part_ptr + b * stride_lpb + h * stride_lph + s * stride_lps, mask=s_mask,
                    other=float("-inf"))
    m = tl.max(lse_p, axis=0)
    if MUT == 1:                                  # no max subtracted
        m = 0.0
    elif MUT != 2:                                # MUT 2: no guard for an all-empty row
        m = tl.where(m == float("-inf"), 0.0, m)
    if MUT == 3:                                  # base 2
        w = tl.exp2(lse_p - m)
    else:
        w = tl.exp(lse_p - m)
    total = tl.sum(w, axis=0)
    o_p = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    if MUT == 4:                                  # plain average
        o = tl.sum(o_p, axis=0) / num_splits
    else:
        o = tl.sum(w[:, None] * o_p, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, o.to(o_ptr.dtype.element_ty), mask=d_mask)
    if MUT == 3:
        lse = tl.where(total > 0, m + tl.log2(total), float("-inf"))
    elif MUT == 5:                                # forgets + m
        lse = tl.where(total > 0, tl.log(total), float("-inf"))
    elif MUT == 6:                                # the largest partial lse
        lse = tl.max(lse_p, axis=0)
    else:
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse)


def my_reduce(o_part, lse_part, o, lse, mut=0, block_s=None):
    B, h, s, d = o_part.shape
    _reduce[(B * h,)](o_part, lse_part, o, lse, s, h,
                      o_part.stride(0), o_part.stride(1), o_part.stride(2),
                      lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
                      o.stride(0), o.stride(1), lse.stride(0), lse.stride(1), d,
                      BLOCK_S=block_s or triton.next_power_of_2(s), BLOCK_D=triton.next_power_of_2(d), MUT=mut)


def _reduce_launcher(mut=0, block_s=None):
    return lambda o_part, lse_part, o, lse: my_reduce(o_part, lse_part, o, lse, mut, block_s)


# -- ex2b: split decode -------------------------------------------------------------------
def _split_launcher(kind):
    def my_split_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits, o, lse):
        B, hq, d = q.shape
        capacity = block_table.shape[1] * k_cache.shape[1]
        if kind == "floor part_len":
            splits, part_len = num_splits, capacity // num_splits
        else:
            splits, part_len = paged.fixed_splits(capacity, num_splits)
        o_part = torch.empty((B, hq, splits, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, hq, splits), dtype=torch.float32, device=q.device)
        decode_partitions(q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, part_len,
                          mut=10 if kind == "partition end unclamped" else 0)
        if kind == "first partition only":
            o.copy_(o_part[:, :, 0])
            lse.copy_(lse_part[:, :, 0])
        elif kind == "mean of the partitions":
            o.copy_(o_part.mean(2))
            my_reduce(o_part, lse_part, torch.empty_like(o), lse)
        elif kind == "lse = max of the partial LSEs":
            my_reduce(o_part, lse_part, o, lse, mut=6)
        else:
            my_reduce(o_part, lse_part, o, lse)
    return my_split_decode


# -- ex4: plan / run ----------------------------------------------------------------------
def _plan_run(kind):
    class MyPagedDecode:
        def plan(self, block_table, seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size, num_pages, dtype):
            B, width = block_table.shape
            self.block_table = block_table
            self.seq_lens = seq_lens.clone() if kind == "seq_lens copied in plan" else seq_lens
            capacity = width * page_size
            if kind == "planned from today's longest sequence":
                capacity = max(1, int(seq_lens.max()))
            self.splits, self.part_len = paged.plan_splits(B, num_kv_heads, capacity)
            self.o_part = torch.empty((B, num_qo_heads, self.splits, head_dim), dtype=torch.float32,
                                      device=block_table.device)
            self.lse_part = torch.empty((B, num_qo_heads, self.splits), dtype=torch.float32,
                                        device=block_table.device)
            self.out = None

        def run(self, q, k_cache, v_cache, out, lse):
            if kind == "item() in run":
                if self.seq_lens.max().item() == 0:
                    return
            if kind == "int(...) in run":
                self.part_len = max(self.part_len, int(self.seq_lens.max()) // self.splits)
            decode_partitions(q, k_cache, v_cache, self.block_table, self.seq_lens, self.o_part, self.lse_part,
                              self.part_len)
            if kind == "result kept in its own buffer":
                if self.out is None:
                    self.out = torch.empty_like(out)
                my_reduce(self.o_part, self.lse_part, self.out, lse)
                return self.out
            my_reduce(self.o_part, self.lse_part, out, lse)
    return MyPagedDecode


_DEC, _RED, _SPL, _PR = "paged_decode_attention", "split_kv_reduce", "paged_decode_split", "paged_decode_plan_run"
MISTAKES = [
    Mistake("05/check-decode", _DEC, "GQA map h % Hkv", _decode_launcher(1), ("h // (num_qo_heads",)),
    Mistake("05/check-decode", _DEC, "block-table index + 1", _decode_launcher(2), ("pages are off by one",)),
    Mistake("05/check-decode", _DEC, "exp2 without log2(e)", _decode_launcher(3), ("log2(e)",)),
    Mistake("05/check-decode", _DEC, "LSE left in base 2", _decode_launcher(4), ("base 2",)),
    Mistake("05/check-decode", _DEC, "mask t <= seq_len", _decode_launcher(5), ("one token too many",)),
    Mistake("05/check-decode", _DEC, "last token left out", _decode_launcher(6), ("leaves out its last token",)),
    Mistake("05/check-decode", _DEC, "no guard for the empty sequence", _decode_launcher(7), ("0/0",)),
    Mistake("05/check-decode", _DEC, "q loaded without the group mask", _decode_launcher(8),
            ("a load past the end of input `q`",),
            interpreter_only="the stray query rows (heads past the group) are loaded and scored but their "
                             "outputs are never stored"),
    Mistake("05/check-decode", _DEC, "q indexed as if contiguous (h · D)", _decode_launcher(9), ("`q`",)),

    Mistake("05/check-reduce", _RED, "no max subtracted", _reduce_launcher(1), ("arithmetic", "overflow")),
    Mistake("05/check-reduce", _RED, "no guard for an all-empty row", _reduce_launcher(2), ("−inf − (−inf)",)),
    Mistake("05/check-reduce", _RED, "exp2/log2 on a natural LSE", _reduce_launcher(3), ("base 2",)),
    Mistake("05/check-reduce", _RED, "plain average of o", _reduce_launcher(4), ("plain average",)),
    Mistake("05/check-reduce", _RED, "lse without + M", _reduce_launcher(5), ("without the max",)),
    Mistake("05/check-reduce", _RED, "lse = the largest partial lse", _reduce_launcher(6), ("largest partial lse",)),
    Mistake("05/check-reduce", _RED, "BLOCK_S fixed to 8", _reduce_launcher(block_s=8), ("only the first partitions",)),

    Mistake("05/check-split-decode", _SPL, "part_len = capacity // num_splits", _split_launcher("floor part_len"),
            ("rounded down",)),
    Mistake("05/check-split-decode", _SPL, "no reduce: the first partition", _split_launcher("first partition only"),
            ("first partition's state alone",)),
    Mistake("05/check-split-decode", _SPL, "mean of the partial outputs", _split_launcher("mean of the partitions"),
            ("weight",)),
    Mistake("05/check-split-decode", _SPL, "lse = max of the partial LSEs",
            _split_launcher("lse = max of the partial LSEs"), ("log-sum-exp",)),
    Mistake("05/check-split-decode", _SPL, "partition end not clamped to seq_len",
            _split_launcher("partition end unclamped"), ("past seq_len", "past the end of input `block_table`")),

    Mistake("05/check-plan-run", _PR, "seq_lens copied in plan()", _plan_run("seq_lens copied in plan"),
            ("when plan() ran",)),
    Mistake("05/check-plan-run", _PR, ".item() in run()", _plan_run("item() in run"), ("host sync",)),
    Mistake("05/check-plan-run", _PR, "int(tensor) in run()", _plan_run("int(...) in run"), ("host sync",)),
    Mistake("05/check-plan-run", _PR, "partitions planned from the longest sequence",
            _plan_run("planned from today's longest sequence"), ("capacity",)),
    Mistake("05/check-plan-run", _PR, "result kept in run()'s own buffer", _plan_run("result kept in its own buffer"),
            ("never written",)),
]

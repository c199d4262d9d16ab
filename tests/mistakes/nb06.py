"""Notebook 06: the merge kernel, the shared-prefix kernel, the cascade."""
import torch
import triton
import triton.language as tl

from gpulab import paged

from . import Mistake


@triton.jit
def _merge(oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, n_rows, head_dim,
           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, MUT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_mask = r < n_rows
    mask = r_mask[:, None] & (d[None, :] < head_dim)
    offs = r[:, None] * head_dim + d[None, :]
    if MUT == 1:                                   # lse loads without the row mask
        la = tl.load(la_ptr + r)
        lb = tl.load(lb_ptr + r)
    else:
        la = tl.load(la_ptr + r, mask=r_mask, other=float("-inf"))
        lb = tl.load(lb_ptr + r, mask=r_mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    if MUT != 2:                                   # 2: no guard for two empty states
        m = tl.where(m == float("-inf"), 0.0, m)
    if MUT == 3:                                   # no max subtraction
        wa = tl.exp(la)
        wb = tl.exp(lb)
    elif MUT == 4:                                 # one weight from the wrong side
        wa = tl.exp(la - m)
        wb = tl.exp(la - m)
    else:
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
    total = wa + wb
    inv = 1.0 / tl.where(total > 0, total, 1.0)
    oa = tl.load(oa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    if MUT == 5:                                   # o stored with the column mask only
        tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=d[None, :] < head_dim)
    else:
        tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=mask)
    if MUT == 6:                                   # lse in base 2
        lse = tl.where(total > 0, m + tl.log2(total), float("-inf"))
    else:
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    tl.store(l_ptr + r, lse, mask=r_mask)


def _launcher(mut):
    def my_merge(o_a, lse_a, o_b, lse_b, o, lse):
        rows, d = lse.numel(), o.shape[-1]
        block_d = triton.next_power_of_2(d)
        block_r = max(1, min(64, 4096 // block_d))
        _merge[(triton.cdiv(rows, block_r),)](o_a, lse_a, o_b, lse_b, o, lse, rows, d,
                                             BLOCK_R=block_r, BLOCK_D=block_d, MUT=mut)
    return my_merge


MISTAKES = [
    Mistake("06/check-merge", "merge_state", "lse loads without the row mask", _launcher(1),
            ("a load past the end of input `lse_a`", "a load past the end of input `lse_b`"),
            interpreter_only="the stray rows' log-sum-exps are loaded and merged but never stored"),
    Mistake("06/check-merge", "merge_state", "no guard for two empty states", _launcher(2), ("arithmetic",)),
    Mistake("06/check-merge", "merge_state", "no max subtraction", _launcher(3), ("arithmetic", "overflow")),
    Mistake("06/check-merge", "merge_state", "both weights from lse_a", _launcher(4),
            ("lse_b", "weight")),
    Mistake("06/check-merge", "merge_state", "o stored with the column mask only", _launcher(5),
            ("past the end of output `o`",)),
    Mistake("06/check-merge", "merge_state", "lse in base 2", _launcher(6),
            ("base 2", "ln 2", "log2")),
]


# -- ex2: the shared-prefix kernel --------------------------------------------------------
@triton.jit
def _prefix(q_ptr, k_ptr, v_ptr, pages_ptr, o_ptr, lse_ptr, qk_scale,
            stride_qb, stride_qh, stride_kp, stride_kt, stride_kh,
            stride_ob, stride_oh, stride_lb, stride_lh,
            n_rows, prefix_len, page_size, head_dim,
            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, IEEE: tl.constexpr, MUT: tl.constexpr):
    kvh = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_mask = r < n_rows
    d_mask = d < head_dim
    b = r // GROUP
    head = kvh * GROUP + r % GROUP
    q = tl.load(q_ptr + b[:, None] * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(0, prefix_len, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < prefix_len
        if MUT == 1:                                   # the page table loaded without its mask
            page = tl.load(pages_ptr + t // page_size)
        elif MUT == 2:                                 # page table skipped: logical page = cache page
            page = t // page_size
        else:
            page = tl.load(pages_ptr + t // page_size, mask=t_mask, other=0)
        if MUT == 3:                                   # every query head reads KV head 0
            kv_off = page[:, None] * stride_kp + (t % page_size)[:, None] * stride_kt + d[None, :]
        else:
            kv_off = page[:, None] * stride_kp + (t % page_size)[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if MUT == 4:                                   # keys past prefix_len not masked (score 0)
            s = s * qk_scale
        else:
            s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if MUT == 5:                                   # exp, though qk_scale carries log2(e)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
        else:
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if MUT == 6:                                   # acc not rescaled when the max moves
            alpha_acc = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            alpha_acc = alpha
        if IEEE:
            acc = acc * alpha_acc[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha_acc[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    tl.store(o_ptr + b[:, None] * stride_ob + head[:, None] * stride_oh + d[None, :],
             (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh,
             tl.where(has, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf")), mask=r_mask)


def _prefix_launcher(mut):
    def my_prefix(q, k_cache, v_cache, prefix_pages, prefix_len, o, lse, scale=None):
        B, hq, d = q.shape
        hkv = k_cache.shape[2]
        group = hq // hkv
        scale = d ** -0.5 if scale is None else scale
        _prefix[(triton.cdiv(B * group, 32), hkv)](
            q, k_cache, v_cache, prefix_pages, o, lse, scale * 1.4426950408889634,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
            B * group, prefix_len, k_cache.shape[1], d,
            GROUP=group, BLOCK_M=32, BLOCK_N=32, BLOCK_D=max(16, triton.next_power_of_2(d)),
            IEEE=q.dtype == torch.float32, MUT=mut)
    return my_prefix


# -- ex3: cascade = prefix state merged with the paged suffix state -----------------------
def _cascade(kind):
    my_prefix, my_merge = _prefix_launcher(0), _launcher(0)

    def my_cascade(q, k_cache, v_cache, prefix_pages, prefix_len, block_table, seq_lens, o, lse):
        o_p, lse_p = torch.empty_like(o), torch.empty_like(lse)
        my_prefix(q, k_cache, v_cache, prefix_pages, prefix_len, o_p, lse_p)
        o_s, lse_s = paged.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, return_lse=True)
        if kind == "suffix only":
            o.copy_(o_s)
            lse.copy_(lse_s)
        elif kind == "prefix only":
            o.copy_(o_p)
            lse.copy_(lse_p)
        elif kind == "lse swapped":
            my_merge(o_p, lse_s, o_s, lse_p, o, lse)
        elif kind == "average":
            o.copy_((o_p.float() + o_s.float()) / 2)
            lse.copy_(torch.logaddexp(lse_p, lse_s))
        elif kind == "whole prefix pages":
            ps = k_cache.shape[1]
            my_prefix(q, k_cache, v_cache, prefix_pages, -(-prefix_len // ps) * ps, o_p, lse_p)
            my_merge(o_p, lse_p, o_s, lse_s, o, lse)
        elif kind == "lse of the prefix":
            my_merge(o_p, lse_p, o_s, lse_s, o, torch.empty_like(lse))
            lse.copy_(lse_p)
        else:
            my_merge(o_p, lse_p, o_s, lse_s, o, lse)
    return my_cascade


MISTAKES += [
    Mistake("06/check-prefix", "shared_prefix_attention", "page table loaded without its mask", _prefix_launcher(1),
            ("a load past the end of input `prefix_pages`",),
            interpreter_only="the stray page ids belong to keys past prefix_len, whose K and V loads are "
                             "masked: the value read never reaches an address or the output"),
    Mistake("06/check-prefix", "shared_prefix_attention", "page table skipped", _prefix_launcher(2),
            ("page table is skipped",)),
    Mistake("06/check-prefix", "shared_prefix_attention", "every query head reads KV head 0", _prefix_launcher(3),
            ("KV head",)),
    Mistake("06/check-prefix", "shared_prefix_attention", "keys past prefix_len not masked", _prefix_launcher(4),
            ("keys past the prefix",)),
    Mistake("06/check-prefix", "shared_prefix_attention", "exp where the scale carries log2(e)", _prefix_launcher(5),
            ("exp2",)),
    Mistake("06/check-prefix", "shared_prefix_attention", "acc not rescaled when the max moves", _prefix_launcher(6),
            ("not rescaled when the running max moves",)),

    Mistake("06/check-cascade", "cascade_decode_attention", "suffix only (prefix state dropped)",
            _cascade("suffix only"),
            ("suffix's state alone",)),
    Mistake("06/check-cascade", "cascade_decode_attention", "prefix only (suffix state dropped)",
            _cascade("prefix only"),
            ("prefix's state alone", "prefix's LSE alone")),
    Mistake("06/check-cascade", "cascade_decode_attention", "lse of prefix and suffix swapped", _cascade("lse swapped"),
            ("lse_p and lse_s swapped",)),
    Mistake("06/check-cascade", "cascade_decode_attention", "plain average of the two o", _cascade("average"),
            ("plain average",)),
    Mistake("06/check-cascade", "cascade_decode_attention", "prefix read as whole pages",
            _cascade("whole prefix pages"), ("read as whole pages",)),
    Mistake("06/check-cascade", "cascade_decode_attention", "lse of the prefix returned", _cascade("lse of the prefix"),
            ("lse is the prefix's LSE alone",)),
]

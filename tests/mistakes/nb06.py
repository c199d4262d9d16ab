"""Notebook 06: the merge kernel."""
import triton
import triton.language as tl

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
            ("a load past the end of input `lse_a`", "a load past the end of input `lse_b`")),
    Mistake("06/check-merge", "merge_state", "no guard for two empty states", _launcher(2), ("arithmetic",)),
    Mistake("06/check-merge", "merge_state", "no max subtraction", _launcher(3), ("arithmetic", "overflow")),
    Mistake("06/check-merge", "merge_state", "both weights from lse_a", _launcher(4),
            ("lse_b", "weight")),
    Mistake("06/check-merge", "merge_state", "o stored with the column mask only", _launcher(5),
            ("past the end of output `o`",)),
    Mistake("06/check-merge", "merge_state", "lse in base 2", _launcher(6),
            ("base 2", "ln 2", "log2")),
]

"""Notebook 04: the online softmax kernel and the merge of two attention states."""
import torch
import triton
import triton.language as tl

from . import Mistake


@triton.jit
def _online(x_ptr, y_ptr, n_cols, sx, sy, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        if MUT == 1:                        # no mask on the load
            x = tl.load(x_ptr + row * sx + start + cols).to(tl.float32)
        elif MUT == 2:                      # masked lanes read 0
            x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        if MUT == 3:                        # d not rescaled when the max moves
            d = d + tl.sum(tl.exp(x - m_new), axis=0)
        elif MUT == 4:                      # base 2 without log2(e)
            d = d * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
        else:
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if MUT == 4:
            y = tl.exp2(x - m) / d
        elif MUT == 5:                      # forgets to divide by d
            y = tl.exp(x - m)
        else:
            y = tl.exp(x - m) / d
        if MUT == 6:                        # store without its mask
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _online_launcher(mut, stride="own"):
    def online_softmax(x, y):
        n_rows, n_cols = x.shape
        block = min(1024, triton.next_power_of_2(n_cols))
        sx, sy = x.stride(0), y.stride(0)
        if stride == "x for y":
            sy = sx
        elif stride == "row length":
            sx = sy = n_cols
        _online[(n_rows,)](x, y, n_cols, sx, sy, BLOCK=block, MUT=mut)
    return online_softmax


def _merge(kind):
    def merge_states(o_a, lse_a, o_b, lse_b):
        m = torch.maximum(lse_a, lse_b)
        if kind == "no empty-state guard":
            m_safe = m
        else:
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
        total = wa + wb
        safe_total = torch.where(total > 0, total, torch.ones_like(total))
        if kind == "swapped weights":
            wa, wb = wb, wa
        o = (wa / safe_total)[..., None] * o_a.float() + (wb / safe_total)[..., None] * o_b.float()
        if kind == "average":
            o = (o_a.float() + o_b.float()) / 2
        if kind == "base-2 lse":
            lse = torch.where(total > 0, m_safe + torch.log2(safe_total), m)
        else:
            lse = torch.where(total > 0, m_safe + torch.log(safe_total), m)
        if kind == "o stays float32":
            return o, lse
        if kind == "lse in o's dtype":
            return o.to(o_a.dtype), lse.to(o_a.dtype)
        return o.to(o_a.dtype), lse
    return merge_states


MISTAKES = [
    Mistake("04/check-online-softmax", "online_softmax", "no mask on the load", _online_launcher(1),
            ("a load past the end of input `x`",)),
    Mistake("04/check-online-softmax", "online_softmax", "masked lanes read 0", _online_launcher(2),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "running sum not rescaled", _online_launcher(3),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "exp2 without log2(e)", _online_launcher(4),
            ("exp2", "base")),
    Mistake("04/check-online-softmax", "online_softmax", "never divides by the sum", _online_launcher(5),
            ("own constant factor",)),
    Mistake("04/check-online-softmax", "online_softmax", "store without its mask", _online_launcher(6),
            ("past the end of output `y`",)),
    Mistake("04/check-online-softmax", "online_softmax", "x's row stride used for y", _online_launcher(0, "x for y"),
            ("between the rows",)),
    Mistake("04/check-online-softmax", "online_softmax", "row length as row stride",
            _online_launcher(0, "row length"), ("between the rows",)),

    Mistake("04/check-merge-states", "merge_state_torch", "no guard for two empty states",
            _merge("no empty-state guard"), ("arithmetic",)),
    Mistake("04/check-merge-states", "merge_state_torch", "weights swapped", _merge("swapped weights"),
            ("`lse_a` and `lse_b` swapped", "`o_a` and `o_b` swapped")),
    Mistake("04/check-merge-states", "merge_state_torch", "plain average of o", _merge("average"),
            ("weight",)),
    Mistake("04/check-merge-states", "merge_state_torch", "base-2 log-sum-exp", _merge("base-2 lse"),
            ("base 2", "ln 2", "log2")),
    Mistake("04/check-merge-states", "merge_state_torch", "o returned in float32", _merge("o stays float32"),
            ("dtype float32, expected float16", "dtype float32, expected bfloat16")),
    Mistake("04/check-merge-states", "merge_state_torch", "lse in o's dtype", _merge("lse in o's dtype"),
            ("dtype float16, expected float32", "dtype bfloat16, expected float32")),
]

"""Notebook 02: the fused RMSNorm + int8 quantization kernel, forward and backward."""
import torch
import triton
import triton.language as tl

from . import Mistake


# -- ex1: fused forward -------------------------------------------------------------------
@triton.jit
def _fwd(x_ptr, w_ptr, q_ptr, s_ptr, n_cols, eps, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if MUT == 1:                                   # rows strided by BLOCK, not the row length
        base = row * BLOCK
    else:
        base = row * n_cols
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if MUT == 2:                                   # mean over the block, not the row
        ms = tl.sum(x * x, axis=0) / BLOCK
    else:
        ms = tl.sum(x * x, axis=0) / n_cols
    if MUT == 3:                                   # no eps
        rstd = 1.0 / tl.sqrt(ms)
    else:
        rstd = 1.0 / tl.sqrt(ms + eps)
    if MUT == 4:                                   # weight forgotten
        y = x * rstd
    else:
        y = x * rstd * w
    if MUT == 5:                                   # no floor on the absmax
        amax = tl.max(tl.abs(y), axis=0)
    elif MUT == 6:                                 # absmax of x·rstd, before the weight
        amax = tl.maximum(tl.max(tl.abs(x * rstd), axis=0), 1e-5)
    else:
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-5)
    scale = 127.0 / amax
    v = y * scale
    if MUT == 7:                                   # truncates (a plain cast)
        q = v
    elif MUT == 8:                                 # floor
        q = tl.floor(v)
    else:
        q = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    tl.store(q_ptr + base + cols, q.to(tl.int8), mask=mask)
    if MUT == 9:                                   # stores absmax / 127, the dequantization step
        tl.store(s_ptr + row, amax / 127.0)
    else:
        tl.store(s_ptr + row, scale)


def _fwd_launcher(mut=0):
    def fused_forward(x, weight, x_q, scale, eps=1e-6):
        rows, cols = x.shape
        _fwd[(rows,)](x, weight, x_q, scale, cols, eps, BLOCK=triton.next_power_of_2(cols), MUT=mut)
    return fused_forward


# -- ex2: fused backward ------------------------------------------------------------------
@triton.jit
def _bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, part_ptr, n_cols, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if MUT == 1:                                   # no mask on the loads of dy
        dy = tl.load(dy_ptr + row * n_cols + cols).to(tl.float32)
    else:
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    xhat = x * rstd
    if MUT == 2:                                   # weight forgotten in dx
        g = dy
    else:
        g = dy * w
    if MUT == 3:                                   # mean over the block
        c = tl.sum(xhat * g, axis=0) / BLOCK
    else:
        c = tl.sum(xhat * g, axis=0) / n_cols
    if MUT == 4:                                   # no term through rstd
        dx = g * rstd
    elif MUT == 5:                                 # misses the final × rstd
        dx = g - xhat * c
    else:
        dx = (g - xhat * c) * rstd
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if MUT == 6:                                   # dw partial with x, not x̂
        part = dy * x
    else:
        part = dy * xhat
    if MUT == 7:                                   # every row writes the same dw
        tl.store(part_ptr + cols, part, mask=mask)
    else:
        tl.store(part_ptr + row * n_cols + cols, part, mask=mask)


def _bwd_launcher(mut=0):
    def fused_backward(x, weight, rstd, dy, dx, dw):
        rows, cols = x.shape
        if mut == 7:
            _bwd[(rows,)](x, weight, rstd, dy, dx, dw, cols, BLOCK=triton.next_power_of_2(cols), MUT=mut)
            return
        part = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
        _bwd[(rows,)](x, weight, rstd, dy, dx, part, cols, BLOCK=triton.next_power_of_2(cols), MUT=mut)
        torch.sum(part, dim=0, out=dw)
    return fused_backward


MISTAKES = [
    Mistake("02/check-fused-forward", "rmsnorm_quant", "rows strided by BLOCK", _fwd_launcher(1),
            ("a load past the end of input `x`",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "mean of x² over the block", _fwd_launcher(2),
            ("block size",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "no eps in the root", _fwd_launcher(3), ("eps",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "norm weight forgotten", _fwd_launcher(4),
            ("weight is not applied",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "no floor on the absmax", _fwd_launcher(5),
            ("floor the absmax",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "absmax before the weight", _fwd_launcher(6),
            ("before the weight",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "truncates to int8", _fwd_launcher(7),
            ("truncated toward zero",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "rounds down (floor)", _fwd_launcher(8),
            ("rounded down",)),
    Mistake("02/check-fused-forward", "rmsnorm_quant", "scale = absmax / 127", _fwd_launcher(9),
            ("reciprocals",)),

    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "no mask on the load of dy", _bwd_launcher(1),
            ("a load past the end of input `dy`",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "weight forgotten in dx", _bwd_launcher(2),
            ("weight is missing from dx",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "mean over the block", _bwd_launcher(3),
            ("block size",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "no term through rstd", _bwd_launcher(4),
            ("term through rstd",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "misses the final × rstd", _bwd_launcher(5),
            ("final factor rstd",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "dw from x, not x̂", _bwd_launcher(6),
            ("not dy · x̂",)),
    Mistake("02/check-fused-backward", "rmsnorm_quant_bwd", "every row overwrites dw", _bwd_launcher(7),
            ("partial dy · x̂ alone",)),
]

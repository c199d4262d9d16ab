r"""Notebook 02: RMSNorm fused with per-row absmax int8 quantization, forward and backward.

Every BitLinear layer of the MatMul-free LM (Zhu et al. 2024) normalises its input
and quantizes it to int8 before the ternary matmul. For one row x of length N, with a
learnable norm weight w:

    rstd  = 1 / sqrt(mean_j x_j^2 + eps)
    y_j   = x_j · rstd · w_j                         (computed in float32)
    s     = 127 / max(max_j |y_j|, 1e-5)            (per-row scale, float32)
    q_j   = clamp(round(y_j · s), -128, 127)        (int8)

Rounding rule (used by the kernels *and* the references): round half away from zero,
``round(v) = sign(v) · floor(|v| + 0.5)``. Since |y_j·s| <= 127, q never reaches -128.

Unfused, PyTorch reads and writes the row about ten times (square, mean, rsqrt,
multiply, multiply, abs, max, divide, round, clamp, cast). The fused kernel reads x and
w once and writes q (1 byte) and s: for a bf16 input that is 3 bytes per element
instead of several dozen (notebook 02 counts them).

Training uses *fake* quantization with the straight-through estimator (STE): the
forward returns the dequantized value ŷ = q / s, and the backward treats
quantization as the identity, ``ŷ = y + (fakequant(y) - y).detach()``. With
x̂ = x · rstd and g = w ⊙ dŷ, the gradients of RMSNorm are

    dx = rstd · (g - x̂ · mean_j(x̂_j · g_j))
    dw = Σ_rows dŷ ⊙ x̂

so the backward needs only x, w and rstd (one float per row): it recomputes x̂ instead
of saving y, x̂ or the quantized tensor. That is where the fused layer's training-memory
saving comes from (up to 61% in the paper).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .validate import FLOAT_DTYPES, require_float, require_same_device, require_tensor

ABSMAX_FLOOR = 1e-5
MAX_COLS = 1 << 16


# -- PyTorch reference ----------------------------------------------------------------------
def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """The course's rounding rule: to nearest, ties away from zero."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm in x's dtype promoted to at least float32 (differentiable)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd * weight.to(xf.dtype)


def absmax_quantize(y: torch.Tensor):
    """Per-row absmax int8 quantization: (q int8, scale) with q ≈ y·scale."""
    scale = 127.0 / y.abs().amax(-1, keepdim=True).clamp_min(ABSMAX_FLOOR)
    q = round_half_away(y * scale).clamp(-128, 127)
    return q.to(torch.int8), scale.squeeze(-1)


def rmsnorm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The unfused chain, op by op: (x_q int8, scale float32)."""
    q, scale = absmax_quantize(rmsnorm_ref(x, weight, eps))
    return q, scale.float()


def rmsnorm_fakequant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Training reference: RMSNorm then fake quantization with the straight-through
    estimator; autograd through this gives the gradients the fused backward must match."""
    y = rmsnorm_ref(x, weight, eps)
    scale = 127.0 / y.abs().amax(-1, keepdim=True).clamp_min(ABSMAX_FLOOR)
    yq = round_half_away(y * scale).clamp(-128, 127) / scale
    return (y + (yq - y).detach()).to(x.dtype)


# -- Triton kernels -------------------------------------------------------------------------
@triton.jit
def round_half_away_int(v):
    """round(v), halves away from zero, as int32: the float-to-int conversion truncates,
    which is floor for |v| + 0.5 ≥ 0, so one conversion does the rounding. (floor and
    ceil both evaluated, then converted, were three conversions per element on the
    H200's XU pipe, which Nsight Compute showed 65% busy in this kernel.)"""
    r = (tl.abs(v) + 0.5).to(tl.int32)
    return tl.where(v < 0, -r, r)


@triton.jit
def sum_and_max(s0, m0, s1, m1):
    return s0 + s1, tl.maximum(m0, m1)


# Sizes that change from one engine step to the next are not specialised on: Triton would
# compile the kernel again (about a second) for each new value class (1, multiple of 16, other).
@triton.jit(do_not_specialize=["n_rows"])
def rmsnorm_quant_fwd_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, yhat_ptr, rstd_ptr,
                              n_rows, n_cols, stride_x, stride_q, stride_y, eps,
                              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                              FAKE_QUANT: tl.constexpr, ONE_REDUCTION: tl.constexpr,
                              EVEN: tl.constexpr = False, MANY_ROWS: tl.constexpr = False):
    """One program normalises and quantizes BLOCK_R whole rows held in registers.
    FAKE_QUANT=False: store int8 q and the per-row scale (inference).
    FAKE_QUANT=True: store the dequantized ŷ = q/scale in x's dtype and rstd (training).
    EVEN: n_cols == BLOCK_N and BLOCK_R divides n_rows, so loads and stores need no mask.
    MANY_ROWS: only a key for the tuner (a grid of many programs wants other warps than a
    decode step's few), unused in the body.

    max|y| = rstd · max|x·w| (rstd > 0), so Σx² and max|x·w| need not wait for each
    other: compiled, one reduction carries both (two values per step) instead of two in
    a row; y·scale = (x·w)·(rstd·scale) is one multiply per element. The interpreter
    runs a reduction with a combine function of our own element by element in Python,
    so there (ONE_REDUCTION=False) the two are tl.sum and tl.max, still independent."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)
    if EVEN:
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :]).to(tl.float32)
        w = tl.load(w_ptr + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    xw = x * w[None, :]
    if ONE_REDUCTION:                                                     # masked lanes give 0
        sum_sq, max_xw = tl.reduce((x * x, tl.abs(xw)), 1, sum_and_max)
    else:
        sum_sq, max_xw = tl.sum(x * x, axis=1), tl.max(tl.abs(xw), axis=1)
    rstd = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
    scale = 127.0 / tl.maximum(max_xw * rstd, 1e-5)
    q = tl.minimum(tl.maximum(round_half_away_int(xw * (rstd * scale)[:, None]), -128), 127)
    if FAKE_QUANT:
        yhat = q.to(tl.float32) / scale[:, None]
        tl.store(yhat_ptr + rows64[:, None] * stride_y + cols[None, :],
                 yhat.to(yhat_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
    elif EVEN:
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(tl.int8))
        tl.store(scale_ptr + rows, scale)
    else:
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=rmask)


@triton.jit
def rmsnorm_quant_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_part_ptr,
                              n_rows, n_cols, stride_x, stride_dy, stride_dx,
                              BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Straight-through backward. Program p walks row blocks p, p+G, p+2G... (G programs),
    writes dx for them and one partial sum of dw (row p of dw_part)."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_R)
    for rb in range(pid, n_blocks, n_progs):
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]                     # recomputed, never saved
        g = dy * w[None, :]
        c = tl.sum(xhat * g, axis=1) / n_cols
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
    tl.store(dw_part_ptr + pid * n_cols + cols, dw_acc, mask=cmask)


# On a GPU the number of warps is tuned per row length and for few or many programs (the
# interpreter has one config). Without MANY_ROWS in the key, the first call's grid chose for
# every later one: 7 rows of 8192 picked 16 warps, which then ran 8192 rows in 65.0 µs
# against 55.8 µs at 4 warps (H200, tools/rmsnorm_pieces_probe.py, 2026-12-03).
if runtime.interpreting():
    _fwd_tuned = rmsnorm_quant_fwd_kernel
else:
    _fwd_tuned = triton.autotune(configs=runtime.tuning_configs([triton.Config({}, num_warps=w) for w in (4, 8, 16)]),
                                 key=["n_cols", "BLOCK_R", "FAKE_QUANT", "EVEN", "MANY_ROWS"])(rmsnorm_quant_fwd_kernel)


def _fwd_launch(grid, *args, num_warps, **kw):
    n_rows, n_cols = args[6], args[7]
    kw["EVEN"] = n_cols == kw["BLOCK_N"] and n_rows % kw["BLOCK_R"] == 0
    kw["MANY_ROWS"] = not runtime.interpreting() and grid[0] >= 2 * runtime.num_sms()
    if runtime.interpreting():
        _fwd_tuned[grid](*args, num_warps=num_warps, **kw)
    else:   # the tuner's key and the dtypes of x, weight, x_q and yhat
        x, weight, x_q, _, yhat = args[:5]
        key = (n_cols, kw["BLOCK_R"], kw["FAKE_QUANT"], kw["EVEN"], kw["MANY_ROWS"],
               x.dtype, weight.dtype, x_q.dtype, yhat.dtype)
        runtime.launch_tuned(_fwd_tuned, grid, key, *args, **kw)


# -- launchers ------------------------------------------------------------------------------
def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(rows per program, padded row length). The interpreter pays per program, so it
    takes many rows at once; a GPU wants about 4K elements per program for short rows."""
    block_n = runtime.next_power_of_2(max(1, n_cols))
    budget = 1 << 14 if runtime.interpreting() else 1 << 12
    block_r = max(1, min(budget // block_n, runtime.next_power_of_2(max(1, n_rows)), 64))
    return block_r, block_n


def _warps(block_r: int, block_n: int) -> int:
    """A memory-bound row kernel wants ~8-16 elements per thread."""
    size = block_r * block_n
    return 4 if size <= 2048 else 8 if size <= 8192 else 16


def rmsnorm_quant_into(x, weight, x_q, scale, eps: float = 1e-6):
    """Launcher (check calling convention): x [rows, cols] -> x_q int8 [rows, cols], scale [rows]."""
    n_rows, n_cols = x.shape
    block_r, block_n = _blocks(n_rows, n_cols)
    _fwd_launch((runtime.cdiv(n_rows, block_r),),
        x, weight, x_q, scale, x, scale, n_rows, n_cols, x.stride(0), x_q.stride(0), 0, eps,
        BLOCK_R=block_r, BLOCK_N=block_n, FAKE_QUANT=False, ONE_REDUCTION=not runtime.interpreting(),
        num_warps=_warps(block_r, block_n))


def rmsnorm_fakequant_fwd_into(x, weight, y, rstd, eps: float = 1e-6):
    """Training forward launcher: y = dequantized fake-quant output (x's dtype), rstd [rows] fp32."""
    n_rows, n_cols = x.shape
    block_r, block_n = _blocks(n_rows, n_cols)
    _fwd_launch((runtime.cdiv(n_rows, block_r),),
        x, weight, x, rstd, y, rstd, n_rows, n_cols, x.stride(0), 0, y.stride(0), eps,
        BLOCK_R=block_r, BLOCK_N=block_n, FAKE_QUANT=True, ONE_REDUCTION=not runtime.interpreting(),
        num_warps=_warps(block_r, block_n))


def _bwd_programs(n_rows: int, block_r: int) -> int:
    """How many programs the backward uses (each writes one partial dw row)."""
    n_blocks = runtime.cdiv(n_rows, block_r)
    cap = 8 if runtime.interpreting() else 4 * runtime.num_sms()
    return max(1, min(n_blocks, cap))


def rmsnorm_quant_bwd_into(x, weight, rstd, dy, dx, dw):
    """Backward launcher: dx like x, dw [cols] float32 (partials reduced in PyTorch)."""
    n_rows, n_cols = x.shape
    block_r, block_n = _blocks(n_rows, n_cols)
    block_r = max(1, min(block_r, 16))
    grid = _bwd_programs(n_rows, block_r)
    part = torch.empty((grid, n_cols), dtype=torch.float32, device=x.device)
    rmsnorm_quant_bwd_kernel[(grid,)](x, weight, rstd, dy, dx, part, n_rows, n_cols,
                                       x.stride(0), dy.stride(0), dx.stride(0),
                                       BLOCK_R=block_r, BLOCK_N=block_n, num_warps=_warps(block_r, block_n))
    torch.sum(part, dim=0, out=dw)


def rmsnorm_quant_bwd_partials_into(x, weight, rstd, dy, dx, dw_part):
    """Backward launcher with the weight gradient left as G partial rows (G =
    ``dw_part.shape[0]`` programs): program g handles rows g, g + G, g + 2G... and writes
    ``dw_part[g] = Σ_{r ≡ g (mod G)} dy_r ⊙ x̂_r``; dw is ``dw_part.sum(0)``. A grouped
    reduction: the partial traffic is G rows, not one per input row."""
    n_rows, n_cols = x.shape
    block_n = runtime.next_power_of_2(max(1, n_cols))
    rmsnorm_quant_bwd_kernel[(dw_part.shape[0],)](x, weight, rstd, dy, dx, dw_part, n_rows, n_cols,
                                                   x.stride(0), dy.stride(0), dx.stride(0),
                                                   BLOCK_R=1, BLOCK_N=block_n, num_warps=_warps(1, block_n))


# -- public API -----------------------------------------------------------------------------
def plainly_valid_norm_args(x, weight, eps) -> bool:
    """True when :func:`rmsnorm_quant`'s arguments pass all its checks, tested with a few
    attribute reads (a model calls it before every BitLinear; the full checks cost a GPU
    host tens of µs). False means "run the full checks", never "invalid"."""
    try:
        n = x.shape[-1]
        return bool(0 < n <= MAX_COLS and x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES
                    and weight.dim() == 1 and weight.shape[0] == n and eps > 0
                    and x.is_contiguous() and weight.is_contiguous() and weight.device == x.device
                    and not runtime.COMPILE_ONLY and runtime.runs_on(x.device))
    except (AttributeError, IndexError, TypeError):
        return False


def _require_norm_inputs(x, weight):
    require_tensor("x", x)
    require_float("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the row being normalised)")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x has rows of length 0: RMSNorm of an empty row is undefined")
    if n > MAX_COLS:
        raise ValueError(f"rows of {n} elements do not fit one program's registers (at most {MAX_COLS})")
    require_tensor("weight", weight, shape=(n,))
    require_float("weight", weight)
    require_same_device(x=x, weight=weight)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """Fused RMSNorm + per-row absmax int8 quantization (inference).

    x: [..., N] float32/float16/bfloat16, contiguous; weight: [N].
    Returns (x_q int8 [..., N], scale float32 [...]) with x_q ≈ rmsnorm(x)·weight·scale."""
    if not plainly_valid_norm_args(x, weight, eps):    # the full checks say what to fix
        _require_norm_inputs(x, weight)
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps}")
    if x.dim() == 2:                       # the usual [rows, N]: no views to make
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        if x.shape[0]:
            rmsnorm_quant_into(x, weight, q, s, eps)
        return q, s
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, n)
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        rmsnorm_quant_into(x2, weight, q, s, eps)
    return q.view(*lead, n), s.view(lead)


class RMSNormFakeQuant(torch.autograd.Function):
    """Fused training path: Triton forward (stores ŷ and rstd), Triton STE backward.
    Saves x, weight and rstd only; x̂ is recomputed in the backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            rmsnorm_fakequant_fwd_into(x2, weight, y, rstd, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        dw = torch.empty(n, dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            rmsnorm_quant_bwd_into(x2, weight, rstd, dy2, dx, dw)
        else:
            dw.zero_()
        return dx.view(x.shape), dw.to(weight.dtype), None


def rmsnorm_fakequant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      fused: bool | None = None) -> torch.Tensor:
    """RMSNorm + int8 fake quantization with the straight-through estimator (training).

    fused=None picks the Triton kernels when they are compiled for a GPU and the
    PyTorch reference otherwise (the interpreter is far too slow for training loops);
    fused=True forces the kernels (they run in the interpreter on a CPU)."""
    _require_norm_inputs(x, weight)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if fused is None:
        fused = runtime.mode() == "compiled" and x.is_cuda
    if not fused:
        return rmsnorm_fakequant_ref(x, weight, eps)
    return RMSNormFakeQuant.apply(x, weight, eps)

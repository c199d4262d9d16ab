r"""RMSNorm + int8 quantization fused with the operation before it: the residual add and
the gated MLP's SiLU·mul.

Every projection of the engine's transformer (:mod:`gpulab.engine.model`) is a BitLinear,
which normalises and quantizes its own input (notebook 02's ``rmsnorm_quant``). Two of
those inputs are made by one elementwise operation on tensors that were just written:

    gate_up's input:   s = x + a                     (the residual plus attention's output)
    down_proj's input: h = SiLU(g) ⊙ u,  [g, u] = gate_up(x),  SiLU(g) = g / (1 + e^(−g))

Unfused, each is one or two PyTorch kernels that read and write whole rows (F.silu, then
the product: read 2H, write H, read 2H, write H), then ``rmsnorm_quant`` reads the result
again. Here one program loads a row's inputs once, forms s (storing it: it is the next
residual) or h in registers, and normalises and quantizes it as ``rmsnorm_quant`` does:

    rstd = 1 / sqrt(mean_j v_j² + eps),   y = v · rstd · w,
    scale = 127 / max(max_j |y_j|, 1e-5),  q = clamp(round(y · scale), −128, 127)

For the engine's MLP at 2048 rows of H = 5632 in bf16 that is 46 MB read and 12 MB
written where the three kernels moved 139 MB; a decode step of 16 layers also launches 48
kernels fewer (each ~2-3 µs even replayed from a CUDA graph).

Rounding: the kernels compute in float32 and round where PyTorch's ops on the
activations' dtype round: the sum s once (it is stored in x's dtype and normalised as
stored), SiLU(g) to the dtype, then the product. ``exp`` is the GPU's fast one, so a
16-bit SiLU(g) may round the other way from PyTorch's about once in 30 000 elements (one
unit in the last place). Rounding to bfloat16 is done on the bits (:func:`round_to`):
Triton's interpreter would truncate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import runtime
from .normquant import MAX_COLS, rmsnorm_quant_ref, round_half_away_int, sum_and_max
from .validate import FLOAT_DTYPES, require_float, require_same_device, require_tensor

TILE = 1 << 12      # elements a program holds per input (a GPU); whole rows, at least one


# -- PyTorch reference ----------------------------------------------------------------------
def add_rmsnorm_quant_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The unfused ops: s = x + residual (x's dtype), then RMSNorm + int8 quantization of s.
    Returns (s, s_q int8, scale float32)."""
    s = x + residual
    q, scale = rmsnorm_quant_ref(s, weight, eps)
    return s, q, scale


def silu_mul_rmsnorm_quant_ref(gate_up: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The unfused ops: h = SiLU(gate) ⊙ up with [gate, up] the two halves of the last
    dimension, in gate_up's dtype, then RMSNorm + int8 quantization of h. Returns
    (h_q int8 [..., H], scale float32 [...])."""
    gate, up = gate_up.chunk(2, dim=-1)
    return rmsnorm_quant_ref(F.silu(gate) * up, weight, eps)


# -- Triton kernels -------------------------------------------------------------------------
@triton.jit
def _norm_quant_store(v, w_ptr, q_ptr, scale_ptr, rows64, cols, mask, n_rows, n_cols, stride_q, eps,
                      ONE_REDUCTION: tl.constexpr):
    """RMSNorm + absmax int8 quantization of rows v [BLOCK_R, BLOCK_N] (float32, zeros in
    masked lanes) as ``rmsnorm_quant_fwd_kernel`` does it: Σv² and max|v·w| in one reduction
    where compiled (rstd > 0, so max|y| = rstd · max|v·w|), one multiply per element."""
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    vw = v * w[None, :]
    if ONE_REDUCTION:
        sum_sq, max_vw = tl.reduce((v * v, tl.abs(vw)), 1, sum_and_max)
    else:
        sum_sq, max_vw = tl.sum(v * v, axis=1), tl.max(tl.abs(vw), axis=1)
    rstd = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
    scale = 127.0 / tl.maximum(max_vw * rstd, 1e-5)                  # normquant.ABSMAX_FLOOR
    q = tl.minimum(tl.maximum(round_half_away_int(vw * (rstd * scale)[:, None]), -128), 127)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows64, scale, mask=rows64 < n_rows)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """float32 v rounded to ``dtype`` (to nearest, ties to even), kept in float32. bfloat16
    by hand on the bits: Triton's interpreter truncates in its float32-to-bfloat16
    conversion, and the kernels must round as PyTorch's ops do there too."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


# The row count changes every engine step: not specialised on (a recompile per value class).
@triton.jit(do_not_specialize=["n_rows"])
def add_rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, s_ptr, q_ptr, scale_ptr, n_rows, n_cols,
                             stride_x, stride_r, stride_s, stride_q, eps,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_REDUCTION: tl.constexpr):
    """BLOCK_R whole rows: s = x + r stored in s's dtype, then s as stored normalised and
    quantized. A program reads its rows before it writes them: s may be x itself."""
    rows64 = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows64 < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = round_to(x + r, s_ptr.dtype.element_ty)     # rounded once, as PyTorch's add
    tl.store(s_ptr + rows64[:, None] * stride_s + cols[None, :], s.to(s_ptr.dtype.element_ty), mask=mask)
    _norm_quant_store(s, w_ptr, q_ptr, scale_ptr, rows64, cols, mask, n_rows, n_cols,
                      stride_q, eps, ONE_REDUCTION)


@triton.jit(do_not_specialize=["n_rows"])
def silu_mul_rmsnorm_quant_kernel(gu_ptr, w_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_gu, stride_q, eps,
                                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ONE_REDUCTION: tl.constexpr):
    """BLOCK_R whole rows of h = SiLU(g) ⊙ u, g = gu[:, :n_cols] and u = gu[:, n_cols:],
    normalised and quantized; h never leaves registers."""
    rows64 = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows64 < n_rows)[:, None] & (cols < n_cols)[None, :]
    g_ptrs = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    dtype = gu_ptr.dtype.element_ty
    act = round_to(g / (1.0 + tl.exp(-g)), dtype)      # F.silu, rounded to the dtype
    h = round_to(act * u, dtype)                        # the product, rounded too
    _norm_quant_store(h, w_ptr, q_ptr, scale_ptr, rows64, cols, mask, n_rows, n_cols, stride_q, eps,
                      ONE_REDUCTION)


# -- launchers ------------------------------------------------------------------------------
def tile_config(n_rows: int, n_cols: int) -> dict:
    """Rows per program, the padded row and warps: about :data:`TILE` elements of each input
    a program on a GPU (whole rows), ~16 a thread; the interpreter pays per program, so
    there a program takes four times as many."""
    block_n = runtime.next_power_of_2(max(1, n_cols))
    budget = TILE * (4 if runtime.interpreting() else 1)
    block_r = max(1, min(budget // block_n, runtime.next_power_of_2(max(1, n_rows)), 64))
    warps = max(4, min(16, block_r * block_n // 512))
    return {"BLOCK_R": block_r, "BLOCK_N": block_n, "num_warps": warps}


def add_rmsnorm_quant_into(x, residual, weight, s, s_q, scale, eps: float = 1e-6):
    """Launcher (no validation): x, residual [rows, N] -> s = x + residual [rows, N] (x's
    dtype; may be x), s_q int8 [rows, N], scale float32 [rows]. Row strides are free."""
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    cfg = tile_config(n_rows, n_cols)
    block_r, block_n, warps = cfg["BLOCK_R"], cfg["BLOCK_N"], cfg["num_warps"]
    runtime.launch(add_rmsnorm_quant_kernel, (runtime.cdiv(n_rows, block_r),), {"num_warps": warps},
                   x, residual, weight, s, s_q, scale, n_rows, n_cols,
                   x.stride(0), residual.stride(0), s.stride(0), s_q.stride(0), eps,
                   BLOCK_R=block_r, BLOCK_N=block_n, ONE_REDUCTION=not runtime.interpreting())


def silu_mul_rmsnorm_quant_into(gate_up, weight, h_q, scale, eps: float = 1e-6):
    """Launcher (no validation): gate_up [rows, 2H] -> h_q int8 [rows, H], scale float32
    [rows] of h = SiLU(gate_up[:, :H]) ⊙ gate_up[:, H:]."""
    n_rows, n_cols = h_q.shape
    if n_rows == 0:
        return
    cfg = tile_config(n_rows, 2 * n_cols)            # two loads a column: rows of 2H count
    block_r, block_n = cfg["BLOCK_R"], runtime.next_power_of_2(max(1, n_cols))
    runtime.launch(silu_mul_rmsnorm_quant_kernel, (runtime.cdiv(n_rows, block_r),),
                   {"num_warps": cfg["num_warps"]},
                   gate_up, weight, h_q, scale, n_rows, n_cols, gate_up.stride(0), h_q.stride(0), eps,
                   BLOCK_R=block_r, BLOCK_N=block_n, ONE_REDUCTION=not runtime.interpreting())


# -- public API -----------------------------------------------------------------------------
def plainly_valid_fused_args(rows: tuple, n: int, weight, eps) -> bool:
    """True when every tensor of ``rows`` is a contiguous float tensor of the first one's
    dtype and device, ``weight`` a contiguous float [n] beside them, 0 < n ≤ MAX_COLS and
    eps > 0: tested with a few attribute reads (a decode-sized call's host time counts; the
    full checks cost tens of µs). False means "run the full checks", never "invalid"."""
    try:
        x = rows[0]
        return bool(0 < n <= MAX_COLS and x.dim() >= 1 and x.dtype in FLOAT_DTYPES and eps > 0
                    and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous() for t in rows)
                    and weight.dtype in FLOAT_DTYPES and weight.dim() == 1 and weight.shape[0] == n
                    and weight.is_contiguous() and weight.device == x.device
                    and not runtime.COMPILE_ONLY and runtime.runs_on(x.device))
    except (AttributeError, IndexError, TypeError):
        return False


def _require_rows_of(name: str, t, n: int | None = None, dtype=None) -> None:
    """A contiguous float tensor [..., n] (n: any, where None) of ``dtype`` (where given)."""
    require_tensor(name, t, dtype=dtype)
    require_float(name, t)
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (its rows), got a scalar")
    if n is not None and t.shape[-1] != n:
        raise ValueError(f"{name} has rows of {t.shape[-1]} elements, expected {n}")


def _require_norm_weight(weight, n: int) -> None:
    if not 0 < n <= MAX_COLS:
        raise ValueError(f"rows of {n} elements: need 1..{MAX_COLS} (one program holds a whole row)")
    require_tensor("weight", weight, shape=(n,))
    require_float("weight", weight)


def _require_add_inputs(x, residual, weight, eps, out) -> None:
    _require_rows_of("x", x)
    _require_rows_of("residual", residual, x.shape[-1], dtype=x.dtype)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    _require_norm_weight(weight, x.shape[-1])
    if out is not None:
        _require_rows_of("out", out, x.shape[-1], dtype=x.dtype)
        if out.shape != x.shape:
            raise ValueError(f"out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    require_same_device(x=x, residual=residual, weight=weight, out=out)


def _require_silu_mul_inputs(gate_up, weight, eps) -> None:
    _require_rows_of("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even ([gate, up] halves), got {gate_up.shape[-1]}")
    _require_norm_weight(weight, gate_up.shape[-1] // 2)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    require_same_device(gate_up=gate_up, weight=weight)


def add_rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      out: torch.Tensor | None = None):
    """s = x + residual, then fused RMSNorm + per-row absmax int8 quantization of s.

    Parameters
    ----------
    x, residual : [..., N] float32/float16/bfloat16, same shape and dtype, contiguous
    weight : [N], the norm's weight
    out : where s goes (x's shape and dtype; may be x itself); None: a new tensor

    Returns
    -------
    (s, s_q int8 [..., N], scale float32 [...]) with s_q ≈ rmsnorm(s)·weight·scale.

    >>> x, a = torch.randn(3, 8), torch.randn(3, 8)
    >>> s, q, scale = add_rmsnorm_quant(x, a, torch.ones(8))
    >>> torch.equal(s, x + a), q.dtype, tuple(scale.shape)
    (True, torch.int8, (3,))
    """
    n = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 0
    rows = (x, residual) if out is None else (x, residual, out)
    if not (plainly_valid_fused_args(rows, n, weight, eps) and residual.shape == x.shape
            and (out is None or out.shape == x.shape)):
        _require_add_inputs(x, residual, weight, eps, out)      # says what to fix
    s = torch.empty_like(x) if out is None else out
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    add_rmsnorm_quant_into(x.view(-1, n), residual.view(-1, n), weight, s.view(-1, n), q.view(-1, n),
                           scale.view(-1), eps)
    return s, q, scale


def silu_mul_rmsnorm_quant(gate_up: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """h = SiLU(gate) ⊙ up, [gate, up] = the two halves of gate_up's last dimension, then
    fused RMSNorm + per-row absmax int8 quantization of h; h itself is never stored.

    Parameters
    ----------
    gate_up : [..., 2H] float32/float16/bfloat16, contiguous (a gated MLP's fused projection)
    weight : [H], the norm's weight (the down projection's)

    Returns
    -------
    (h_q int8 [..., H], scale float32 [...]) with h_q ≈ rmsnorm(h)·weight·scale.

    >>> q, scale = silu_mul_rmsnorm_quant(torch.randn(3, 16), torch.ones(8))
    >>> tuple(q.shape), tuple(scale.shape)
    ((3, 8), (3,))
    """
    width = gate_up.shape[-1] if isinstance(gate_up, torch.Tensor) and gate_up.dim() else 1
    if width % 2 or not plainly_valid_fused_args((gate_up,), width // 2, weight, eps):
        _require_silu_mul_inputs(gate_up, weight, eps)          # says what to fix
    h = gate_up.shape[-1] // 2
    lead = gate_up.shape[:-1]
    q = torch.empty(*lead, h, dtype=torch.int8, device=gate_up.device)
    scale = torch.empty(lead, dtype=torch.float32, device=gate_up.device)
    silu_mul_rmsnorm_quant_into(gate_up.view(-1, 2 * h), weight, q.view(-1, h), scale.view(-1), eps)
    return q, scale

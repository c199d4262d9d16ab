r"""Notebook 00: a first kernel (vector add) and a fused row softmax.

Vector add:  out_i = x_i + y_i. One program handles BLOCK consecutive elements; the
last program's block runs past the end, so every load and store is masked with
``offsets < n``.

Row softmax of an [M, N] matrix, in the safe form that cannot overflow:

    m_r = max_j x_rj,     s_r = \sum_j exp(x_rj - m_r),     y_rj = exp(x_rj - m_r) / s_r

Row sums of an [M, N] matrix, y_m = \sum_n x_mn, with 2-D tiles: program p owns rows
p·BLOCK_M … p·BLOCK_M + BLOCK_M - 1 and walks the columns BLOCK_N at a time, loading a
[BLOCK_M, BLOCK_N] tile whose addresses are ``rows[:, None] * stride_m + cols[None, :] *
stride_n`` (a column of row offsets plus a row of column offsets, broadcast), masked on
both axes, and adding ``tl.sum(tile, axis=1)`` into a float32 accumulator. The ternary
GEMV of notebook 01 is the same loop with a multiply in it.

Softmax unfused (:func:`safe_softmax_unfused`), PyTorch reads x for the max, reads it again for
the exponentials and writes them, reads them for the sum, reads them again to divide
and writes y: about 6·M·N elements of traffic. The fused kernel gives each row to one
program, holds the row in registers and touches memory twice: read x, write y (2·M·N).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validate import require_float, require_same_device, require_tensor


# -- PyTorch reference --------------------------------------------------------------------
def safe_softmax_unfused(x: torch.Tensor) -> torch.Tensor:
    """Safe softmax (max subtracted first) as separate PyTorch passes over the last
    dimension; each line is a trip to memory."""
    x_max = x.max(dim=-1, keepdim=True).values   # read x
    e = torch.exp(x - x_max)                      # read x, write e
    s = e.sum(dim=-1, keepdim=True)               # read e
    return e / s                                  # read e, write y


# -- Triton kernels -----------------------------------------------------------------------
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n                      # the last block runs past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Masked lanes read -inf: they add exp(-inf) = 0 to the sum and never win the max.
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_sum_kernel(x_ptr, y_ptr, M, N, stride_m, stride_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    row_offsets = rows.to(tl.int64)[:, None] * stride_m          # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]            # both axes: [BLOCK_M, BLOCK_N]
        tile = tl.load(x_ptr + row_offsets + cols[None, :] * stride_n, mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=1)
    tl.store(y_ptr + rows, acc, mask=row_mask)


# -- launchers (the checks' calling convention: inputs, then preallocated outputs) ---------
ADD_BLOCK = 1024


def add_into(x, y, out):
    """Writes x + y into ``out``: cdiv(n, ADD_BLOCK) programs."""
    n = out.numel()
    add_kernel[(triton.cdiv(n, ADD_BLOCK),)](x, y, out, n, BLOCK=ADD_BLOCK)


ROW_SUM_BLOCK_M, ROW_SUM_BLOCK_N = 16, 128


def row_sum_into(x, y):
    """Writes the float32 row sums of x [M, N] (any strides) into y [M]."""
    m, n = x.shape
    row_sum_kernel[(triton.cdiv(m, ROW_SUM_BLOCK_M),)](x, y, m, n, x.stride(0), x.stride(1),
                                                      BLOCK_M=ROW_SUM_BLOCK_M, BLOCK_N=ROW_SUM_BLOCK_N)


def _softmax_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def softmax_into(x, y):
    """Writes the row softmax of x [rows, cols] into y: one program per row."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    softmax_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK=block,
                              num_warps=_softmax_warps(block))


# -- public API ---------------------------------------------------------------------------
SOFTMAX_MAX_COLS = 1 << 16


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two contiguous tensors of one shape, dtype and device."""
    require_tensor("x", x)
    require_tensor("y", y, shape=x.shape, dtype=x.dtype)
    require_same_device(x=x, y=y)
    out = torch.empty_like(x)
    if x.numel():
        add_into(x, y, out)
    return out


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Float32 row sums of a 2-D float tensor (any strides: views such as ``x.t()`` work)."""
    require_tensor("x", x, ndim=2, contiguous=False)
    require_float("x", x)
    y = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    if x.numel():
        row_sum_into(x, y)
    return y


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row softmax of a 2-D tensor (rows of up to 65536 elements) in one fused kernel."""
    require_tensor("x", x, ndim=2)
    require_float("x", x)
    if x.shape[1] == 0:
        raise ValueError("x has rows of length 0: softmax of an empty row is undefined")
    if x.shape[1] > SOFTMAX_MAX_COLS:
        raise ValueError(f"rows of {x.shape[1]} elements do not fit one program's registers "
                         f"(at most {SOFTMAX_MAX_COLS}); an online softmax (notebook 04) has no limit")
    y = torch.empty_like(x)
    if x.shape[0]:
        softmax_into(x, y)
    return y

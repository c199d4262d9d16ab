r"""Notebook 00: a first kernel (vector add) and a fused row softmax.

Vector add:  out_i = x_i + y_i. One program handles BLOCK consecutive elements; the
last program's block runs past the end, so every load and store is masked with
``offsets < n``.

Row softmax of an [M, N] matrix, in the safe form that cannot overflow:

    m_r = max_j x_rj,     s_r = \sum_j exp(x_rj - m_r),     y_rj = exp(x_rj - m_r) / s_r

Unfused, PyTorch reads x once for the max, once more for the exponentials, writes
them, reads them back for the sum and again to divide, then writes y: about
5·M·N elements of traffic. The fused kernel gives each row to one program, holds the
row in registers and touches memory twice: read x, write y (2·M·N elements).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .harness.spec import Case, KernelSpec, bytes_of, randn
from .validate import require_float, require_same_device, require_tensor

# -- vector add ---------------------------------------------------------------------------
ADD_BLOCK = 1024


def add_reference(x, y):
    return {"out": x.double() + y.double()}


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n                      # the last block runs past the end
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add_into(x, y, out):
    """Launcher with the check's calling convention: writes x + y into ``out``."""
    n = out.numel()
    add_kernel[(triton.cdiv(n, ADD_BLOCK),)](x, y, out, n, BLOCK=ADD_BLOCK)


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two contiguous tensors of one shape, dtype and device."""
    require_tensor("x", x)
    require_tensor("y", y, shape=x.shape, dtype=x.dtype)
    require_same_device(x=x, y=y)
    out = torch.empty_like(x)
    if x.numel():
        add_into(x, y, out)
    return out


def _add_inputs(p, dtype, device, gen):
    return {"x": randn((p["n"],), dtype, device, gen),
            "y": randn((p["n"],), dtype, device, gen, offset=0.5)}


ADD = KernelSpec(
    name="vector_add",
    summary="out = x + y, elementwise",
    args=("x", "y", "out"),
    make_inputs=_add_inputs,
    reference=add_reference,
    outputs=lambda inp, dtype: {"out": (inp["x"].shape, dtype)},
    implementation=add_into,
    cases={
        "cpu": [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
                Case("one block", dict(n=ADD_BLOCK)), Case("blocks + tail", dict(n=3 * ADD_BLOCK + 77))],
        "gpu": [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
                Case("many blocks + tail", dict(n=(1 << 20) + 3))],
        "bench": [Case(f"n=2^{k}", dict(n=1 << k)) for k in (20, 24, 28)],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)},
    bytes_moved=lambda p, dtype: 3 * p["n"] * bytes_of(dtype),
    flops=lambda p, dtype: p["n"],
    baselines={"torch": lambda inp: inp["x"] + inp["y"]},
    read_inputs=("x", "y"),
)


# -- softmax ------------------------------------------------------------------------------
def softmax_reference(x):
    return {"y": torch.softmax(x.double(), dim=-1)}


def softmax_naive(x: torch.Tensor) -> torch.Tensor:
    """Safe softmax as separate PyTorch passes (each line is a trip to memory)."""
    x_max = x.max(dim=-1, keepdim=True).values   # pass 1: read x
    e = torch.exp(x - x_max)                      # pass 2: read x, write e
    s = e.sum(dim=-1, keepdim=True)               # pass 3: read e
    return e / s                                  # pass 4: read e, write y


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


def _softmax_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def softmax_into(x, y):
    """Launcher with the check's calling convention: one program per row."""
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    softmax_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK=block,
                              num_warps=_softmax_warps(block))


SOFTMAX_MAX_COLS = 1 << 16


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


def _softmax_inputs(p, dtype, device, gen):
    # Scores with a large, row-dependent offset: an unsafe softmax (no max) overflows.
    x = randn((p["rows"], p["cols"]), torch.float32, device, gen, scale=3.0)
    x = x + torch.linspace(120, -60, p["rows"], device=device)[:, None]
    return {"x": x.to(dtype)}


SOFTMAX = KernelSpec(
    name="softmax",
    summary="row softmax, one program per row",
    args=("x", "y"),
    make_inputs=_softmax_inputs,
    reference=softmax_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=softmax_into,
    cases={
        "cpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("power of two", dict(rows=5, cols=256)), Case("tail", dict(rows=7, cols=1000))],
        "gpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("tail", dict(rows=37, cols=1000)), Case("wide", dict(rows=129, cols=12345))],
        "bench": [Case(f"4096x{n}", dict(rows=4096, cols=n)) for n in (256, 1024, 4096, 16384)]
        + [Case("8192x8192", dict(rows=8192, cols=8192))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances={torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (4e-3, 1e-2)},
    bytes_moved=lambda p, dtype: 2 * p["rows"] * p["cols"] * bytes_of(dtype),
    flops=lambda p, dtype: 5 * p["rows"] * p["cols"],
    baselines={"torch": lambda inp: torch.softmax(inp["x"], dim=-1),
               "torch (3 passes)": lambda inp: softmax_naive(inp["x"])},
    read_inputs=("x",),
)

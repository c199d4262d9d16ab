"""Notebook 00: vector add, softmax in PyTorch, the fused softmax kernel."""
import torch
import triton
import triton.language as tl

from gpulab import basics

from . import Mistake


# -- ex1: vector add ---------------------------------------------------------------------
@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, MUT: tl.constexpr):
    pid = tl.program_id(0)
    if MUT == 3:                                  # forgot pid * BLOCK
        offs = pid + tl.arange(0, BLOCK)
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if MUT == 1:                                  # no mask anywhere
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs))
    elif MUT == 2:                                # masked store, unmasked loads
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs), mask=mask)
    elif MUT == 4:                                # y never loaded
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    elif MUT == 5:                                # mask off by one
        m = offs <= n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)
    elif MUT == 6:                                # x - y
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) - tl.load(y_ptr + offs, mask=mask), mask=mask)
    else:
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def _add_launcher(mut, grid=None):
    def add(x, y, out):
        n = out.numel()
        g = grid(n) if grid else triton.cdiv(n, 1024)
        _add[(g,)](x, y, out, n, BLOCK=1024, MUT=mut)
    return add


def _torch_add(x, y, out):
    torch.add(x, y, out=out)


# -- ex2: softmax in PyTorch --------------------------------------------------------------
def _sm_torch(kind):
    def softmax_torch(x):
        if kind == "no max":
            e = torch.exp(x)
        elif kind == "min":
            e = torch.exp(x - x.min(-1, keepdim=True).values)
        elif kind == "max over columns":
            e = torch.exp(x - x.max(0, keepdim=True).values)
            return e / e.sum(0, keepdim=True)
        else:
            e = torch.exp(x - x.max(-1, keepdim=True).values)
        if kind == "sum only":
            return e.sum(-1, keepdim=True)          # a (rows, 1) result
        if kind == "no normalisation":
            return e
        return e / e.sum(-1, keepdim=True)
    return lambda x, y: y.copy_(softmax_torch(x))


TORCH_KW = dict(dtypes=[torch.float32], learner_kernel=False)


# -- ex3: the fused softmax kernel --------------------------------------------------------
@triton.jit
def _softmax(x_ptr, y_ptr, n_cols, sx, sy, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if MUT == 1:                                   # masked lanes read 0, not -inf
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    elif MUT == 2:                                 # no mask on the load
        x = tl.load(x_ptr + row * sx + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if MUT == 3:                                   # no max subtraction
        e = tl.exp(x)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    if MUT == 4:                                   # no mask on the store
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _sm_launcher(mut=0, rows=lambda r: r, stride="own", block=None):
    def softmax(x, y):
        n_rows, n_cols = x.shape
        sx, sy = x.stride(0), y.stride(0)
        if stride == "x for y":
            sy = sx
        elif stride == "row length":
            sx = sy = n_cols
        b = block or triton.next_power_of_2(n_cols)
        _softmax[(rows(n_rows),)](x, y, n_cols, sx, sy, BLOCK=b, MUT=mut)
    return softmax


MISTAKES = [
    Mistake("00/check-add", "vector_add", "no mask on loads or store", _add_launcher(1),
            ("past the end of output `out`",)),
    Mistake("00/check-add", "vector_add", "masked store, unmasked loads", _add_launcher(2),
            ("a load past the end of input",),
            interpreter_only="the stray values are loaded but never stored; only the interpreter's "
                             "watch on load addresses sees the read (compute-sanitizer would on a GPU)"),
    Mistake("00/check-add", "vector_add", "offsets forget pid * BLOCK", _add_launcher(3),
            ("never written",)),
    Mistake("00/check-add", "vector_add", "y never loaded", _add_launcher(4), ("y set to zero",)),
    Mistake("00/check-add", "vector_add", "mask offsets <= n", _add_launcher(5),
            ("past the end of output `out`", "a load past the end of input")),
    Mistake("00/check-add", "vector_add", "x - y", _add_launcher(6), ("compare your math",)),
    Mistake("00/check-add", "vector_add", "grid n // BLOCK", _add_launcher(0, grid=lambda n: n // 1024),
            ("never written",)),
    Mistake("00/check-add", "vector_add", "grid fixed to 4 programs (visible sizes only)",
            _add_launcher(0, grid=lambda n: 4), ("never written",)),
    Mistake("00/check-add", "vector_add", "torch.add(out=) instead of a kernel", _torch_add,
            ("asks for a Triton kernel of your own",)),
    Mistake("00/check-add", "vector_add", "gpulab's own add_into", basics.add_into,
            ("asks for a Triton kernel of your own",)),

    Mistake("00/check-softmax-torch", "softmax", "no max subtraction (overflow)", _sm_torch("no max"),
            ("arithmetic", "overflow"), TORCH_KW),
    Mistake("00/check-softmax-torch", "softmax", "subtracts the min", _sm_torch("min"),
            ("arithmetic", "overflow"), TORCH_KW),
    Mistake("00/check-softmax-torch", "softmax", "normalises over dim 0", _sm_torch("max over columns"),
            ("wrong axis",), TORCH_KW),
    Mistake("00/check-softmax-torch", "softmax", "returns the (rows, 1) sum", _sm_torch("sum only"),
            ("broadcasting a result of shape",), TORCH_KW),
    Mistake("00/check-softmax-torch", "softmax", "forgets to divide by the sum", _sm_torch("no normalisation"),
            ("own constant factor",), TORCH_KW),

    Mistake("00/check-softmax-kernel", "softmax", "masked lanes read 0", _sm_launcher(1),
            ("own constant factor",)),
    Mistake("00/check-softmax-kernel", "softmax", "no mask on the load", _sm_launcher(2),
            ("a load past the end of input `x`",)),
    Mistake("00/check-softmax-kernel", "softmax", "no max subtraction", _sm_launcher(3),
            ("arithmetic", "overflow")),
    Mistake("00/check-softmax-kernel", "softmax", "no mask on the store", _sm_launcher(4),
            ("past the end of output `y`",)),
    Mistake("00/check-softmax-kernel", "softmax", "one program too few", _sm_launcher(rows=lambda r: r - 1),
            ("never written",)),
    Mistake("00/check-softmax-kernel", "softmax", "x's row stride used for y", _sm_launcher(stride="x for y"),
            ("between the rows", "padding between the rows")),
    Mistake("00/check-softmax-kernel", "softmax", "row length as row stride", _sm_launcher(stride="row length"),
            ("between the rows", "padding between the rows")),
    Mistake("00/check-softmax-kernel", "softmax", "fixed BLOCK = 1024", _sm_launcher(block=1024),
            ("never written", "columns")),
    Mistake("00/check-softmax-kernel", "softmax", "gpulab's softmax_into", basics.softmax_into,
            ("asks for a Triton kernel of your own",)),
    Mistake("00/check-softmax-kernel", "softmax", "torch.softmax in a launcher",
            lambda x, y: y.copy_(torch.softmax(x.float(), -1)), ("no Triton kernel at all",)),
]


# -- ex2: row sums over 2-D tiles ---------------------------------------------------------
@triton.jit
def _row_sum(x_ptr, y_ptr, M, N, stride_m, stride_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MUT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, N if MUT != 4 else 1, BLOCK_N):  # 4: the first column tile only
        if MUT == 5:                                   # cols not offset by n0
            cols = tl.arange(0, BLOCK_N)
        else:
            cols = n0 + tl.arange(0, BLOCK_N)
        if MUT == 1:                                   # row mask only: columns past N read
            mask = row_mask[:, None] & (cols >= 0)[None, :]
        else:
            mask = row_mask[:, None] & (cols < N)[None, :]
        if MUT == 2:                                   # N as the row stride (assumes contiguous rows)
            offs = rows[:, None] * N + cols[None, :] * stride_n
        elif MUT == 6:                                 # strides swapped
            offs = rows[:, None] * stride_n + cols[None, :] * stride_m
        else:
            offs = rows[:, None] * stride_m + cols[None, :] * stride_n
        tile = tl.load(x_ptr + offs, mask=mask, other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=1)
    if MUT == 3:                                       # a mean, not a sum
        acc = acc / N
    if MUT == 7:                                       # store without the row mask
        tl.store(y_ptr + rows, acc)
    else:
        tl.store(y_ptr + rows, acc, mask=row_mask)


def _row_sum_launcher(mut=0, grid=None):
    def row_sum(x, y):
        M, N = x.shape
        g = grid(M) if grid else triton.cdiv(M, 16)
        _row_sum[(g,)](x, y, M, N, x.stride(0), x.stride(1), BLOCK_M=16, BLOCK_N=64, MUT=mut)
    return row_sum


MISTAKES += [
    Mistake("00/check-row-sum", "row_sum", "no column mask on the tile", _row_sum_launcher(1),
            ("a load past the end of input `x`",)),
    Mistake("00/check-row-sum", "row_sum", "N as the row stride", _row_sum_launcher(2),
            ("between the rows",)),
    Mistake("00/check-row-sum", "row_sum", "a mean, not a sum", _row_sum_launcher(3),
            ("row mean",)),
    Mistake("00/check-row-sum", "row_sum", "first column tile only", _row_sum_launcher(4),
            ("only the first column tile",)),
    Mistake("00/check-row-sum", "row_sum", "column offsets forget n0", _row_sum_launcher(5),
            ("column offsets must start at the loop's n0",)),
    Mistake("00/check-row-sum", "row_sum", "row and column strides swapped", _row_sum_launcher(6),
            ("strides look swapped",),
            weak_compiled="the swapped offsets read past the end of x; without the interpreter's load "
                          "watch only the stray values are seen, not the offsets that read them",
            faults_compiled="on the wide case (3 x 12345) the swapped offsets reach 600 MB past x: "
                            "an illegal address on the H200 (2026-12-01)"),
    Mistake("00/check-row-sum", "row_sum", "store without the row mask", _row_sum_launcher(7),
            ("past the end of output `y`",)),
    Mistake("00/check-row-sum", "row_sum", "grid M // BLOCK_M", _row_sum_launcher(grid=lambda m: m // 16),
            ("never written",)),
]

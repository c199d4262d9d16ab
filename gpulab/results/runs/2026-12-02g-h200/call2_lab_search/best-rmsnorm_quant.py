"""Lab seed for ``rmsnorm_quant``: RMSNorm fused with per-row absmax int8 quantization
(notebook 02): y = x * rstd * w, scale = 127 / max(max|y|, 1e-5),
x_q = clamp(round_half_away(y * scale), -128, 127). One read of x, a one-byte write."""
import triton
import triton.language as tl

from gpulab import runtime

ROWS_PER_PROGRAM = 1  # gene
NUM_WARPS = 4  # gene
PERSISTENT = False  # gene
GENE_SPACE = {"ROWS_PER_PROGRAM": [1, 2, 4, 8, 16, 32], "NUM_WARPS": [1, 2, 4, 8, 16],
              "PERSISTENT": [False, True]}
EPS = 1e-6
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): the rows per program shrink to fit


# compiled, one reduction carries both sums; the interpreter would run it element by element
ONE_REDUCTION = tl.constexpr(not runtime.interpreting())


@triton.jit
def sum_and_max(s0, m0, s1, m1):
    return s0 + s1, tl.maximum(m0, m1)


@triton.jit
def norm_quant_rows(x_ptr, w_ptr, q_ptr, scale_ptr, rb, n_rows, n_cols, eps, cols, cmask, R: tl.constexpr):
    rows = rb * R + tl.arange(0, R)
    rmask = rows < n_rows
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    xw = x * w[None, :]
    if ONE_REDUCTION:
        sum_sq, max_xw = tl.reduce((x * x, tl.abs(xw)), 1, sum_and_max)
    else:
        sum_sq, max_xw = tl.sum(x * x, axis=1), tl.max(tl.abs(xw), axis=1)
    rstd = 1.0 / tl.sqrt(sum_sq / n_cols + eps)
    scale = 127.0 / tl.maximum(max_xw * rstd, 1e-5)
    v = xw * (rstd * scale)[:, None]
    q = (tl.abs(v) + 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(tl.where(v < 0, -q, q), -128), 127)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rmask)


@triton.jit
def rmsnorm_quant_kernel(x_ptr, w_ptr, q_ptr, scale_ptr, n_rows, n_cols, eps, R: tl.constexpr,
                         BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    if PERSISTENT:     # a grid of a few programs per SM, each walking row blocks
        for rb in range(tl.program_id(0), tl.cdiv(n_rows, R), tl.num_programs(0)):
            norm_quant_rows(x_ptr, w_ptr, q_ptr, scale_ptr, rb, n_rows, n_cols, eps, cols, cmask, R)
    else:              # one row block per program, no loop
        norm_quant_rows(x_ptr, w_ptr, q_ptr, scale_ptr, tl.program_id(0), n_rows, n_cols, eps, cols, cmask, R)


def launch(x, weight, x_q, scale):
    n_rows, n_cols = x.shape
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(ROWS_PER_PROGRAM, MAX_TILE_PER_WARP * NUM_WARPS // block_n))
    blocks = triton.cdiv(n_rows, rows)
    grid = min(blocks, 4 * runtime.num_sms()) if PERSISTENT else blocks
    rmsnorm_quant_kernel[(grid,)](x, weight, x_q, scale, n_rows, n_cols, EPS, R=rows, BLOCK_N=block_n,
                                  PERSISTENT=PERSISTENT, num_warps=NUM_WARPS)

"""Lab seed for ``rmsnorm``: y = x / sqrt(mean(x^2) + eps) * w per row (eps = 1e-6), in
float32, stored in x's dtype. ROWS_PER_PROGRAM whole rows per program, or a persistent
grid that strides over row blocks."""
import triton
import triton.language as tl

from gpulab import runtime

ROWS_PER_PROGRAM = 1  # gene
NUM_WARPS = 4  # gene
PERSISTENT = False  # gene
GENE_SPACE = {"ROWS_PER_PROGRAM": [1, 2, 4, 8, 16], "NUM_WARPS": [1, 2, 4, 8, 16],
              "PERSISTENT": [False, True]}
EPS = 1e-6
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): the rows per program shrink to fit


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, eps, R: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for rb in range(tl.program_id(0), tl.cdiv(n_rows, R), tl.num_programs(0)):
        rows = rb * R + tl.arange(0, R)
        mask = (rows < n_rows)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, weight, y):
    n_rows, n_cols = x.shape
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(ROWS_PER_PROGRAM, MAX_TILE_PER_WARP * NUM_WARPS // block_n))
    blocks = triton.cdiv(n_rows, rows)
    grid = min(blocks, 4 * runtime.num_sms()) if PERSISTENT else blocks
    rmsnorm_kernel[(grid,)](x, weight, y, n_rows, n_cols, EPS, R=rows, BLOCK_N=block_n,
                            num_warps=NUM_WARPS)

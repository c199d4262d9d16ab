"""Lab seed for ``cumsum``: the inclusive prefix sum of each row, y_rj = sum_{k<=j} x_rk,
accumulated in float32. The row is scanned in TILE_N-wide tiles with ``tl.cumsum``;
each tile adds the running total of the tiles before it (a carried scan)."""
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 1  # gene
NUM_WARPS = 4  # gene
TILE_N = 1024  # gene
GENE_SPACE = {"ROWS_PER_PROGRAM": [1, 2, 4, 8, 16], "NUM_WARPS": [1, 2, 4, 8, 16],
              "TILE_N": [128, 256, 512, 1024, 2048, 4096]}
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): the rows per program shrink to fit


@triton.jit
def cumsum_kernel(x_ptr, y_ptr, n_rows, n_cols, R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    carry = tl.zeros([R], tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        offs = rows64[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.cumsum(x, axis=1) + carry[:, None]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        # the running total: the tile's last prefix sum (a sum of x beside the scan trips
        # a compiler pass of some Triton versions)
        carry = tl.max(tl.where((cols == c0 + BLOCK_N - 1)[None, :], y, -float("inf")), axis=1)


def launch(x, y):
    n_rows, n_cols = x.shape
    block_n = min(TILE_N, triton.next_power_of_2(n_cols))
    rows = max(1, min(ROWS_PER_PROGRAM, MAX_TILE_PER_WARP * NUM_WARPS // block_n))
    cumsum_kernel[(triton.cdiv(n_rows, rows),)](x, y, n_rows, n_cols, R=rows,
                                                            BLOCK_N=block_n, num_warps=NUM_WARPS)

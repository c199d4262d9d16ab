"""Lab seed for ``logsumexp``: y_r = log(sum_j exp(x_rj)) = m_r + log(sum_j exp(x_rj - m_r))
with m_r = max_j x_rj, in float32. The row streams through TILE_N-wide tiles with a
running max and a rescaled running sum (one read of x), ROWS_PER_PROGRAM rows at a time."""
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 1  # gene
NUM_WARPS = 4  # gene
TILE_N = 1024  # gene
GENE_SPACE = {"ROWS_PER_PROGRAM": [1, 2, 4, 8, 16], "NUM_WARPS": [1, 2, 4, 8, 16],
              "TILE_N": [256, 512, 1024, 2048, 4096, 8192]}
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): the rows per program shrink to fit


@triton.jit
def logsumexp_kernel(x_ptr, y_ptr, n_rows, n_cols, R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rmask = rows < n_rows
    rows64 = rows.to(tl.int64)
    m = tl.full([R], -float("inf"), tl.float32)
    s = tl.zeros([R], tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * n_cols + cols[None, :], mask=mask,
                    other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
    tl.store(y_ptr + rows, m + tl.log(s), mask=rmask)


def launch(x, y):
    n_rows, n_cols = x.shape
    block_n = min(TILE_N, triton.next_power_of_2(n_cols))
    rows = max(1, min(ROWS_PER_PROGRAM, MAX_TILE_PER_WARP * NUM_WARPS // block_n))
    logsumexp_kernel[(triton.cdiv(n_rows, rows),)](x, y, n_rows, n_cols, R=rows,
                                                               BLOCK_N=block_n, num_warps=NUM_WARPS)

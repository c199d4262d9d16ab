"""Lab seed for ``softmax``: the safe row softmax y = exp(x - max) / sum(exp(x - max)).

Two loop structures, chosen by the LOOP gene:

* ``"single"``: each program holds ROWS_PER_PROGRAM whole rows in registers (one read
  of x, one write of y); the tile is padded to a power of two.
* ``"online"``: rows stream through in TILE_N-wide tiles: a first pass keeps a running
  max and a rescaled running sum (the online softmax), a second pass writes y. Rows of
  any length fit, at the cost of reading x twice.
"""
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 1  # gene
NUM_WARPS = 4  # gene
LOOP = 'single'  # gene
TILE_N = 1024  # gene
GENE_SPACE = {"ROWS_PER_PROGRAM": [1, 2, 4, 8, 16], "NUM_WARPS": [1, 2, 4, 8, 16],
              "LOOP": ["single", "online"], "TILE_N": [256, 512, 1024, 2048, 4096]}
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): the rows per program shrink to fit


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_rows, n_cols, sx, sy, R: tl.constexpr, BLOCK_N: tl.constexpr,
                   ONLINE: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rmask = rows < n_rows
    rows64 = rows
    if ONLINE:
        m = tl.full([R], -float("inf"), tl.float32)
        s = tl.zeros([R], tl.float32)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * sx + cols[None, :], mask=mask,
                        other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)   # rows past the end
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
            m = m_new
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        inv = 1.0 / tl.where(s == 0.0, 1.0, s)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = rmask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * sx + cols[None, :], mask=mask,
                        other=-float("inf")).to(tl.float32)
            y = tl.exp(x - m_safe[:, None]) * inv[:, None]
            tl.store(y_ptr + rows64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        # Masked lanes read -inf: they add exp(-inf) = 0 to the sum and never win the max.
        x = tl.load(x_ptr + rows64[:, None] * sx + cols[None, :], mask=mask,
                    other=-float("inf")).to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(x)
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(y_ptr + rows64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def launch(x, y):
    n_rows, n_cols = x.shape
    online = LOOP == "online"
    block_n = TILE_N if online else triton.next_power_of_2(n_cols)
    rows = max(1, min(ROWS_PER_PROGRAM, MAX_TILE_PER_WARP * NUM_WARPS // block_n))
    softmax_kernel[(triton.cdiv(n_rows, rows),)](x, y, n_rows, n_cols, x.stride(0), y.stride(0),
                                                  R=rows, BLOCK_N=block_n, ONLINE=online,
                                                  num_warps=NUM_WARPS)

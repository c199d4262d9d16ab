"""Lab seed for ``bias_gelu``: out = gelu_tanh(x + bias) on a [rows, cols] matrix, the
bias broadcast over rows. GELU with the tanh approximation,
gelu(v) = v/2 * (1 + tanh(sqrt(2/pi) * (v + 0.044715 v^3))), and tanh(t) = 2 sigmoid(2t) - 1.
Programs tile the matrix in BLOCK_R x BLOCK_C tiles; ROW_MAJOR picks the order in
which program ids walk the tiles."""
import triton
import triton.language as tl

BLOCK_R = 4  # gene
BLOCK_C = 256  # gene
NUM_WARPS = 4  # gene
ROW_MAJOR = True  # gene
GENE_SPACE = {"BLOCK_R": [1, 2, 4, 8, 16, 32], "BLOCK_C": [64, 128, 256, 512, 1024, 2048],
              "NUM_WARPS": [1, 2, 4, 8, 16], "ROW_MAJOR": [True, False]}
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): BLOCK_R shrinks to fit


@triton.jit
def bias_gelu_kernel(x_ptr, b_ptr, out_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, ROW_MAJOR: tl.constexpr):
    pid = tl.program_id(0)
    tiles_c = tl.cdiv(n_cols, BLOCK_C)
    tiles_r = tl.cdiv(n_rows, BLOCK_R)
    if ROW_MAJOR:
        tr = pid // tiles_c
        tc = pid % tiles_c
    else:
        tr = pid % tiles_r
        tc = pid // tiles_r
    rows = tr * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tc * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    v = x + b[None, :]
    t = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    out = 0.5 * v * (1.0 + (2.0 * tl.sigmoid(2.0 * t) - 1.0))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, bias, out):
    n_rows, n_cols = x.shape
    block_r = max(1, min(BLOCK_R, MAX_TILE_PER_WARP * NUM_WARPS // BLOCK_C))
    grid = triton.cdiv(n_rows, block_r) * triton.cdiv(n_cols, BLOCK_C)
    bias_gelu_kernel[(grid,)](x, bias, out, n_rows, n_cols, BLOCK_R=block_r, BLOCK_C=BLOCK_C,
                              ROW_MAJOR=ROW_MAJOR, num_warps=NUM_WARPS)

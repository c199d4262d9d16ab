"""Lab seed for ``gemv``: y = x @ w^T for a few rows x [M, K] and weights w [N, K]
(decode: M is 1 to 4), accumulated in float32. One program per (row of x, BLOCK_N
outputs), walking K in BLOCK_K steps; the weights dominate the traffic."""
import triton
import triton.language as tl

BLOCK_N = 16  # gene
BLOCK_K = 256  # gene
NUM_WARPS = 4  # gene
NUM_STAGES = 2  # gene
GENE_SPACE = {"BLOCK_N": [4, 8, 16, 32, 64, 128], "BLOCK_K": [32, 64, 128, 256, 512, 1024],
              "NUM_WARPS": [1, 2, 4, 8, 16], "NUM_STAGES": [1, 2, 3, 4]}
MAX_TILE_PER_WARP = 1 << 12   # elements one warp holds at once, 128 a thread (past that,
                               # registers spill and a kernel can take a minute to compile): BLOCK_K shrinks to fit


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + m * K + k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + m * N + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)


def launch(x, w, y):
    m, k = x.shape
    n = w.shape[0]
    block_k = max(16, min(BLOCK_K, triton.next_power_of_2(k), MAX_TILE_PER_WARP * NUM_WARPS // BLOCK_N))
    gemv_kernel[(m, triton.cdiv(n, BLOCK_N))](x, w, y, n, k, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                                              num_warps=NUM_WARPS, num_stages=NUM_STAGES)

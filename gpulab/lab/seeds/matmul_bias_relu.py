"""Lab seed for ``matmul_bias_relu``: c = relu(a @ b + bias), the epilogue fused into the
matmul (eager PyTorch writes a @ b + bias and reads it back for the relu).
BLOCK_M x BLOCK_N output tiles, K walked in BLOCK_K steps, program ids grouped
GROUP_M tiles down a column so neighbouring programs share tiles of b in L2."""
import triton
import triton.language as tl
import torch

BLOCK_M = 64  # gene
BLOCK_N = 64  # gene
BLOCK_K = 32  # gene
GROUP_M = 8  # gene
NUM_WARPS = 4  # gene
NUM_STAGES = 3  # gene
GENE_SPACE = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [16, 32, 64, 128, 256], "BLOCK_K": [16, 32, 64, 128],
              "GROUP_M": [1, 4, 8, 16], "NUM_WARPS": [2, 4, 8], "NUM_STAGES": [1, 2, 3, 4, 5]}


@triton.jit
def matmul_bias_relu_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            IEEE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tm = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    tn = (pid % (GROUP_M * tiles_n)) // size_m
    rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :],
                    mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0)
        b = tl.load(b_ptr + rk.to(tl.int64)[:, None] * N + rn[None, :],
                    mask=(rk < K)[:, None] & (rn < N)[None, :], other=0.0)
        if IEEE:    # float32 inputs: full-precision products, not TF32
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    c = tl.maximum(acc + bias[None, :], 0.0)
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], c.to(c_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def launch(a, b, bias, c):
    m, k = a.shape
    n = b.shape[1]
    grid = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    matmul_bias_relu_kernel[(grid,)](a, b, bias, c, m, n, k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, IEEE=a.dtype == torch.float32,
                                     num_warps=NUM_WARPS, num_stages=NUM_STAGES)

"""Lab seed for ``silu_mul`` (SwiGLU's activation): out = silu(gate) * up, with
silu(g) = g * sigmoid(g), computed in float32 and stored once."""
import triton
import triton.language as tl

from gpulab import runtime

BLOCK = 1024  # gene
NUM_WARPS = 4  # gene
PERSISTENT = False  # gene
GENE_SPACE = {"BLOCK": [128, 256, 512, 1024, 2048, 4096, 8192], "NUM_WARPS": [1, 2, 4, 8, 16],
              "PERSISTENT": [False, True]}


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else tl.cdiv(n, BLOCK)
    for b in range(pid, tl.cdiv(n, BLOCK), step):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch(gate, up, out):
    n = out.numel()
    blocks = triton.cdiv(n, BLOCK)
    grid = min(blocks, 4 * runtime.num_sms()) if PERSISTENT else blocks
    silu_mul_kernel[(grid,)](gate, up, out, n, BLOCK=BLOCK, PERSISTENT=PERSISTENT, num_warps=NUM_WARPS)

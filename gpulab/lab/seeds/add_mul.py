"""Lab seed for ``add_mul``: out = (x + y) * z, one read of each input and one write
(eager PyTorch writes and re-reads the intermediate x + y)."""
import triton
import triton.language as tl

from gpulab import runtime

BLOCK = 1024  # gene
NUM_WARPS = 4  # gene
PERSISTENT = False  # gene
GENE_SPACE = {"BLOCK": [128, 256, 512, 1024, 2048, 4096, 8192], "NUM_WARPS": [1, 2, 4, 8, 16],
              "PERSISTENT": [False, True]}


@triton.jit
def add_mul_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else tl.cdiv(n, BLOCK)
    for b in range(pid, tl.cdiv(n, BLOCK), step):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, ((x + y) * z).to(out_ptr.dtype.element_ty), mask=mask)


def launch(x, y, z, out):
    n = out.numel()
    blocks = triton.cdiv(n, BLOCK)
    grid = min(blocks, 4 * runtime.num_sms()) if PERSISTENT else blocks
    add_mul_kernel[(grid,)](x, y, z, out, n, BLOCK=BLOCK, PERSISTENT=PERSISTENT, num_warps=NUM_WARPS)

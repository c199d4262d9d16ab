"""Lab seed for ``vector_add``: out = x + y. One program per BLOCK elements, or a
persistent grid of a few programs per SM striding over the blocks."""
import triton
import triton.language as tl

from gpulab import runtime

BLOCK = 1024  # gene
NUM_WARPS = 4  # gene
PERSISTENT = False  # gene
GENE_SPACE = {"BLOCK": [128, 256, 512, 1024, 2048, 4096, 8192], "NUM_WARPS": [1, 2, 4, 8, 16],
              "PERSISTENT": [False, True]}


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
    pid = tl.program_id(0)
    if PERSISTENT:
        for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            y = tl.load(y_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, x + y, mask=mask)
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x + y, mask=mask)


def launch(x, y, out):
    n = out.numel()
    blocks = triton.cdiv(n, BLOCK)
    grid = min(blocks, 4 * runtime.num_sms()) if PERSISTENT else blocks
    add_kernel[(grid,)](x, y, out, n, BLOCK=BLOCK, PERSISTENT=PERSISTENT, num_warps=NUM_WARPS)

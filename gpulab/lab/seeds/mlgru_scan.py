"""Lab seed for ``mlgru_scan``: the MLGRU recurrence h_t = f_t * h_{t-1} + i_t (notebook 03),
state carried in float32. One program per (BLOCK_D channels, batch row) loops over time."""
import triton
import triton.language as tl

BLOCK_D = 64  # gene
NUM_WARPS = 1  # gene
GENE_SPACE = {"BLOCK_D": [16, 32, 64, 128, 256, 512], "NUM_WARPS": [1, 2, 4, 8]}


@triton.jit
def scan_kernel(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, T, D, BLOCK_D: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    h = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    offs = b * T * D + cols
    for t in range(T):
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(i_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = f * h + x
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        offs += D
    tl.store(hlast_ptr + b * D + cols, h, mask=mask)


def launch(f, i, h0, h, h_last):
    batch, steps, width = f.shape
    scan_kernel[(triton.cdiv(width, BLOCK_D), batch)](f, i, h0, h, h_last, steps, width, BLOCK_D=BLOCK_D,
                                                      num_warps=NUM_WARPS)

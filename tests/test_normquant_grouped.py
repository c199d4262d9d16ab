"""Notebook 02's backward with a grouped reduction of the weight gradient: the package
launcher passes its check, and the check rejects a partial row per input row (past the
end of dw_part, on a case whose stray rows stay in the guard region), rows assigned to
the wrong groups, and a sum that is not accumulated."""
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import normquant as nq
from gpulab.harness.checking import rejects
from gpulab.harness.spec import Case


def test_grouped_backward_passes_its_check():
    gpulab.check("rmsnorm_quant_bwd_grouped", nq.rmsnorm_quant_bwd_partials_into)


def test_grouped_partials_sum_to_the_weight_gradient(device):
    spec = gpulab.get_spec("rmsnorm_quant_bwd_grouped")
    inp = spec.inputs(dict(rows=11, cols=20, groups=3), torch.float32, device)
    dx, part = torch.empty_like(inp["x"]), torch.empty(3, 20, device=device)
    nq.rmsnorm_quant_bwd_partials_into(inp["x"], inp["weight"], inp["rstd"], inp["dy"], dx, part)
    dw = torch.empty(20, device=device)
    nq.rmsnorm_quant_bwd_into(inp["x"], inp["weight"], inp["rstd"], inp["dy"], torch.empty_like(dx), dw)
    torch.testing.assert_close(part.sum(0), dw, atol=1e-5, rtol=1e-5)


@triton.jit
def _grouped_mutant(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols,
                    BLOCK: tl.constexpr, MODE: tl.constexpr):
    group = tl.program_id(0)
    n_groups = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    if MODE == 1:      # contiguous chunks of rows instead of rows g, g + G, ...
        chunk = tl.cdiv(n_rows, n_groups)
        start, stop, step = group * chunk, tl.minimum(group * chunk + chunk, n_rows), 1
    else:
        start, stop, step = group, n_rows, n_groups
    for row in range(start, stop, step):
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        c = tl.sum(xhat * g, axis=0) / n_cols
        tl.store(dx_ptr + row * n_cols + cols, ((g - xhat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        if MODE == 0:  # one partial row per input row
            tl.store(dw_part_ptr + row * n_cols + cols, dy * xhat, mask=mask)
        elif MODE == 2:  # overwritten, not accumulated
            dw = dy * xhat
        else:
            dw += dy * xhat
    if MODE != 0:
        tl.store(dw_part_ptr + group * n_cols + cols, dw, mask=mask)


def _mutant(mode):
    def fn(x, weight, rstd, dy, dx, dw_part):
        rows, cols = x.shape
        _grouped_mutant[(dw_part.shape[0],)](x, weight, rstd, dy, dx, dw_part, rows, cols,
                                             BLOCK=triton.next_power_of_2(cols), MODE=mode)
    return fn


def test_check_rejects_a_partial_row_per_input_row():
    """Rows - groups stray rows past dw_part: on the GPU's cases (1000 rows, 64 groups)
    they run megabytes past its guard region into unmapped memory, and CUDA kills the
    context (the check then ends with checking.DeviceFault). On a case whose stray rows
    (33 x 300 elements) stay within the guard, both modes see and name them."""
    msg = rejects("rmsnorm_quant_bwd_grouped", _mutant(0),
                  cases=[Case("tail, 4 groups", dict(rows=37, cols=300, groups=4))])
    assert "past the end of output `dw_part`" in msg


def test_check_rejects_rows_in_the_wrong_groups():
    msg = rejects("rmsnorm_quant_bwd_grouped", _mutant(1))
    assert "dw_part" in msg and "contiguous chunk of rows" in msg


def test_check_rejects_a_sum_that_is_not_accumulated():
    msg = rejects("rmsnorm_quant_bwd_grouped", _mutant(2))
    assert "dw_part" in msg and "only the last row's term" in msg

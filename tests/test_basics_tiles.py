"""Notebook 00's 2-D tile exercise (row sums over [BLOCK_M, BLOCK_N] tiles): the package
kernel passes, the public function takes views and refuses bad input, and the check
rejects the usual 2-D tile mistakes with a message naming them."""
import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import basics
from gpulab.harness.checking import rejects
from gpulab.harness.spec import Case


def test_row_sum_passes_its_check():
    gpulab.check("row_sum", basics.row_sum_into)


def test_row_sum_public_function(device):
    x = torch.randn(7, 300, device=device, dtype=torch.float16)
    for view in (x, x.t(), x[:, ::3]):
        torch.testing.assert_close(basics.row_sum(view).double(), view.double().sum(-1), atol=1e-3, rtol=1e-5)
    assert basics.row_sum(x[:0]).shape == (0,)
    assert torch.equal(basics.row_sum(x[:, :0]), torch.zeros(7, device=device))


@pytest.mark.parametrize("bad, err, words", [
    (lambda d: torch.randn(8, device=d), ValueError, "2 dimensions"),
    (lambda d: torch.ones(3, 3, dtype=torch.int32, device=d), TypeError, "float"),
])
def test_row_sum_rejects_bad_input(device, bad, err, words):
    with pytest.raises(err, match=words):
        basics.row_sum(bad(device))


BM, BN = 16, 128


@triton.jit
def _row_sum_mutant(x_ptr, y_ptr, M, N, stride_m, stride_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MODE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, N if MODE != 3 else 1, BLOCK_N):    # MODE 3: the first column tile only
        cols = n0 + tl.arange(0, BLOCK_N)
        if MODE == 0:      # columns unmasked: reads past the end of each row
            mask = row_mask[:, None] & (cols >= 0)[None, :]
        else:
            mask = row_mask[:, None] & (cols < N)[None, :]
        if MODE == 4:      # assumes contiguous rows: N instead of the row stride
            offs = rows[:, None] * N + cols[None, :] * stride_n
        else:
            offs = rows[:, None] * stride_m + cols[None, :] * stride_n
        acc += tl.sum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), axis=1)
    if MODE == 2:          # a mean, not a sum
        acc = acc / N
    if MODE == 1:          # the store's row mask forgotten
        tl.store(y_ptr + rows, acc)
    else:
        tl.store(y_ptr + rows, acc, mask=row_mask)


def _mutant(mode):
    def fn(x, y):
        m, n = x.shape
        _row_sum_mutant[(triton.cdiv(m, BM),)](x, y, m, n, x.stride(0), x.stride(1),
                                               BLOCK_M=BM, BLOCK_N=BN, MODE=mode)
    return fn


def test_row_sum_check_rejects_unmasked_columns():
    msg = rejects("row_sum", _mutant(0))
    # the interpreter watches every load; compiled, the stray value is seen in the output
    seen = ("offsets ≥ the length",) if gpulab.mode() == "interpreter" else \
        ("past the end of an input", "past the end of input `x`")
    assert "mask" in msg and any(s in msg for s in seen), msg


def test_row_sum_check_rejects_unmasked_store():
    msg = rejects("row_sum", _mutant(1))
    assert "past the end of output `y`" in msg


def test_row_sum_check_rejects_a_mean():
    assert "row mean" in rejects("row_sum", _mutant(2), cases=[Case("3 x 40", dict(M=3, N=40))])


def test_row_sum_check_rejects_a_single_column_tile():
    assert "only the first column tile" in rejects("row_sum", _mutant(3), cases=[Case("2 tiles", dict(M=2, N=2 * BN + 3))])


def test_row_sum_check_rejects_assumed_contiguous_rows():
    msg = rejects("row_sum", _mutant(4), cases=[Case("3 x 7", dict(M=3, N=7))])
    assert "stride" in msg


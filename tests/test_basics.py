"""Notebook 00's kernels: correct on awkward shapes, validated input, and checks that
reject wrong kernels with a useful message."""
import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import basics
from gpulab.harness.checking import rejects
from gpulab.harness.spec import Case


def test_vector_add_passes_its_check():
    gpulab.check("vector_add", basics.add_into)


def test_softmax_passes_its_check():
    gpulab.check("softmax", basics.softmax_into)


def test_softmax_public_function_matches_torch(device):
    for rows, cols in [(1, 1), (2, 3), (5, 1000), (1, 4097)]:
        x = torch.randn(rows, cols, device=device) * 7
        y = basics.softmax(x)
        torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-5)


def test_vector_add_public_function(device):
    x = torch.randn(3, 333, device=device)
    y = torch.randn(3, 333, device=device)
    torch.testing.assert_close(basics.vector_add(x, y), x + y)
    assert basics.vector_add(x[:0], y[:0]).numel() == 0


@pytest.mark.parametrize("bad, err, words", [
    (lambda d: torch.randn(8, device=d), ValueError, "2 dimensions"),
    (lambda d: torch.randint(0, 5, (3, 3), device=d), TypeError, "float32"),
    (lambda d: torch.randn(6, 4, device=d).t(), ValueError, "contiguous"),
    (lambda d: torch.randn(3, 0, device=d), ValueError, "length 0"),
    (lambda d: [[1.0]], TypeError, "torch.Tensor"),
])
def test_softmax_rejects_bad_input(device, bad, err, words):
    with pytest.raises(err, match=words):
        basics.softmax(bad(device))


def test_vector_add_rejects_mismatched_input(device):
    with pytest.raises(ValueError, match="shape"):
        basics.vector_add(torch.randn(4, device=device), torch.randn(5, device=device))
    with pytest.raises(TypeError, match="float16"):
        basics.vector_add(torch.randn(4, device=device), torch.randn(4, device=device).half())


# -- wrong kernels the checks must reject --------------------------------------------------
B = basics.ADD_BLOCK


@triton.jit
def _add_no_mask(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + tl.load(y_ptr + offs))


@triton.jit
def _add_scaled(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, 0.5 * (tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)), mask=m)


@triton.jit
def _add_ignores_y(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)


@triton.jit
def _add_off_by_one(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs <= n   # one element too many
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def _add_writes_input(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    tl.store(x_ptr + offs, s, mask=m)
    tl.store(out_ptr + offs, s, mask=m)


def _launch(kernel, grid=None):
    def fn(x, y, out):
        n = out.numel()
        kernel[grid or (triton.cdiv(n, B),)](x, y, out, n, BLOCK=B)
    return fn


def test_add_check_rejects_missing_mask():
    msg = rejects("vector_add", _launch(_add_no_mask))
    assert "past the end of output `out`" in msg and "mask" in msg


def test_add_check_rejects_wrong_scale():
    msg = rejects("vector_add", _launch(_add_scaled))
    assert "same factor ≈ 0.5" in msg


def test_add_check_rejects_unread_input():
    msg = rejects("vector_add", _launch(_add_ignores_y))
    assert "y set to zero" in msg


def test_add_check_rejects_off_by_one_write():
    msg = rejects("vector_add", _launch(_add_off_by_one))
    assert "wrote 1 element(s) past the end" in msg


def test_add_check_rejects_writing_an_input():
    msg = rejects("vector_add", _launch(_add_writes_input))
    assert "input `x` was modified" in msg


def test_add_check_rejects_too_small_grid():
    msg = rejects("vector_add", _launch(_add_no_mask, grid=(1,)), cases=[Case("3 blocks", dict(n=3 * B))])
    assert "never written" in msg and "triton.cdiv" in msg


def test_add_check_rejects_a_python_function_that_returns_instead_of_writing():
    msg = rejects("vector_add", lambda x, y, out: x + y)
    assert "nothing was written" in msg


@triton.jit
def _softmax_mutant(x_ptr, y_ptr, n_cols, xs, ys, BLOCK: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if MODE == 0:    # masked lanes load 0 instead of -inf: they add e^{0-m} to the sum
        x = tl.load(x_ptr + row * xs + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * xs + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if MODE == 1:    # no max subtraction: overflows on large scores
        e = tl.exp(x)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
    if MODE == 2:    # forgot to normalise
        y = e
    else:
        y = e / tl.sum(e, axis=0)
    if MODE == 3:    # stores the whole block: past the end of the row
        tl.store(y_ptr + row * ys + cols, y.to(y_ptr.dtype.element_ty))
    elif MODE == 4:  # block narrower than the row
        tl.store(y_ptr + row * ys + cols, y.to(y_ptr.dtype.element_ty), mask=mask & (cols < 128))
    else:
        tl.store(y_ptr + row * ys + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _softmax_launch(mode):
    def fn(x, y):
        n_rows, n_cols = x.shape
        _softmax_mutant[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0),
                                   BLOCK=triton.next_power_of_2(n_cols), MODE=mode)
    return fn


def test_softmax_check_rejects_wrong_other_value():
    msg = rejects("softmax", _softmax_launch(0))
    assert "factor" in msg   # masked lanes that win the max rescale their row


def test_softmax_check_rejects_unsafe_softmax():
    msg = rejects("softmax", _softmax_launch(1))
    assert "NaN" in msg or "wrong" in msg


def test_softmax_check_rejects_missing_normalisation():
    assert "wrong" in rejects("softmax", _softmax_launch(2))


def test_softmax_check_rejects_out_of_bounds_store():
    msg = rejects("softmax", _softmax_launch(3))
    assert "past the end" in msg or "never written" in msg or "wrong" in msg


def test_softmax_check_rejects_short_block():
    msg = rejects("softmax", _softmax_launch(4))
    assert "columns 128.." in msg and "never written" in msg


def test_softmax_check_rejects_unread_input():
    msg = rejects("softmax", lambda x, y: y.fill_(1.0 / x.shape[1]))
    assert "x set to zero" in msg

"""Fused RMSNorm + int8 quantization: forward, straight-through backward, the autograd
Function, input validation, and checks that reject wrong kernels."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import normquant as nq
from gpulab.grading import normquant as nq_grading
from gpulab.harness import memory
from gpulab.harness.checking import rejects

from helpers import few, on_gpu, subprocess_env


def test_forward_passes_its_check():
    gpulab.check("rmsnorm_quant", nq.rmsnorm_quant_into)


def test_backward_passes_its_check():
    gpulab.check("rmsnorm_quant_bwd", nq.rmsnorm_quant_bwd_into)


def test_training_forward_passes_its_check():
    gpulab.check("rmsnorm_fakequant_fwd", nq.rmsnorm_fakequant_fwd_into)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rmsnorm_quant_matches_unfused_chain(device, dtype):
    for shape in [(1,), (2, 3, 7), (37, 300)] + ([(64, 12345)] if on_gpu() else []):
        x = (torch.randn(shape, device=device) * 3).to(dtype)
        w = (torch.rand(shape[-1], device=device) + 0.5).to(dtype)
        q, s = nq.rmsnorm_quant(x, w)
        q_ref, s_ref = nq.rmsnorm_quant_ref(x, w)
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
        diff = (q.int() - q_ref.int()).abs()
        assert int(diff.max()) <= 1                       # a rounding tie seen differently
        assert float((diff > 0).float().mean()) < 1e-3
        assert int(q.abs().max()) == 127                  # each row's absmax maps to ±127


@pytest.mark.parametrize("fake_quant", [False, True])
def test_one_reduction_and_its_interpreter_twin_agree(device, fake_quant):
    """Compiled, Σx² and max|x·w| come from one reduction with a combine function of our
    own; the interpreter (which runs such a reduction element by element) takes tl.sum and
    tl.max. Both paths, on a shape small enough for the interpreter's slow one, with a
    partial block of rows and of columns."""
    x = torch.randn(5, 40, device=device) * 3
    w = torch.rand(40, device=device) + 0.5
    got = []
    for one in (True, False):
        a, b = torch.full((5, 40), 99, device=device, dtype=torch.int8), torch.zeros(5, device=device)
        y = torch.zeros(5, 40, device=device)
        nq.rmsnorm_quant_fwd_kernel[(2,)](
            x, w, a, b, y, b, 5, 40, x.stride(0), a.stride(0), y.stride(0), 1e-6, BLOCK_R=4, BLOCK_N=64,
            FAKE_QUANT=fake_quant, ONE_REDUCTION=one)
        got.append(y if fake_quant else a)
        got.append(b)
    q_ref, s_ref = nq.rmsnorm_quant_ref(x, w)
    if fake_quant:
        torch.testing.assert_close(got[0], got[2], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[0], nq.rmsnorm_fakequant_ref(x, w), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got[0], got[2]) and int((got[0].int() - q_ref.int()).abs().max()) <= 1
        torch.testing.assert_close(got[1], s_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], got[3], rtol=1e-6, atol=0)


def test_zero_row_and_empty_batch(device):
    x = torch.zeros(3, 10, device=device)
    q, s = nq.rmsnorm_quant(x, torch.ones(10, device=device))
    assert int(q.abs().max()) == 0
    torch.testing.assert_close(s, torch.full_like(s, 127 / 1e-5), rtol=1e-6, atol=0)
    q, s = nq.rmsnorm_quant(torch.zeros(0, 8, device=device), torch.ones(8, device=device))
    assert q.shape == (0, 8) and s.shape == (0,)


def test_rounding_rule_is_half_away_from_zero():
    v = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49, -0.51])
    assert nq.round_half_away(v).tolist() == [-3, -2, -1, 1, 2, 3, 0, -1]


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 300), (70, 33)])
def test_fused_gradients_match_autograd_through_reference(device, shape):
    x = (torch.randn(shape, device=device) * 2).requires_grad_()
    w = (torch.rand(shape[-1], device=device) + 0.5).requires_grad_()
    y = nq.rmsnorm_fakequant(x, w, fused=True)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    y_ref = nq.rmsnorm_fakequant_ref(x, w)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    step = y_ref.detach().abs().amax(-1, keepdim=True) / 127   # one quantization step
    assert bool(((y - y_ref).abs() <= step * 1.01 + 1e-6).all())
    assert float(((y - y_ref).abs() > 1e-5).float().mean()) < 1e-2
    torch.testing.assert_close(gx, gx_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gw, gw_ref, atol=1e-4, rtol=1e-4)


def test_fused_gradients_half_precision(device):
    dtype = torch.bfloat16 if on_gpu() else torch.float16
    x = (torch.randn(9, 130, device=device)).to(dtype).requires_grad_()
    w = (torch.rand(130, device=device) + 0.5).to(dtype).requires_grad_()
    y = nq.rmsnorm_fakequant(x, w, fused=True)
    assert y.dtype == dtype
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    gx_ref, gw_ref = torch.autograd.grad(nq.rmsnorm_fakequant_ref(x, w), (x, w), dy)
    assert gx.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(gx.float(), gx_ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(gw.float(), gw_ref.float(), atol=5e-2, rtol=3e-2)


def test_fused_path_saves_only_x_weight_rstd(device):
    x = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.ones(256, device=device, requires_grad=True)
    fused = memory.saved_bytes(lambda a, b: nq.RMSNormFakeQuant.apply(a, b, 1e-6), x, w)
    assert fused == x.numel() * 4 + w.numel() * 4 + 64 * 4
    assert fused <= 0.5 * memory.saved_bytes(nq.rmsnorm_fakequant_ref, x, w)


def test_activation_memory_measured_on_gpu_or_shipped():
    """On a GPU measured now; on a CPU the H200 figures shipped in the package. Either
    way the fused layer keeps less and peaks lower than autograd through the reference."""
    result = nq_grading.activation_memory()
    ref, fused = result["rows"]["autograd through the reference"], result["rows"]["fused (gpulab)"]
    assert 0 <= fused["kept_MiB"] < 0.1 * ref["kept_MiB"]
    assert 0 < fused["peak_MiB"] < 0.5 * ref["peak_MiB"]
    assert "peak" in memory.format_memory(result) and result["gpu"] and result["date"]


def test_default_path_picks_reference_on_cpu_and_kernels_on_gpu(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.ones(16, device=device, requires_grad=True)
    y = nq.rmsnorm_fakequant(x, w)
    assert ("RMSNormFakeQuant" in type(y.grad_fn).__name__) == on_gpu()


@pytest.mark.parametrize("make, err, words", [
    (lambda d: (torch.randint(0, 5, (3, 4), device=d), torch.ones(4, device=d)), TypeError, "float32"),
    (lambda d: (torch.randn(3, 4, device=d), torch.ones(5, device=d)), ValueError, r"shape \(4,\)"),
    (lambda d: (torch.randn(6, 4, device=d).t(), torch.ones(6, device=d)), ValueError, "contiguous"),
    (lambda d: (torch.randn(3, 0, device=d), torch.ones(0, device=d)), ValueError, "length 0"),
    (lambda d: (torch.randn(1, 70000, device=d), torch.ones(70000, device=d)), ValueError, "at most"),
    (lambda d: ([1.0], torch.ones(1, device=d)), TypeError, "torch.Tensor"),
])
def test_rmsnorm_quant_rejects_bad_input(device, make, err, words):
    x, w = make(device)
    with pytest.raises(err, match=words):
        nq.rmsnorm_quant(x, w)
    with pytest.raises(err, match=words):
        nq.rmsnorm_fakequant(x, w)


def test_the_fast_argument_check_accepts_nothing_the_full_checks_reject(device):
    """rmsnorm_quant tests its arguments with a few attribute reads and runs the full
    checks (which explain the error) only when that fails."""
    x, w = torch.randn(3, 4, device=device), torch.ones(4, device=device)
    good = [(x, w, 1e-6), (x.half(), w, 1e-5), (x[None], w.bfloat16(), 1e-6)]
    bad = [(torch.randint(0, 5, (3, 4), device=device), w, 1e-6), (x, torch.ones(5, device=device), 1e-6),
           (torch.randn(6, 4, device=device).t(), torch.ones(6, device=device), 1e-6),
           (torch.randn(3, 0, device=device), torch.ones(0, device=device), 1e-6),
           (torch.randn(1, 70000, device=device), torch.ones(70000, device=device), 1e-6),
           ([1.0], w, 1e-6), (x, w, 0.0), (x, w.int(), 1e-6), (x, torch.ones(8, device=device)[::2], 1e-6),
           (x, torch.ones(1, 4, device=device), 1e-6), (torch.randn((), device=device), w, 1e-6),
           (x, w.to("meta"), 1e-6)]
    for args in good:
        assert nq.plainly_valid_norm_args(*args), args
    for i, args in enumerate(bad):
        assert not nq.plainly_valid_norm_args(*args), f"bad call {i} passes the fast check"
        with pytest.raises((TypeError, ValueError)):
            nq.rmsnorm_quant(*args)


def test_rejects_bad_eps(device):
    with pytest.raises(ValueError, match="eps"):
        nq.rmsnorm_quant(torch.randn(2, 3, device=device), torch.ones(3, device=device), eps=0.0)


# -- wrong kernels the checks must reject --------------------------------------------------------
@triton.jit
def _fwd_bug(x_ptr, w_ptr, q_ptr, s_ptr, n_cols, BLOCK: tl.constexpr, BUG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if BUG == 1:    # no mask on the load: reads past the row
        x = tl.load(x_ptr + row * n_cols + cols).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == 4:    # weight never read
        w = tl.where(mask, 1.0, 0.0)
    denom = n_cols
    if BUG == 5:    # mean over the padded block instead of the row
        denom = BLOCK
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / denom + 1e-6)
    y = x * rstd * w
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-5)
    scale = 127.0 / amax
    if BUG == 2:    # wrong scale
        scale = 128.0 / amax
    v = y * scale
    if BUG == 6:    # truncation instead of rounding
        q = v.to(tl.int32).to(tl.float32)
    else:
        q = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
    q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    if BUG == 3:    # no mask on the store: writes past the end of the output
        tl.store(q_ptr + row * n_cols + cols, q.to(tl.int8))
    else:
        tl.store(q_ptr + row * n_cols + cols, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


def _fwd_launcher(bug):
    def fn(x, weight, x_q, scale):
        rows, cols = x.shape
        _fwd_bug[(rows,)](x, weight, x_q, scale, cols, BLOCK=triton.next_power_of_2(cols), BUG=bug)
    return fn


def test_fwd_reference_launcher_is_right():
    gpulab.check("rmsnorm_quant", _fwd_launcher(0), **few("rmsnorm_quant", ("odd row", "tail")))


@pytest.mark.parametrize("bug, words", [
    (1, "past the end of"), (2, "same factor"), (3, "past the end of output `x_q`"), (4, "is wrong"),
    (5, "is wrong"), (6, "output `x_q` is wrong"),
])
def test_fwd_check_rejects(bug, words):
    msg = rejects("rmsnorm_quant", _fwd_launcher(bug), **few("rmsnorm_quant", ("odd row", "tail")))
    assert words in msg, msg


@triton.jit
def _bwd_bug(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_part_ptr, n_cols, BLOCK: tl.constexpr,
             BUG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    if BUG == 4:    # dy never read
        dy = tl.zeros([BLOCK], dtype=tl.float32)
    xhat = x * rstd
    g = dy * w
    c = tl.sum(xhat * g, axis=0) / n_cols
    if BUG == 1:    # forgets that rstd depends on x
        c = 0.0
    dx = (g - xhat * c) * rstd
    if BUG == 2:
        dx = 2 * dx
    if BUG == 3:
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty))
    else:
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dw = dy * xhat
    if BUG == 5:    # the norm weight's gradient uses the output gradient times w
        dw = dy * w
    tl.store(dw_part_ptr + row * n_cols + cols, dw, mask=mask)


def _bwd_launcher(bug):
    def fn(x, weight, rstd, dy, dx, dw):
        rows, cols = x.shape
        part = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
        _bwd_bug[(rows,)](x, weight, rstd, dy, dx, part, cols, BLOCK=triton.next_power_of_2(cols), BUG=bug)
        torch.sum(part, 0, out=dw)
    return fn


def test_bwd_reference_launcher_is_right():
    gpulab.check("rmsnorm_quant_bwd", _bwd_launcher(0), **few("rmsnorm_quant_bwd", ("odd row", "tail")))


@pytest.mark.parametrize("bug, words", [
    (1, "output `dx` is wrong"), (2, "same factor ≈ 2"), (3, "past the end of output `dx`"), (4, "dy set to zero"),
    (5, "output `dw` is wrong"),
])
def test_bwd_check_rejects(bug, words):
    msg = rejects("rmsnorm_quant_bwd", _bwd_launcher(bug), **few("rmsnorm_quant_bwd", ("odd row", "tail")))
    assert words in msg, msg




_PTX_PROBE = r'''
import os, re
os.environ["TRITON_INTERPRET"] = "0"; os.environ["GPULAB_COMPILE_ONLY"] = "1"
os.environ["TRITON_STORE_BINARY_ONLY"] = "0"     # the PTX is read below (tools/gpu-suite.sh sets 1)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpulab import normquant
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "yhat_ptr": "*bf16",
       "rstd_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "stride_x": "i32", "stride_q": "i32",
       "stride_y": "i32", "eps": "fp32", "BLOCK_R": "constexpr", "BLOCK_N": "constexpr", "FAKE_QUANT": "constexpr",
       "ONE_REDUCTION": "constexpr", "EVEN": "constexpr", "MANY_ROWS": "constexpr"}
src = ASTSource(normquant.rmsnorm_quant_fwd_kernel, sig,
                constexprs={"BLOCK_R": 1, "BLOCK_N": 4096, "FAKE_QUANT": False, "ONE_REDUCTION": True,
                            "EVEN": True, "MANY_ROWS": True})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4}).asm["ptx"]
print(len(re.findall(r"cvt\.rzi\.s32\.f32", ptx)), len(re.findall(r"cvt\.rm[i]|cvt\.rp[i]", ptx)))
'''


def test_quantizing_converts_each_element_to_an_integer_once():
    """Nsight Compute found the forward compute-bound on the H200 with the XU pipe (float
    conversions) 65% busy; rounding with one float->int conversion per element instead
    of floor, ceil and a conversion cut its conversions to a third. Compiled for sm_90
    without a GPU: a 4096-wide row over 128 threads is 32 elements per thread."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _PTX_PROBE], capture_output=True, text=True,
                       env=subprocess_env(root), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    to_int, floor_ceil = map(int, r.stdout.split()[-2:])
    assert (to_int, floor_ceil) == (32, 0), r.stdout


def test_even_rows_take_the_unmasked_path_with_the_same_bits(device):
    """Rows exactly BLOCK_N wide load and store without masks (EVEN): the same codes and
    scales as the masked path with the same launch (compiled, another num_warps sums in
    another order, so both run with 4), and a row one column shorter still takes the
    masked one through the public function."""
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(6, 64, generator=g, device=device) * torch.rand(6, 1, generator=g, device=device) * 4
    w = torch.rand(64, generator=g, device=device) + 0.5

    def run(even):
        q, s = torch.empty(6, 64, dtype=torch.int8, device=device), torch.empty(6, device=device)
        nq.rmsnorm_quant_fwd_kernel[(6,)](x, w, q, s, x, s, 6, 64, x.stride(0), q.stride(0), 0, 1e-6,
                                          BLOCK_R=1, BLOCK_N=64, FAKE_QUANT=False,
                                          ONE_REDUCTION=gpulab.mode() == "compiled", EVEN=even, num_warps=4)
        return q, s
    (q, s), (q2, s2) = run(True), run(False)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    q4, s4 = torch.empty(6, 64, dtype=torch.int8, device=device), torch.empty(6, device=device)
    nq.rmsnorm_quant_into(x, w, q4, s4)                       # the public path, EVEN, tuned warps
    assert (q4.int() - q.int()).abs().max() <= 1 and torch.allclose(s4, s, rtol=1e-5)
    ref_q, ref_s = nq.rmsnorm_quant_ref(x[:, :63], w[:63])
    q3, s3 = torch.empty(6, 63, dtype=torch.int8, device=device), torch.empty(6, device=device)
    nq.rmsnorm_quant_into(x[:, :63].contiguous(), w[:63].contiguous(), q3, s3)
    assert (q3.int() - ref_q.int()).abs().max() <= 1


def test_pieces_probe_agrees_with_the_package_without_a_gpu():
    """tools/rmsnorm_pieces_probe.py (issue 13's 4096 x 14336 row): its unpadded kernel gives
    the package's codes and scales on rows of one, two and three pieces; timing needs a GPU."""
    root = Path(__file__).resolve().parents[1]
    tool = str(root / "tools" / "rmsnorm_pieces_probe.py")
    r = subprocess.run([sys.executable, tool, "--check"], capture_output=True, text=True,
                       env=subprocess_env(root), timeout=600)
    assert r.returncode == 0 and "False" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    if gpulab.mode() != "compiled":
        r = subprocess.run([sys.executable, tool, str(root / "never-written")], capture_output=True, text=True,
                           env=subprocess_env(root))
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stdout

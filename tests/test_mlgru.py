"""Notebook 03's scan kernels: forward and gradients against float64 on awkward shapes,
recurrent vs chunked, step vs scan, input validation, and checks that reject wrong kernels."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import mlgru, runtime
from gpulab.harness.checking import rejects
from gpulab.harness.spec import Case

from helpers import on_gpu, subprocess_env

SPECS = ["mlgru_scan_recurrent", "mlgru_scan_chunked", "mlgru_scan_two_phase", "mlgru_scan_backward_recurrent",
         "mlgru_scan_backward_chunked", "mlgru_scan_backward_two_phase", "mlgru_scan", "mlgru_scan_train"]


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Small ops: extra threads only wait on each other (and on the other test worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", SPECS)
def test_package_kernels_pass_their_checks(name):
    spec = gpulab.get_spec(name)
    gpulab.check(spec, spec.implementation)


def _inputs(B, T, D, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    f = torch.sigmoid(torch.randn(B, T, D, generator=g, device=device) * 1.5 + 1.5).to(dtype)
    i = torch.randn(B, T, D, generator=g, device=device).to(dtype)
    h0 = torch.randn(B, D, generator=g, device=device)
    return f, i, h0


# T=1, T below / above the rule's threshold, T not a multiple of any chunk, odd widths.
SHAPES = [(1, 1, 1), (2, 7, 3), (1, 33, 5), (3, 19, 17)] if not on_gpu() else \
    [(1, 1, 1), (2, 7, 3), (1, 33, 5), (3, 1000, 130), (2, 4099, 512)]
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("kernel", ["auto", "recurrent", "chunked", "two_phase", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scan_forward_and_gradients_match_float64(kernel, dtype, device):
    shapes = SHAPES if dtype == torch.float32 or on_gpu() else SHAPES[:2]
    for B, T, D in shapes:
        f, i, h0 = _inputs(B, T, D, dtype, device, seed=B * T * D)
        f.requires_grad_(), i.requires_grad_(), h0.requires_grad_()
        h, h_last = mlgru.mlgru_scan(f, i, h0, kernel=kernel)
        assert h.dtype == dtype and h_last.dtype == torch.float32
        ref = mlgru.scan_reference(f.detach(), i.detach(), h0.detach())
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(h.double(), ref["h"], atol=atol, rtol=rtol)
        torch.testing.assert_close(h_last.double(), ref["h_last"], atol=1e-4, rtol=1e-4)
        dh = torch.randn_like(h)
        dh_last = torch.randn_like(h_last)
        torch.autograd.backward((h, h_last), (dh, dh_last))
        # float64 gradients by autograd through the plain loop
        f64, i64, h064 = (t.detach().double().requires_grad_() for t in (f, i, h0))
        r = mlgru.scan_reference(f64, i64, h064)
        torch.autograd.backward((r["h"], r["h_last"]), (dh.double(), dh_last.double()))
        gtol = (atol * 10, rtol * 10) if dtype != torch.float32 else (1e-4, 1e-4)
        for got, exp in ((f.grad, f64.grad), (i.grad, i64.grad), (h0.grad, h064.grad)):
            torch.testing.assert_close(got.double(), exp, atol=gtol[0], rtol=gtol[1])


def test_recurrent_and_chunked_agree(device):
    B, T, D = (2, 45, 21) if not on_gpu() else (4, 3001, 257)
    f, i, h0 = _inputs(B, T, D, torch.float32, device)
    a, a_last = mlgru.mlgru_scan(f, i, h0, kernel="recurrent")
    b, b_last = mlgru.mlgru_scan(f, i, h0, kernel="chunked")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a_last, b_last, atol=1e-5, rtol=1e-5)


# -- the two-phase (parallel-in-time) forward ------------------------------------------------
C = mlgru.two_phase_chunk()     # 8 in the interpreter
TWO_PHASE_SHAPES = [(1, 1, 1), (1, C, 5), (3, C + 1, 17), (1, 2 * C + 3, 3), (3, 3 * C, 20)] if not on_gpu() else \
    [(1, 1, 1), (1, C, 5), (3, C + 1, 130), (2, 5 * C + 7, 333), (3, 4099, 512)]


@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_two_phase_forward_matches_float64(dtype, with_h0, device):
    """T = 1, T = chunk, chunk + 1, not a multiple of the chunk; D not a multiple of any
    BLOCK_D; B = 1 and 3; with and without h0; through the launcher and mlgru_scan."""
    atol, rtol = TOL[dtype]
    for B, T, D in TWO_PHASE_SHAPES:
        f, i, h0 = _inputs(B, T, D, dtype, device, seed=B * T + D)
        h, h_last = mlgru.mlgru_scan(f, i, h0 if with_h0 else None, kernel="two_phase")
        assert h.dtype == dtype and h_last.dtype == torch.float32
        ref = mlgru.scan_reference(f, i, h0 if with_h0 else torch.zeros_like(h0))
        torch.testing.assert_close(h.double(), ref["h"], atol=atol, rtol=rtol)
        torch.testing.assert_close(h_last.double(), ref["h_last"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk, segment", [(1, None), (2, None), (16, None), (4, 8), (4, 30), (2, 5)])
def test_two_phase_chunks_and_segments(chunk, segment, device):
    """Chunks shorter and longer than a tile (the interpreter's BLOCK_T is 4), more chunks
    than phase 2 scans per block (T=70, chunk 1: 64 + 6), and segments (one, ragged, a
    length rounded down to a multiple of the chunk) that carry h_last into the next."""
    B, T, D = (2, 70, 3) if chunk == 1 else (2, 37, 19)
    f, i, h0 = _inputs(B, T, D, torch.float32, device, seed=chunk)
    h, h_last = torch.empty_like(f), torch.empty_like(h0)
    mlgru.scan_two_phase_into(f, i, h0, h, h_last, chunk=chunk, segment=segment)
    ref = mlgru.scan_reference(f, i, h0)
    torch.testing.assert_close(h.double(), ref["h"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h_last.double(), ref["h_last"], atol=1e-5, rtol=1e-4)


def test_two_phase_rejects_a_chunk_that_is_not_a_power_of_two(device):
    f, i, h0 = _inputs(1, 4, 2, torch.float32, device)
    with pytest.raises(ValueError, match="power of two"):
        mlgru.scan_two_phase_into(f, i, h0, torch.empty_like(f), torch.empty_like(h0), chunk=6)


def test_two_phase_empty_sequence_returns_h0(device):
    f, i, h0 = _inputs(2, 0, 3, torch.float32, device)
    h_last = torch.empty_like(h0)
    mlgru.scan_two_phase_into(f, i, h0, torch.empty_like(f), h_last)
    assert torch.equal(h_last, h0)


def test_rule_picks_two_phase_for_long_sequences():
    """From TWO_PHASE_MIN_T steps (measured on the H200), in chunks of about T/32 steps."""
    assert mlgru.choose_kernel(mlgru.TWO_PHASE_MIN_T - 1) == "chunked"
    assert mlgru.choose_kernel(mlgru.TWO_PHASE_MIN_T) == mlgru.choose_kernel(1 << 20) == "two_phase"
    if runtime.interpreting():
        assert mlgru.two_phase_chunk(8192) == mlgru.TWO_PHASE_CHUNK_INTERPRETED
    else:
        assert [mlgru.two_phase_chunk(T) for T in (2048, 4096, 8192, 1 << 20)] == [64, 128, 256, 256]


@pytest.mark.parametrize("chunk", sorted({C, mlgru.TWO_PHASE_CHUNK}))
def test_two_phase_check_rejects_a_lost_carry(chunk):
    """Every chunk starting from zero (phase 2 skipped) is caught, with the diagnosis, for the
    interpreter's chunk and the GPU's (the diagnosis does not know which chunk ran)."""
    def no_carry(f, i, h0, h, h_last):
        for t0 in range(0, f.shape[1], chunk):
            sl = slice(t0, t0 + chunk)
            mlgru.scan_recurrent_into(f[:, sl].contiguous(), i[:, sl].contiguous(), torch.zeros_like(h0),
                                      hs := torch.empty_like(h[:, sl]), h_last)
            h[:, sl] = hs
    msg = rejects("mlgru_scan_two_phase", no_carry, cases=[Case("3 chunks", dict(B=1, T=2 * chunk + 4, D=5))])
    assert "output `h` is wrong" in msg and "every chunk of time steps starts from 0" in msg


@pytest.mark.parametrize("chunk", [1, 2, 4, 16, None])
def test_two_phase_backward_matches_float64(chunk, device):
    """The backward in chunks shorter and longer than a tile, more chunks than phase 2 scans
    per block (T = 70, chunk 1), a ragged first-from-the-end chunk, T = 1."""
    for B, T, D in [(1, 1, 1), (2, 70, 3) if chunk == 1 else (2, 37, 19)]:
        f, i, h0 = _inputs(B, T, D, torch.float32, device, seed=T + (chunk or 0))
        h = mlgru.scan_reference(f, i, h0)["h"].float()
        dh, dh_last = torch.randn_like(f), torch.randn_like(h0)
        ref = mlgru.scan_backward_reference(f, h0, h, dh, dh_last)
        nan = float("nan")
        df, di, dh0 = torch.full_like(f, nan), torch.full_like(f, nan), torch.full_like(h0, nan)
        mlgru.scan_backward_two_phase_into(f, h0, h, dh, dh_last, df, di, dh0, chunk=chunk)
        for got, name in ((df, "df"), (di, "di"), (dh0, "dh0")):
            torch.testing.assert_close(got.double(), ref[name], atol=1e-5, rtol=1e-4, msg=f"{name}, T={T}")


def test_two_phase_backward_empty_sequence_and_bad_chunk(device):
    f, i, h0 = _inputs(2, 0, 3, torch.float32, device)
    dh_last, dh0 = torch.randn_like(h0), torch.empty_like(h0)
    mlgru.scan_backward_two_phase_into(f, h0, f, f, dh_last, f, f, dh0)
    assert torch.equal(dh0, dh_last)
    with pytest.raises(ValueError, match="power of two"):
        mlgru.scan_backward_two_phase_into(f, h0, f, f, dh_last, f, f, dh0, chunk=3)


@pytest.mark.parametrize("from_end", [False, True])
def test_backward_checks_reject_a_lost_carry(from_end):
    """A backward whose every chunk starts its walk down from 0 is caught, with the diagnosis,
    for chunks counted from t = 0 (the two-phase kernel) and from T - 1 (the chunked one)."""
    chunk = C

    def no_carry(f, h0, h, dh, dh_last, df, di, dh0):
        T = f.shape[1]
        starts = range(T % chunk - chunk if from_end else 0, T, chunk)
        for t0 in starts:
            sl = slice(max(t0, 0), t0 + chunk)
            parts = [torch.empty_like(df[:, sl]), torch.empty_like(di[:, sl])]
            h_in = h0 if t0 <= 0 else h[:, t0 - 1].float()
            mlgru.scan_backward_recurrent_into(f[:, sl].contiguous(), h_in.contiguous(), h[:, sl].contiguous(),
                                               dh[:, sl].contiguous(), torch.zeros_like(dh_last), *parts,
                                               g := torch.empty_like(dh0))
            df[:, sl], di[:, sl] = parts
            if t0 <= 0:
                dh0.copy_(g)
    name = "mlgru_scan_backward_chunked" if from_end else "mlgru_scan_backward_two_phase"
    msg = rejects(name, no_carry, cases=[Case("3 chunks", dict(B=1, T=2 * chunk + 4, D=5))])
    assert "is wrong" in msg and "starts its walk down from 0" in msg, msg


def test_rule_picks_recurrent_for_short_sequences():
    assert mlgru.choose_kernel(1) == "recurrent"
    assert mlgru.choose_kernel(mlgru.RECURRENT_MAX_T) == "recurrent"
    assert mlgru.choose_kernel(mlgru.RECURRENT_MAX_T + 1) == "chunked"


def test_step_equals_scan(device):
    f, i, h0 = _inputs(3, 9, 6, torch.float32, device)
    h_scan, h_last = mlgru.mlgru_scan(f, i, h0)
    h = h0
    for t in range(9):
        h = mlgru.mlgru_step(f[:, t], i[:, t], h)
        torch.testing.assert_close(h, h_scan[:, t], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h, h_last, atol=1e-6, rtol=1e-6)
    assert torch.equal(mlgru.mlgru_step(f[:, 0], i[:, 0]), i[:, 0])


def test_state_carries_across_calls(device):
    """Scanning in two pieces with h_last as the next h0 equals one scan."""
    f, i, h0 = _inputs(2, 40, 7, torch.float32, device)
    full, full_last = mlgru.mlgru_scan(f, i, h0)
    a, a_last = mlgru.mlgru_scan(f[:, :15].contiguous(), i[:, :15].contiguous(), h0)
    b, b_last = mlgru.mlgru_scan(f[:, 15:].contiguous(), i[:, 15:].contiguous(), a_last)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b_last, full_last, atol=1e-5, rtol=1e-5)


def test_empty_sequence_returns_h0(device):
    f, i, h0 = _inputs(2, 0, 3, torch.float32, device)
    h, h_last = mlgru.mlgru_scan(f, i, h0)
    assert h.shape == (2, 0, 3) and torch.equal(h_last, h0)
    h, h_last = mlgru.mlgru_scan(f, i)
    assert torch.equal(h_last, torch.zeros_like(h0))


@pytest.mark.parametrize("make, err, words", [
    (lambda d: (torch.rand(2, 3, device=d), torch.rand(2, 3, device=d), None), ValueError, "3 dimensions"),
    (lambda d: (torch.rand(2, 3, 4, device=d), torch.rand(2, 3, 5, device=d), None), ValueError, "shape"),
    (lambda d: (torch.rand(2, 3, 4, device=d), torch.rand(2, 3, 4, device=d).half(), None), TypeError, "float32"),
    (lambda d: (torch.ones(2, 3, 4, dtype=torch.int32, device=d),) * 2 + (None,), TypeError, "float32, float16"),
    (lambda d: (torch.rand(2, 4, 3, device=d).transpose(1, 2), torch.rand(2, 3, 4, device=d), None),
     ValueError, "contiguous"),
    (lambda d: (torch.rand(2, 3, 4, device=d), torch.rand(2, 3, 4, device=d), torch.zeros(2, 3, device=d)),
     ValueError, r"h0 must have shape \(2, 4\)"),
    (lambda d: (torch.rand(2, 3, 4, device=d), torch.rand(2, 3, 4, device=d), [0.0]), TypeError, "torch.Tensor"),
])
def test_scan_rejects_bad_input(device, make, err, words):
    with pytest.raises(err, match=words):
        mlgru.mlgru_scan(*make(device))


def test_scan_rejects_unknown_kernel(device):
    f, i, _ = _inputs(1, 2, 3, torch.float32, device)
    with pytest.raises(ValueError, match="kernel must be one of"):
        mlgru.mlgru_scan(f, i, kernel="fast")


def test_step_rejects_bad_input(device):
    f = torch.rand(2, 4, device=device)
    with pytest.raises(ValueError, match="2 dimensions"):
        mlgru.mlgru_step(f[None], f[None])
    with pytest.raises(ValueError, match="shape"):
        mlgru.mlgru_step(f, torch.rand(2, 5, device=device))
    with pytest.raises(ValueError, match=r"h must have shape \(2, 4\)"):
        mlgru.mlgru_step(f, f, torch.zeros(4, device=device))


# -- the layer --------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["paper", "code"])
def test_layer_forward_backward_and_step(variant, device):
    torch.manual_seed(0)
    layer = mlgru.MLGRU(24, variant=variant, lower_bound=0.3 if variant == "code" else None).to(device)
    x = torch.randn(2, 11, 24, device=device, requires_grad=True)
    out, h_last = layer(x)
    assert out.shape == x.shape and h_last.shape == (2, 24)
    out.square().mean().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
    with torch.no_grad():   # token by token gives the same outputs as the scan
        h = None
        for t in range(11):
            o, h = layer.step(x[:, t], h)
            torch.testing.assert_close(o, out[:, t], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h, h_last, atol=1e-5, rtol=1e-5)


def test_layer_triton_and_torch_paths_agree(device):
    torch.manual_seed(1)
    layer = mlgru.MLGRU(16, scan="chunked").to(device)
    x = torch.randn(2, 37, 16, device=device)
    a, a_last = layer(x)
    layer.scan = "torch"
    b, b_last = layer(x)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_layer_rejects_bad_options():
    with pytest.raises(ValueError, match="variant"):
        mlgru.MLGRU(8, variant="hgrn")
    with pytest.raises(ValueError, match="lower_bound"):
        mlgru.MLGRU(8, lower_bound=0.5)
    with pytest.raises(ValueError, match="scan"):
        mlgru.MLGRU(8, scan="cuda")
    with pytest.raises(ValueError, match=r"\[batch, time, 8\]"):
        mlgru.MLGRU(8)(torch.randn(2, 3, 9))


# -- wrong kernels the checks must reject ------------------------------------------------------
BD = 16


@triton.jit
def _fwd_variant(f_ptr, i_ptr, h0_ptr, h_ptr, hlast_ptr, T, D, BLOCK_D: tl.constexpr,
                 MASK: tl.constexpr, READ_H0: tl.constexpr, RELOAD: tl.constexpr,
                 MASK_LAST: tl.constexpr, GATE_I: tl.constexpr):
    """The recurrent forward with one switchable mistake at a time."""
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    if not MASK:
        mask = cols < BLOCK_D * 1024
    if READ_H0:
        h = tl.load(h0_ptr + b * D + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_D], tl.float32)
    offs = b * T * D + cols
    for t in range(T):
        f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(i_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GATE_I:
            x = (1 - f) * x
        h = f * h + x
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        if RELOAD:     # carry the state through the low-precision output
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        offs += D
    if MASK_LAST:
        tl.store(hlast_ptr + b * D + cols, h, mask=mask)
    else:
        tl.store(hlast_ptr + b * D + cols, h)


def _fwd(MASK=True, READ_H0=True, RELOAD=False, MASK_LAST=True, GATE_I=False):
    def launch(f, i, h0, h, h_last):
        B, T, D = f.shape
        _fwd_variant[(triton.cdiv(D, BD), B)](f, i, h0, h, h_last, T, D, BLOCK_D=BD, MASK=MASK,
                                               READ_H0=READ_H0, RELOAD=RELOAD, MASK_LAST=MASK_LAST,
                                               GATE_I=GATE_I)
    return launch


CPU_FWD = [Case("odd widths", dict(B=2, T=9, D=21))]


def test_forward_check_accepts_the_variant_kernel_without_mistakes():
    gpulab.check("mlgru_scan_recurrent", _fwd(), cases=CPU_FWD)


def test_forward_check_rejects_missing_mask():
    msg = rejects("mlgru_scan_recurrent", _fwd(MASK=False), cases=CPU_FWD)
    assert "past the end of output" in msg or "NaN" in msg


def test_forward_check_rejects_out_of_bounds_state_store():
    msg = rejects("mlgru_scan_recurrent", _fwd(MASK_LAST=False), cases=CPU_FWD)
    assert "past the end of output `h_last`" in msg


def test_forward_check_rejects_unread_h0():
    msg = rejects("mlgru_scan_recurrent", _fwd(READ_H0=False), cases=CPU_FWD)
    assert "h0 set to zero" in msg


def test_forward_check_rejects_gating_i_twice():
    msg = rejects("mlgru_scan_recurrent", _fwd(GATE_I=True), cases=CPU_FWD)
    assert "output `h` is wrong" in msg


def test_forward_check_rejects_state_carried_in_low_precision():
    msg = rejects("mlgru_scan_recurrent", _fwd(RELOAD=True), cases=CPU_FWD, dtypes=[torch.float16])
    assert "output `h_last` is wrong" in msg or "output `h` is wrong" in msg, msg   # both drift


def test_forward_check_rejects_wrong_scale():
    def scaled(f, i, h0, h, h_last):
        mlgru.scan_recurrent_into(f, i, h0, h, h_last)
        h.mul_(0.5)
        h_last.mul_(0.5)
    msg = rejects("mlgru_scan_recurrent", scaled, cases=CPU_FWD)
    assert "same factor ≈ 0.5" in msg


def test_chunked_check_rejects_missing_carry():
    def no_carry(f, i, h0, h, h_last):   # every chunk of 8 starts again from h0
        for t0 in range(0, f.shape[1], 8):
            sl = slice(t0, t0 + 8)
            mlgru.scan_recurrent_into(f[:, sl].contiguous(), i[:, sl].contiguous(), h0,
                                      hs := torch.empty_like(h[:, sl]), h_last)
            h[:, sl] = hs
    msg = rejects("mlgru_scan_chunked", no_carry, cases=[Case("3 chunks", dict(B=1, T=20, D=5))])
    assert "output `h` is wrong" in msg


def _bwd_wrong(mistake):
    def run(f, h0, h, dh, dh_last, df, di, dh0):
        ref = mlgru.scan_backward_reference(
            f, h0, h, dh, torch.zeros_like(dh_last) if mistake == "no dh_last" else dh_last)
        if mistake == "same-step gate":        # g_t = dh_t + f_t g_{t+1}
            ref = mlgru.scan_backward_reference(torch.cat([f[:, :1], f[:, :-1]], 1), h0, h, dh, dh_last)
        if mistake == "df from h_t":           # df_t = g_t h_t instead of g_t h_{t-1}
            ref["df"] = ref["di"] * h.double()
        df.copy_(ref["df"])
        di.copy_(ref["di"])
        dh0.copy_(ref["dh0"])
    return run


CPU_BWD = [Case("odd widths", dict(B=2, T=9, D=5))]


@pytest.mark.parametrize("mistake, words", [
    ("no dh_last", "dh_last set to zero"),
    ("same-step gate", "is wrong"),
    ("df from h_t", "output `df` is wrong"),
])
def test_backward_check_rejects_kernel_specific_mistakes(mistake, words):
    gpulab.check("mlgru_scan_backward_recurrent", _bwd_wrong(None), cases=CPU_BWD)
    msg = rejects("mlgru_scan_backward_recurrent", _bwd_wrong(mistake), cases=CPU_BWD)
    assert words in msg


@triton.jit
def _bwd_no_mask(f_ptr, h0_ptr, h_ptr, dh_ptr, dhlast_ptr, df_ptr, di_ptr, dh0_ptr, T, D,
                 BLOCK_D: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    g = tl.load(dhlast_ptr + b * D + cols)
    f_next = tl.full([BLOCK_D], 1.0, tl.float32)
    offs = b * T * D + (T - 1) * D + cols
    for _ in range(T - 1):
        g = tl.load(dh_ptr + offs).to(tl.float32) + f_next * g
        tl.store(di_ptr + offs, g.to(di_ptr.dtype.element_ty))
        tl.store(df_ptr + offs, (g * tl.load(h_ptr + offs - D).to(tl.float32)).to(df_ptr.dtype.element_ty))
        f_next = tl.load(f_ptr + offs).to(tl.float32)
        offs -= D
    g = tl.load(dh_ptr + offs).to(tl.float32) + f_next * g
    tl.store(di_ptr + offs, g.to(di_ptr.dtype.element_ty))
    tl.store(df_ptr + offs, (g * tl.load(h0_ptr + b * D + cols)).to(df_ptr.dtype.element_ty))
    tl.store(dh0_ptr + b * D + cols, tl.load(f_ptr + offs).to(tl.float32) * g)


def test_backward_check_rejects_missing_mask():
    def launch(f, h0, h, dh, dh_last, df, di, dh0):
        B, T, D = f.shape
        _bwd_no_mask[(triton.cdiv(D, BD), B)](f, h0, h, dh, dh_last, df, di, dh0, T, D, BLOCK_D=BD)
    msg = rejects("mlgru_scan_backward_recurrent", launch, cases=CPU_BWD)
    assert "past the end of output" in msg


def test_backward_check_rejects_wrong_scale():
    def scaled(f, h0, h, dh, dh_last, df, di, dh0):
        mlgru.scan_backward_recurrent_into(f, h0, h, dh, dh_last, df, di, dh0)
        di.mul_(2)
    msg = rejects("mlgru_scan_backward_recurrent", scaled, cases=CPU_BWD)
    assert "same factor ≈ 2" in msg


def test_lookback_probe_matches_float64_without_a_gpu():
    """tools/mlgru_lookback_probe.py (issue 13's single-read scan, to be measured on a GPU):
    correct in the interpreter, also when every program composes every map down to chunk 0
    window by window (its look-back arithmetic; a wrong composition fails there)."""
    root = Path(__file__).resolve().parents[1]
    tool = str(root / "tools" / "mlgru_lookback_probe.py")
    r = subprocess.run([sys.executable, tool, "--check"], capture_output=True, text=True,
                       env=subprocess_env(root), timeout=600)
    assert r.returncode == 0 and "WRONG" not in r.stdout and r.stdout.count(": ok") == 6, r.stdout + r.stderr[-2000:]

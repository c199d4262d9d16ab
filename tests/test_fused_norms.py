"""RMSNorm + int8 quantization fused with the residual add and with SiLU·mul
(gpulab.fused_norms): against the PyTorch ops they replace, through their checks (which
must reject wrong kernels and say why), their public functions' errors, and in the
engine's transformer block."""
import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab import runtime
from gpulab.engine import model as engine_model
from gpulab.engine.model import TINY, TernaryTransformer, run_bitlinear
from gpulab.fused_norms import (add_rmsnorm_quant, add_rmsnorm_quant_into, add_rmsnorm_quant_ref,
                                plainly_valid_fused_args, silu_mul_rmsnorm_quant, silu_mul_rmsnorm_quant_into,
                                silu_mul_rmsnorm_quant_ref)
from gpulab.grading.fused_norms import ADD_RMSNORM_QUANT, SILU_MUL_RMSNORM_QUANT
from gpulab.normquant import rmsnorm_quant_into

DEVICE = runtime.device()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if runtime.supports(torch.bfloat16) else [])


def rows(shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


# -- against the unfused PyTorch ops ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (37, 300), (2, 5, 64)])
def test_add_rmsnorm_quant_is_the_add_then_the_norm(dtype, shape):
    """The sum bit for bit as PyTorch's add; codes and scales as rmsnorm_quant_ref's of it."""
    x, r = rows(shape, dtype, 2.0), rows(shape, dtype, 0.7, seed=1)
    w = rows(shape[-1:], dtype, 0.5, seed=2) + 1
    s, q, scale = add_rmsnorm_quant(x, r, w)
    want_s, want_q, want_scale = add_rmsnorm_quant_ref(x, r, w)
    assert torch.equal(s, want_s)
    assert (q.int() - want_q.int()).abs().max() <= 1 and (q != want_q).float().mean() < 0.01
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (37, 600), (2, 5, 128)])
def test_silu_mul_rmsnorm_quant_is_silu_times_up_then_the_norm(dtype, shape):
    gate_up = rows(shape, dtype, 3.0)
    w = rows(shape[-1:], dtype, 0.5, seed=2)[: shape[-1] // 2] + 1
    q, scale = silu_mul_rmsnorm_quant(gate_up, w)
    want_q, want_scale = silu_mul_rmsnorm_quant_ref(gate_up, w)
    assert q.shape == want_q.shape and scale.shape == want_scale.shape
    assert (q.int() - want_q.int()).abs().max() <= 1 and (q != want_q).float().mean() < 0.01
    torch.testing.assert_close(scale, want_scale, rtol=1e-2 if dtype == torch.bfloat16 else 2e-3, atol=0)


def test_the_sum_may_overwrite_x():
    x, r, w = rows((5, 33), torch.float32), rows((5, 33), torch.float32, seed=1), torch.ones(33, device=DEVICE)
    want = x + r
    s, _, _ = add_rmsnorm_quant(x, r, w, out=x)
    assert s is x and torch.equal(x, want)


def test_no_rows():
    s, q, scale = add_rmsnorm_quant(torch.zeros(0, 8, device=DEVICE), torch.zeros(0, 8, device=DEVICE),
                                    torch.ones(8, device=DEVICE))
    assert s.shape == q.shape == (0, 8) and scale.shape == (0,)
    q, scale = silu_mul_rmsnorm_quant(torch.zeros(0, 16, device=DEVICE), torch.ones(8, device=DEVICE))
    assert q.shape == (0, 8) and scale.shape == (0,)


# -- the checks -------------------------------------------------------------------------------------
def test_the_checks_accept_the_kernels(capsys):
    gpulab.check("add_rmsnorm_quant", ADD_RMSNORM_QUANT.implementation)
    gpulab.check("silu_mul_rmsnorm_quant", SILU_MUL_RMSNORM_QUANT.implementation)
    out = capsys.readouterr().out
    assert "✔ add_rmsnorm_quant" in out and "✔ silu_mul_rmsnorm_quant" in out


def _add_forgets_residual(x, r, w, s, q, scale):
    add_rmsnorm_quant_into(x, torch.zeros_like(r), w, s, q, scale)
    s.copy_(x + r)


def _add_stores_x(x, r, w, s, q, scale):
    add_rmsnorm_quant_into(x, r, w, s, q, scale)
    s.copy_(x)


def _add_without_weight(x, r, w, s, q, scale):
    add_rmsnorm_quant_into(x, r, torch.ones_like(w), s, q, scale)


def _add_truncates(x, r, w, s, q, scale):
    s.copy_(x + r)
    v = s.double()
    y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    sc = 127.0 / y.abs().amax(-1).clamp_min(1e-5)
    q.copy_(torch.trunc(y * sc[:, None]).to(torch.int8))
    scale.copy_(sc)


def _longer(t):
    """t with one row more than it owns: a launcher that runs past the end."""
    return t.as_strided((t.shape[0] + 1, *t.shape[1:]), t.stride())


def _add_past_the_end(x, r, w, s, q, scale):
    add_rmsnorm_quant_into(_longer(x), _longer(r), w, _longer(s), _longer(q), _longer(scale))


@pytest.mark.parametrize("wrong, says", [
    (_add_forgets_residual, "quantize x alone: the residual must be added first"),
    (_add_stores_x, "`s` holds x"),
    (_add_without_weight, "the norm weight is not applied"),
    (_add_truncates, "truncated toward zero"),
    (_add_past_the_end, "past the end of"),
])
def test_the_add_check_rejects_wrong_kernels(wrong, says):
    with pytest.raises(gpulab.CheckFailure) as info:
        gpulab.check("add_rmsnorm_quant", wrong)
    assert says in str(info.value), str(info.value)


def _quantize_h(h, w, q, scale):
    rmsnorm_quant_into(h.contiguous(), w, q, scale)


def _silu_swapped(gu, w, q, scale):
    n = q.shape[1]
    silu_mul_rmsnorm_quant_into(torch.cat([gu[:, n:], gu[:, :n]], dim=1), w, q, scale)


def _silu_is_sigmoid(gu, w, q, scale):
    g, u = gu.float().chunk(2, dim=-1)
    _quantize_h((torch.sigmoid(g) * u).to(gu.dtype), w, q, scale)


def _silu_without_up(gu, w, q, scale):
    g, _ = gu.chunk(2, dim=-1)
    _quantize_h(F.silu(g), w, q, scale)


def _silu_truncates(gu, w, q, scale):
    g, u = gu.chunk(2, dim=-1)
    h = (F.silu(g) * u).double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    sc = 127.0 / y.abs().amax(-1).clamp_min(1e-5)
    q.copy_(torch.trunc(y * sc[:, None]).to(torch.int8))
    scale.copy_(sc)


def _silu_past_the_end(gu, w, q, scale):
    silu_mul_rmsnorm_quant_into(_longer(gu), w, _longer(q), _longer(scale))


@pytest.mark.parametrize("wrong, says", [
    (_silu_swapped, "gate and up are swapped"),
    (_silu_is_sigmoid, "sigmoid(gate) ⊙ up"),
    (_silu_without_up, "SiLU(gate) alone"),
    (_silu_truncates, "truncated toward zero"),
    (_silu_past_the_end, "past the end of"),
])
def test_the_silu_check_rejects_wrong_kernels(wrong, says):
    with pytest.raises(gpulab.CheckFailure) as info:
        gpulab.check("silu_mul_rmsnorm_quant", wrong)
    assert says in str(info.value), str(info.value)


# -- public functions' errors -----------------------------------------------------------------------
def test_bad_input_gets_a_clear_error_and_writes_nothing():
    x, r, w = rows((3, 8), torch.float32), rows((3, 8), torch.float32, seed=1), torch.ones(8, device=DEVICE)
    before = x.clone()
    with pytest.raises(ValueError, match=r"residual \(3, 7\) must have x's shape|rows of 7 elements"):
        add_rmsnorm_quant(x, r[:, :7].contiguous(), w)
    with pytest.raises(ValueError, match=r"residual \(2, 8\) must have x's shape"):
        add_rmsnorm_quant(x, r[:2], w)
    with pytest.raises(TypeError, match="residual must be float32"):
        add_rmsnorm_quant(x, r.half(), w)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        add_rmsnorm_quant(x, r, w[:4])
    with pytest.raises(ValueError, match="x must be contiguous"):
        add_rmsnorm_quant(x.t().contiguous().t(), r, w)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        add_rmsnorm_quant(x.int(), r.int(), w)
    with pytest.raises(ValueError, match="eps must be positive"):
        add_rmsnorm_quant(x, r, w, eps=0.0)
    with pytest.raises(ValueError, match=r"out \(3, 4\) must have x's shape|rows of 4 elements"):
        add_rmsnorm_quant(x, r, w, out=torch.empty(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="must be even"):
        silu_mul_rmsnorm_quant(x[:, :7].contiguous(), w)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        silu_mul_rmsnorm_quant(x, w)
    with pytest.raises(ValueError, match="rows of 0 elements"):
        silu_mul_rmsnorm_quant(torch.zeros(3, 0, device=DEVICE), torch.ones(0, device=DEVICE))
    assert torch.equal(x, before), "a refused call wrote"


def test_the_fast_argument_check_accepts_nothing_the_full_checks_reject():
    """The public functions test their arguments with a few attribute reads and run the
    full checks (which explain the error) only when that fails."""
    x, r, w = rows((3, 8), torch.float32), rows((3, 8), torch.float32, seed=1), torch.ones(8, device=DEVICE)
    good = [((x, r), 8, w, 1e-6), ((x.half(), r.half()), 8, w.half(), 1e-5), ((x[None],), 8, w, 1e-6)]
    bad = [((x, r.half()), 8, w, 1e-6), ((x.int(),), 8, w, 1e-6), ((x, r.t().contiguous().t()), 8, w, 1e-6),
           ((x,), 8, w[:4], 1e-6), ((x,), 8, w.int(), 1e-6), ((x,), 8, torch.ones(16, device=DEVICE)[::2], 1e-6),
           ((x,), 8, torch.ones(1, 8, device=DEVICE), 1e-6), ((x,), 8, w, 0.0), ((x,), 0, w, 1e-6),
           ((torch.zeros((), device=DEVICE),), 8, w, 1e-6), (([1.0],), 8, w, 1e-6), ((x,), 8, w.to("meta"), 1e-6),
           ((x, r.to("meta")), 8, w, 1e-6), ((torch.zeros(1, 70000, device=DEVICE),), 70000,
                                             torch.ones(70000, device=DEVICE), 1e-6)]
    for args in good:
        assert plainly_valid_fused_args(*args), args
    for i, args in enumerate(bad):
        assert not plainly_valid_fused_args(*args), f"bad call {i} passes the fast check"
    # calls the fast check refuses, which the full checks then explain
    for call in (lambda: add_rmsnorm_quant(x, r[:2], w), lambda: add_rmsnorm_quant(x, r, w, out=x[:2]),
                 lambda: silu_mul_rmsnorm_quant(x[:, :7].contiguous(), w[:3]),
                 lambda: silu_mul_rmsnorm_quant(torch.zeros((), device=DEVICE), w)):
        with pytest.raises((TypeError, ValueError)):
            call()


# -- the engine's transformer block ----------------------------------------------------------------
@pytest.fixture(scope="module")
def block():
    torch.manual_seed(7)
    return TernaryTransformer(TINY).pack().to(DEVICE).blocks[0]


def test_packed_block_runs_the_fused_kernels_as_the_unfused_ops_compute(block, monkeypatch):
    """post_attention of a packed block takes the fused path (each fused launcher once,
    F.silu never) and computes what the unfused layers compute."""
    c = TINY
    x = torch.randn(19, c.d_model, device=DEVICE) * 3
    o = torch.randn(19, c.n_heads, c.head_dim, device=DEVICE)
    with torch.no_grad():
        h = x + run_bitlinear(block.o_proj, o.flatten(-2))
        gate, up = run_bitlinear(block.gate_up, h).chunk(2, dim=-1)
        want = h + run_bitlinear(block.down_proj, F.silu(gate) * up)
        calls = []
        for name in ("add_rmsnorm_quant_into", "silu_mul_rmsnorm_quant_into"):
            real = getattr(engine_model, name)
            monkeypatch.setattr(engine_model, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))

        def no_silu(*args):
            raise AssertionError("F.silu ran: the packed path should fuse it into down_proj's norm")
        monkeypatch.setattr(engine_model.F, "silu", no_silu)
        got = block.post_attention(x, o)
    assert sorted(calls) == ["add_rmsnorm_quant_into", "silu_mul_rmsnorm_quant_into"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_and_learner_kernels_keep_the_unfused_ops(block):
    assert block.gate_up.takes_quantized_input and block.down_proj.takes_quantized_input
    unpacked = TernaryTransformer(TINY).blocks[0]
    assert not unpacked.gate_up.takes_quantized_input                 # training: float weights
    x = torch.randn(3, TINY.d_model, device=DEVICE)
    o = torch.randn(3, TINY.n_heads, TINY.head_dim, device=DEVICE)
    with torch.no_grad():
        h = x + run_bitlinear(block.o_proj, o.flatten(-2), reference=True)
        gate, up = run_bitlinear(block.gate_up, h, reference=True).chunk(2, dim=-1)
        want = h + run_bitlinear(block.down_proj, F.silu(gate) * up, reference=True)
        assert torch.equal(block.post_attention(x, o, reference=True), want)


def test_the_last_residual_add_quantizes_the_next_blocks_qkv_input(monkeypatch):
    """Between two packed blocks the last residual add also normalises and quantizes the
    new x for the next QKV projection (one kernel for the add and that norm-quant): the
    next block's q, k, v from that input equal those from x through its own BitLinear,
    and a whole forward equals one without the hand-over, bit for bit."""
    torch.manual_seed(11)
    model = TernaryTransformer(TINY)
    with torch.no_grad():                   # each projection its own norm weights, away from 1
        for name, p in model.named_parameters():
            if name.endswith("norm_weight"):
                p.mul_(1 + 0.5 * torch.randn_like(p))
    model = model.pack().to(DEVICE)
    first, second = model.blocks[0], model.blocks[1]
    c = TINY
    x = torch.randn(7, c.d_model, device=DEVICE) * 3
    o = torch.randn(7, c.n_heads, c.head_dim, device=DEVICE)
    pos = torch.arange(7, device=DEVICE)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    with torch.no_grad():
        plain = first.post_attention(x, o)
        handed, quantized = first.post_attention_to(x, o, second.qkv_proj)
        assert quantized is not None and quantized[0].dtype == torch.int8 and quantized[1].shape == (7,)
        assert torch.equal(handed, plain)
        for got, want in zip(second.pre_attention(handed, cos, sin, x_quantized=quantized),
                             second.pre_attention(plain, cos, sin)):
            assert torch.equal(got, want)
        assert first.post_attention_to(x, o, None)[1] is None                  # the last block: a plain add
        assert first.post_attention_to(x, o, second.qkv_proj, reference=True)[1] is None

        def attend(layer, q, k, v):          # attention over the step's own rows, enough here
            return engine_model.attention_with_history(q, k, v)
        tokens = torch.tensor([72, 101, 108, 108, 111, 10, 3], device=DEVICE)
        fused = model.hidden_states(tokens, pos, attend)
        monkeypatch.setattr(TernaryTransformer, "next_qkv", lambda self, i: None)
        assert torch.equal(fused, model.hidden_states(tokens, pos, attend))

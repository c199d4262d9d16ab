"""The peer rows of the MatMul-free benchmarks compute the same thing as gpulab's kernels,
so a timing next to them compares like with like. Each peer is optional (pip install
gpulab[peers]) and needs a CUDA GPU; the norm-only PyTorch row runs everywhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpulab
from gpulab.fused_norms import silu_mul_rmsnorm_quant
from gpulab.grading import bitlinear as gb
from gpulab.grading import fused_norms as gf
from gpulab.grading import mlgru as gm
from gpulab.grading import normquant as gn
from gpulab.mlgru import scan_reference

CUDA = torch.cuda.is_available() and gpulab.mode() == "compiled"


def _inputs(spec_name, params, dtype, device):
    spec = gpulab.get_spec(spec_name)
    return spec.make_inputs(params, dtype, torch.device(device), torch.Generator(device).manual_seed(0))


def test_norm_only_row_is_the_normalisation_that_rmsnorm_quant_quantizes(device):
    inp = _inputs("rmsnorm_quant", dict(rows=5, cols=300), torch.float32, device)
    x, w = inp["x"].double(), inp["weight"].double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    row = gpulab.get_spec("rmsnorm_quant").baselines[gn.NORM_ONLY_ROW]
    assert torch.allclose(row(inp).double(), y, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (CUDA and gn.LIGER_INSTALLED), reason="Liger-Kernel and a CUDA GPU")
def test_liger_row_matches_the_norm():
    inp = _inputs("rmsnorm_quant", dict(rows=64, cols=4100), torch.bfloat16, "cuda")
    ref = F.rms_norm(inp["x"].float(), (4100,), inp["weight"].float(), 1e-6)
    assert gn.LIGER_ROW in gpulab.get_spec("rmsnorm_quant").baselines
    torch.testing.assert_close(gn.liger_rms_norm(inp).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not (CUDA and gm.FLA_INSTALLED), reason="flash-linear-attention and a CUDA GPU")
def test_chunk_hgrn_rows_scan_the_same_recurrence():
    inp = _inputs("mlgru_scan_train", dict(B=2, T=300, D=96), torch.float32, "cuda")
    keys = sorted(inp)
    ref = scan_reference(inp["f"], inp["i"], inp["h0"])
    h, h_last = gm.chunk_hgrn_forward(inp)
    assert sorted(inp) == keys          # the spec's implementation takes **inp after it
    torch.testing.assert_close(h.float(), ref["h"].float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(h_last.float(), ref["h_last"].float(), rtol=1e-3, atol=1e-3)
    # the peer's backward takes no gradient of the final state and gives none for h0: compare
    # with dh_last = 0, without dh0
    inp["dh_last"] = torch.zeros_like(inp["dh_last"])
    ours = gm.mlgru_scan_train(**inp)
    peer = gm.chunk_hgrn_train(inp)
    # the peer's gate gradient is for g = log f: dg = df · f
    torch.testing.assert_close(peer[2].float(), (ours[2] * inp["f"]).float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(peer[3].float(), ours[3].float(), rtol=1e-3, atol=1e-3)
    assert peer[4] is None
    assert gm.FLA_ROW in gpulab.get_spec("mlgru_scan").baselines


@pytest.mark.skipif(not (CUDA and gb.GEMLITE_INSTALLED), reason="gemlite and a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gemlite_row_multiplies_by_the_same_ternary_weights(m):
    inp = _inputs("ternary_matmul", dict(m=m, k=2048, n=1024), torch.bfloat16, "cuda")
    ref = F.linear(inp["x_bf16"].float(), inp["w_bf16"].float())
    y = gb.gemlite_w2(inp).float()
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not (CUDA and gf.FLASHINFER_INSTALLED), reason="FlashInfer and a CUDA GPU")
def test_flashinfer_rows_compute_the_fused_norms_inputs():
    """FlashInfer's add + RMSNorm normalises x + residual (and leaves the sum in its copy of
    x); its SiLU·mul followed by rmsnorm_quant gives the fused kernel's codes up to two: its
    SiLU·mul is rounded to bfloat16 (2^-9 of a value, a quarter of a code at 127) before the
    norm, whose sum of squares and absmax then move too; the fused kernel keeps float32. One
    code was the most seen until 2026-12-05, when the H200 showed two; a wrong function
    (another activation, no norm, another scale) moves codes by far more."""
    inp = _inputs("add_rmsnorm_quant", dict(rows=64, cols=2048), torch.bfloat16, "cuda")
    run = gf.flashinfer_fused_add_rmsnorm()
    run(inp)
    state = run.state
    s = inp["x"].float() + inp["residual"].float()
    torch.testing.assert_close(state["stream"].float(), s, rtol=1e-2, atol=1e-2)
    y = F.rms_norm(s, (2048,), inp["weight"].float(), gf.EPS)
    torch.testing.assert_close(state["attn"].float(), y, rtol=2e-2, atol=2e-2)
    inp = _inputs("silu_mul_rmsnorm_quant", dict(rows=64, hidden=5632), torch.bfloat16, "cuda")
    q, scale = gf.flashinfer_silu_mul(inp)
    want_q, want_scale = silu_mul_rmsnorm_quant(inp["gate_up"], inp["weight"], gf.EPS)
    assert (q.int() - want_q.int()).abs().max() <= 2
    torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)

r"""One decode step of a MatMul-free block in one kernel.

A draft model is meant to cost a small fraction of the target. The shipped MLGRU draft
(d_model 128, two blocks, 68 K weights) reads almost nothing per token, yet a step of
:meth:`gpulab.model.MatMulFreeLM.step` launches about twenty kernels per block: each
BitLinear is a norm-quant and a ternary matmul, and the gates, the recurrence, the GLU
and the residual adds are one PyTorch kernel each. Replayed from a CUDA graph each still
costs a few µs of launch latency, so on the H200 four draft tokens took 0.5 ms, longer
than the target's verify pass (``gpulab/results/engine/speculative.json``, 2026-12-02).
Here a block's whole step is one program per 16 sequences, everything in registers.

The step of a block (paper variant; x [B, D] the residual stream, h [B, D] the state)::

    u = RMSNorm(x; a)
    y_p = BitLinear_p(u) for p in f, c, g          BitLinear(z) = Q(RMSNorm(z; w_p)) · T_pᵀ / (s·σ_p)
    f = σ(y_f),  i = SiLU(y_c)(1 − f),  h ← f ⊙ h + i
    x ← x + BitLinear_o(σ(y_g) ⊙ h)
    [gate, up] = BitLinear_gate(RMSNorm(x; b));  x ← x + BitLinear_down(SiLU(gate) ⊙ up)

Q is the per-row absmax int8 quantization (scale s = 127 / max|·|, rounding half away
from zero), T_p the ternary weights, σ_p their scale. The int8 × ternary dots run as
fp16 tensor-core dots: every product is an integer of at most 127 and the fp32 sums stay
exact below 2^24. The GLU's hidden vector (H wide) is made D columns at a time, twice:
the first pass gathers Σv² and max|v·w_down| for the down projection's norm-quant (the
norm's rstd is a common positive factor of every element, so the max of the normalised
row is rstd times the max of v·w), the second recomputes each chunk, quantizes it and
accumulates its dot. Everything stays in float32 between the quantizations (the layered
path rounds to the model's dtype after each op), so the two paths differ by rounding:
a draft may propose another token now and then, never the target's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import runtime
from .normquant import ABSMAX_FLOOR, absmax_quantize, rmsnorm_ref, round_half_away_int
from .validate import require_same_device, require_tensor

BLOCK_B = 16          # rows per program: the smallest tile of a tensor-core dot
FLOOR = tl.constexpr(ABSMAX_FLOOR)     # the quantization's floor on max|y|, inside kernels


@dataclass(frozen=True)
class BlockStepWeights:
    """A block's weights as the kernel reads them (:meth:`gpulab.model.Block.step_weights`).

    norms: float32 [7, D], the RMSNorm weights of the mixer, of f, c, g and o's inputs, of
    the MLP and of gate's input; down_norm: float32 [H]; scales: float32 [6], the ternary
    scales σ of f, c, g, o, gate and down; w_f, w_c, w_g, w_o: float16 [D, D] and w_gate
    [D, 2H], w_down [H, D]: ternary weights transposed (K rows, N columns) as −1, 0, 1.
    eps_norm: the blocks' RMSNorm epsilon; eps_bit: the BitLinears'."""
    norms: torch.Tensor
    down_norm: torch.Tensor
    scales: torch.Tensor
    w_f: torch.Tensor
    w_c: torch.Tensor
    w_g: torch.Tensor
    w_o: torch.Tensor
    w_gate: torch.Tensor
    w_down: torch.Tensor
    eps_norm: float
    eps_bit: float

    @property
    def d_model(self) -> int:
        return self.norms.shape[1]

    @property
    def hidden(self) -> int:
        return self.down_norm.shape[0]


def fits(d_model: int, hidden: int) -> bool:
    """Sizes the kernel takes: D a power of two from 16 to 256 (a row in registers), H a
    multiple of D (the GLU in D-wide chunks)."""
    return 16 <= d_model <= 256 and d_model & (d_model - 1) == 0 and hidden % d_model == 0 and hidden > 0


# -- PyTorch reference ----------------------------------------------------------------------
def _bitlinear_ref(z, norm, w_t, scale, eps):
    x_q, x_scale = absmax_quantize(rmsnorm_ref(z, norm, eps))
    return (x_q.to(z.dtype) @ w_t.to(z.dtype)) / (x_scale[:, None] * scale)


def block_step_ref(x: torch.Tensor, h: torch.Tensor, w: BlockStepWeights):
    """The step in float64, op by op: (new x [B, D] in x's dtype, new h [B, D] float32)."""
    xd, hd = x.double(), h.double()
    n, sc = w.norms.double(), w.scales.double()
    u = rmsnorm_ref(xd, n[0], w.eps_norm)
    f = torch.sigmoid(_bitlinear_ref(u, n[1], w.w_f, sc[0], w.eps_bit))
    yc = _bitlinear_ref(u, n[2], w.w_c, sc[1], w.eps_bit)
    hd = f * hd + yc * torch.sigmoid(yc) * (1 - f)
    g = torch.sigmoid(_bitlinear_ref(u, n[3], w.w_g, sc[2], w.eps_bit))
    xd = xd + _bitlinear_ref(g * hd, n[4], w.w_o, sc[3], w.eps_bit)
    gate, up = _bitlinear_ref(rmsnorm_ref(xd, n[5], w.eps_norm), n[6], w.w_gate, sc[4], w.eps_bit).chunk(2, dim=-1)
    xd = xd + _bitlinear_ref(gate * torch.sigmoid(gate) * up, w.down_norm.double(), w.w_down, sc[5], w.eps_bit)
    return xd.to(x.dtype), hd.float()


# -- Triton kernel --------------------------------------------------------------------------
@triton.jit
def _rms_rows(x, w, eps, K: tl.constexpr):
    """x [BLOCK_B, K] · rstd per row · w [K]."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
    return x * rstd[:, None] * w[None, :]


@triton.jit
def _quantize_rows(y, scale):
    """round(y · scale) per row, clamped to int8's range, as float16 (exact)."""
    return tl.minimum(tl.maximum(round_half_away_int(y * scale[:, None]), -128), 127).to(tl.float16)


@triton.jit
def _ternary_dot(q, w_ptr, ld, col0, K: tl.constexpr, N: tl.constexpr):
    """q [BLOCK_B, K] (float16 integers) · W[:, col0:col0+N] (W float16 [K, ld]): exact."""
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    w = tl.load(w_ptr + k[:, None] * ld + col0 + n[None, :])
    return tl.dot(q, w, out_dtype=tl.float32)


@triton.jit
def _bitlinear(z, norm_ptr, scale_ptr, w_ptr, eps, K: tl.constexpr, N: tl.constexpr):
    """BitLinear of z [BLOCK_B, K] with a [K, N] weight: norm, int8 quantization, ternary dot, scales."""
    k = tl.arange(0, K)
    y = _rms_rows(z, tl.load(norm_ptr + k), eps, K)
    s = 127.0 / tl.maximum(tl.max(tl.abs(y), axis=1), FLOOR)
    acc = _ternary_dot(_quantize_rows(y, s), w_ptr, N, 0, K, N)
    return acc / (s[:, None] * tl.load(scale_ptr))


@triton.jit
def block_step_kernel(x_ptr, h_ptr, x_out_ptr, h_out_ptr, B,
                      norm_ptr, down_norm_ptr, scale_ptr,
                      wf_ptr, wc_ptr, wg_ptr, wo_ptr, wgate_ptr, wdown_ptr,
                      eps_norm, eps_bit,
                      D: tl.constexpr, H: tl.constexpr, BLOCK_B: tl.constexpr):
    """Rows [pid·BLOCK_B, (pid+1)·BLOCK_B) of x [B, D] and h [B, D] (contiguous) one
    block step forward, into x_out (x's dtype) and h_out (float32)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, D)
    mask = (rows < B)[:, None]
    offs = rows[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    # token mixer: the MLGRU's gates from one normalised input, then the recurrence
    u = _rms_rows(x, tl.load(norm_ptr + d), eps_norm, D)
    f = tl.sigmoid(_bitlinear(u, norm_ptr + D, scale_ptr, wf_ptr, eps_bit, D, D))
    c = _bitlinear(u, norm_ptr + 2 * D, scale_ptr + 1, wc_ptr, eps_bit, D, D)
    h = f * h + c * tl.sigmoid(c) * (1.0 - f)
    g = tl.sigmoid(_bitlinear(u, norm_ptr + 3 * D, scale_ptr + 2, wg_ptr, eps_bit, D, D))
    x += _bitlinear(g * h, norm_ptr + 4 * D, scale_ptr + 3, wo_ptr, eps_bit, D, D)

    # channel mixer: gate's input quantized once; the hidden row in D-wide chunks, twice
    y = _rms_rows(_rms_rows(x, tl.load(norm_ptr + 5 * D + d), eps_norm, D), tl.load(norm_ptr + 6 * D + d), eps_bit, D)
    s_in = 127.0 / tl.maximum(tl.max(tl.abs(y), axis=1), FLOOR)
    q_in = _quantize_rows(y, s_in)
    gate_scale = s_in[:, None] * tl.load(scale_ptr + 4)
    sum_sq = tl.zeros([BLOCK_B], tl.float32)
    max_vw = tl.zeros([BLOCK_B], tl.float32)
    for j in tl.static_range(H // D):
        gate = _ternary_dot(q_in, wgate_ptr, 2 * H, j * D, D, D) / gate_scale
        up = _ternary_dot(q_in, wgate_ptr, 2 * H, H + j * D, D, D) / gate_scale
        v = gate * tl.sigmoid(gate) * up
        sum_sq += tl.sum(v * v, axis=1)
        max_vw = tl.maximum(max_vw, tl.max(tl.abs(v * tl.load(down_norm_ptr + j * D + d)[None, :]), axis=1))
    rstd = 1.0 / tl.sqrt(sum_sq / H + eps_bit)
    s_down = 127.0 / tl.maximum(max_vw * rstd, FLOOR)
    acc = tl.zeros([BLOCK_B, D], tl.float32)
    for j in tl.static_range(H // D):
        gate = _ternary_dot(q_in, wgate_ptr, 2 * H, j * D, D, D) / gate_scale
        up = _ternary_dot(q_in, wgate_ptr, 2 * H, H + j * D, D, D) / gate_scale
        v = gate * tl.sigmoid(gate) * up * tl.load(down_norm_ptr + j * D + d)[None, :]
        acc += _ternary_dot(_quantize_rows(v, rstd * s_down), wdown_ptr + j * D * D, D, 0, D, D)
    x += acc / (s_down[:, None] * tl.load(scale_ptr + 5))

    tl.store(x_out_ptr + offs, x.to(x_out_ptr.dtype.element_ty), mask=mask)
    tl.store(h_out_ptr + offs, h, mask=mask)


# -- launcher and public API ----------------------------------------------------------------
def block_step_into(x, h, w: BlockStepWeights, x_out, h_out):
    """Launcher (check calling convention): x [B, D], h float32 [B, D], all contiguous."""
    b, d = x.shape
    if b == 0:
        return
    runtime.launch(block_step_kernel, (runtime.cdiv(b, BLOCK_B),), {"num_warps": 4},
                   x, h, x_out, h_out, b, w.norms, w.down_norm, w.scales,
                   w.w_f, w.w_c, w.w_g, w.w_o, w.w_gate, w.w_down, float(w.eps_norm), float(w.eps_bit),
                   D=d, H=w.hidden, BLOCK_B=BLOCK_B)


def block_step(x: torch.Tensor, h: torch.Tensor, w: BlockStepWeights):
    """One block step for a token per sequence: x [B, D] (float32, float16 or bfloat16)
    and the state h [B, D] -> (new x in x's dtype, new h float32)."""
    d = w.d_model
    require_tensor("x", x, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16), contiguous=False)
    if x.shape[1] != d:
        raise ValueError(f"x must be [batch, {d}] (the block's d_model), got {tuple(x.shape)}")
    require_tensor("h", h, shape=x.shape, contiguous=False)
    require_same_device(x=x, h=h, weights=w.norms)
    x, h = x.contiguous(), h.float().contiguous()
    x_out, h_out = torch.empty_like(x), torch.empty_like(h)
    block_step_into(x, h, w, x_out, h_out)
    return x_out, h_out

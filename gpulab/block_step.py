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
exact below 2^24. With the weights stored as int8 instead (:data:`INT8_WEIGHTS`, sm_80+)
they are int8 tensor-core dots with int32 sums: the same integers, half the bytes read.
The GLU's hidden vector (H wide) is made C columns at a time (:func:`rollout_tiles`), in
two passes when C < H: the first gathers Σv² and max|v·w_down| for the down projection's
norm-quant (the norm's rstd is a common positive factor of every element, so the max of
the normalised row is rstd times the max of v·w), the second recomputes each chunk,
quantizes it and accumulates its dot; with the whole row in one chunk, once. Everything
stays in float32 between the quantizations (the layered path rounds to the model's dtype
after each op), so the two paths differ by rounding: a draft may propose another token
now and then, never the target's output.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import runtime
from .normquant import ABSMAX_FLOOR, absmax_quantize, rmsnorm_ref, round_half_away_int
from .validate import require_index_range, require_same_device, require_tensor

BLOCK_B = 16          # rows per program: the smallest tile of a tensor-core dot
# A row block's step is a chain of small dots and row reductions: its time is their latency.
# On the H200 (tools/rollout_probe.py, 2026-12-04) four drafts took 274 µs with 4 warps a
# program, 208 µs with 8 and 230 µs with 16 (keeping the GLU's hidden rows in a workspace,
# so that w_gate is read once, not twice, made it slower: 228 µs with 8 warps). That build
# unrolled the GLU's chunks, the layers and the head's chunks (tl.static_range): compiling
# the rollout for sm_75 then took 250 s; as loops it takes 12 s, and 296 µs on the H200
# with 8 warps, 210 µs with the wide tiles of :func:`rollout_tiles`.
BLOCK_STEP_WARPS = 4
ROLLOUT_WARPS = 8
# A step is a chain of loads and dots on one SM: int8 weights halve what each dot loads and
# make the dots int8 tensor-core dots. They give exactly the float16 weights' results
# (tests/test_block_step.py) and compile for sm_80 and sm_90 (int8 dots do not for sm_75:
# float16 there). On the H200 (2026-12-05) four drafts at batch 1 took 181 against 210 µs
# (tools/rollout_probe.py), and speculative decoding at batch 1 ran 8225 against 7524
# tokens/s (tools/speculative_bench.py); one block step alone is slower (39 against 33 µs),
# but the engine drafts with the rollout.
INT8_WEIGHTS = True
TERNARY = ("w_f", "w_c", "w_g", "w_o", "w_gate", "w_down")


def int8_dots() -> bool:
    """Can the kernels take int8 weights here? Int8 tensor-core dots need sm_80+ (they do
    not compile for sm_75, Colab's T4); the interpreter computes them exactly."""
    cc = runtime.compute_capability()
    return cc is None or cc >= (8, 0)


def weight_dtype() -> torch.dtype:
    """The ternary weights' dtype in :meth:`gpulab.model.Block.step_weights`: int8 where
    :data:`INT8_WEIGHTS` is on and :func:`int8_dots` allows it, else float16."""
    return torch.int8 if INT8_WEIGHTS and int8_dots() else torch.float16


def glu_chunk(d_model: int) -> int:
    """Columns of the GLU's hidden row made at a time: two [D, C] weight tiles (gate's and
    up's) are in shared memory together, 32 KiB at D = 128, inside sm_75's 64 KiB."""
    return min(d_model, 64)


def rollout_tiles(d_model: int, hidden: int, vocab_size: int) -> tuple[int, int, int | None]:
    """(GLU chunk C, head chunk VC, num_stages) of :func:`draft_rollout_into`.

    On sm_80+, the widest chunk of the hidden row (a power of two dividing it, up to 512)
    whose [D, C] weight tile fits the GPU's shared memory, up to 256 logits at a time and
    one pipeline stage: fewer dependent loads in the chain. On the H200 (2026-12-04,
    tools/rollout_probe.py) four drafts of the shipped draft (D = 128, H = 512) took 210 µs
    this way against 296 µs in 64-wide chunks; that kernel needs 144 KiB (A100 and H100/H200
    have it, sm_86/89 GPUs about 100 KiB: C = 256 there). Below sm_80, 64-wide chunks,
    which fit the 64 KiB of sm_75."""
    cc, smem = runtime.compute_capability(), runtime.shared_memory_per_block()
    chunk = min(hidden & -hidden, 512)
    if cc is None or cc < (8, 0) or smem is None:
        return glu_chunk(d_model), min(vocab_size, 64), None
    while chunk > glu_chunk(d_model) and 2 * d_model * chunk * 9 // 8 + 8192 > smem:
        chunk //= 2          # the [D, C] float16 tile and what else the compiler keeps, measured
    return chunk, min(vocab_size, 256), 1


def launch_options(num_warps: int, num_stages: int | None = None) -> dict:
    """One pipeline stage below sm_80: the loops' weight tiles, with a second stage in
    flight, overflow the 64 KiB of shared memory of sm_75 (Colab's T4)."""
    cc = runtime.compute_capability()
    if num_stages is None and cc is not None and cc < (8, 0):
        num_stages = 1
    return {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
FLOOR = tl.constexpr(ABSMAX_FLOOR)     # the quantization's floor on max|y|, inside kernels


@dataclass(frozen=True)
class BlockStepWeights:
    """A block's weights as the kernel reads them (:meth:`gpulab.model.Block.step_weights`).

    norms: float32 [7, D], the RMSNorm weights of the mixer, of f, c, g and o's inputs, of
    the MLP and of gate's input; down_norm: float32 [H]; scales: float32 [6], the ternary
    scales σ of f, c, g, o, gate and down; w_f, w_c, w_g, w_o: [D, D] and w_gate [D, 2H],
    w_down [H, D]: ternary weights transposed (K rows, N columns) as −1, 0, 1, all float16
    or all int8 (:func:`weight_dtype`).
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
        return self.norms.shape[-1]

    @property
    def hidden(self) -> int:
        return self.down_norm.shape[-1]

    def with_weight_dtype(self, dtype: torch.dtype) -> "BlockStepWeights":
        """The same weights with the ternary ones as ``dtype`` (torch.float16 or torch.int8)."""
        return replace(self, **{n: getattr(self, n).to(dtype) for n in TERNARY})


def require_weights_run_here(w: BlockStepWeights) -> None:
    """The ternary weights all float16 or all int8, and int8 only where :func:`int8_dots`."""
    dtypes = {getattr(w, n).dtype for n in TERNARY}
    if len(dtypes) != 1 or not dtypes <= {torch.float16, torch.int8}:
        raise TypeError(f"the ternary weights must be all float16 or all int8, got "
                        f"{sorted(str(d).replace('torch.', '') for d in dtypes)}")
    if dtypes == {torch.int8} and not int8_dots():
        raise ValueError(f"int8 weights need int8 tensor-core dots (sm_80 or newer), this GPU is "
                         f"sm_{''.join(map(str, runtime.compute_capability()))}: pass "
                         f"w.with_weight_dtype(torch.float16)")


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
    """q [BLOCK_B, K] (float16 integers) · W[:, col0:col0+N] (W float16 or int8 [K, ld]): exact."""
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    w = tl.load(w_ptr + k[:, None] * ld + col0 + n[None, :])
    if w.dtype == tl.int8:          # the codes fit int8 (the quantization clamps them)
        acc = tl.dot(q.to(tl.int8), w, out_dtype=tl.int32).to(tl.float32)
    else:
        acc = tl.dot(q, w, out_dtype=tl.float32)
    return acc


@triton.jit
def _bitlinear(z, norm_ptr, scale_ptr, w_ptr, eps, K: tl.constexpr, N: tl.constexpr):
    """BitLinear of z [BLOCK_B, K] with a [K, N] weight: norm, int8 quantization, ternary dot, scales."""
    k = tl.arange(0, K)
    y = _rms_rows(z, tl.load(norm_ptr + k), eps, K)
    s = 127.0 / tl.maximum(tl.max(tl.abs(y), axis=1), FLOOR)
    acc = _ternary_dot(_quantize_rows(y, s), w_ptr, N, 0, K, N)
    return acc / (s[:, None] * tl.load(scale_ptr))


@triton.jit
def _block_rows(x, h, norm_ptr, down_norm_ptr, scale_ptr, wf_ptr, wc_ptr, wg_ptr, wo_ptr, wgate_ptr, wdown_ptr,
                eps_norm, eps_bit, D: tl.constexpr, H: tl.constexpr, C: tl.constexpr, BLOCK_B: tl.constexpr):
    """The block's step on rows x [BLOCK_B, D], h [BLOCK_B, D] (float32) -> (x, h), float32.
    The GLU's hidden row is made C columns at a time (:func:`glu_chunk`)."""
    d = tl.arange(0, D)
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
    cols = tl.arange(0, C)
    if C == H:
        # the whole hidden row at once: made once and kept for the down projection
        gate = _ternary_dot(q_in, wgate_ptr, 2 * H, 0, D, H) / gate_scale
        up = _ternary_dot(q_in, wgate_ptr, 2 * H, H, D, H) / gate_scale
        v = gate * tl.sigmoid(gate) * up
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / H + eps_bit)
        v = v * tl.load(down_norm_ptr + cols)[None, :]
        s_down = 127.0 / tl.maximum(tl.max(tl.abs(v), axis=1) * rstd, FLOOR)
        acc = _ternary_dot(_quantize_rows(v, rstd * s_down), wdown_ptr, D, 0, H, D)
    else:
        # chunk by chunk, twice: first the row's sum of squares and largest |value| (its
        # norm and quantization scale), then the quantized chunks into the down projection
        sum_sq = tl.zeros([BLOCK_B], tl.float32)
        max_vw = tl.zeros([BLOCK_B], tl.float32)
        for j in range(H // C):
            gate = _ternary_dot(q_in, wgate_ptr, 2 * H, j * C, D, C) / gate_scale
            up = _ternary_dot(q_in, wgate_ptr, 2 * H, H + j * C, D, C) / gate_scale
            v = gate * tl.sigmoid(gate) * up
            sum_sq += tl.sum(v * v, axis=1)
            max_vw = tl.maximum(max_vw, tl.max(tl.abs(v * tl.load(down_norm_ptr + j * C + cols)[None, :]), axis=1))
        rstd = 1.0 / tl.sqrt(sum_sq / H + eps_bit)
        s_down = 127.0 / tl.maximum(max_vw * rstd, FLOOR)
        acc = tl.zeros([BLOCK_B, D], tl.float32)
        for j in range(H // C):
            gate = _ternary_dot(q_in, wgate_ptr, 2 * H, j * C, D, C) / gate_scale
            up = _ternary_dot(q_in, wgate_ptr, 2 * H, H + j * C, D, C) / gate_scale
            v = gate * tl.sigmoid(gate) * up * tl.load(down_norm_ptr + j * C + cols)[None, :]
            acc += _ternary_dot(_quantize_rows(v, rstd * s_down), wdown_ptr + j * C * D, D, 0, C, D)
    x += acc / (s_down[:, None] * tl.load(scale_ptr + 5))
    return x, h


@triton.jit
def block_step_kernel(x_ptr, h_ptr, x_out_ptr, h_out_ptr, B,
                      norm_ptr, down_norm_ptr, scale_ptr,
                      wf_ptr, wc_ptr, wg_ptr, wo_ptr, wgate_ptr, wdown_ptr,
                      eps_norm, eps_bit,
                      D: tl.constexpr, H: tl.constexpr, C: tl.constexpr, BLOCK_B: tl.constexpr):
    """Rows [pid·BLOCK_B, (pid+1)·BLOCK_B) of x [B, D] and h [B, D] (contiguous) one
    block step forward, into x_out (x's dtype) and h_out (float32)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, D)
    mask = (rows < B)[:, None]
    offs = rows[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x, h = _block_rows(x, h, norm_ptr, down_norm_ptr, scale_ptr, wf_ptr, wc_ptr, wg_ptr, wo_ptr, wgate_ptr,
                       wdown_ptr, eps_norm, eps_bit, D, H, C, BLOCK_B)
    tl.store(x_out_ptr + offs, x.to(x_out_ptr.dtype.element_ty), mask=mask)
    tl.store(h_out_ptr + offs, h, mask=mask)


# -- launcher and public API ----------------------------------------------------------------
def block_step_into(x, h, w: BlockStepWeights, x_out, h_out, num_warps: int = BLOCK_STEP_WARPS):
    """Launcher (check calling convention): x [B, D], h float32 [B, D], all contiguous."""
    b, d = x.shape
    if b == 0:
        return
    runtime.launch(block_step_kernel, (runtime.cdiv(b, BLOCK_B),), launch_options(num_warps),
                   x, h, x_out, h_out, b, w.norms, w.down_norm, w.scales,
                   w.w_f, w.w_c, w.w_g, w.w_o, w.w_gate, w.w_down, float(w.eps_norm), float(w.eps_bit),
                   D=d, H=w.hidden, C=glu_chunk(d), BLOCK_B=BLOCK_B)


def block_step(x: torch.Tensor, h: torch.Tensor, w: BlockStepWeights):
    """One block step for a token per sequence: x [B, D] (float32, float16 or bfloat16)
    and the state h [B, D] -> (new x in x's dtype, new h float32)."""
    d = w.d_model
    require_tensor("x", x, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16), contiguous=False)
    if x.shape[1] != d:
        raise ValueError(f"x must be [batch, {d}] (the block's d_model), got {tuple(x.shape)}")
    require_tensor("h", h, shape=x.shape, contiguous=False)
    require_same_device(x=x, h=h, weights=w.norms)
    require_weights_run_here(w)
    x, h = x.contiguous(), h.float().contiguous()
    x_out, h_out = torch.empty_like(x), torch.empty_like(h)
    block_step_into(x, h, w, x_out, h_out)
    return x_out, h_out


# -- k greedy draft tokens of the whole model in one kernel ---------------------------------
# With each block's step one kernel, a greedy draft token still costs the embedding, two
# block kernels, the final norm, the head and an argmax: about eight launches, 0.28 ms for
# four drafts on the H200 even from a CUDA graph (2026-12-03, third run), longer than the
# target's verify pass. Here a program runs k + 1 steps of the whole model for its rows,
# feeding each step's argmax to the next; the states go to memory after every step (the
# drafter keeps them to rewind to the last accepted token) and are read back from there.

@dataclass(frozen=True)
class RolloutWeights:
    """A MatMul-free LM as :func:`draft_rollout` reads it
    (:meth:`gpulab.model.MatMulFreeLM.rollout_weights`).

    embed: [V, D] and head: [V, D] in the model's dtype; norm: float32 [D], the final
    RMSNorm's weight, eps its epsilon; blocks: the L blocks' :class:`BlockStepWeights`
    stacked (norms [L, 7, D], w_f [L, D, D], ...; :func:`stack_blocks`)."""
    embed: torch.Tensor
    norm: torch.Tensor
    head: torch.Tensor
    blocks: BlockStepWeights
    eps: float

    @property
    def n_layers(self) -> int:
        return self.blocks.norms.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def with_weight_dtype(self, dtype: torch.dtype) -> "RolloutWeights":
        """The same weights with the blocks' ternary ones as ``dtype`` (float16 or int8)."""
        return replace(self, blocks=self.blocks.with_weight_dtype(dtype))


def stack_blocks(blocks: list[BlockStepWeights]) -> BlockStepWeights:
    """The blocks' weights stacked along a new first axis (one pointer per kind of weight)."""
    if len({(b.eps_norm, b.eps_bit) for b in blocks}) != 1:
        raise ValueError("the blocks' epsilons differ: draft_rollout takes one pair for all")
    names = ("norms", "down_norm", "scales", "w_f", "w_c", "w_g", "w_o", "w_gate", "w_down")
    return BlockStepWeights(*(torch.stack([getattr(b, n) for b in blocks]).contiguous() for n in names),
                            eps_norm=blocks[0].eps_norm, eps_bit=blocks[0].eps_bit)


def rollout_fits(d_model: int, hidden: int, vocab_size: int) -> bool:
    """Sizes the rollout kernel takes: the block kernel's, and a vocabulary of a power of
    two from 16 to 1024 (the head's logits in tiles of up to 256, :func:`rollout_tiles`)."""
    return fits(d_model, hidden) and 16 <= vocab_size <= 1024 and vocab_size & (vocab_size - 1) == 0


def layer_weights(blocks: BlockStepWeights, i: int) -> BlockStepWeights:
    """Layer i's weights out of :func:`stack_blocks`' stack."""
    return BlockStepWeights(*(getattr(blocks, n)[i] for n in ("norms", "down_norm", "scales", "w_f", "w_c",
                                                               "w_g", "w_o", "w_gate", "w_down")),
                            eps_norm=blocks.eps_norm, eps_bit=blocks.eps_bit)


@torch.no_grad()
def draft_rollout_ref(first: torch.Tensor, states: torch.Tensor, w: RolloutWeights, k: int):
    """k greedy tokens in float64, step by step: first [B] (the last token of each row),
    states [L, B, D] -> (drafts [k, B] int64, states after each of the k + 1 steps
    [L, B, k + 1, D] float32). As the kernel: x in the model's dtype between blocks, the
    states in float32, the normalised row in the model's dtype before the head."""
    dtype = w.embed.dtype
    token, h = first.long(), [states[i].float() for i in range(w.n_layers)]
    drafts, hist = [], []
    for i in range(k + 1):
        x = w.embed[token]
        for j in range(w.n_layers):
            x, h[j] = block_step_ref(x, h[j], layer_weights(w.blocks, j))
        hist.append(torch.stack(h))
        if i == k:
            break
        xn = rmsnorm_ref(x.double(), w.norm.double(), w.eps).to(dtype)
        token = (xn.double() @ w.head.double().t()).argmax(-1)
        drafts.append(token)
    empty = torch.empty((0, first.shape[0]), dtype=torch.long, device=first.device)
    return (torch.stack(drafts) if drafts else empty), torch.stack(hist, dim=2)


@triton.jit
def _start_after_verify(rows, live, ahead_ptr, verified_ptr, stride_verified, best_ptr, first_limit, K: tl.constexpr):
    """Each row's (first token, state row) from a verify pass: ahead row b = (its first
    verify row r, drafts verified n, state row of the state before them s, its column c in
    verified [K, *]). Accepted a = the leading drafts that equal the target's argmax
    best[r + i] (i < n); first = best[r + a] (0 where it is no draft input: >= first_limit,
    a special), state row s + a (the state after the accepted drafts)."""
    r = tl.load(ahead_ptr + rows * 4, mask=live, other=0)
    n = tl.load(ahead_ptr + rows * 4 + 1, mask=live, other=0)
    s = tl.load(ahead_ptr + rows * 4 + 2, mask=live, other=0)
    c = tl.load(ahead_ptr + rows * 4 + 3, mask=live, other=0)
    accepted = tl.zeros_like(r)
    still = live
    for i in tl.static_range(K):
        draft = tl.load(verified_ptr + i * stride_verified + c, mask=still, other=-1)
        target = tl.load(best_ptr + r + i, mask=still, other=-2)
        still = still & (i < n) & (draft == target)
        accepted += still.to(accepted.dtype)
    first = tl.load(best_ptr + r + accepted, mask=live, other=0)
    return tl.where(first < first_limit, first, 0).to(tl.int32), s + accepted


@triton.jit
def draft_rollout_kernel(first_ptr, src_ptr, dst_ptr, state_in_ptr, state_out_ptr, drafts_ptr, B,
                         stride_in_layer, stride_out_layer,
                         embed_ptr, final_norm_ptr, head_ptr, eps_final,
                         norm_ptr, down_norm_ptr, scale_ptr, wf_ptr, wc_ptr, wg_ptr, wo_ptr, wgate_ptr, wdown_ptr,
                         eps_norm, eps_bit, ahead_ptr, verified_ptr, stride_verified, best_ptr, first_limit,
                         K: tl.constexpr, L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                         V: tl.constexpr, VC: tl.constexpr, BLOCK_B: tl.constexpr, IEEE: tl.constexpr,
                         AHEAD: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr):
    """Rows [pid·BLOCK_B, (pid+1)·BLOCK_B) of the batch, K greedy tokens: steps FIRST to
    LAST − 1 of the K + 1 (all of them, the K that draft, or the last one alone).

    Row b starts from token first[b] and, in every layer l, the state at row src[b] of
    state_in[l] (with AHEAD, both found from a verify pass instead: :func:`_start_after_verify`);
    step i's states go to row dst[b·(K+1) + i] of state_out[l] (float32), step i's argmax
    (i < K) to drafts[i, b]; step i + 1 reads step i's states back (and step FIRST > 0
    resumes from draft FIRST − 1 and the states step FIRST − 1 wrote)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = rows < B
    d = tl.arange(0, D)
    v = tl.arange(0, VC)
    if FIRST > 0:
        token = tl.load(drafts_ptr + (FIRST - 1) * B + rows, mask=live, other=0).to(tl.int32)
        src = tl.zeros([BLOCK_B], tl.int64)                      # (step i > 0 reads state_out)
    elif AHEAD:
        token, src = _start_after_verify(rows, live, ahead_ptr, verified_ptr, stride_verified, best_ptr,
                                         first_limit, K)
    else:
        token = tl.load(first_ptr + rows, mask=live, other=0).to(tl.int32)
        src = tl.load(src_ptr + rows, mask=live, other=0)
    final_norm = tl.load(final_norm_ptr + d)
    for i in range(FIRST, LAST):
        ok = live & (token >= 0) & (token < V)           # a bad first token reads nothing
        x = tl.load(embed_ptr + token[:, None].to(tl.int64) * D + d[None, :], mask=ok[:, None], other=0.0)
        x = x.to(tl.float32)
        prev = tl.load(dst_ptr + rows * (K + 1) + i - 1, mask=live & (i > 0), other=0)
        dst = tl.load(dst_ptr + rows * (K + 1) + i, mask=live, other=0)
        for layer in range(L):
            h_in = tl.load(state_in_ptr + layer * stride_in_layer + src[:, None] * D + d[None, :],
                           mask=live[:, None] & (i == 0), other=0.0)
            h_prev = tl.load(state_out_ptr + layer * stride_out_layer + prev[:, None] * D + d[None, :],
                             mask=live[:, None] & (i > 0), other=0.0)
            x, h = _block_rows(x, h_in + h_prev, norm_ptr + layer * 7 * D, down_norm_ptr + layer * H,
                               scale_ptr + layer * 6, wf_ptr + layer * D * D, wc_ptr + layer * D * D,
                               wg_ptr + layer * D * D, wo_ptr + layer * D * D, wgate_ptr + layer * 2 * D * H,
                               wdown_ptr + layer * H * D, eps_norm, eps_bit, D, H, C, BLOCK_B)
            x = x.to(embed_ptr.dtype.element_ty).to(tl.float32)     # as the layered step rounds it
            tl.debug_barrier()        # every thread's state loaded: the row it came from may be dst
            tl.store(state_out_ptr + layer * stride_out_layer + dst[:, None] * D + d[None, :], h,
                     mask=live[:, None])
        tl.debug_barrier()            # the next step reads these states back: other threads' stores
        if i < K:
            xn = _rms_rows(x, final_norm, eps_final, D).to(head_ptr.dtype.element_ty)
            # the head's logits VC at a time (a float32 [D, V] operand overflows sm_75's
            # shared memory), keeping each row's best so far: the first of equal maxima wins
            best = tl.full([BLOCK_B], float("-inf"), tl.float32)
            token = tl.zeros([BLOCK_B], tl.int32)
            for c in range(V // VC):
                head_t = tl.load(head_ptr + (c * VC + v)[None, :] * D + d[:, None])   # [D, VC]: transposed
                if IEEE:
                    logits = tl.dot(xn, head_t, out_dtype=tl.float32, input_precision="ieee")
                else:
                    logits = tl.dot(xn, head_t, out_dtype=tl.float32)
                top = tl.max(logits, axis=1)
                take = top > best
                token = tl.where(take, tl.argmax(logits, axis=1).to(tl.int32) + c * VC, token)
                best = tl.where(take, top, best)
            tl.store(drafts_ptr + i * B + rows, token.to(tl.int64), mask=live)


def draft_rollout_into(first, src, dst, state_in, state_out, w: RolloutWeights, k: int, drafts,
                       num_warps: int = ROLLOUT_WARPS, chunk: int | None = None, head_chunk: int | None = None,
                       num_stages: int | None = None, ahead: tuple | None = None, part: str = "all"):
    """Launcher (no validation): first, src [B] and dst [B·(k+1)] int64; state_in [L, *, D]
    and state_out [L, *, D] float32 (rows contiguous; they may be one tensor, the drafter's
    pool); drafts int64 [k, B]. ``chunk``: the GLU's columns at a time (a divisor of the
    hidden size), ``head_chunk``: the head's logits at a time (a divisor of the vocabulary),
    ``num_stages``: Triton's; each by default from :func:`rollout_tiles`.

    ``ahead`` = (rows int64 [B, 4], verified int64 [k, *] (last dimension contiguous),
    best int64 [*], first_limit): each row's first token and state row found in the kernel
    from a verify pass instead of ``first`` and ``src`` (not read then): row b = (its
    first row r in best, the drafts verified n <= k, the state row before them s, its
    column in verified); accepted a = leading drafts equal to best[r + i]; first =
    best[r + a] (0 if >= first_limit), state row s + a. Drafting ahead's start
    (:meth:`gpulab.engine.spec_graphs.MLGRUGraphDrafter.launch_ahead`), in the same launch.

    ``part``: "all" k + 1 steps; "drafts" the first k (the drafts, and the states after
    all but the last); "last" the last step alone (the states after draft k, from the
    drafts and states the "drafts" launch left): the engine launches it beside the next
    verify pass, since only a sequence that accepts all k drafts needs those states."""
    b = first.shape[0]
    if b == 0:
        return
    blocks = w.blocks
    tiles = rollout_tiles(blocks.d_model, blocks.hidden, w.vocab_size)
    chunk, head_chunk, num_stages = chunk or tiles[0], head_chunk or tiles[1], num_stages or tiles[2]
    rows, verified, best, first_limit = ahead if ahead is not None else (None, None, None, 0)
    first_step, last_step = {"all": (0, k + 1), "drafts": (0, k), "last": (k, k + 1)}[part]
    runtime.launch(draft_rollout_kernel, (runtime.cdiv(b, BLOCK_B),), launch_options(num_warps, num_stages),
                   first, src, dst, state_in, state_out, drafts, b, state_in.stride(0), state_out.stride(0),
                   w.embed, w.norm, w.head, float(w.eps),
                   blocks.norms, blocks.down_norm, blocks.scales, blocks.w_f, blocks.w_c, blocks.w_g, blocks.w_o,
                   blocks.w_gate, blocks.w_down, float(blocks.eps_norm), float(blocks.eps_bit),
                   rows, verified, 0 if verified is None else verified.stride(0), best, int(first_limit),
                   K=k, L=w.n_layers, D=blocks.d_model, H=blocks.hidden, C=chunk, V=w.vocab_size,
                   VC=head_chunk, BLOCK_B=BLOCK_B,
                   IEEE=w.head.dtype == torch.float32, AHEAD=ahead is not None and first_step == 0,
                   FIRST=first_step, LAST=last_step)


def draft_rollout(first: torch.Tensor, states: torch.Tensor, w: RolloutWeights, k: int):
    """k greedy draft tokens per row in one launch.

    Parameters
    ----------
    first : int64 [B], each row's last token (the first input of the rollout)
    states : float32 [L, B, D], each layer's state before ``first``
    w : RolloutWeights, the draft model's weights
    k : int >= 0, how many tokens to draft

    Returns
    -------
    drafts : int64 [k, B]
    states : float32 [L, B, k + 1, D], the states after each of the k + 1 steps (step k
        consumes the last draft: the state to keep when all k are accepted)
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
        raise ValueError(f"k must be an int in [0, 64], got {k!r}")
    require_tensor("first", first, ndim=1, dtype=torch.long, contiguous=False)
    L, D = w.n_layers, w.blocks.d_model
    b = first.shape[0]
    require_tensor("states", states, shape=(L, b, D), dtype=torch.float32, contiguous=False)
    require_same_device(first=first, states=states, weights=w.embed)
    require_weights_run_here(w.blocks)
    require_index_range("first", first, 0, w.vocab_size, "a token id of the draft's vocabulary")
    dev = first.device
    drafts = torch.empty((k, b), dtype=torch.long, device=dev)
    out = torch.empty((L, b * (k + 1), D), dtype=torch.float32, device=dev)
    draft_rollout_into(first.contiguous(), torch.arange(b, device=dev), torch.arange(b * (k + 1), device=dev),
                       states.contiguous(), out, w, k, drafts)
    return drafts, out.view(L, b, k + 1, D)

"""Grading of :mod:`gpulab.fused_norms` (RMSNorm + int8 quantization fused with the residual
add, and with SiLU·mul): float64 references, inputs, cases, baselines, and the specs
``add_rmsnorm_quant`` and ``silu_mul_rmsnorm_quant``, which feed their checks, their
compile checks for sm_75/80/90 and their benchmarks.

As for ``rmsnorm_quant``, a quantized output's reference is the *unrounded* y·scale: a
kernel that rounds to nearest lands within 0.5 of it. The references round where the
kernels must (the sum to x's dtype, SiLU(g) and the product to gate_up's dtype) and then
work in float64. In 16-bit dtypes SiLU(g) may round the other way (the kernel's exp is
not PyTorch's), which moves an element's y·scale by up to 127·2⁻⁷ ≈ 1.0 more in bfloat16
(0.125 in float16): there SiLU's tolerance grows by that much (float32 keeps 0.5), so its
rounding-mode mistakes are caught by the float32 cases."""
from __future__ import annotations

import importlib
import importlib.util

import torch

from ..fused_norms import (add_rmsnorm_quant, add_rmsnorm_quant_into, add_rmsnorm_quant_ref,
                           silu_mul_rmsnorm_quant, silu_mul_rmsnorm_quant_into, silu_mul_rmsnorm_quant_ref)
from ..harness.checking import Hypothesis, hypotheses_hint
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..normquant import rmsnorm_quant, round_half_away
from .normquant import rmsnorm_quant_reference

EPS = 1e-6


# -- references (float64) -------------------------------------------------------------------
def _quantized(v, weight, names=("x_q", "scale")):
    ref = rmsnorm_quant_reference(v, weight, EPS)
    return {names[0]: ref["x_q"], names[1]: ref["scale"]}


def add_rmsnorm_quant_reference(x, residual, weight) -> dict:
    """s = x + residual exactly; s_q and scale of s as stored (rounded to x's dtype)."""
    s = x.double() + residual.double()
    return {"s": s, **_quantized(s.to(x.dtype).double(), weight, ("s_q", "scale"))}


def _silu_mul(gate_up, swap=False, activation="silu", times_up=True):
    """h as the kernel forms it (each step rounded to gate_up's dtype), in float64; the
    keywords recompute it under a mistake."""
    dtype = gate_up.dtype
    g, u = gate_up.double().chunk(2, dim=-1)
    if swap:
        g, u = u, g
    act = g * torch.sigmoid(g) if activation == "silu" else torch.sigmoid(g)
    act = act.to(dtype).double()
    return (act * u).to(dtype).double() if times_up else act


def silu_mul_rmsnorm_quant_reference(gate_up, weight) -> dict:
    return _quantized(_silu_mul(gate_up), weight, ("h_q", "scale"))


# -- inputs ---------------------------------------------------------------------------------
def _norm_weight(n, dtype, device, gen):
    return (1.0 + 0.5 * torch.randn(n, generator=gen, device=device)).to(dtype)


def add_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """x with a per-row spread; the residual smaller and of another spread (attention's
    output is added to a larger residual stream); a norm weight around 1."""
    rows, cols = p["rows"], p["cols"]
    return {"x": randn((rows, cols), dtype, device, gen, scale=2.0, offset=0.1),
            "residual": randn((rows, cols), dtype, device, gen, scale=0.7),
            "weight": _norm_weight(cols, dtype, device, gen)}


def silu_mul_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """gate_up [rows, 2H]: gate spread over SiLU's curve (negative values nearly vanish),
    up of another scale; a norm weight around 1."""
    rows, hidden = p["rows"], p["hidden"]
    gate = randn((rows, hidden), torch.float32, device, gen, scale=2.5, offset=-0.3)
    up = randn((rows, hidden), torch.float32, device, gen, scale=1.2)
    return {"gate_up": torch.cat([gate, up], dim=1).to(dtype), "weight": _norm_weight(hidden, dtype, device, gen)}


# -- diagnoses: the reference recomputed under plausible mistakes -----------------------------
def _codes(v, weight, names):
    """What a kernel quantizing v computes: the codes rounded (an int8 output is compared
    within 1e-3), and the scale."""
    ref = _quantized(v, weight, names)
    return {names[0]: round_half_away(ref[names[0]]), names[1]: ref[names[1]]}


def _truncated(reference, output):
    """The codes of a kernel that casts y·scale to int8 without rounding (a cast truncates)."""
    return lambda inp: {output: torch.trunc(reference(**inp)[output])}


TRUNCATED = ("the codes are y·scale truncated toward zero (a plain cast to int8 truncates): round to the "
             "nearest integer first, halves away from zero (normquant.round_half_away_int).")

def _stored_sum(inp):
    return (inp["x"].double() + inp["residual"].double()).to(inp["x"].dtype).double()


# codes recomputed in float64 may sit across a rounding tie from a kernel's float32 ones: share 0.99
ADD_RMSNORM_QUANT_HINT = hypotheses_hint(
    Hypothesis(TRUNCATED, _truncated(add_rmsnorm_quant_reference, "s_q"), outputs=("s_q",), share=0.98),
    Hypothesis("s_q and scale quantize x alone: the residual must be added first (s = x + residual), and "
               "the sum normalised.", lambda inp: _codes(inp["x"].double(), inp["weight"], ("s_q", "scale")),
               outputs=("s_q", "scale"), share=0.99),
    Hypothesis("`s` holds x: the sum x + residual must be stored (it is the next residual), not only normalised.",
               lambda inp: {"s": inp["x"].double()}, outputs=("s",)),
    Hypothesis("`s` holds the residual alone: store x + residual.", lambda inp: {"s": inp["residual"].double()},
               outputs=("s",)),
    Hypothesis("the norm weight is not applied: y = s · rstd · weight before the absmax and the rounding.",
               lambda inp: _codes(_stored_sum(inp), torch.ones_like(inp["weight"]), ("s_q", "scale")),
               outputs=("s_q", "scale"), share=0.99),
)


def _silu_mistake(**mistake):
    return lambda inp: _codes(_silu_mul(inp["gate_up"], **mistake), inp["weight"], ("h_q", "scale"))


SILU_MUL_RMSNORM_QUANT_HINT = hypotheses_hint(
    Hypothesis(TRUNCATED, _truncated(silu_mul_rmsnorm_quant_reference, "h_q"), outputs=("h_q",), share=0.98),
    Hypothesis("gate and up are swapped: gate is the first half of each gate_up row, up the second; "
               "h = SiLU(gate) ⊙ up.", _silu_mistake(swap=True), share=0.99),
    Hypothesis("sigmoid(gate) ⊙ up: SiLU(g) = g · sigmoid(g) = g / (1 + e^(−g)).",
               _silu_mistake(activation="sigmoid"), share=0.99),
    Hypothesis("h is SiLU(gate) alone: it must be multiplied by up, the second half of the row.",
               _silu_mistake(times_up=False), share=0.99),
)


# -- cases ----------------------------------------------------------------------------------
ADD_CASES = {"cpu": [Case("one element", dict(rows=1, cols=1)), Case("odd rows", dict(rows=3, cols=7)),
                     Case("tail", dict(rows=37, cols=300))],
             "gpu": [Case("one row", dict(rows=1, cols=2048)), Case("odd rows", dict(rows=3, cols=7)),
                     Case("tail", dict(rows=1001, cols=1000)), Case("wide", dict(rows=129, cols=12345))],
             "bench": [Case("decode, 128 rows of 2048", dict(rows=128, cols=2048)),
                       Case("prefill chunk, 2048 rows of 2048", dict(rows=2048, cols=2048)),
                       Case("8192 rows of 4096", dict(rows=8192, cols=4096))]}
SILU_CASES = {"cpu": [Case("one element", dict(rows=1, hidden=1)), Case("odd rows", dict(rows=3, hidden=7)),
                      Case("tail", dict(rows=37, hidden=300))],
              "gpu": [Case("one row", dict(rows=1, hidden=5632)), Case("odd rows", dict(rows=3, hidden=7)),
                      Case("tail", dict(rows=1001, hidden=1000)), Case("wide", dict(rows=129, hidden=12345))],
              "bench": [Case("decode, 128 rows of 5632", dict(rows=128, hidden=5632)),
                        Case("prefill chunk, 2048 rows of 5632", dict(rows=2048, hidden=5632)),
                        Case("8192 rows of 14336", dict(rows=8192, hidden=14336))]}
# SiLU's tolerances. A 16-bit value rounded the other way is off by at most
# one unit in the last place, 2⁻⁷ of it in bfloat16 and 2⁻¹⁰ in float16: an element's y·scale
# (at most 127) moves by up to 127·2⁻⁷ ≈ 1.0 or 0.125 beyond rounding's 0.5, the scale by
# that share of itself where the row's largest element moved.
QUANT_TOLERANCES = {torch.float32: (0.5 + 1e-3, 0.0), torch.float16: (0.625 + 1e-3, 0.0),
                    torch.bfloat16: (1.5 + 1e-3, 0.0)}
SCALE_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1.1e-3), torch.bfloat16: (1e-5, 8e-3)}


# -- baselines ------------------------------------------------------------------------------
def unfused_add(inp):
    """What the engine ran before: PyTorch's add, then gpulab's rmsnorm_quant."""
    s = inp["x"] + inp["residual"]
    return (s, *rmsnorm_quant(s, inp["weight"], EPS))


def unfused_silu_mul(inp):
    """What the engine ran before: F.silu(gate) * up in PyTorch, then gpulab's rmsnorm_quant."""
    gate, up = inp["gate_up"].chunk(2, dim=-1)
    return rmsnorm_quant(torch.nn.functional.silu(gate) * up, inp["weight"], EPS)


# Peer rows: FlashInfer's residual add + RMSNorm (writes bf16 y, no quantization: 2 bytes an
# element where gpulab writes 1) and its SiLU·mul followed by gpulab's rmsnorm_quant. Only
# where FlashInfer is installed (pip install gpulab[peers]; on the GPU host ../shared/gpu/peers.sh).
FLASHINFER_INSTALLED = importlib.util.find_spec("flashinfer") is not None
FLASHINFER_ADD_ROW = "FlashInfer fused_add_rmsnorm (peer, norm only: writes bf16 y, in place)"
FLASHINFER_SILU_ROW = "FlashInfer silu_and_mul + gpulab rmsnorm_quant (peer)"


def flashinfer_fused_add_rmsnorm():
    """FlashInfer's in-place add + RMSNorm on copies made once per input dict (it overwrites
    both of its inputs: residual += input, input = rmsnorm(residual))."""
    state = {}

    def run(inp):
        if state.get("key") != id(inp):
            state.update(key=id(inp), attn=inp["residual"].clone(), stream=inp["x"].clone())
        importlib.import_module("flashinfer").norm.fused_add_rmsnorm(state["attn"], state["stream"],
                                                                     inp["weight"], EPS)
    run.state = state          # the copies: after a call, "stream" holds the sum, "attn" its norm
    return run


def flashinfer_silu_mul(inp):
    h = importlib.import_module("flashinfer").activation.silu_and_mul(inp["gate_up"])
    return rmsnorm_quant(h, inp["weight"], EPS)


# -- specs ----------------------------------------------------------------------------------
ADD_RMSNORM_QUANT = KernelSpec(
    name="add_rmsnorm_quant",
    summary="s = x + residual stored, and s's RMSNorm + per-row absmax int8 quantization, in one kernel",
    args=("x", "residual", "weight", "s", "s_q", "scale"),
    make_inputs=add_inputs,
    reference=add_rmsnorm_quant_reference,
    outputs=lambda inp, dtype: {"s": (inp["x"].shape, dtype), "s_q": (inp["x"].shape, torch.int8),
                                "scale": ((inp["x"].shape[0],), torch.float32)},
    implementation=add_rmsnorm_quant_into,
    cases=ADD_CASES,
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.float16, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1e-3), torch.bfloat16: (1e-5, 8e-3)},
    # the sum rounds as PyTorch's add does, so its codes are within rounding's 0.5 in every dtype
    output_tolerances={"s_q": {torch.float32: (0.5 + 1e-3, 0.0)}, "scale": {torch.float32: (1e-5, 1e-5)}},
    bytes_moved=lambda p, dtype: p["rows"] * p["cols"] * (3 * bytes_of(dtype) + 1) + 4 * p["rows"],
    flops=lambda p, dtype: 9 * p["rows"] * p["cols"],
    bench_impl=lambda inp: add_rmsnorm_quant(inp["x"], inp["residual"], inp["weight"], EPS),
    baselines={"unfused: torch add + gpulab rmsnorm_quant": unfused_add,
               "torch (add_rmsnorm_quant_ref)": lambda inp: add_rmsnorm_quant_ref(inp["x"], inp["residual"],
                                                                                inp["weight"], EPS),
               **({FLASHINFER_ADD_ROW: flashinfer_fused_add_rmsnorm()} if FLASHINFER_INSTALLED else {})},
    compile_baselines=("torch (add_rmsnorm_quant_ref)",),
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("x", "residual", "weight"),
    hint=ADD_RMSNORM_QUANT_HINT,
    notes="gpulab = add_rmsnorm_quant as called (s into a new tensor); the engine's "
          "TransformerBlock.post_attention_fused calls its launcher for gate_up's input.",
)

SILU_MUL_RMSNORM_QUANT = KernelSpec(
    name="silu_mul_rmsnorm_quant",
    summary="h = SiLU(gate) ⊙ up of a gated MLP's [gate, up] rows, RMSNorm-ed and int8-quantized in one kernel",
    args=("gate_up", "weight", "h_q", "scale"),
    make_inputs=silu_mul_inputs,
    reference=silu_mul_rmsnorm_quant_reference,
    outputs=lambda inp, dtype: {"h_q": ((inp["gate_up"].shape[0], inp["gate_up"].shape[1] // 2), torch.int8),
                                "scale": ((inp["gate_up"].shape[0],), torch.float32)},
    implementation=silu_mul_rmsnorm_quant_into,
    cases=SILU_CASES,
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.float16, torch.bfloat16]},
    tolerances=SCALE_TOLERANCES,
    output_tolerances={"h_q": QUANT_TOLERANCES},
    bytes_moved=lambda p, dtype: p["rows"] * p["hidden"] * (2 * bytes_of(dtype) + 1) + 4 * p["rows"],
    flops=lambda p, dtype: 14 * p["rows"] * p["hidden"],
    bench_impl=lambda inp: silu_mul_rmsnorm_quant(inp["gate_up"], inp["weight"], EPS),
    baselines={"unfused: torch F.silu(gate) * up + gpulab rmsnorm_quant": unfused_silu_mul,
               "torch (silu_mul_rmsnorm_quant_ref)": lambda inp: silu_mul_rmsnorm_quant_ref(inp["gate_up"],
                                                                                          inp["weight"], EPS),
               **({FLASHINFER_SILU_ROW: flashinfer_silu_mul} if FLASHINFER_INSTALLED else {})},
    compile_baselines=("torch (silu_mul_rmsnorm_quant_ref)",),
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("gate_up", "weight"),
    hint=SILU_MUL_RMSNORM_QUANT_HINT,
    notes="gpulab = silu_mul_rmsnorm_quant as called; the engine's TransformerBlock.post_attention_fused "
          "calls its launcher for down_proj's input.",
)

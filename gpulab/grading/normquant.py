"""Grading of notebook 02 (:mod:`gpulab.normquant`): float64 references, inputs, cases,
baselines, the specs ``rmsnorm_quant``, ``rmsnorm_quant_bwd`` and ``rmsnorm_fakequant_fwd``,
and the activation-memory comparison.

gpulab's int8 poison, -128, is a value absmax quantization never writes, so an
unwritten ``x_q`` element is always recognised."""
from __future__ import annotations

import importlib.util

import torch

from ..harness import memory
from ..harness.checking import Hypothesis, hypotheses_hint, rounding_tolerance
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..normquant import (ABSMAX_FLOOR, RMSNormFakeQuant, rmsnorm_fakequant, rmsnorm_fakequant_fwd_into,
                         rmsnorm_quant_bwd_partials_into,
                         rmsnorm_fakequant_ref, rmsnorm_quant, rmsnorm_quant_bwd_into, rmsnorm_quant_into,
                         rmsnorm_quant_ref, round_half_away)


# -- references (float64) -----------------------------------------------------------------
def rmsnorm_quant_reference(x, weight, eps=1e-6):
    """``x_q`` is the *unrounded* y·scale: any kernel that rounds to nearest lands within
    0.5 of it (the tolerance), whatever its summation order, while truncation or a wrong
    scale do not."""
    xd, wd = x.double(), weight.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    y = xd * rstd * wd
    scale = 127.0 / y.abs().amax(-1, keepdim=True).clamp_min(ABSMAX_FLOOR)
    # scale first: a NaN read past a row shows there with the clearest hint
    return {"scale": scale.squeeze(-1), "x_q": y * scale}


def rmsnorm_quant_bwd_reference(x, weight, rstd, dy):
    xd, wd, dyd = x.double(), weight.double(), dy.double()
    xhat = xd * rstd.double()[:, None]
    g = dyd * wd
    dx = (g - xhat * (xhat * g).mean(-1, keepdim=True)) * rstd.double()[:, None]
    return {"dx": dx, "dw": (dyd * xhat).sum(0)}


def rmsnorm_fakequant_fwd_reference(x, weight):
    ref = rmsnorm_quant_reference(x, weight)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
    return {"y": round_half_away(ref["x_q"]) / ref["scale"][:, None], "rstd": rstd}


# -- diagnoses: the reference recomputed under plausible mistakes ----------------------
def _block_of(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _quant_variant(x, weight, eps=1e-6, *, mean_over=None, weight_in_y=True, absmax_floor=ABSMAX_FLOOR,
                   absmax_of_x=False):
    xd, wd = x.double(), weight.double()
    n = mean_over or x.shape[-1]
    ms = xd.pow(2).sum(-1, keepdim=True) / n
    rstd = torch.rsqrt(ms + eps)
    y = xd * rstd * (wd if weight_in_y else 1.0)
    amax = (xd * rstd if absmax_of_x else y).abs().amax(-1, keepdim=True)
    if absmax_floor:
        amax = amax.clamp_min(absmax_floor)
    scale = 127.0 / amax
    return {"scale": scale.squeeze(-1), "x_q": y * scale}


def _rounded(fn):
    def answer(inp):
        return {"x_q": fn(rmsnorm_quant_reference(**inp)["x_q"])}
    return answer


def _zero_rows_hint(output, got, expected, inputs):
    """Only the rows of zeros (which the inputs hold on purpose) are wrong."""
    x = inputs["x"]
    zero = (x == 0).all(-1).cpu()
    if x.shape[0] < 2 or not bool(zero.any()) or bool(zero.all()):
        return None
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    atol, rtol = (0.5 + 1e-3, 0.0) if output == "x_q" else (1e-5, 1e-4)
    bad = ~torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=True)
    rows_bad = bad.reshape(bad.shape[0], -1).any(-1)
    if bool(rows_bad.any()) and bool((rows_bad == zero).all()):
        return (f"only the rows of zeros ({', '.join(map(str, zero.nonzero().flatten().tolist()[:4]))}) are "
                f"wrong: there rstd = 1/sqrt(0 + eps) needs its eps inside the root (without it 0 · ∞ = NaN, "
                f"which a conversion to int8 turns into an arbitrary value), and the absmax needs its floor.")
    return None


RMSNORM_QUANT_HINT = hypotheses_hint(
    Hypothesis("x_q is y·scale truncated toward zero (a plain cast to int8 truncates): round to the "
               "nearest integer first, e.g. floor(v + 0.5) for v ≥ 0 and ceil(v - 0.5) below.",
               _rounded(torch.trunc), outputs=("x_q",), atol=1e-3, share=0.98),
    Hypothesis("x_q is y·scale rounded down (floor): round to the nearest integer instead, "
               "halves away from zero (floor(v + 0.5) for v ≥ 0, ceil(v - 0.5) below).",
               _rounded(torch.floor), outputs=("x_q",), atol=1e-3, share=0.98),
    Hypothesis("the mean of x² is divided by the block size, not by the row length: masked lanes are "
               "zeros, so sum(x²) is right, but the mean is sum / n_cols.",
               lambda inp: _quant_variant(inp["x"], inp["weight"], mean_over=_block_of(inp["x"].shape[-1]))
               if inp["x"].shape[-1] != _block_of(inp["x"].shape[-1]) else None),
    Hypothesis("the norm weight is not applied: y = x · rstd · weight, then the absmax of y.",
               lambda inp: _quant_variant(inp["x"], inp["weight"], weight_in_y=False), outputs=("x_q",)),
    Hypothesis("the scale is 127 / absmax(x · rstd), without the weight: either the norm weight is not "
               "applied at all, or the absmax is taken before the weight is applied; the scale must come "
               "from y = x · rstd · weight, the values being quantized.",
               lambda inp: _quant_variant(inp["x"], inp["weight"], absmax_of_x=True), outputs=("scale",)),
    Hypothesis("a row of zeros has absmax 0 and its scale 127/0 is infinite: floor the absmax "
               "(max(absmax, 1e-5)) before dividing.",
               lambda inp: _quant_variant(inp["x"], inp["weight"], absmax_floor=0.0), outputs=("scale",)),
    Hypothesis("rows of zeros come out NaN: rstd = 1/sqrt(mean(x²) + eps) needs eps inside the root "
               "(without it a row of zeros gives 0 · ∞).",
               lambda inp: _quant_variant(inp["x"], inp["weight"], eps=0.0)),
    then=_zero_rows_hint,
)


def _bwd_parts(x, weight, rstd, dy):
    xd, wd, dyd = x.double(), weight.double(), dy.double()
    r = rstd.double()[:, None]
    xhat = xd * r
    g = dyd * wd
    return xd, wd, dyd, r, xhat, g


def _bwd_variant(kind):
    def answer(inp):
        x, w, dy, r, xhat, g = _bwd_parts(inp["x"], inp["weight"], inp["rstd"], inp["dy"])
        n = x.shape[-1]
        if kind == "no mean term":
            return {"dx": g * r}
        if kind == "no rstd":
            return {"dx": g - xhat * (xhat * g).mean(-1, keepdim=True)}
        if kind == "no weight":
            return {"dx": (dy - xhat * (xhat * dy).mean(-1, keepdim=True)) * r}
        if kind == "block mean":
            b = _block_of(n)
            return None if b == n else {"dx": (g - xhat * (xhat * g).sum(-1, keepdim=True) / b) * r}
        if kind == "x for xhat":
            return {"dw": (dy * x).sum(0)}
        if kind == "dw not summed":
            return None
    return answer


def _dw_one_row(output, got, expected, inputs):
    """dw equal to one row's partial dy · x̂ (each program overwrote it)."""
    if output != "dw" or inputs["x"].shape[0] < 2:
        return None
    x, w, dy, r, xhat, g = _bwd_parts(inputs["x"], inputs["weight"], inputs["rstd"], inputs["dy"])
    parts = dy * xhat
    gd = got.detach().double().cpu()
    for row in range(parts.shape[0]):
        if torch.allclose(gd, parts[row].cpu(), *rounding_tolerance(got.dtype, 1e-3, 1e-3)):
            return (f"dw equals row {row}'s partial dy · x̂ alone: every program wrote its row's "
                    f"partial over the same dw; dw sums the partials over all rows (store per-row "
                    f"partials and sum them, or accumulate with tl.atomic_add).")
    return None


RMSNORM_QUANT_BWD_HINT = hypotheses_hint(
    Hypothesis("dx lacks the term through rstd: dx = (g - x̂ · mean(x̂ · g)) · rstd with g = dy · weight, "
               "not g · rstd alone.", _bwd_variant("no mean term"), outputs=("dx",)),
    Hypothesis("dx misses the final factor rstd: dx = (g - x̂ · mean(x̂ · g)) · rstd.",
               _bwd_variant("no rstd"), outputs=("dx",)),
    Hypothesis("the norm weight is missing from dx: g = dy · weight, then dx = (g - x̂ · mean(x̂ · g)) · rstd.",
               _bwd_variant("no weight"), outputs=("dx",)),
    Hypothesis("the mean of x̂ · g is divided by the block size, not by the row length (masked lanes "
               "are zeros: divide the sum by n_cols).", _bwd_variant("block mean"), outputs=("dx",)),
    Hypothesis("dw sums dy · x, not dy · x̂: normalise x first (x̂ = x · rstd).",
               _bwd_variant("x for xhat"), outputs=("dw",)),
    then=_dw_one_row,
)


# -- inputs -------------------------------------------------------------------------------
def _rows_inputs(p, dtype, device, gen):
    x = randn((p["rows"], p["cols"]), dtype, device, gen, scale=2.0, offset=0.1)
    if p["rows"] > 2:                              # one row of zeros: scale hits its floor
        x[p["rows"] // 2] = 0
    w = (1.0 + 0.5 * torch.randn(p["cols"], generator=gen, device=device)).to(dtype)
    return {"x": x, "weight": w}


def _bwd_inputs(p, dtype, device, gen):
    inp = _rows_inputs(p, dtype, device, gen)
    x = inp["x"]
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6).float()
    dy = randn(x.shape, dtype, device, gen, scale=0.5)
    return {**inp, "rstd": rstd, "dy": dy}


# -- cases --------------------------------------------------------------------------------
ROW_CASES_CPU = [Case("one element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                 Case("tail", dict(rows=37, cols=300)), Case("many short rows", dict(rows=130, cols=33))]
ROW_CASES_GPU = [Case("one element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                 Case("tail", dict(rows=1000, cols=1000)), Case("wide", dict(rows=129, cols=12345)),
                 Case("many short rows", dict(rows=5000, cols=96))]


# -- baselines ----------------------------------------------------------------------------
def _fused_train_step(inp):
    x = inp["x"].detach().requires_grad_()
    w = inp["weight"].detach().requires_grad_()
    RMSNormFakeQuant.apply(x, w, 1e-6).backward(inp["dy"])
    return x.grad, w.grad


def _eager_train_step(inp):
    x = inp["x"].detach().requires_grad_()
    w = inp["weight"].detach().requires_grad_()
    rmsnorm_fakequant_ref(x, w, 1e-6).backward(inp["dy"])
    return x.grad, w.grad


def _launcher_outputs_preallocated():
    """A benchmark row beside the public function as called: ``rmsnorm_quant_into`` with
    its outputs allocated once per input dict."""
    state = {}

    def run(inp):
        if state.get("key") != id(inp):
            x = inp["x"]
            state.update(key=id(inp), x_q=torch.empty(x.shape, dtype=torch.int8, device=x.device),
                         scale=torch.empty(x.shape[0], dtype=torch.float32, device=x.device))
        rmsnorm_quant_into(inp["x"], inp["weight"], state["x_q"], state["scale"])
    return run


LAUNCHER_ROW = "rmsnorm_quant_into (launcher, outputs preallocated)"

# Norm-only peers: RMSNorm without the quantization, writing y in x's dtype (2 bytes an element
# where rmsnorm_quant writes 1, so their GB/s and roofline columns, computed on
# rmsnorm_quant's bytes, understate them). They show how close a plain row-per-program
# norm gets to the bandwidth on the same shape. Liger-Kernel: pip install gpulab[peers].
LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None
LIGER_ROW = "Liger-Kernel RMSNorm (peer, norm only: writes bf16 y)"
NORM_ONLY_ROW = "torch F.rms_norm (norm only: writes bf16 y)"


def liger_rms_norm(inp):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return LigerRMSNormFunction.apply(inp["x"], inp["weight"], 1e-6, 0.0, "llama", False)


def _norm_only(inp):
    return torch.nn.functional.rms_norm(inp["x"], (inp["x"].shape[-1],), inp["weight"], 1e-6)


# -- specs --------------------------------------------------------------------------------
RMSNORM_QUANT = KernelSpec(
    name="rmsnorm_quant",
    summary="fused RMSNorm + per-row absmax int8 quantization",
    args=("x", "weight", "x_q", "scale"),
    make_inputs=_rows_inputs,
    reference=rmsnorm_quant_reference,
    outputs=lambda inp, dtype: {"x_q": (inp["x"].shape, torch.int8),
                                "scale": ((inp["x"].shape[0],), torch.float32)},
    implementation=rmsnorm_quant_into,
    cases={"cpu": ROW_CASES_CPU, "gpu": ROW_CASES_GPU,
           "bench": [Case("8192x8192", dict(rows=8192, cols=8192)),
                     Case("8192x4096", dict(rows=8192, cols=4096)),
                     Case("4096x14336", dict(rows=4096, cols=14336))]},
    dtypes={"cpu": [torch.float32, torch.float16, torch.bfloat16],
            "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5)},
    # x_q is compared with the unrounded y·scale: rounding to nearest is within 0.5.
    output_tolerances={"x_q": {torch.float32: (0.5 + 1e-3, 0.0)}},
    bytes_moved=lambda p, dtype: p["rows"] * p["cols"] * (bytes_of(dtype) + 1) + 4 * p["rows"],
    flops=lambda p, dtype: 8 * p["rows"] * p["cols"],
    # benchmarks lead with the public function as a user calls it (outputs allocated per call)
    bench_impl=lambda inp: rmsnorm_quant(inp["x"], inp["weight"]),
    baselines={LAUNCHER_ROW: _launcher_outputs_preallocated(),
               "torch": lambda inp: rmsnorm_quant_ref(inp["x"], inp["weight"]),
               NORM_ONLY_ROW: _norm_only, **({LIGER_ROW: liger_rms_norm} if LIGER_INSTALLED else {})},
    compile_baselines=("torch", NORM_ONLY_ROW),
    bench_dtypes=[torch.bfloat16],
    read_inputs=("x", "weight"),
    hint=RMSNORM_QUANT_HINT,
    notes="gpulab = rmsnorm_quant as called; x_q's reference is the unrounded y·scale; an int8 "
          "within 0.5 of it is correct.",
)

RMSNORM_QUANT_BWD = KernelSpec(
    name="rmsnorm_quant_bwd",
    summary="straight-through backward of RMSNorm + fake quantization (dx, dw)",
    args=("x", "weight", "rstd", "dy", "dx", "dw"),
    make_inputs=_bwd_inputs,
    reference=rmsnorm_quant_bwd_reference,
    outputs=lambda inp, dtype: {"dx": (inp["x"].shape, dtype), "dw": ((inp["x"].shape[1],), torch.float32)},
    implementation=rmsnorm_quant_bwd_into,
    cases={"cpu": ROW_CASES_CPU, "gpu": ROW_CASES_GPU,
           # fwd+bwd timing, against eager autograd through the reference (see bench_impl)
           "bench": [Case("8192x4096 fwd+bwd", dict(rows=8192, cols=4096))]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)},
    # per row: fwd reads x, writes ŷ and rstd; bwd reads x, dy, rstd and writes dx
    bytes_moved=lambda p, dtype: 5 * p["rows"] * p["cols"] * bytes_of(dtype),
    flops=lambda p, dtype: 20 * p["rows"] * p["cols"],
    baselines={"torch eager autograd": _eager_train_step},
    bench_impl=_fused_train_step,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("x", "weight", "rstd", "dy"),
    hint=RMSNORM_QUANT_BWD_HINT,
)

RMSNORM_FAKEQUANT_FWD = KernelSpec(
    name="rmsnorm_fakequant_fwd",
    summary="training forward: RMSNorm + fake quantization, stores ŷ and rstd",
    args=("x", "weight", "y", "rstd"),
    make_inputs=_rows_inputs,
    reference=rmsnorm_fakequant_fwd_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype), "rstd": ((inp["x"].shape[0],), torch.float32)},
    implementation=rmsnorm_fakequant_fwd_into,
    cases={"cpu": ROW_CASES_CPU, "gpu": ROW_CASES_GPU, "bench": []},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    # ŷ = q/scale: a rounding tie resolved differently moves one element by 1/scale
    # (≤ 1/127 of the row's absmax): allowed through atol relative to the data.
    tolerances={torch.float32: (0.1, 1e-5), torch.float16: (0.1, 2e-3), torch.bfloat16: (0.1, 1e-2)},
    read_inputs=("x", "weight"),
)


# -- activation memory (measured like a benchmark) ----------------------------------------
def activation_memory(save: bool = False) -> dict:
    """Activation memory of RMSNorm + fake quantization, 8192 tokens × 4096, bf16:
    autograd through the reference against the fused kernels. Measured on a GPU
    (``save=True`` writes it to the repo); on a CPU, the figures saved from an H200."""
    return memory.activation_memory(
        "rmsnorm_fakequant", "RMSNorm + fake quantization forward and backward, 8192 x 4096 bfloat16",
        {"autograd through the reference": rmsnorm_fakequant_ref,
         "fused (gpulab)": lambda x, w: rmsnorm_fakequant(x, w, fused=True)},
        rows=8192, cols=4096, dtype=torch.bfloat16, save=save)


# -- the backward with a grouped reduction of the weight gradient ------------------------------
def rmsnorm_quant_bwd_grouped_reference(x, weight, rstd, dy, groups):
    ref = rmsnorm_quant_bwd_reference(x, weight, rstd, dy)
    xhat = x.double() * rstd.double()[:, None]
    terms = dy.double() * xhat                                   # one dw term per row
    part = torch.zeros(groups, x.shape[1], dtype=torch.float64, device=x.device)
    part.index_add_(0, torch.arange(x.shape[0], device=x.device) % groups, terms)
    return {"dx": ref["dx"], "dw_part": part}


def _grouped_hint(name, got, expected, inputs):
    """Two grouping mistakes with their own message: contiguous chunks of rows per group,
    and a partial row overwritten by each row's term instead of accumulated."""
    if name != "dw_part" or got.shape != expected.shape:
        return None
    x, groups = inputs["x"], inputs["groups"]
    rows = x.shape[0]
    terms = inputs["dy"].double() * x.double() * inputs["rstd"].double()[:, None]
    chunk = -(-rows // groups)
    chunks = torch.zeros_like(expected)
    chunks.index_add_(0, torch.arange(rows, device=x.device) // chunk, terms)
    last = torch.zeros_like(expected)
    for r in range(rows):
        last[r % groups] = terms[r]

    def close(a):
        return bool(torch.allclose(got.double(), a, *rounding_tolerance(got.dtype, 1e-3, 1e-3)))
    if close(chunks):
        return ("each group summed a contiguous chunk of rows; the contract is rows g, g + G, "
                "g + 2G, ... in group g (loop `for row in range(group, n_rows, n_groups)`).")
    if close(last):
        return ("dw_part[g] holds only the last row's term of group g: accumulate the terms "
                "(dw += dy * xhat) in a float32 vector and store it once, after the loop.")
    return None


def _grouped_inputs(p, dtype, device, gen):
    return {**_bwd_inputs(p, dtype, device, gen), "groups": p["groups"]}


RMSNORM_QUANT_BWD_GROUPED = KernelSpec(
    name="rmsnorm_quant_bwd_grouped",
    summary="RMSNorm + fake-quant backward, dw reduced in G groups: dw_part[g] sums rows r ≡ g (mod G)",
    args=("x", "weight", "rstd", "dy", "dx", "dw_part"),
    make_inputs=_grouped_inputs,
    reference=lambda x, weight, rstd, dy, groups: rmsnorm_quant_bwd_grouped_reference(x, weight, rstd, dy, groups),
    outputs=lambda inp, dtype: {"dx": (inp["x"].shape, dtype),
                                "dw_part": ((inp["groups"], inp["x"].shape[1]), torch.float32)},
    implementation=rmsnorm_quant_bwd_partials_into,
    cases={"cpu": [Case("one element", dict(rows=1, cols=1, groups=1)),
                   Case("odd rows, 2 groups", dict(rows=5, cols=7, groups=2)),
                   Case("tail, 4 groups", dict(rows=37, cols=300, groups=4)),
                   Case("more groups than rows", dict(rows=3, cols=33, groups=4))],
           "gpu": [Case("one element", dict(rows=1, cols=1, groups=1)),
                   Case("tail", dict(rows=1000, cols=1000, groups=64)),
                   Case("wide", dict(rows=129, cols=12345, groups=16))],
           "bench": [Case("8192x4096, 528 groups", dict(rows=8192, cols=4096, groups=528))]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)},
    # reads x, dy (rows x cols), rstd and w; writes dx and G partial rows of dw in float32
    bytes_moved=lambda p, dtype: (3 * p["rows"] * p["cols"] + p["cols"]) * bytes_of(dtype)
    + 4 * p["rows"] + 4 * p["groups"] * p["cols"],
    flops=lambda p, dtype: 10 * p["rows"] * p["cols"],
    read_inputs=("x", "weight", "rstd", "dy"),
    axes={"dx": ("row", "col"), "dw_part": ("group", "col")},
    hint=_grouped_hint,
)

"""Grading of notebook 01 (:mod:`gpulab.bitlinear`): float64 references, inputs, cases,
baselines and the specs ``ternary_quantize``, ``pack_ternary``, ``ternary_gemv``,
``ternary_gemv_x16`` and ``ternary_mm_x16`` (the same products on the int32x16 layout),
``ternary_mm`` and ``ternary_matmul``."""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
import triton

from ..bitlinear import (WEIGHT_FLOOR, pack_ternary, pack_ternary_x16, ternary_gemv_into,
                         ternary_gemv_x16_into, ternary_matmul, ternary_matmul_into, ternary_matmul_ref,
                         ternary_mm_into, ternary_mm_small_into, ternary_mm_unpacked_into, ternary_mm_x16_into,
                         ternary_quantize, unpack_ternary, unpack_ternary_x16)
from ..harness.checking import Hypothesis, hypotheses_hint
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..normquant import absmax_quantize


# -- references (float64) -----------------------------------------------------------------
def ternary_quantize_reference(w):
    wd = w.double()
    s = 1.0 / wd.abs().mean().clamp_min(WEIGHT_FLOOR)
    # unrounded, clamped: rounding to nearest lands within 0.5
    return {"w_scale": s, "w_t": (wd * s).clamp(-1, 1)}


def pack_ternary_reference(w_t):
    return {"packed": pack_ternary(w_t)}


def ternary_matmul_reference(x_q, x_scale, w_packed, w_scale, **_):
    # from the packed weights, so zeroing them shows; int32 words are the int32x16 layout
    unpack = unpack_ternary_x16 if w_packed.dtype == torch.int32 else unpack_ternary
    w_t = unpack(w_packed, x_q.shape[1])
    return {"y": ternary_matmul_ref(x_q, x_scale, w_t, w_scale)}


# -- diagnoses: the references recomputed under plausible mistakes ----------------------
def _all_zero_weights(inputs, params, dtype, gen):
    """all-zero weights: mean|w| = 0, the scale needs its floor"""
    return {**inputs, "w": torch.zeros_like(inputs["w"])}


TERNARY_QUANTIZE_HINT = hypotheses_hint(
    Hypothesis("w_t is w · scale truncated toward zero (a plain cast to int8 truncates): round to the nearest "
               "integer first (halves away from zero), then clamp to [-1, 1].",
               lambda inp: {"w_t": torch.trunc(ternary_quantize_reference(**inp)["w_t"])}, outputs=("w_t",),
               share=0.98),
    Hypothesis("all-zero weights give mean|w| = 0 and an infinite scale: floor the mean before inverting it "
               "(1 / max(mean|w|, 1e-5)).",
               lambda inp: {"w_scale": torch.tensor(math.inf, dtype=torch.float64)} if not bool(inp["w"].any())
               else None, outputs=("w_scale",)),
)


def pack_variant(w_t, *, offset=1, layout="quarters", high_first=False):
    """pack_ternary with one mistake: codes w + ``offset``, four consecutive weights per
    byte (``layout="consecutive"``) instead of quarters, or quarter 0 in the high bits."""
    n, k = w_t.shape
    q = triton.cdiv(k, 4)
    codes = torch.ones((n, 4 * q), dtype=torch.uint8, device=w_t.device)
    codes[:, :k] = (w_t + offset).to(torch.uint8)
    c = codes.view(n, q, 4).transpose(1, 2) if layout == "consecutive" else codes.view(n, 4, q)
    if high_first:
        return (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


PACK_TERNARY_HINT = hypotheses_hint(
    Hypothesis("the codes are the weights themselves: a weight w in {-1, 0, 1} is stored as the code w + 1 "
               "in {0, 1, 2}.", lambda inp: {"packed": pack_variant(inp["w_t"], offset=0)}, atol=0, rtol=0),
    Hypothesis("byte j holds four consecutive weights (4j .. 4j+3): the layout is by quarters, byte j holds "
               "weights j, j + Q, j + 2Q, j + 3Q (Q = ceil(K/4)).",
               lambda inp: {"packed": pack_variant(inp["w_t"], layout="consecutive")}, atol=0, rtol=0),
    Hypothesis("the quarters are in the wrong bits: quarter i goes to bits 2i..2i+1 (quarter 0 in the low "
               "bits: code0 | code1 << 2 | code2 << 4 | code3 << 6).",
               lambda inp: {"packed": pack_variant(inp["w_t"], high_first=True)}, atol=0, rtol=0),
)


def _gemv_variant(kind):
    def answer(inp):
        packed, k = inp["w_packed"], inp["x_q"].shape[1]
        n, q = packed.shape
        if kind == "q floor":                   # Q = K // 4: every row and quarter indexed with it
            q2 = k // 4
            if q2 == q or q2 == 0:
                return None
            flat = packed.flatten()[:n * q2].view(n, q2).long()
            w = torch.zeros((n, k), dtype=torch.long)
            for i in range(4):
                w[:, i * q2:(i + 1) * q2] = ((flat >> (2 * i)) & 3) - 1
            w_t = w
        else:
            shifts = torch.arange(4) * (1 if kind == "shift i" else 2)
            codes = (packed.long()[:, None, :] >> shifts[None, :, None]) & 3
            w_t = codes.reshape(n, -1)[:, :k] - (0 if kind == "no -1" else 1)
        return {"y": ternary_matmul_ref(inp["x_q"], inp["x_scale"], w_t, inp["w_scale"])}
    return answer


TERNARY_GEMV_HINT = hypotheses_hint(
    Hypothesis("quarter i is shifted by i bits: each weight takes 2 bits, quarter i sits at bits 2i..2i+1 "
               "((byte >> 2i) & 3).", _gemv_variant("shift i")),
    Hypothesis("the codes are used as weights: a code c in {0, 1, 2} stands for the weight c - 1.",
               _gemv_variant("no -1")),
    Hypothesis("the packed row length is taken as K // 4: it is Q = ceil(K/4) bytes (the last byte holds "
               "the tail and padding); index rows and quarters with Q.", _gemv_variant("q floor")),
)


# -- inputs -------------------------------------------------------------------------------
def _quantize_inputs(p, dtype, device, gen):
    return {"w": randn((p["n"], p["k"]), dtype, device, gen, scale=0.02)}


def _pack_inputs(p, dtype, device, gen):
    w = randn((p["n"], p["k"]), torch.float32, device, gen)
    return {"w_t": ternary_quantize(w)[0]}


def _matmul_inputs(p, dtype, device, gen):
    m, k, n = p["m"], p["k"], p["n"]
    x = randn((m, k), torch.float32, device, gen)
    x_q, x_scale = absmax_quantize(x)
    w = randn((n, k), torch.float32, device, gen)
    w = w * (torch.rand((n, k), generator=gen, device=device) > 0.3)     # extra zeros
    w_t, w_scale = ternary_quantize(w)
    return {"x_q": x_q.contiguous(), "x_scale": x_scale.float().contiguous(),
            "w_packed": pack_ternary(w_t), "w_scale": w_scale.reshape(1).float(),
            # the same product in bf16, for the F.linear baseline
            "x_bf16": (x_q.float() / x_scale[:, None]).to(torch.bfloat16),
            "w_bf16": (w_t.float() / w_scale).to(torch.bfloat16)}


def _x16_inputs(p, dtype, device, gen):
    inp = _matmul_inputs(p, dtype, device, gen)
    inp["w_packed"] = pack_ternary_x16(unpack_ternary(inp["w_packed"], p["k"]))
    return inp


def _x16_extremes(inp, params, dtype, gen):
    """All weights +1 in odd rows and -1 in even rows, x at -128 and +127: the largest
    bytes (code 2 in the top lane is 128) and the largest sums the int32x16 GEMV meets."""
    m, k = inp["x_q"].shape
    n = inp["w_packed"].shape[0]
    dev = inp["x_q"].device
    x_q = torch.where(torch.arange(k, device=dev) % 3 == 0, 127, -128).to(torch.int8).expand(m, k).contiguous()
    w_t = torch.where(torch.arange(n, device=dev) % 2 == 1, 1, -1).to(torch.int8)[:, None].expand(n, k).contiguous()
    return {**inp, "x_q": x_q, "w_packed": pack_ternary_x16(w_t)}


def _matmul_outputs(inp, dtype):
    return {"y": ((inp["x_q"].shape[0], inp["w_packed"].shape[0]), dtype)}


def _x16_bytes(p, dtype):
    return 4 * p["n"] * triton.cdiv(p["k"], 16) + p["m"] * p["k"] + 4 * p["m"] + p["m"] * p["n"] * bytes_of(dtype)


def _matmul_bytes(p, dtype):
    return p["n"] * triton.cdiv(p["k"], 4) + p["m"] * p["k"] + 4 * p["m"] + p["m"] * p["n"] * bytes_of(dtype)


# -- baselines ----------------------------------------------------------------------------
def _bf16_linear(inp):
    """The same product as a bf16 F.linear."""
    return F.linear(inp["x_bf16"], inp["w_bf16"])


def _int_mm_unpacked(inp):
    """cuBLAS's int8 GEMM (torch._int_mm) on weights unpacked beforehand, outside the
    timing, then the same scaling: the peer for the GEMM part of the unpacked path."""
    if "_w_int8" not in inp:
        inp["_w_int8"] = unpack_ternary(inp["w_packed"], inp["x_q"].shape[1]).to(torch.int8).t()
    acc = torch._int_mm(inp["x_q"], inp["_w_int8"])
    return (acc.float() / (inp["x_scale"][:, None] * inp["w_scale"])).to(torch.bfloat16)


# gemlite's 2-bit weight-only kernels are the peer (pip install gpulab[peers]): bf16 x times
# the same ternary weights stored as codes w + 1 with zero point 1 and one scale per output
# row; the layer is built once per input dict, outside the timing.
GEMLITE_INSTALLED = importlib.util.find_spec("gemlite") is not None
GEMLITE_ROW = "gemlite A16W2 (peer: bf16 x, 2-bit weights)"


def gemlite_w2(inp):
    if "_gemlite" not in inp:
        from gemlite.helper import A16W2_HQQ_INT
        w_t = unpack_ternary(inp["w_packed"], inp["x_q"].shape[1])
        n = w_t.shape[0]
        scales = (1.0 / inp["w_scale"]).expand(n).reshape(n, 1).to(torch.bfloat16)
        zeros = torch.ones(n, 1, dtype=torch.bfloat16, device=w_t.device)
        inp["_gemlite"] = A16W2_HQQ_INT(device=w_t.device, dtype=torch.bfloat16).from_weights(
            (w_t + 1).to(torch.uint8), scales, zeros)
    return inp["_gemlite"](inp["x_bf16"])


def _bench_with(launcher):
    """Benchmark callable: bf16 output allocated once per input dict, outside the timing
    (the default would take the output dtype from x_q, which is int8)."""
    def run(inp):
        if "_y" not in inp:
            inp["_y"] = torch.empty((inp["x_q"].shape[0], inp["w_packed"].shape[0]),
                                    dtype=torch.bfloat16, device=inp["x_q"].device)
        launcher(inp["x_q"], inp["x_scale"], inp["w_packed"], inp["w_scale"], inp["_y"])
        return inp["_y"]
    return run


# -- specs --------------------------------------------------------------------------------
TERNARY_QUANTIZE = KernelSpec(
    name="ternary_quantize",
    summary="per-tensor absmean ternary quantization (PyTorch)",
    args=("w",),
    make_inputs=_quantize_inputs,
    reference=ternary_quantize_reference,
    returns=("w_t", "w_scale"),
    implementation=ternary_quantize,
    cases={"cpu": [Case("1x1", dict(n=1, k=1)), Case("odd", dict(n=7, k=33)), Case("wide", dict(n=64, k=1000))],
           "gpu": [Case("1x1", dict(n=1, k=1)), Case("odd", dict(n=7, k=33)), Case("big", dict(n=1024, k=4099))],
           "bench": []},
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-6, 1e-5)},
    output_tolerances={"w_t": {torch.float32: (0.5 + 1e-3, 0.0)}},
    read_inputs=("w",),
    hint=TERNARY_QUANTIZE_HINT,
    edge_data=_all_zero_weights,
)

PACK_TERNARY = KernelSpec(
    name="pack_ternary",
    summary="2-bit packing of ternary weights (PyTorch)",
    args=("w_t",),
    make_inputs=_pack_inputs,
    reference=pack_ternary_reference,
    returns=("packed",),
    implementation=pack_ternary,
    cases={"cpu": [Case("1x1", dict(n=1, k=1)), Case("K=4", dict(n=3, k=4)), Case("K not /4", dict(n=5, k=33)),
                   Case("wide", dict(n=64, k=1001))],
           "gpu": [Case("1x1", dict(n=1, k=1)), Case("K not /4", dict(n=5, k=33)), Case("big", dict(n=512, k=4099))],
           "bench": []},
    dtypes={"cpu": [torch.int8], "gpu": [torch.int8]},
    tolerances={torch.int8: (0.0, 0.0)},
    read_inputs=("w_t",),
    hint=PACK_TERNARY_HINT,
)

_MATMUL_TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}


def _matmul_spec(name: str, summary: str, launcher, cases: dict, make_inputs=_matmul_inputs,
                 bytes_moved=_matmul_bytes, baselines=None, bench_impl=None, **extra) -> KernelSpec:
    """The matmul specs differ only in which launcher runs, on which shapes, and (int32x16)
    in how the weights are packed."""
    return KernelSpec(
        name=name, summary=summary, graph_timing=True,
        args=("x_q", "x_scale", "w_packed", "w_scale", "y"),
        make_inputs=make_inputs, reference=ternary_matmul_reference, outputs=_matmul_outputs,
        implementation=launcher, cases=cases,
        dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]},
        tolerances=_MATMUL_TOLERANCES, bytes_moved=bytes_moved, **extra,
        flops=lambda p, dtype: 2 * p["m"] * p["n"] * p["k"], compute_ceiling="int8_ops_per_s",
        baselines=baselines or {"torch bf16 F.linear": _bf16_linear}, bench_impl=bench_impl or _bench_with(launcher),
        compile_baselines=("torch bf16 F.linear",),      # the others are gpulab's or cuBLAS's own
        bench_dtypes=[torch.bfloat16], read_inputs=("x_q", "x_scale", "w_packed"))


TERNARY_GEMV = _matmul_spec(
    "ternary_gemv", "int8 × 2-bit ternary GEMV (decode: one row at a time)", ternary_gemv_into,
    {"cpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("K not /4", dict(m=1, k=7, n=5)),
             Case("ragged", dict(m=3, k=1001, n=77)), Case("two blocks", dict(m=2, k=2050, n=130))],
     "gpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("K not /4", dict(m=1, k=7, n=5)),
             Case("ragged", dict(m=5, k=4097, n=1000)), Case("decode 16", dict(m=16, k=2051, n=3001))],
     "bench": [Case("M=1 K=N=8192", dict(m=1, k=8192, n=8192)),
               Case("M=16 K=N=8192", dict(m=16, k=8192, n=8192))]},
    hint=TERNARY_GEMV_HINT)

TERNARY_MATMUL = _matmul_spec(
    "ternary_matmul", "int8 × 2-bit ternary matmul (GEMV for one row, int8 tensor-core dots above)",
    ternary_matmul_into,
    {"cpu": [Case("decode", dict(m=1, k=13, n=9)), Case("prefill, K not /4", dict(m=37, k=301, n=70)),
             Case("prefill, two K steps", dict(m=20, k=257, n=65))],
     "gpu": [Case("decode", dict(m=1, k=13, n=9)), Case("prefill, K not /4", dict(m=37, k=301, n=70)),
             Case("prefill ragged", dict(m=1000, k=4099, n=3001)), Case("M=17", dict(m=17, k=2048, n=512))],
     "bench": [Case(f"M={m} K=N=8192", dict(m=m, k=8192, n=8192)) for m in (1, 16, 4096)]},
    # benchmarks lead with the public function as a user calls it (output allocated per call)
    bench_impl=lambda inp: ternary_matmul(inp["x_q"], inp["x_scale"], inp["w_packed"], inp["w_scale"]),
    baselines={"torch bf16 F.linear": _bf16_linear,
               "ternary_matmul_into (launcher, output preallocated)": _bench_with(ternary_matmul_into),
               **({GEMLITE_ROW: gemlite_w2} if GEMLITE_INSTALLED else {})},
    notes="gpulab = ternary_matmul as called")

TERNARY_MM = _matmul_spec(
    "ternary_mm", "int8 × 2-bit ternary matmul, tensor-core path only (prefill)", ternary_mm_into,
    {"cpu": [Case("1 row", dict(m=1, k=13, n=9)), Case("K not /4", dict(m=37, k=301, n=70))],
     "gpu": [Case("1 row", dict(m=1, k=13, n=9)), Case("16 rows", dict(m=16, k=8191, n=1000)),
             Case("ragged", dict(m=1000, k=4099, n=3001))],
     "bench": [Case(f"M={m} K=N=8192", dict(m=m, k=8192, n=8192)) for m in (16, 4096)]})

TERNARY_MM_SMALL = _matmul_spec(
    "ternary_mm_small", "int8 × 2-bit ternary matmul for a few rows (2 to 256), four weights unpacked per "
    "instruction group", ternary_mm_small_into,
    {"cpu": [Case("2 rows", dict(m=2, k=13, n=9)), Case("K not /4, two row tiles", dict(m=37, k=301, n=70)),
             Case("three K steps", dict(m=16, k=1030, n=65)), Case("three 64-row tiles", dict(m=130, k=33, n=20))],
     "gpu": [Case("2 rows", dict(m=2, k=13, n=9)), Case("16 rows", dict(m=16, k=8191, n=1000)),
             Case("40 rows", dict(m=40, k=2048, n=3072)), Case("64 rows, ragged", dict(m=64, k=4099, n=3001)),
             Case("40 rows, K split in four", dict(m=40, k=5632, n=2048)),
             Case("24 rows, K split, ragged", dict(m=24, k=5001, n=1000)),
             Case("96 rows, K split in two", dict(m=96, k=5632, n=2048)),
             Case("200 rows, large layer: 128-row tiles, K split", dict(m=200, k=8191, n=4100)),
             Case("256 rows, wide: 128-row tiles", dict(m=256, k=2048, n=11264))],
     "bench": [Case(f"M={m} K=N=8192", dict(m=m, k=8192, n=8192)) for m in (16, 64, 128)]},
    baselines={"torch bf16 F.linear": _bf16_linear, "ternary_mm (unpacks per tile)": _bench_with(ternary_mm_into)})

TERNARY_MM_UNPACKED = _matmul_spec(
    "ternary_mm_unpacked", "int8 × 2-bit ternary matmul, weights unpacked to int8 once, then an int8 GEMM "
    "(prefill at large M)", ternary_mm_unpacked_into,
    {"cpu": TERNARY_MM.cases["cpu"] + [Case("two K steps, ragged", dict(m=45, k=97, n=33))],
     "gpu": TERNARY_MM.cases["gpu"] + [Case("M=4099", dict(m=4099, k=2048, n=1000))],
     "bench": [Case(f"M={m} K=N=8192", dict(m=m, k=8192, n=8192)) for m in (256, 1024, 4096)]},
    baselines={"torch bf16 F.linear": _bf16_linear, "ternary_mm (unpacks per tile)": _bench_with(ternary_mm_into),
               "cuBLAS int8 on unpacked weights (torch._int_mm)": _int_mm_unpacked})

TERNARY_GEMV_X16 = _matmul_spec(
    "ternary_gemv_x16", "int8 × ternary GEMV on the int32x16 layout (16 weights per word, dp4a)",
    ternary_gemv_x16_into,
    {"cpu": TERNARY_GEMV.cases["cpu"],
     "gpu": TERNARY_GEMV.cases["gpu"] + [Case("split-K, K not /4", dict(m=1, k=8190, n=300)),
                                        Case("split-K", dict(m=1, k=8192, n=512)),
                                        Case("16 rows, no masks", dict(m=16, k=2048, n=2048))],
     "bench": [Case(f"M={m} N={n} K={k}", dict(m=m, k=k, n=n))
               for m, n, k in ((1, 8192, 8192), (1, 4096, 4096), (1, 14336, 4096), (1, 4096, 14336),
                               (16, 8192, 8192))]},
    make_inputs=_x16_inputs, bytes_moved=_x16_bytes, edge_data=_x16_extremes)

TERNARY_MM_X16 = _matmul_spec(
    "ternary_mm_x16", "int8 × ternary matmul on the int32x16 layout, tensor-core path (prefill)",
    ternary_mm_x16_into,
    {"cpu": [Case("1 row", dict(m=1, k=13, n=9)), Case("K not /4", dict(m=37, k=301, n=70))],
     "gpu": [Case("1 row", dict(m=1, k=13, n=9)), Case("16 rows", dict(m=16, k=8191, n=1000)),
             Case("ragged", dict(m=1000, k=4099, n=3001))],
     "bench": [Case(f"M={m} K=N=8192", dict(m=m, k=8192, n=8192)) for m in (16, 4096)]},
    make_inputs=_x16_inputs, bytes_moved=_x16_bytes)

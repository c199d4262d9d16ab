"""Grading of notebook 04 (gpulab.attention): inputs, cases, specs, baselines, diagnoses.

Specs (``gpulab.check(NAME, fn)``): ``online_softmax``, ``merge_state_torch``,
``exp2_poly3``, ``flash_attention_noncausal`` (exercise 3: non-causal, Hq = Hkv),
``flash_attention`` (every case: causal, GQA, empty rows), ``flash_attention_fa4`` and
``flash_attention_sweep`` (benchmarks).
"""
from __future__ import annotations

import math

import torch

from ..attention import (ONLINE_SOFTMAX_BLOCK, attention_reference, exp2_poly3_into, flash_attention,
                         flash_attention_fa4_into, flash_attention_into, merge_state_torch,
                         online_softmax_into, repeat_kv)
from ..attention_state import LOG2E, POLY3, merge_state_reference
from ..harness.checking import Hypothesis, hypotheses_hint, rounding_tolerance
from ..harness.spec import Case, KernelSpec, bytes_of, randn


# =========================================================================================
# Online softmax
# =========================================================================================
def make_softmax_inputs(p, dtype, device, gen):
    x = randn((p["rows"], p["cols"]), torch.float32, device, gen, scale=4.0)
    # A row-dependent offset (an unsafe softmax overflows) and a trend along the row, so
    # the running max keeps moving and a missing rescale shows.
    x = x + torch.linspace(-50, 70, p["rows"], device=device)[:, None]
    x = x + torch.linspace(0, 6, p["cols"], device=device)[None, :]
    return {"x": x.to(dtype)}


def softmax_reference(x):
    return {"y": torch.softmax(x.double(), dim=-1)}


def softmax_hint(output, got, expected, inputs):
    """Does the output equal the softmax of x · ln 2 (exp2 used without log2(e))? Compared
    on each row's scale (divided by the row's largest probability): over thousands of
    columns the probabilities are far below the absolute tolerance, and another mistake
    (a running sum not rescaled, in one check of about 300) matched them there."""
    alt = torch.softmax(inputs["x"].double() * math.log(2.0), dim=-1).cpu()
    atol, rtol = rounding_tolerance(got.dtype, 1e-3, 1e-2)
    top = alt.amax(-1, keepdim=True)
    if torch.allclose(got.double().cpu() / top, alt / top, atol=atol, rtol=rtol):
        return ("the output equals the softmax of x · ln 2: exp2 needs its argument multiplied by "
                "log2(e) (2^(x · log2 e) = e^x), or use exp; base 2 without the factor changes the result.")
    return None


ONLINE_SOFTMAX = KernelSpec(
    name="online_softmax",
    summary="row softmax of any length: running max and sum, then normalise",
    args=("x", "y"),
    make_inputs=make_softmax_inputs,
    reference=softmax_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=online_softmax_into,
    cases={
        "cpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("several blocks + tail", dict(rows=4, cols=2 * ONLINE_SOFTMAX_BLOCK + 333)),
                Case("long row", dict(rows=2, cols=5 * ONLINE_SOFTMAX_BLOCK))],
        "gpu": [Case("single element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
                Case("blocks + tail", dict(rows=37, cols=3 * ONLINE_SOFTMAX_BLOCK + 5)),
                Case("very long rows", dict(rows=5, cols=200_001))],
        "bench": [Case("4096x4096", dict(rows=4096, cols=4096)),
                  Case("1024x65536", dict(rows=1024, cols=65536)),
                  Case("128x1048576", dict(rows=128, cols=1 << 20))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (4e-3, 1e-2)},
    bytes_moved=lambda p, dtype: 3 * p["rows"] * p["cols"] * bytes_of(dtype),
    flops=lambda p, dtype: 6 * p["rows"] * p["cols"],
    baselines={"torch": lambda inp: torch.softmax(inp["x"], dim=-1)},
    hint=softmax_hint,
    strided=("x", "y"),    # the launcher passes x.stride(0), y.stride(0)
    read_inputs=("x",),
    bench_dtypes=[torch.bfloat16],
)


# =========================================================================================
# The two-state merge in PyTorch (exercise 2)
# =========================================================================================
def make_merge_inputs(p, dtype, device, gen):
    n, h, d = p["n"], p["heads"], p["dim"]
    o_a = randn((n, h, d), torch.float32, device, gen)
    o_b = randn((n, h, d), torch.float32, device, gen, offset=0.3)
    lse_a = randn((n, h), torch.float32, device, gen, scale=4.0, offset=3.0)
    lse_b = randn((n, h), torch.float32, device, gen, scale=4.0, offset=2.0)
    # Empty states (lse = -inf, o = 0): one side, the other side, and both.
    r = torch.rand((n, h), generator=gen, device=device)
    ea, eb = r < 0.15, (r > 0.85)
    both = (r > 0.45) & (r < 0.55)
    ea, eb = ea | both, eb | both
    lse_a = lse_a.masked_fill(ea, -math.inf)
    lse_b = lse_b.masked_fill(eb, -math.inf)
    o_a = o_a.masked_fill(ea[..., None], 0.0)
    o_b = o_b.masked_fill(eb[..., None], 0.0)
    return {"o_a": o_a.to(dtype), "lse_a": lse_a, "o_b": o_b.to(dtype), "lse_b": lse_b}


def merge_hint(output, got, expected, inputs):
    """Diagnoses of a two-state merge: plain average, base-2 LSE (gpulab's is natural log),
    exponentials taken without subtracting the max first."""
    g = got.detach().double().cpu()
    la, lb = inputs["lse_a"].double().cpu(), inputs["lse_b"].double().cpu()
    if output == "o":
        average = (inputs["o_a"].double().cpu() + inputs["o_b"].double().cpu()) / 2
        both = torch.isfinite(la) & torch.isfinite(lb)      # (empty states aside)
        if g.shape != average.shape:
            return None
        # (NaN/Inf aside too, and states far apart: equal weights e^(lse_a - M) underflow there)
        sel = (both & ((la - lb).abs() < 60))[..., None].expand_as(g) & torch.isfinite(g)
        if bool(sel.any()) and \
                torch.allclose(g[sel], average[sel], *rounding_tolerance(got.dtype, 1e-3, 1e-2)):
            return ("o is the plain average of o_a and o_b: each state must count with its weight "
                    "w = e^(lse - M) / (w_a + w_b), M = max(lse_a, lse_b): its share of the total sum.")
        return None
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = expected.detach().double().cpu()
    atol = rounding_tolerance(got.dtype, 1e-3, 1e-3)[0]

    def explains(alt) -> bool:
        """got is wrong somewhere and the mistake ``alt`` gives got's value at every wrong
        element: compared as lse − M, so that an LSE of −100 does not widen the tolerance."""
        if g.shape != alt.shape:
            return False
        gr, ar, er = ((t - m).nan_to_num(nan=-7e29, posinf=1e30, neginf=-1e30) for t in (g, alt, e))
        wrong = (gr - er).abs() > atol
        return bool(wrong.any()) and bool(((gr - ar).abs() <= atol)[wrong].all())

    total = torch.exp(la - m) + torch.exp(lb - m)
    mixed = torch.where(total > 0, m + torch.log2(torch.where(total > 0, total, 1.0)), -math.inf)
    if explains(mixed) or explains(e * LOG2E):
        return ("the LSE is in base 2 (log2 somewhere): gpulab's LSE is the natural log, "
                "lse = M + ln(w_a + w_b); FlashInfer's base-2 LSE is lse · log2(e), i.e. lse / ln 2.")
    # e^lse taken without subtracting M first, in the LSE's float32
    la32, lb32 = inputs["lse_a"].float().cpu(), inputs["lse_b"].float().cpu()
    if explains(torch.log(torch.exp(la32) + torch.exp(lb32)).double()):
        return ("e^lse is taken without subtracting M = max(lse_a, lse_b) first: in float32 it overflows "
                "to inf above lse ≈ 88 (then inf/inf = NaN in o) and keeps only a few digits below ≈ −87. "
                "Use lse = M + ln(e^(lse_a − M) + e^(lse_b − M)).")
    return None


MERGE_STATE_TORCH = KernelSpec(
    name="merge_state_torch",
    summary="merge two attention states (o, natural-log lse) over disjoint key sets (PyTorch)",
    args=("o_a", "lse_a", "o_b", "lse_b"),
    make_inputs=make_merge_inputs,
    reference=merge_state_reference,
    returns=("o", "lse"),
    implementation=merge_state_torch,
    hint=merge_hint,
    cases={
        "cpu": [Case("one state", dict(n=1, heads=1, dim=1)), Case("odd", dict(n=7, heads=3, dim=5)),
                Case("many", dict(n=64, heads=8, dim=64))],
        "gpu": [Case("one state", dict(n=1, heads=1, dim=1)), Case("odd", dict(n=7, heads=3, dim=5)),
                Case("many", dict(n=1000, heads=32, dim=128))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    read_inputs=("o_a", "o_b", "lse_a", "lse_b"),
)


# =========================================================================================
# FlashAttention forward
# =========================================================================================
def make_attention_inputs(p, dtype, device, gen):
    B, Hq, Hkv, Sq, Skv, D = p["B"], p["Hq"], p.get("Hkv", p["Hq"]), p["Sq"], p["Skv"], p["D"]
    # q carries a per-(batch) spread and a trend over positions, so scores vary in range
    # across rows and the running max moves along a row.
    q = randn((B, Hq, Sq, D), torch.float32, device, gen, scale=1.5)
    k = randn((B, Hkv, Skv, D), torch.float32, device, gen)
    k = k + 0.3 * torch.linspace(-1, 1, Skv, device=device)[None, None, :, None] * q.mean((1, 2))[:, None, None, :]
    v = randn((B, Hkv, Skv, D), torch.float32, device, gen, offset=0.2)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "causal": bool(p.get("causal", False))}


def attention_lse_first_reference(q, k, v, causal):
    """float64 reference with the LSE first: a check compares outputs in this order, so
    when ``o`` is wrong the diagnosis knows whether the LSE was right."""
    ref = attention_reference(q, k, v, causal)
    return {"lse": ref["lse"], "o": ref["o"]}


def attention_outputs(inp, dtype):
    q = inp["q"]
    return {"o": (q.shape, dtype), "lse": (q.shape[:3], torch.float32)}


def attention_flops(p, dtype):
    """4·B·Hq·S_q·S_kv·D (two matrix products), half of it when causal."""
    f = 4 * p["B"] * p["Hq"] * p["Sq"] * p["Skv"] * p["D"]
    return f / 2 if p.get("causal") else f


def attention_bytes(p, dtype):
    """q, k, v read and o written once, plus the float32 LSE."""
    B, Hq, Hkv, Sq, Skv, D = p["B"], p["Hq"], p.get("Hkv", p["Hq"]), p["Sq"], p["Skv"], p["D"]
    return (2 * B * Hq * Sq * D + 2 * B * Hkv * Skv * D) * bytes_of(dtype) + 4 * B * Hq * Sq


def sdpa_baseline(inp):
    q, k, v = inp["q"], inp["k"], inp["v"]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=inp["causal"], enable_gqa=k.shape[1] != q.shape[1])


def _case(label, B, Hq, Sq, Skv, D, Hkv=None, causal=False):
    return Case(label, dict(B=B, Hq=Hq, Hkv=Hkv or Hq, Sq=Sq, Skv=Skv, D=D, causal=causal))


ATTN_CPU_NONCAUSAL = [
    _case("one query, one key", 1, 1, 1, 1, 16),
    _case("ragged S_q ≠ S_kv", 1, 2, 37, 45, 32),
    _case("decode: one query", 2, 2, 1, 70, 64),
    _case("D=128, tail", 1, 1, 33, 40, 128),
]
ATTN_CPU_MORE = [
    _case("causal square", 1, 2, 50, 50, 16, causal=True),
    _case("causal + cache (S_q < S_kv), GQA 4/2", 1, 4, 20, 67, 32, Hkv=2, causal=True),
    _case("causal, S_q > S_kv: empty rows", 1, 1, 40, 9, 16, causal=True),
    _case("GQA 6/2, non-causal", 2, 6, 9, 33, 64, Hkv=2),
]
ATTN_GPU_NONCAUSAL = [
    _case("one query, one key", 1, 1, 1, 1, 64),
    _case("ragged", 2, 3, 1000, 777, 128),
    _case("decode: one query", 4, 8, 1, 4097, 128),
    _case("D=64, tail", 1, 4, 513, 1031, 64),
    _case("D=16", 1, 2, 77, 200, 16),
]
ATTN_GPU_MORE = [
    _case("causal square", 2, 4, 1000, 1000, 128, causal=True),
    _case("causal + cache, GQA 8/2", 1, 8, 300, 2049, 128, Hkv=2, causal=True),
    _case("causal, S_q > S_kv", 1, 2, 260, 100, 128, causal=True),
    _case("GQA 32/8", 1, 32, 129, 1000, 128, Hkv=8),
    _case("D=32 causal", 1, 2, 100, 100, 32, causal=True),
]
_BENCH = [_case("S=8192", 4, 32, 8192, 8192, 128), _case("S=8192 causal", 4, 32, 8192, 8192, 128, causal=True)]
_SWEEP = [_case(f"S={s // 1024}K" + (" causal" if c else ""), 4, 32, s, s, 128, causal=c)
          for c in (False, True) for s in (1024, 2048, 4096, 8192, 16384)]


# -- diagnoses: what a wrong attention output most likely means ---------------------------
# Tile widths a learner's kernel may use (mistakes that depend on a tile try each).
KEY_TILES = (16, 32, 64, 128)


def _with_scale(factor):
    return lambda inp: attention_reference(inp["q"], inp["k"], inp["v"], inp["causal"],
                                           scale=factor / math.sqrt(inp["q"].shape[-1]))


def _causal_flipped(inp):
    return attention_reference(inp["q"], inp["k"], inp["v"], not inp["causal"])


def _causal_top_left(inp):
    """The mask j ≤ i (aligned top-left). Alone, or inside a key loop that still ends
    where the bottom-right mask needs it, at min(S_kv, (pid_m + 1)·BLOCK_M + S_kv - S_q)
    walked in whole key tiles (each query and key tile width a learner may use): with
    S_q > S_kv that loop skips keys the top-left mask lets through."""
    s_q, s_kv = inp["q"].shape[2], inp["k"].shape[2]
    if not inp["causal"] or s_q == s_kv:
        return
    yield attention_variant(inp, keep=lambda i, j: j <= i)
    if s_kv > s_q:      # the loop then ends past every j ≤ i: the mask alone decides
        return
    for bm in KEY_TILES:
        for bn in KEY_TILES:
            def keep(i, j, bm=bm, bn=bn):
                end = ((i // bm + 1) * bm + s_kv - s_q).clamp(0, s_kv)
                return (j <= i) & (j < (end + bn - 1) // bn * bn)
            yield attention_variant(inp, keep=keep)


def _gqa_modulo(inp):
    q, k, v = inp["q"], inp["k"], inp["v"]
    if k.shape[1] == q.shape[1] or k.shape[1] == 1:
        return None
    idx = torch.arange(q.shape[1], device=q.device) % k.shape[1]
    return attention_reference(q, k[:, idx], v[:, idx], inp["causal"])


def attention_variant(inp, keep=None, zero_keys=0, scale_factor=1.0):
    """attention_reference with one mistake: query i sees key j where ``keep(i, j)`` (index
    tensors [S_q, 1] and [1, S_kv]; None: the spec's own mask), ``zero_keys`` extra keys of
    score 0 and value 0 after the last (a key tile's padding with unmasked scores), scores
    times ``scale_factor``. Also returns the scores: {"o", "lse", "s"}."""
    q, k, v = inp["q"].double(), inp["k"].double(), inp["v"].double()
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    s = (q @ k.transpose(-1, -2)) * scale_factor / math.sqrt(q.shape[-1])
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    if keep is not None:
        s = s.masked_fill(~keep(i, j), -math.inf)
    elif inp["causal"]:
        s = s.masked_fill(j > i + (k.shape[2] - q.shape[2]), -math.inf)
    if zero_keys:
        s = torch.cat([s, s.new_zeros(*s.shape[:-1], zero_keys)], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], zero_keys, v.shape[-1])], dim=2)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return {"o": torch.exp(s - safe[..., None]) @ v, "lse": lse, "s": s}


def _unmasked_key_padding(inp):
    """The last key tile's padding counted with score 0 (K/V loads masked, scores not)."""
    s_kv = inp["k"].shape[2]
    for t in KEY_TILES:
        if s_kv % t and not inp["causal"]:
            yield attention_variant(inp, zero_keys=t - s_kv % t)


def _diagonal_excluded(inp):
    if not inp["causal"]:
        return None
    off = inp["k"].shape[2] - inp["q"].shape[2]
    return attention_variant(inp, keep=lambda i, j: j < i + off)


def _causal_loop_unshifted(inp):
    """The causal key loop ends at (pid_m + 1)·BLOCK_M, without + S_kv - S_q."""
    s_q, s_kv = inp["q"].shape[2], inp["k"].shape[2]
    if not inp["causal"] or s_kv <= s_q:
        return
    for t in KEY_TILES:
        yield attention_variant(inp, keep=lambda i, j, t=t: (j <= i + (s_kv - s_q)) & (j < (i // t + 1) * t))


def _exp_of_log2e_scores(inp):
    """Scores × scale × log2(e) through exp, and a base-2 epilogue (m + log2 l)·ln 2 on that
    natural-base state: lse = lse' - (1 - ln 2)·max s'."""
    alt = attention_variant(inp, scale_factor=LOG2E)
    m = alt["s"].max(-1).values
    lse = torch.where(torch.isneginf(m), m, alt["lse"] - (1 - math.log(2.0)) * m)
    return {"o": alt["o"], "lse": lse}


def _never_divided_by_l(inp):
    """o = acc: the unnormalised sum, acc = o · l with l = Σ exp(s - max s)."""
    alt = attention_variant(inp)
    m = alt["s"].max(-1).values
    l = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(alt["lse"] - m))
    return {"o": alt["o"] * l[..., None], "lse": alt["lse"]}


ATTENTION_MISTAKES = [
    ("the output equals attention with the scale × ln 2: exp2 needs the scores multiplied by "
     "scale · log2(e) (qk_scale), not just scale.", _with_scale(1 / LOG2E)),
    ("the output equals attention without the 1/sqrt(D) softmax scale.",
     lambda inp: attention_reference(inp["q"], inp["k"], inp["v"], inp["causal"], scale=1.0)),
    ("the output equals attention with scores × scale × log2(e) fed to exp (natural): use "
     "exp2 with qk_scale, or exp with scale, not a mix.", _with_scale(LOG2E)),
    ("the output equals attention with the causal mask the wrong way round (applied when "
     "causal=False or missing when causal=True).", _causal_flipped),
    ("the output equals a causal mask aligned top-left (j ≤ i): gpulab aligns it bottom-right, "
     "j ≤ i + S_kv - S_q.", _causal_top_left),
    ("the output equals GQA with kv head = h % Hkv: query head h uses kv head h // (Hq // Hkv).",
     _gqa_modulo),
    ("the output equals attention with scores × scale × log2(e) fed to exp (natural), with a base-2 "
     "epilogue: use exp2 with qk_scale, or exp with scale, not a mix.", _exp_of_log2e_scores),
    ("the output equals attention where the keys past S_kv in the last key tile count with score 0: "
     "masking their K/V loads is not enough, set their scores to -inf (tl.where(cols < S_kv, s, -inf)).",
     _unmasked_key_padding),
    ("the output equals a causal mask that excludes the diagonal (j < i + S_kv - S_q): query i sees "
     "key j ≤ i + S_kv - S_q, its own position included.", _diagonal_excluded),
    ("the output equals a causal key loop that stops too early: with S_q < S_kv the last key a query "
     "block needs is (pid_m + 1)·BLOCK_M + S_kv - S_q (bottom-right alignment), not (pid_m + 1)·BLOCK_M.",
     _causal_loop_unshifted),
    ("the LSE is in base 2 (m + log2 l, the running state's units): gpulab's LSE is the natural log, "
     "multiply by ln 2.", lambda inp: {"lse": attention_variant(inp)["lse"] / math.log(2.0)}),
    ("o is the unnormalised sum acc: divide it by the running sum l at the end (o = acc / l).",
     _never_divided_by_l),
]
ONLINE_UPDATE_ROWS = ("some rows are right and others wrong: that is the signature of the online "
                      "update. Rows whose max moved after their first key block need acc and l "
                      "rescaled by alpha = exp2(m_old - m_new), and p, l and acc must all use the "
                      "same max.")
LSE_RIGHT_O_WRONG = ("the LSE is right, so the running max m and sum l are; the output is not: is "
                     "acc rescaled by alpha = exp2(m_old - m_new) whenever the max changes, and are "
                     "p (for acc) and l computed against the same max?")


def attention_hint(output, got, expected, inputs):
    """Spec hint for the attention checks (``lse`` is compared before ``o``)."""
    g, e = got.detach().double().cpu(), expected.detach().double().cpu()
    if bool((~torch.isfinite(g) & torch.isfinite(e)).any()):
        return None                     # NaN where the answer is finite: the generic hint says why
    for text, mistake in ATTENTION_MISTAKES:
        alts = mistake(inputs)
        # one answer, or several (a mistake with a free parameter, e.g. the key tile)
        for alt in [alts] if alts is None or isinstance(alts, dict) else alts:
            if alt is not None and output in alt and alt[output].shape == g.shape and \
                    torch.allclose(g, alt[output].double().cpu(), atol=5e-3, rtol=5e-3):
                return text
    if output == "o":
        return LSE_RIGHT_O_WRONG        # reached only when the LSE passed
    for name in ("q", "k"):             # an input never loaded: the generic hint names it
        zeroed = {**inputs, name: torch.zeros_like(inputs[name])}
        alt = attention_reference(zeroed["q"], zeroed["k"], zeroed["v"], inputs["causal"])[output]
        if torch.allclose(g, alt.double().cpu(), atol=5e-3, rtol=5e-3):
            return None
    # LSE per query row: some right (to float rounding) and others wrong points at the update.
    bad = ~torch.isclose(g, e, atol=2e-4, rtol=2e-4, equal_nan=True)
    if bool(bad.any()) and not bool(bad.all()):
        return ONLINE_UPDATE_ROWS
    return None


_ATTN_COMMON = dict(
    args=("q", "k", "v", "causal", "o", "lse"),
    make_inputs=make_attention_inputs,
    reference=attention_lse_first_reference,
    outputs=attention_outputs,
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float16, torch.bfloat16]},
    tolerances={torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)},
    output_tolerances={"lse": {torch.float32: (2e-5, 1e-6), torch.float16: (1e-4, 1e-5),
                               torch.bfloat16: (1e-4, 1e-5)}},
    bytes_moved=attention_bytes,
    flops=attention_flops,
    read_inputs=("q", "k", "v"),
    hint=attention_hint,
    bench_dtypes=[torch.bfloat16],
)

FLASH_ATTENTION = KernelSpec(
    name="flash_attention",
    summary="FlashAttention forward: causal or not, GQA, natural-log LSE",
    implementation=flash_attention_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL + ATTN_CPU_MORE, "gpu": ATTN_GPU_NONCAUSAL + ATTN_GPU_MORE,
           "bench": _BENCH},
    baselines={"torch SDPA": sdpa_baseline},
    **_ATTN_COMMON,
)

FLASH_ATTENTION_NONCAUSAL = KernelSpec(
    name="flash_attention_noncausal",
    summary="FlashAttention forward, non-causal, as many kv heads as query heads (exercise 3)",
    implementation=flash_attention_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL, "gpu": ATTN_GPU_NONCAUSAL},
    **_ATTN_COMMON,
)

FLASH_ATTENTION_SWEEP = KernelSpec(
    name="flash_attention_sweep",
    summary="FlashAttention forward, B=4 H=32 D=128, S = 1K..16K (the notebook's sweep)",
    implementation=flash_attention_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL[:1], "gpu": ATTN_GPU_NONCAUSAL[:1], "bench": _SWEEP},
    baselines={"torch SDPA": sdpa_baseline},
    **_ATTN_COMMON,
)

# FA4's options: the polynomial adds ≤ 8.8e-5 relative error to each probability; the
# lazy rescale is exact up to rounding (probabilities up to 2^8 before the final divide).
FA4_TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1.5e-2)}
FLASH_ATTENTION_FA4 = KernelSpec(
    name="flash_attention_fa4",
    summary="FlashAttention forward with FA4's poly-3 exp2 and lazy rescaling (τ = 8)",
    implementation=flash_attention_fa4_into,
    cases={"cpu": ATTN_CPU_NONCAUSAL[1:2] + ATTN_CPU_MORE[:3],
           "gpu": ATTN_GPU_NONCAUSAL[:2] + ATTN_GPU_MORE[:3],
           "bench": _BENCH},
    baselines={"torch SDPA": sdpa_baseline,
               "gpulab, native exp2, always rescale": lambda inp: flash_attention(
                   inp["q"], inp["k"], inp["v"], causal=inp["causal"])},
    compile_baselines=("torch SDPA",),   # the other baseline is gpulab's own Triton kernel
    **{**_ATTN_COMMON, "tolerances": FA4_TOLERANCES,
       "output_tolerances": {"lse": {d: (3e-4, 1e-4) for d in FA4_TOLERANCES}}},
)


def make_exp2_inputs(p, dtype, device, gen):
    n = p["n"]
    # Attention feeds it s - m ≤ τ ≤ 8 (lazy rescaling); beyond that only the range grows.
    x = (torch.randn(n, generator=gen, device=device) * 4.0).clamp(max=8.0)
    # Very negative arguments (masked scores end up here) and a few past the clamp.
    x[::7] = -torch.rand(x[::7].shape, generator=gen, device=device) * 140.0
    return {"x": x.to(dtype)}


FA4_COEFFICIENTS = ", ".join(f"{c:.9g}" for c in POLY3)
# Taylor's coefficients of 2^f at f = 0: (ln 2)^k / k!
EXP2_TAYLOR3 = (1.0, math.log(2.0), math.log(2.0) ** 2 / 2, math.log(2.0) ** 3 / 6)


def exp2_poly3_variant(x, *, clamp=True, trunc=False, shift=23):
    """exp2_poly3_torch with one mistake: no clamp at -127, the integer part by truncation
    toward zero, the integer part added ``shift`` bits up (0: not shifted; None: never
    added, the polynomial of the fraction alone)."""
    x = x.float()
    if clamp:
        x = x.clamp(min=-127.0)
    j = torch.trunc(x) if trunc else torch.floor(x)
    f = x - j
    p = POLY3[0] + f * (POLY3[1] + f * (POLY3[2] + f * POLY3[3]))
    if shift is None:
        return p
    return (p.view(torch.int32) + (j.to(torch.int32) << shift)).view(torch.float32)


def _exp2_polynomial_hint(output, got, expected, inputs):
    """The integer part right and the cubic of the fraction wrong: y / 2^floor(x) is then a
    cubic in f = x - floor(x); fit it and compare its coefficients with FA4's."""
    x = inputs["x"].double().cpu()
    keep = (x > -100) & (x < 100)
    if int(keep.sum()) < 8:
        return None
    j = torch.floor(x[keep])
    f = x[keep] - j
    r = got.detach().double().cpu()[keep] / torch.exp2(j)
    a = torch.stack([f ** k for k in range(4)], dim=1)
    c = torch.linalg.lstsq(a, r[:, None]).solution[:, 0]
    if not bool(torch.isfinite(c).all()) or float((a @ c - r).abs().max()) > 1e-5 * float(r.abs().max()):
        return None
    fit = ", ".join(f"{float(v):.6g}" for v in c)
    if all(abs(float(v) - t) < 1e-4 for v, t in zip(c, EXP2_TAYLOR3)):
        return (f"your polynomial of the fraction has Taylor's coefficients ({fit}), exact only at f = 0: FA4's "
                f"cubic is fitted over [0, 1) ({FA4_COEFFICIENTS}), with a far smaller largest error.")
    return (f"the integer part is right, the cubic of the fraction is not: its coefficients are ≈ ({fit}), "
            f"FA4's are ({FA4_COEFFICIENTS}): check each coefficient.")


EXP2_HINT = hypotheses_hint(
    Hypothesis("the integer part j comes from truncation toward zero (a plain int cast): for x < 0 that "
               "leaves f = x - j in (-1, 0], outside the cubic's range; use j = floor(x).",
               lambda inp: {"y": exp2_poly3_variant(inp["x"], trunc=True)}),
    Hypothesis("x is not clamped at -127: below that, j << 23 runs past the exponent bits (garbage, even "
               "negative numbers); clamp x to ≥ -127 first (2^-127 is then 0 to float32's bits).",
               lambda inp: {"y": exp2_poly3_variant(inp["x"], clamp=False)}),
    # (j added unshifted moves only p's last mantissa bits: the two are told apart to 1e-6)
    Hypothesis("the integer part is added to the bits without << 23: it must land in the exponent field "
               "(bits 23..30), so add j << 23 to p's bits.",
               lambda inp: {"y": exp2_poly3_variant(inp["x"], shift=0)}, atol=0, rtol=1e-6),
    Hypothesis("the result is the cubic of the fraction alone (≈ 2^f in [1, 2)): the integer part never "
               "scales it; add j to the exponent bits (bits of p + (j << 23)).",
               lambda inp: {"y": exp2_poly3_variant(inp["x"], shift=None)}, atol=0, rtol=1e-6),
    then=_exp2_polynomial_hint,
)


EXP2_POLY3 = KernelSpec(
    name="exp2_poly3",
    summary="2^x from a cubic polynomial and exponent-bit insertion (FA4)",
    args=("x", "y"),
    make_inputs=make_exp2_inputs,
    reference=lambda x: {"y": torch.exp2(x.double())},
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)},
    implementation=exp2_poly3_into,
    cases={"cpu": [Case("one", dict(n=1)), Case("tail", dict(n=3000))],
           "gpu": [Case("one", dict(n=1)), Case("tail", dict(n=100_003))]},
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
    tolerances={torch.float32: (1e-37, 1e-4)},
    read_inputs=("x",),
    hint=EXP2_HINT,
)

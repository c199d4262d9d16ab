"""Grading of :mod:`gpulab.rope` (rotate-half RoPE of q and k in one kernel): inputs,
cases and the spec ``rope``, which feeds its check, its compile check for sm_75/80/90
and its benchmark.

The check calls the launcher out of place (q, k in; q_out, k_out out), so unwritten
elements, stray stores and modified inputs all show; ``tests/test_rope.py`` checks the
in-place form the engine uses on views of the QKV projection's output. The spec
``rope_kv`` is the same launch storing the rotated k and v into a KV cache's slots, as
the serving engine calls it; its cache has as many slots as the case has tokens, a
random permutation of them, so that every cache element is written and checked (the
tests check that other slots stay untouched and that a bad slot stores nothing). The kernel rounds
once to the output dtype (Triton's interpreter truncates to bfloat16 instead of rounding
to nearest, so there a bfloat16 element may sit one unit in the last place off), and the
tolerances allow that and no more: a rotation the wrong way, of the wrong pairs or by
another token's angles moves most elements by their own size."""
from __future__ import annotations

import torch

from ..harness.checking import Hypothesis, hypotheses_hint
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..rope import rope_qk, rope_qk_into, rope_reference

THETA = 10000.0           # the engine's rope_theta
MAX_POSITION = 4096


# -- references (float64) -------------------------------------------------------------------
def _rotated(x, cos, sin):
    return rope_reference(x.double(), cos.double(), sin.double())


def rope_spec_reference(q, k, cos, sin) -> dict:
    """q and k rotated in float64 (:func:`gpulab.rope.rope_reference`)."""
    return {"q_out": _rotated(q, cos, sin), "k_out": _rotated(k, cos, sin)}


# -- inputs ---------------------------------------------------------------------------------
def rope_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """q [T, Hq, D] and k [T, Hkv, D] with a random spread per token, and the angles of
    random positions (distinct per token, as in a batch of requests) as the engine
    gathers them: cos, sin [T, D/2] float32."""
    t, d = p["T"], p["D"]
    pos = torch.randint(0, MAX_POSITION, (t,), generator=gen, device=device).double()
    inv = THETA ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    angle = pos[:, None] * inv[None, :]
    return {"q": randn((t, p["Hq"], d), dtype, device, gen, scale=2.0),
            "k": randn((t, p["Hkv"], d), dtype, device, gen, scale=2.0),
            "cos": angle.cos().float(), "sin": angle.sin().float()}


def _fresh(gen: torch.Generator) -> Case:
    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))
    hkv = pick(1, 3)
    return Case("random size", dict(T=pick(1, 80), Hq=hkv * pick(1, 3), Hkv=hkv, D=2 * pick(4, 24)))


# -- diagnoses ------------------------------------------------------------------------------
def _answer(change):
    """The outputs of a kernel making the mistake ``change(x, cos, sin) -> rotated x``."""
    def answer(inp):
        return {"q_out": change(inp["q"].double(), inp["cos"].double(), inp["sin"].double()),
                "k_out": change(inp["k"].double(), inp["cos"].double(), inp["sin"].double())}
    return answer


def _interleaved(x, cos, sin):
    """Pairs (x[2i], x[2i+1]) turned by θ_i: the GPT-J layout."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


ROPE_HINT = hypotheses_hint(
    Hypothesis("the rotation goes the wrong way (by −θ, as if sin were negated): the first half must be "
               "x1·cos − x2·sin, the second x2·cos + x1·sin.", _answer(lambda x, c, s: rope_reference(x, c, -s))),
    Hypothesis("cos and sin are swapped (x1·sin − x2·cos in the first half): check which pointer each load uses.",
               _answer(lambda x, c, s: rope_reference(x, s, c))),
    Hypothesis("adjacent elements (x[2i], x[2i+1]) are rotated as pairs, the interleaved (GPT-J) layout; "
               "this model's RoPE is rotate-half: element i pairs with element i + D/2 of its head.",
               _answer(_interleaved)),
    Hypothesis("every token is turned by the first token's angles: cos and sin must be read at each token's "
               "own row (row stride cos.stride(0)).",
               _answer(lambda x, c, s: rope_reference(x, c[:1].expand_as(c), s[:1].expand_as(s)))),
    Hypothesis("`q_out` is q unrotated: the rotation is not applied to q.",
               lambda inp: {"q_out": inp["q"].double()}, outputs=("q_out",)),
    Hypothesis("`k_out` is k unrotated: the rotation is not applied to k (the program must turn k's heads "
               "with the same cos and sin as q's).", lambda inp: {"k_out": inp["k"].double()}, outputs=("k_out",)),
)


# -- baselines ------------------------------------------------------------------------------
def torch_rope(inp):
    """The engine's PyTorch path: rope_reference on q, then on k (about sixteen kernels)."""
    return rope_reference(inp["q"], inp["cos"], inp["sin"]), rope_reference(inp["k"], inp["cos"], inp["sin"])


def _bytes(p, dtype):
    t, d = p["T"], p["D"]
    return 2 * t * (p["Hq"] + p["Hkv"]) * d * bytes_of(dtype) + t * d * 4    # q, k in and out; cos, sin


# -- specs ----------------------------------------------------------------------------------
ROPE = KernelSpec(
    name="rope",
    summary="rotate-half RoPE of q [T, Hq, D] and k [T, Hkv, D] in one kernel (in place in the engine)",
    args=("q", "k", "cos", "sin", "q_out", "k_out"),
    make_inputs=rope_inputs,
    reference=rope_spec_reference,
    outputs=lambda inp, dtype: {"q_out": (inp["q"].shape, dtype), "k_out": (inp["k"].shape, dtype)},
    implementation=rope_qk_into,
    cases={"cpu": [Case("one token", dict(T=1, Hq=4, Hkv=2, D=16)),
                   Case("3 tokens", dict(T=3, Hq=4, Hkv=2, D=32)),
                   Case("37 tokens, 6 heads of 24", dict(T=37, Hq=6, Hkv=2, D=24))],
           "gpu": [Case("decode, 1 token", dict(T=1, Hq=16, Hkv=4, D=128)),
                   Case("37 tokens", dict(T=37, Hq=16, Hkv=4, D=128)),
                   Case("301 tokens, 6 heads of 96", dict(T=301, Hq=6, Hkv=2, D=96)),
                   Case("prefill, 2049 tokens", dict(T=2049, Hq=16, Hkv=4, D=128))],
           "bench": [Case("decode B1", dict(T=1, Hq=16, Hkv=4, D=128)),
                     Case("decode B64", dict(T=64, Hq=16, Hkv=4, D=128)),
                     Case("prefill 4096", dict(T=4096, Hq=16, Hkv=4, D=128))]},
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.float16, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)},
    bytes_moved=_bytes,
    baselines={"torch (rope_reference on q, then k)": torch_rope},
    bench_impl=lambda inp: rope_qk(inp["q"], inp["k"], inp["cos"], inp["sin"]),    # in place, as the engine
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("q", "k", "cos", "sin"),
    strided=("q", "k", "cos", "sin", "q_out", "k_out"),     # the launcher passes every token and head stride
    fresh_case=_fresh,
    axes={"q_out": ("token", "head", "dim"), "k_out": ("token", "head", "dim")},
    hint=ROPE_HINT,
    notes="gpulab = rope_qk in place (one launch); the engine's TransformerBlock.pre_attention calls "
          "rope_qk_into with q into a contiguous buffer and k in place.",
)


# -- rope_kv: the same launch, storing k and v into a KV cache's slots ------------------------
def rope_kv_inputs(p: dict, dtype: torch.dtype, device, gen: torch.Generator) -> dict:
    """rope's inputs, v [T, Hkv, D], and the slots of the T tokens: a random permutation of
    the cache's T slots (as a step's tokens land in pages all over the pool)."""
    inputs = rope_inputs(p, dtype, device, gen)
    inputs["v"] = randn(inputs["k"].shape, dtype, device, gen, scale=2.0)
    inputs["slots"] = torch.randperm(p["T"], generator=gen, device=gen.device).to(device)
    return inputs


def _by_slot(slots, k_rows, v_rows) -> dict:
    """Caches whose row slots[t] holds k_rows[t] and v_rows[t] (the slots: all the rows)."""
    k_cache, v_cache = torch.empty_like(k_rows), torch.empty_like(v_rows)
    k_cache[slots], v_cache[slots] = k_rows, v_rows
    return {"k_cache": k_cache, "v_cache": v_cache}


def rope_kv_reference(q, k, v, cos, sin, slots) -> dict:
    """rope's outputs; row slots[t] of the caches holds token t's rotated k and its v."""
    out = rope_spec_reference(q, k, cos, sin)
    return {**out, **_by_slot(slots, out["k_out"], v.double())}


def rope_kv_launch(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache):
    """:func:`gpulab.rope.rope_qk_into` in the check's calling convention."""
    rope_qk_into(q, k, cos, sin, q_out, k_out, v, slots, k_cache, v_cache)


ROPE_KV_HINT = hypotheses_hint(
    Hypothesis("token t's k and v went to cache row t: they belong in row slots[t] (load the slot of each "
               "token and store at that row).",
               lambda inp: {"k_cache": _rotated(inp["k"], inp["cos"], inp["sin"]), "v_cache": inp["v"].double()},
               outputs=("k_cache", "v_cache")),
    Hypothesis("`k_cache` holds k unrotated: store the rotated k, as attention reads keys from the cache.",
               lambda inp: _by_slot(inp["slots"], inp["k"].double(), inp["v"].double()), outputs=("k_cache",)),
    Hypothesis("`v_cache` holds the rotated k, not v: v is copied into the cache as it is (RoPE turns q and k "
               "only).", lambda inp: _by_slot(inp["slots"], _rotated(inp["k"], inp["cos"], inp["sin"]),
                                               _rotated(inp["k"], inp["cos"], inp["sin"])), outputs=("v_cache",)),
    then=ROPE_HINT)


def torch_rope_kv(inp):
    """The engine's path without the fused store: rope_reference on q and k, then
    index_copy_ of k and of v into the caches (about eighteen kernels)."""
    q, k = torch_rope(inp)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(inp["v"])
    k_cache.index_copy_(0, inp["slots"], k)
    v_cache.index_copy_(0, inp["slots"], inp["v"])
    return q, k_cache, v_cache


def _kv_bytes(p, dtype):
    return _bytes(p, dtype) + 3 * p["T"] * p["Hkv"] * p["D"] * bytes_of(dtype) + 8 * p["T"]   # v, k and v stored


ROPE_KV = KernelSpec(
    name="rope_kv",
    summary="RoPE of q and k, and the rotated k and v stored into a KV cache's slots, in one kernel "
            "(the serving engine's step before attention)",
    args=("q", "k", "v", "cos", "sin", "slots", "q_out", "k_out", "k_cache", "v_cache"),
    make_inputs=rope_kv_inputs,
    reference=rope_kv_reference,
    outputs=lambda inp, dtype: {"q_out": (inp["q"].shape, dtype), "k_out": (inp["k"].shape, dtype),
                                "k_cache": (inp["k"].shape, dtype), "v_cache": (inp["k"].shape, dtype)},
    implementation=rope_kv_launch,
    cases={"cpu": [Case("one token", dict(T=1, Hq=4, Hkv=2, D=16)),
                   Case("37 tokens, 6 heads of 24", dict(T=37, Hq=6, Hkv=2, D=24))],
           "gpu": [Case("decode, 1 token", dict(T=1, Hq=16, Hkv=4, D=128)),
                   Case("37 tokens", dict(T=37, Hq=16, Hkv=4, D=128)),
                   Case("prefill, 2049 tokens", dict(T=2049, Hq=16, Hkv=4, D=128))],
           "bench": [Case("decode B1", dict(T=1, Hq=16, Hkv=4, D=128)),
                     Case("decode B64", dict(T=64, Hq=16, Hkv=4, D=128)),
                     Case("prefill 4096", dict(T=4096, Hq=16, Hkv=4, D=128))]},
    dtypes={"cpu": [torch.float32, torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)},
    bytes_moved=_kv_bytes,
    baselines={"torch (rope_reference on q and k, index_copy_ of k and v)": torch_rope_kv},
    graph_timing=True,
    bench_dtypes=[torch.bfloat16],
    read_inputs=("q", "k", "v", "cos", "sin"),
    strided=("q", "k", "v", "cos", "sin", "q_out", "k_out", "k_cache", "v_cache"),
    axes={name: ("token", "head", "dim") for name in ("q_out", "k_out")} | {
        name: ("slot", "head", "dim") for name in ("k_cache", "v_cache")},
    hint=ROPE_KV_HINT,
    notes="gpulab = rope_qk_into with the cache arguments, outputs preallocated, as the engine's "
          "TransformerBlock.pre_attention calls it (rope_qk_store_kv adds validation, which reads the slots "
          "back to the host); the baseline is the path it replaced.",
)

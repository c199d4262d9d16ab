"""Grading of notebook 05 (gpulab.paged): inputs, cases, specs, baselines, the no-sync check.

Specs (``gpulab.check(NAME, fn)``): ``paged_decode_attention`` (a launcher
``fn(q, k_cache, v_cache, block_table, seq_lens, o, lse)``), ``split_kv_reduce``,
``paged_decode_split`` (a forced number of partitions) and ``paged_decode_plan_run`` (a
class with ``plan``/``run`` whose run may not read device data on the host).
"""
from __future__ import annotations

import math

import torch

from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..paged import gather_kv, paged_decode_into, paged_decode_reference, paged_decode_split_into, \
    split_reduce_into, split_reduce_reference

def make_paged_inputs(p, dtype, device, gen):
    """A paged cache with the given sequence lengths, its pages in shuffled order, spare
    pages full of other data, and block-table padding past each sequence's pages."""
    lens = list(p["lens"])
    ps, hq, hkv, d = p["page"], p["hq"], p["hkv"], p["d"]
    n_pages = [-(-n // ps) for n in lens]
    total = sum(n_pages) + p.get("spare", 3)
    width = max(n_pages + [1]) + p.get("pad", 1)
    perm = torch.randperm(total, generator=gen, device=device).to(torch.int32)
    bt = torch.randint(0, total, (len(lens), width), generator=gen, device=device, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    k = randn((total, ps, hkv, d), dtype, device, gen)
    v = randn((total, ps, hkv, d), dtype, device, gen, offset=0.3)
    q = randn((len(lens), hq, d), dtype, device, gen, scale=1.5)
    inputs = {"q": q, "k_cache": k, "v_cache": v, "block_table": bt,
              "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device)}
    if "splits" in p:
        inputs["num_splits"] = p["splits"]
    return inputs


def sdpa_contiguous_baseline():
    """SDPA on the same KV stored contiguously [B, Hkv, L, D] (built once per input dict,
    outside the timing): what a paged kernel has to match."""
    cache = {}

    def run(inp):
        key = id(inp)
        if key not in cache:
            cache.clear()
            B = inp["q"].shape[0]
            L = int(inp["seq_lens"].max())
            ks, vs = [], []
            for b in range(B):
                k, v = gather_kv(inp["k_cache"], inp["v_cache"], inp["block_table"], L, b)
                ks.append(k.transpose(0, 1))
                vs.append(v.transpose(0, 1))
            cache[key] = (torch.stack(ks).contiguous(), torch.stack(vs).contiguous())
        kc, vc = cache[key]
        return torch.nn.functional.scaled_dot_product_attention(
            inp["q"][:, :, None, :], kc, vc, enable_gqa=True)
    return run


def decode_bytes(p, dtype):
    B, L = len(p["lens"]), sum(p["lens"])
    return (2 * L * p["hkv"] * p["d"] + 2 * B * p["hq"] * p["d"]) * bytes_of(dtype) + 4 * B * p["hq"]


def decode_flops(p, dtype):
    return 4 * sum(p["lens"]) * p["hq"] * p["d"]


def decode_outputs(inp, dtype):
    B, hq, d = inp["q"].shape
    return {"o": ((B, hq, d), dtype), "lse": ((B, hq), torch.float32)}


# float32: one program that sums a 16K-token context in 512 sequential steps (the
# notebooks' kernels do not split) is off by up to ~4e-5 relative: rounding, not a bug.
DECODE_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 2e-2)}
LSE_TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 5e-3)}

_CPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=4, hkv=2, d=16)),
    Case("ragged: 1, page, page+1, long", dict(lens=[1, 16, 17, 75], page=16, hq=4, hkv=2, d=16)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 31], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 40], page=8, hq=3, hkv=3, d=32)),
]
_GPU_DECODE = [
    Case("one token", dict(lens=[1], page=16, hq=32, hkv=8, d=128)),
    Case("ragged", dict(lens=[1, 16, 17, 1000, 4099], page=16, hq=32, hkv=8, d=128)),
    Case("GQA 6/2, D=24, page 5", dict(lens=[13, 5, 310], page=5, hq=6, hkv=2, d=24)),
    Case("MHA, empty sequence", dict(lens=[0, 9, 4000], page=8, hq=12, hkv=12, d=64)),
    Case("few long", dict(lens=[20000, 777], page=16, hq=32, hkv=8, d=128)),
]

PAGED_DECODE_ATTENTION = KernelSpec(
    name="paged_decode_attention",
    graph_timing=True,
    summary="decode attention through a block table (GQA, split-KV planned from the batch)",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=decode_outputs,
    implementation=paged_decode_into,
    cases={
        "cpu": _CPU_DECODE,
        "gpu": _GPU_DECODE,
        "bench": [Case("B64 L4096", dict(lens=[4096] * 64, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
                  Case("B4 L32768", dict(lens=[32768] * 4, page=16, hq=32, hkv=8, d=128, spare=0, pad=0))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    bytes_moved=decode_bytes,
    flops=decode_flops,
    baselines={"SDPA, contiguous KV": sdpa_contiguous_baseline()},
    read_inputs=("q", "k_cache", "v_cache"),
    bench_dtypes=[torch.bfloat16],
    notes="baseline: SDPA on the same KV copied into a contiguous [B, Hkv, L, D] tensor",
)


def _split_cases(cases, splits):
    return [Case(c.label, {**c.params, "splits": s}) for c, s in zip(cases, splits)]


PAGED_DECODE_SPLIT = KernelSpec(
    name="paged_decode_split",
    summary="paged decode with a forced number of KV partitions and a reduce",
    args=("q", "k_cache", "v_cache", "block_table", "seq_lens", "num_splits", "o", "lse"),
    make_inputs=make_paged_inputs,
    reference=paged_decode_reference,
    outputs=decode_outputs,
    implementation=paged_decode_split_into,
    cases={
        "cpu": _split_cases(_CPU_DECODE, [1, 3, 2, 4]),
        "gpu": _split_cases(_GPU_DECODE, [1, 7, 2, 5, 16]),
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    read_inputs=("q", "k_cache", "v_cache"),
)


def make_partials(p, dtype, device, gen):
    """Partial states of a split-KV decode: normalised outputs and LSEs with a wide
    spread (an exp without the max subtracted overflows) and empty states (-inf)."""
    B, h, s, d = p["b"], p["h"], p["s"], p["d"]
    o = randn((B, h, s, d), torch.float32, device, gen)
    lse = randn((B, h, s), torch.float32, device, gen, scale=p.get("spread", 30.0), offset=40.0)
    empty = torch.rand((B, h, s), generator=gen, device=device) < p.get("empty", 0.25)
    if p.get("all_empty_row", False):
        empty[0, 0, :] = True
    lse = torch.where(empty, -math.inf, lse)
    o = torch.where(empty[..., None], 0.0, o)
    return {"o_part": o.contiguous(), "lse_part": lse.contiguous()}


SPLIT_KV_REDUCE = KernelSpec(
    name="split_kv_reduce",
    summary="merge split-KV partial states (o_p, lse_p) into (o, lse)",
    args=("o_part", "lse_part", "o", "lse"),
    make_inputs=make_partials,
    reference=split_reduce_reference,
    outputs=lambda inp, dtype: {"o": (inp["o_part"].shape[:2] + inp["o_part"].shape[3:], torch.float32),
                                "lse": (inp["lse_part"].shape[:2], torch.float32)},
    implementation=split_reduce_into,
    cases={
        "cpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=3, h=5, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=2, h=4, s=33, d=128, spread=60.0))],
        "gpu": [Case("one split", dict(b=1, h=1, s=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(b=33, h=32, s=7, d=24, all_empty_row=True)),
                Case("many splits", dict(b=4, h=32, s=64, d=128, spread=60.0))],
    },
    dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
    tolerances={torch.float32: (1e-5, 1e-5)},
    read_inputs=("o_part", "lse_part"),
)

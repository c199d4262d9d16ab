"""Grading of gpulab.prefill (append attention over paged KV, append_kv): inputs, cases,
specs, baselines, diagnoses of the usual mistakes, and the ``check_*`` functions."""
from __future__ import annotations

import importlib.util
import math

import torch

from .. import prefill
from ..harness.checking import check, format_ranges
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..paged import gather_kv, to_flashinfer
from .paged import make_page_pool


# =========================================================================================
# Inputs
# =========================================================================================
def make_append_inputs(p, dtype, device, gen):
    """A ragged batch over a paged cache. ``p``: new (new tokens per request), hist
    (history per request; kv_len = hist + new), page, hq, hkv, d, and optionally causal,
    scale, spare (extra pages of unrelated data), pad (block-table columns past the
    longest request; 0 makes the longest fill its table exactly)."""
    new, hist = list(p["new"]), list(p["hist"])
    lens = [h + n for h, n in zip(hist, new)]
    k, v, bt = make_page_pool(lens, p, dtype, device, gen)
    q = randn((sum(new), p["hq"], p["d"]), dtype, device, gen, scale=1.5)
    indptr = torch.zeros(len(new) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(new, dtype=torch.int64).cumsum(0).to(torch.int32)
    return {"q": q, "k_cache": k, "v_cache": v, "qo_indptr": indptr.to(device), "block_tables": bt,
            "kv_lens": torch.tensor(lens, dtype=torch.int32, device=device),
            "causal": bool(p.get("causal", True)), "sm_scale": p.get("scale")}


def make_append_kv_inputs(p, dtype, device, gen):
    """The new tokens' K/V and a cache whose pages hold older data ("before")."""
    inp = make_append_inputs(p, dtype, device, gen)
    total_new, hkv, d = sum(p["new"]), p["hkv"], p["d"]
    return {"k": randn((total_new, hkv, d), dtype, device, gen, offset=-0.2),
            "v": randn((total_new, hkv, d), dtype, device, gen, offset=0.5),
            "qo_indptr": inp["qo_indptr"], "block_tables": inp["block_tables"], "kv_lens": inp["kv_lens"],
            "k_cache_before": inp["k_cache"], "v_cache_before": inp["v_cache"]}


def append_outputs(inp, dtype):
    total_q, hq, d = inp["q"].shape
    return {"o": ((total_q, hq, d), dtype), "lse": ((total_q, hq), torch.float32)}


def append_kv_spec_reference(k, v, qo_indptr, block_tables, kv_lens, k_cache_before, v_cache_before):
    return prefill.append_kv_reference(k, v, k_cache_before, v_cache_before, qo_indptr, block_tables, kv_lens)


# =========================================================================================
# Roofline figures
# =========================================================================================
def _visible_pairs(p) -> int:
    """(new token, visible KV position) pairs of the batch: the attention's work."""
    total = 0
    for n, h in zip(p["new"], p["hist"]):
        total += n * (h + n) if not p.get("causal", True) else n * h + n * (n + 1) // 2
    return total


def append_flops(p, dtype):
    return 4 * _visible_pairs(p) * p["hq"] * p["d"]     # QKᵀ and PV: 2 FLOPs each per MAC


def append_bytes(p, dtype):
    """q read and o written once, each request's KV read once, the LSE written."""
    total_q = sum(p["new"])
    kv = sum(h + n for n, h in zip(p["new"], p["hist"]))
    e = bytes_of(dtype)
    return 2 * total_q * p["hq"] * p["d"] * e + 2 * kv * p["hkv"] * p["d"] * e + 4 * total_q * p["hq"]


def append_kv_bytes(p, dtype):
    return 4 * sum(p["new"]) * p["hkv"] * p["d"] * bytes_of(dtype)


# =========================================================================================
# Baselines
# =========================================================================================
def sdpa_per_request_baseline():
    """PyTorch SDPA once per request, on that request's KV copied into a contiguous
    [1, Hkv, L, D] tensor (outside the timing), with the bottom-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right
    cache = {}

    def run(inp):
        key = id(inp)
        if key not in cache:
            cache.clear()
            indptr = inp["qo_indptr"].tolist()
            items = []
            for b in range(len(indptr) - 1):
                L = int(inp["kv_lens"][b])
                k, v = gather_kv(inp["k_cache"], inp["v_cache"], inp["block_tables"], L, b)
                items.append((indptr[b], indptr[b + 1], L, k.transpose(0, 1)[None].contiguous(),
                              v.transpose(0, 1)[None].contiguous()))
            cache[key] = items
        q, outs = inp["q"], []
        for start, end, L, k, v in cache[key]:
            qb = q[start:end].transpose(0, 1)[None]                     # [1, Hq, n, D]
            mask = causal_lower_right(end - start, L) if inp["causal"] else None
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qb, k, v, attn_mask=mask, scale=inp["sm_scale"], enable_gqa=True))
        return outs
    return run


def flashinfer_baseline():
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper (plan outside the timing, run
    timed) on the same cache; None when FlashInfer is not installed."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    cache = {}

    def run(inp):
        import flashinfer
        key = id(inp)
        if key not in cache:
            cache.clear()
            q, kc = inp["q"], inp["k_cache"]
            _, ps, hkv, d = kc.shape
            kv_indptr, kv_indices, last = to_flashinfer(inp["block_tables"], inp["kv_lens"], ps)
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(inp["qo_indptr"], kv_indptr, kv_indices, last, q.shape[1], hkv, d, ps,
                   causal=inp["causal"], sm_scale=inp["sm_scale"], q_data_type=q.dtype, kv_data_type=kc.dtype)
            cache[key] = (w, ws)
        return cache[key][0].run(inp["q"], (inp["k_cache"], inp["v_cache"]))
    return run


def append_baselines():
    out = {"SDPA per request, contiguous KV": sdpa_per_request_baseline()}
    fi = flashinfer_baseline()
    if fi is not None:
        out["FlashInfer BatchPrefillWithPagedKVCache"] = fi
    return out


# =========================================================================================
# Diagnoses: the usual mistakes, recognised by their outputs
# =========================================================================================
def append_attention_variant(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal=True,
                             sm_scale=None, *, limit_shift=0, square=False, no_mask=False,
                             gqa_modulo=False, table_row0=False, new_keys_only=False,
                             scale_mul=1.0, first_part=None, overlapping_parts=None, **_):
    """The reference with one deliberate mistake (float64): the causal limit shifted by
    ``limit_shift``, a square mask ignoring the history (token j sees positions ≤ j), no
    mask at all, kv head h % Hkv, every request reading row 0 of the block table, or
    only the new tokens' keys, or the softmax scale times ``scale_mul``. Split-KV
    mistakes, for parts of ``(part_len, parts)``: ``first_part``, only the first part's
    state (positions < part_len); ``overlapping_parts``, every part streams to the end,
    so position p counts min(p // part_len + 1, parts) times in the merged state."""
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    scale = (d ** -0.5 if sm_scale is None else float(sm_scale)) * scale_mul
    o = torch.zeros((total_q, hq, d), dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64, device=q.device)
    indptr = qo_indptr.tolist()
    heads = (torch.arange(hq, device=q.device) % hkv if gqa_modulo
             else torch.arange(hq, device=q.device) // (hq // hkv))
    for b in range(len(indptr) - 1):
        start, end, L = indptr[b], indptr[b + 1], int(kv_lens[b])
        n = end - start
        if n == 0 or L == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables, L, 0 if table_row0 else b)
        k, v = k.double()[:, heads], v.double()[:, heads]
        s = torch.einsum("jhd,phd->hjp", q[start:end].double(), k) * scale
        j = torch.arange(n, device=q.device)[:, None]
        p = torch.arange(L, device=q.device)[None, :]
        limit = torch.full_like(j, L)
        if square:
            limit = j + 1
        elif causal and not no_mask:
            limit = L - n + j + 1 + limit_shift
        visible = p < limit
        if new_keys_only:
            visible &= p >= L - n
        if first_part is not None:
            visible &= p < first_part[0]
        if overlapping_parts is not None:       # a position seen c times weighs c · e^s
            part_len, parts = overlapping_parts
            s = s + torch.log(torch.clamp(p // part_len + 1, max=parts).double())
        s = s.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)
        o[start:end] = torch.einsum("hjp,phd->jhd", torch.exp(s - row_lse[..., None]).nan_to_num(0.0), v)
        lse[start:end] = row_lse.transpose(0, 1)
    return {"o": o, "lse": lse}


MISTAKES = (
    (dict(limit_shift=-1), "causal mask off by one: token j of a request must see KV positions "
                           "p < kv_len − n + j + 1 (itself included); yours stops one short."),
    (dict(limit_shift=1), "causal mask off by one: token j of a request must see KV positions "
                          "p < kv_len − n + j + 1; yours lets it see the next token too."),
    (dict(square=True), "a square causal mask (token j sees positions ≤ j) ignores the history: new "
                        "token j is KV position kv_len − n + j, so it sees p < kv_len − n + j + 1 "
                        "(bottom-right alignment)."),
    (dict(new_keys_only=True), "only the new tokens' keys are attended: the history (KV positions "
                               "0 .. kv_len − n − 1, already in the cache) must be read too."),
    (dict(no_mask=True), "the output is attention without the causal mask: with causal=True each new "
                         "token sees only positions up to its own."),
    (dict(gqa_modulo=True), "wrong GQA head map: query head h reads kv head h // (Hq // Hkv), not h % Hkv."),
    (dict(table_row0=True), "every request reads block_tables row 0: the page lookup forgets the "
                            "request's row offset (block_tables + b · stride)."),
    (dict(scale_mul=math.log(2.0)), "the output equals attention with the softmax scale × ln 2: exp2 "
                                    "needs the scores times sm_scale · log2(e), not just sm_scale."),
    (dict(scale_mul=1.0 / math.log(2.0)), "the output equals attention with the softmax scale × log2(e) "
                                          "fed to a natural exp: use exp2 with sm_scale · log2(e), or exp "
                                          "with sm_scale, not a mix."),
)


def _close(got, exp, dtype) -> bool:
    atol, rtol = APPEND_TOL.get(dtype, (1e-4, 1e-4))
    g, e = got.detach().double().cpu(), exp.detach().double().cpu()
    return bool(torch.isclose(g, e, atol=3 * atol, rtol=3 * rtol, equal_nan=True).all())


def append_attention_hint(output, got, expected, inputs):
    """Name the mistake whose output equals the wrong one (spec hint for the check)."""
    dtype = inputs["q"].dtype
    if output == "lse":
        if _close(got, expected / math.log(2.0), torch.float32):
            return ("the LSE is in base 2 (m + log2 l): gpulab's convention is the natural log, "
                    "lse = (m + log2 l) · ln 2 (FlashInfer's base-2 value is lse / ln 2).")
        if _close(got, expected * math.log(2.0), torch.float32):
            return "the LSE was multiplied by ln 2 once too often: lse = (m + log2 l) · ln 2."
    for kw, text in MISTAKES:
        alt = append_attention_variant(**inputs, **kw)[output]
        if torch.allclose(alt, expected, atol=1e-9, rtol=1e-9, equal_nan=True):
            continue           # this case cannot tell the mistake apart
        if _close(got, alt, dtype if output == "o" else torch.float32):
            return text
    return boundary_rows_hint(got, expected, inputs, dtype if output == "o" else torch.float32)


def forced_split(inputs, num_splits: int = 3) -> tuple[int, int] | None:
    """(part_len, parts) of :func:`gpulab.prefill.append_attention_split_into` on these
    inputs (None: the block table is too short to split)."""
    q, kc = inputs["q"], inputs["k_cache"]
    block_n = prefill.append_tile_config(q.dtype, q.shape[2], q.shape[1] // kc.shape[2])["BLOCK_N"]
    split = prefill.plan_kv_split(1, 1, inputs["block_tables"].shape[1] * kc.shape[1], 0, 1, 1, block_n,
                                  "cpu", num_splits)
    return None if split is None else (split.part_len, split.num_splits)


SPLIT_MISTAKES = (
    ("first_part", "the result is the first KV part's state alone: with split-KV every part's partial "
                   "state (o_p, lse_p) must be merged, each weighted by e^(lse_p − M)."),
    ("overlapping_parts", "the KV parts overlap: part p must stream only positions [p·part_len, "
                          "(p+1)·part_len); yours runs on to the end of the history, so later positions "
                          "count several times in the merged state."),
)


def append_split_hint(output, got, expected, inputs):
    """The split-KV mistakes first, then those of the unsplit kernel."""
    split = forced_split(inputs)
    if split is not None:
        dtype = inputs["q"].dtype if output == "o" else torch.float32
        for kw, text in SPLIT_MISTAKES:
            alt = append_attention_variant(**inputs, **{kw: split})[output]
            if not torch.allclose(alt, expected, atol=1e-9, rtol=1e-9, equal_nan=True) and _close(got, alt, dtype):
                return text
    return append_attention_hint(output, got, expected, inputs)


def boundary_rows_hint(got, expected, inputs, dtype):
    """Wrong rows only at the start of requests that follow another: the previous
    request's last q tile ran past its rows (no tail mask on the ragged q axis)."""
    atol, rtol = APPEND_TOL.get(dtype, (1e-4, 1e-4))
    bad = ~torch.isclose(got.detach().double().cpu(), expected.detach().double().cpu(),
                         atol=atol, rtol=rtol, equal_nan=True)
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
    if not rows:
        return None
    indptr = inputs["qo_indptr"].tolist()
    for r in rows:
        b = max(i for i in range(len(indptr) - 1) if indptr[i] <= r)
        if b == 0 or indptr[b - 1] == indptr[b] or r - indptr[b] >= 128:
            return None
    return ("only the first rows of requests that follow another are wrong: a q tile of the previous "
            "request ran past its n_b new tokens and wrote rows of the next one. Mask the tile's rows "
            "(token < n_b), not just the KV columns.")


def stray_rows_hint(output, rows, unwritten, inputs):
    """Stores outside o or lse (spec ``stray_write_hint``): whole token rows right next to
    the output while every element of it was written are extra rows, the rows of a q tile
    beyond its request's new tokens: past the end from the last request's last tile, before
    the start from a work item without a request (a surplus item of the work list, whose
    tile index is negative). Stores that also left part of the output unwritten, or that
    land away from its ends, are shifted ones: the generic message (a wrong base pointer
    or offset) stands."""
    total_q = inputs["q"].shape[0]
    before = [r for r in rows if r < 0]
    after = [r for r in rows if r >= total_q]
    if unwritten or not rows or before != list(range(-len(before), 0)) or \
            after != list(range(total_q, total_q + len(after))):
        return None
    where = []
    if before:
        where.append(f"token rows {format_ranges(before)} before the start: a work item without a request "
                     f"(a surplus item of the work list, its tile index negative) stored its tile")
    if after:
        where.append(f"token rows {format_ranges(after)} past the end: the last request's last tile")
    return (f"the stores outside the output are whole token rows next to it, and every row of it was written "
            f"as well, so its base pointer is right: they are rows of q tiles beyond their request's new tokens "
            f"({'; '.join(where)}). In append attention the q axis is ragged: mask the tile's rows "
            f"(token < n_b, and no row for an item without a request) in the loads of q and the stores, "
            f"not just the KV columns.")


# =========================================================================================
# Cases and specs
# =========================================================================================
APPEND_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 2e-2)}
APPEND_LSE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1e-2, 5e-3)}

# Interpreter tiles are 32 rows = 32 // G tokens (see prefill.append_tile_config): the
# ragged lengths below straddle them, so a flat tiling of q would cross requests.
CPU_CASES = [
    Case("one token, no history", dict(new=[1], hist=[0], page=4, hq=2, hkv=1, d=16)),
    Case("ragged with history", dict(new=[5, 17, 1], hist=[7, 0, 20], page=8, hq=4, hkv=2, d=16)),
    Case("G=3, D=24, page 5, fills its table", dict(new=[3, 9], hist=[12, 1], page=5, hq=6, hkv=2, d=24, pad=0)),
    Case("MHA, non-causal, empty request, scale 0.3",
         dict(new=[4, 0, 6], hist=[3, 5, 0], page=8, hq=3, hkv=3, d=32, causal=False, scale=0.3)),
]
GPU_CASES = [
    Case("one token, no history", dict(new=[1], hist=[0], page=16, hq=32, hkv=8, d=128)),
    Case("ragged, longest fills its table",
         dict(new=[1, 17, 130, 300, 64], hist=[0, 100, 1000, 33, 3920], page=16, hq=32, hkv=8, d=128, pad=0)),
    Case("decode rows beside a chunk",
         dict(new=[1] * 13 + [257], hist=[5, 16, 31, 64, 100, 1, 0, 700, 33, 15, 17, 2000, 9, 511],
              page=16, hq=32, hkv=8, d=128)),
    Case("G=3, D=64, page 5", dict(new=[3, 40, 77], hist=[12, 0, 301], page=5, hq=6, hkv=2, d=64)),
    Case("MHA, non-causal, empty request, scale 0.3",
         dict(new=[40, 0, 129], hist=[3, 5, 0], page=8, hq=12, hkv=12, d=64, causal=False, scale=0.3)),
    Case("G=8, long prompt, no history", dict(new=[1000, 77], hist=[0, 0], page=16, hq=32, hkv=4, d=128)),
]
BENCH_CASES = [
    Case("32 x 512 new over 2K", dict(new=[512] * 32, hist=[2048] * 32, page=16, hq=32, hkv=8, d=128,
                                      spare=0, pad=0)),
    Case("4 x 1K chunks over 8K + 60 decodes over 4K",
         dict(new=[1024] * 4 + [1] * 60, hist=[8192] * 4 + [4096] * 60, page=16, hq=32, hkv=8, d=128,
              spare=0, pad=0)),
    Case("8 x 2K fresh prompts", dict(new=[2048] * 8, hist=[0] * 8, page=16, hq=32, hkv=8, d=128, spare=0, pad=0)),
]

def fresh_append_case(gen: torch.Generator) -> Case:
    """A ragged batch of random sizes (CPU-friendly): a kernel whose grid or tiles only
    cover the listed cases fails on it."""
    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def rnd(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))
    B = rnd(1, 4)
    hkv, group = pick(1, 2), pick(1, 2, 3, 4)
    new = [rnd(0, 19) for _ in range(B)]
    new[rnd(0, B - 1)] = rnd(1, 19)                      # at least one new token
    return Case("random ragged batch", dict(new=new, hist=[rnd(0, 40) for _ in range(B)], page=pick(3, 4, 8, 16),
                                            hq=hkv * group, hkv=hkv, d=pick(16, 24, 32), pad=rnd(0, 2),
                                            causal=pick(True, True, False)))


_ARGS = ("q", "k_cache", "v_cache", "qo_indptr", "block_tables", "kv_lens", "causal", "sm_scale", "o", "lse")
_COMMON = dict(
    args=_ARGS,
    make_inputs=make_append_inputs,
    reference=prefill.append_attention_reference,
    outputs=append_outputs,
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances=APPEND_TOL,
    output_tolerances={"lse": APPEND_LSE_TOL},
    read_inputs=("q", "k_cache", "v_cache"),
    hint=append_attention_hint,
    stray_write_hint=stray_rows_hint,
    axes={"o": ("token", "head", "dim"), "lse": ("token", "head")},
    strided=("q", "k_cache", "v_cache", "block_tables", "o", "lse"),
    fresh_case=fresh_append_case,
)

APPEND_ATTENTION = KernelSpec(
    name="append_attention",
    summary="append/paged-prefill attention: ragged new tokens over paged KV, causal, GQA",
    implementation=prefill.append_attention_into,
    cases={"cpu": CPU_CASES, "gpu": GPU_CASES, "bench": BENCH_CASES},
    bytes_moved=append_bytes,
    flops=append_flops,
    baselines=append_baselines(),
    compile_baselines=False,            # a Python loop over requests, and a CUDA library
    bench_dtypes=[torch.bfloat16],
    notes="baselines: SDPA per request on contiguous copies of its KV (lower-right causal mask); "
          "FlashInfer's paged prefill wrapper when installed",
    **_COMMON,
)

APPEND_ATTENTION_PLAN = KernelSpec(
    name="append_attention_plan",
    summary="append attention through AppendAttention.plan() then run() (host work list)",
    implementation=prefill.append_attention_planned_into,
    cases={"cpu": CPU_CASES[1:], "gpu": GPU_CASES},
    **{**_COMMON, "dtypes": {"cpu": [torch.float32], "gpu": [torch.bfloat16, torch.float16]}},
)

APPEND_ATTENTION_SPLIT = KernelSpec(
    name="append_attention_split",
    summary="append attention with each tile's KV positions split in three parts, merged after",
    implementation=prefill.append_attention_split_into,
    cases={"cpu": CPU_CASES, "gpu": GPU_CASES},
    **{**_COMMON, "dtypes": {"cpu": [torch.float32], "gpu": [torch.float32, torch.bfloat16]},
       "hint": append_split_hint},
)

APPEND_KV = KernelSpec(
    name="append_kv",
    summary="write new tokens' K/V into their pages at positions kv_len - n + j",
    args=("k", "v", "qo_indptr", "block_tables", "kv_lens", "k_cache_before", "v_cache_before",
          "k_cache", "v_cache"),
    make_inputs=make_append_kv_inputs,
    reference=append_kv_spec_reference,
    outputs=lambda inp, dtype: {"k_cache": (inp["k_cache_before"].shape, dtype),
                                "v_cache": (inp["v_cache_before"].shape, dtype)},
    implementation=prefill.append_kv_copy_into,
    cases={"cpu": CPU_CASES[:3], "gpu": GPU_CASES[:4], "bench": BENCH_CASES[:1]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (0.0, 0.0), torch.float16: (0.0, 0.0), torch.bfloat16: (0.0, 0.0)},
    bytes_moved=append_kv_bytes,
    read_inputs=("k", "v"),
    axes={"k_cache": ("page", "slot", "kv head", "dim"), "v_cache": ("page", "slot", "kv head", "dim")},
    strided=("k", "v", "block_tables", "k_cache", "v_cache"),
    fresh_case=fresh_append_case,
)


# =========================================================================================
# Checks
# =========================================================================================
def check_append_attention(fn, **kw):
    """Check a launcher ``fn(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal,
    sm_scale, o, lse)`` writing o [total_q, Hq, D] and lse [total_q, Hq] (natural log)."""
    return check(APPEND_ATTENTION, fn, **kw)


def check_append_kv(fn, **kw):
    """Check an in-place launcher ``fn(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache)``."""
    def launcher(k, v, qo_indptr, block_tables, kv_lens, k_before, v_before, k_cache, v_cache):
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        fn(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache)
    return check(APPEND_KV, launcher, **kw)

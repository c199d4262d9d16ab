"""Grading of notebook 06 (gpulab.cascade): inputs, cases, specs, baselines.

Specs (``gpulab.check(NAME, fn)``): ``merge_state`` (a launcher
``fn(o_a, lse_a, o_b, lse_b, o, lse)``), ``merge_states`` (S states, FlashInfer's layout),
``shared_prefix_attention``, ``cascade_decode_attention``.
"""
from __future__ import annotations

import math

import torch

from ..attention_state import lse_to_base2, merge_state_reference, merge_states_reference
from ..cascade import (CascadeDecodeWrapper, cascade_decode_attention, cascade_decode_into, cascade_reference,
                       merge_state, merge_state_into, merge_states_into, prefix_kv, shared_prefix_into,
                       shared_prefix_reference)
from ..harness.checking import Hypothesis, hypotheses_hint, narrowed_hint
from ..harness.bench import cuda_graph_replay
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..paged import paged_decode_attention, paged_decode_reference, to_flashinfer
from .attention import KEY_TILES, merge_hint
from .paged import (DECODE_TOLERANCES, FLASHINFER_INSTALLED, GRAPH_ROW, LSE_TOLERANCES, PEER_NOTE,
                    decode_outputs, flashinfer_module, make_paged_inputs, make_partials)


def make_states(p, dtype, device, gen):
    """Two states per (row, head) with a wide LSE spread (exp without a max overflows)
    and empty states (-inf, o = 0) on either side, sometimes both."""
    n, h, d = p["n"], p["h"], p["d"]
    out = {}
    for side, off in (("a", 20.0), ("b", -10.0)):
        o = randn((n, h, d), torch.float32, device, gen)
        lse = randn((n, h), torch.float32, device, gen, scale=p.get("spread", 40.0), offset=off)
        empty = torch.rand((n, h), generator=gen, device=device) < p.get("empty", 0.2)
        lse = torch.where(empty, -math.inf, lse)
        out[f"o_{side}"] = torch.where(empty[..., None], 0.0, o).to(dtype)
        out[f"lse_{side}"] = lse
    if p.get("both_empty") and n * h:
        out["lse_a"][0, 0] = -math.inf
        out["lse_b"][0, 0] = -math.inf
        out["o_a"][0, 0] = 0
        out["o_b"][0, 0] = 0
    return {"o_a": out["o_a"], "lse_a": out["lse_a"], "o_b": out["o_b"], "lse_b": out["lse_b"]}


def flashinfer_merge_baseline():
    """FlashInfer's merge_state on the same states, its LSEs converted to base 2 once per
    input dict (outside the timing)."""
    state = {}

    def run(inp):
        if state.get("key") != id(inp):
            state.update(key=id(inp), fi=flashinfer_module(), lse_a=lse_to_base2(inp["lse_a"]),
                         lse_b=lse_to_base2(inp["lse_b"]))
        return state["fi"].merge_state(inp["o_a"], state["lse_a"], inp["o_b"], state["lse_b"])
    return run


def torch_merge(inp):
    """The merge in eager PyTorch (the benchmark's baseline)."""
    lse = torch.logaddexp(inp["lse_a"], inp["lse_b"])
    wa = torch.exp(inp["lse_a"] - lse)[..., None]
    wb = torch.exp(inp["lse_b"] - lse)[..., None]
    return (wa * inp["o_a"] + wb * inp["o_b"]).to(inp["o_a"].dtype), lse


MERGE_STATE = KernelSpec(
    name="merge_state",
    expected_fp_warnings=("divide",),   # a learner's log(0) in tl.where (interpreter)
    summary="merge two attention states (o, lse) over disjoint key sets",
    args=("o_a", "lse_a", "o_b", "lse_b", "o", "lse"),
    make_inputs=make_states,
    reference=merge_state_reference,
    outputs=lambda inp, dtype: {"o": (inp["o_a"].shape, dtype), "lse": (inp["lse_a"].shape, torch.float32)},
    implementation=merge_state_into,
    hint=merge_hint,
    cases={
        "cpu": [Case("one state", dict(n=1, h=1, d=16, empty=0.0)),
                Case("empty states", dict(n=5, h=3, d=24, empty=0.4, both_empty=True)),
                Case("wide spread", dict(n=37, h=4, d=128, spread=80.0))],
        "gpu": [Case("one state", dict(n=1, h=1, d=16, empty=0.0)),
                Case("empty states", dict(n=5, h=3, d=24, empty=0.4, both_empty=True)),
                Case("batch", dict(n=1000, h=32, d=128, spread=80.0))],
        "bench": [Case("256 x 32 x 128", dict(n=256, h=32, d=128, empty=0.0)),
                  Case("8192 x 32 x 128", dict(n=8192, h=32, d=128, empty=0.0))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    bytes_moved=lambda p, dt: p["n"] * p["h"] * (3 * p["d"] * bytes_of(dt) + 12),
    bench_impl=lambda inp: merge_state(inp["o_a"], inp["lse_a"], inp["o_b"], inp["lse_b"]),
    baselines={"torch": torch_merge,
               **({"FlashInfer merge_state": flashinfer_merge_baseline()} if FLASHINFER_INSTALLED else {})},
    compile_baselines=("torch",),
    read_inputs=("o_a", "lse_a", "o_b", "lse_b"),
    bench_dtypes=[torch.bfloat16],
    notes="gpulab = merge_state as called" + (f"; {PEER_NOTE}" if PEER_NOTE else ""),
)


def merge_states_flashinfer_layout_reference(o_states, lse_states):
    """S states in FlashInfer's layout: o_states [N, S, H, D], lse_states [N, S, H]."""
    return merge_states_reference(o_states.transpose(1, 2), lse_states.transpose(1, 2))


def make_multi_states(p, dtype, device, gen):
    n, s, h, d = p["n"], p["s"], p["h"], p["d"]
    parts = make_partials(dict(b=n, h=s, s=h, d=d, empty=p.get("empty", 0.25),
                                     all_empty_row=p.get("all_empty_row", False)),
                                dtype, device, gen)
    # make_partials builds [B, H, S, D]-shaped data; here dims 1 and 2 are (states, heads)
    return {"o_states": parts["o_part"].to(dtype), "lse_states": parts["lse_part"]}


MERGE_STATES = KernelSpec(
    name="merge_states",
    summary="merge S attention states per row (FlashInfer's merge_states layout)",
    args=("o_states", "lse_states", "o", "lse"),
    make_inputs=make_multi_states,
    reference=merge_states_flashinfer_layout_reference,
    outputs=lambda inp, dtype: {"o": ((inp["o_states"].shape[0],) + tuple(inp["o_states"].shape[2:]), dtype),
                                "lse": ((inp["o_states"].shape[0], inp["o_states"].shape[2]), torch.float32)},
    implementation=merge_states_into,
    cases={
        "cpu": [Case("one state", dict(n=1, s=1, h=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(n=3, s=5, h=6, d=24)),
                Case("many states", dict(n=2, s=17, h=4, d=128))],
        "gpu": [Case("one state", dict(n=1, s=1, h=1, d=16, empty=0.0)),
                Case("ragged, empty states", dict(n=33, s=5, h=6, d=24)),
                Case("many states", dict(n=256, s=17, h=32, d=128))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances={torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1e-2)},
    output_tolerances={"lse": {torch.float32: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6),
                               torch.bfloat16: (1e-5, 1e-6)}},
    read_inputs=("o_states", "lse_states"),
)


def make_cascade_inputs(p, dtype, device, gen):
    """A shared prefix of ``prefix`` tokens and per-request suffixes of ``lens`` tokens,
    all in one pool of shuffled pages. With ``full=True`` (benchmarks) also the block
    tables of the same requests without sharing (prefix pages ++ suffix pages), for
    the non-cascade baseline."""
    ps = p["page"]
    P = p["prefix"]
    n_pre = -(-P // ps)
    base = make_paged_inputs({**p, "spare": p.get("spare", 2) + n_pre}, dtype, device, gen)
    total = base["k_cache"].shape[0]
    # The suffix pages are perm[:sum]; the prefix takes pages from the spare ones.
    n_suffix_pages = sum(-(-n // ps) for n in p["lens"])
    in_use = torch.zeros(total, dtype=torch.bool, device=device)
    for b, n in enumerate(p["lens"]):
        in_use[base["block_table"][b, :-(-n // ps)].long()] = True
    free = (~in_use).nonzero().flatten()
    pick = free[torch.randperm(free.numel(), generator=gen, device=device)[:n_pre]]
    assert pick.numel() == n_pre and n_suffix_pages + n_pre <= total
    inputs = {"q": base["q"], "k_cache": base["k_cache"], "v_cache": base["v_cache"],
              "prefix_pages": pick.to(torch.int32), "prefix_len": P,
              "block_table": base["block_table"], "seq_lens": base["seq_lens"]}
    if p.get("full"):
        if P % ps:
            raise ValueError("the non-cascade baseline needs prefix % page == 0")
        bt = torch.cat([inputs["prefix_pages"][None, :].expand(len(p["lens"]), -1),
                        base["block_table"]], dim=1).contiguous()
        inputs["full_block_table"] = bt
        inputs["full_seq_lens"] = base["seq_lens"] + P
    return inputs


def noncascade_baseline(inp):
    """gpulab's paged decode on the same requests, each reading the prefix itself (as called)."""
    return paged_decode_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["full_block_table"],
                                  inp["full_seq_lens"])


def cascade_as_called(inp):
    return cascade_decode_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["prefix_pages"],
                                    inp["prefix_len"], inp["block_table"], inp["seq_lens"])


def cascade_planned(inp):
    """plan() for a benchmark input dict; returns run() with its arguments bound."""
    q, kc = inp["q"], inp["k_cache"]
    cascade = CascadeDecodeWrapper()
    cascade.plan(inp["prefix_pages"], inp["prefix_len"], inp["block_table"], inp["seq_lens"], q.shape[1],
                 kc.shape[2], q.shape[2], kc.shape[1], kc.shape[0], q.dtype)
    return lambda: cascade.run(q, kc, inp["v_cache"])


def flashinfer_cascade_baseline():
    """FlashInfer's two-level MultiLevelCascadeAttentionWrapper: level 0 all queries over the
    prefix pages, level 1 each request over its suffix pages; plan() once per input dict."""
    state = {}

    def run(inp):
        if state.get("key") != id(inp):
            fi = flashinfer_module()
            q, kc = inp["q"], inp["k_cache"]
            B, ps, dev = q.shape[0], kc.shape[1], q.device
            i32 = dict(dtype=torch.int32, device=dev)
            pages = inp["prefix_pages"]
            level0 = (torch.tensor([0, pages.numel()], **i32), pages,
                      torch.tensor([(inp["prefix_len"] - 1) % ps + 1], **i32))
            level1 = to_flashinfer(inp["block_table"], inp["seq_lens"], ps)
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
            wrapper = fi.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
            wrapper.plan([torch.tensor([0, B], **i32), torch.arange(B + 1, **i32)],
                         [level0[0], level1[0]], [level0[1], level1[1]], [level0[2], level1[2]],
                         q.shape[1], kc.shape[2], q.shape[2], ps, causal=False,
                         q_data_type=q.dtype, kv_data_type=kc.dtype)
            state.update(key=id(inp), wrapper=wrapper, workspace=workspace)
        return state["wrapper"].run(inp["q"], (inp["k_cache"], inp["v_cache"]))
    return run


NONCASCADE_ROW = "paged decode (no cascade)"
FLASHINFER_CASCADE_ROW = "FlashInfer cascade run()"   # MultiLevelCascadeAttentionWrapper, 2 levels


def cascade_bytes(p, dtype):
    kv = (p["prefix"] + sum(p["lens"])) * p["hkv"] * p["d"] * 2
    return (kv + 2 * len(p["lens"]) * p["hq"] * p["d"]) * bytes_of(dtype)


def cascade_flops(p, dtype):
    return 4 * p["hq"] * p["d"] * (len(p["lens"]) * p["prefix"] + sum(p["lens"]))


def bench_lens(n, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, hi + 1, (n,), generator=g).tolist()


_CASCADE_CPU = [
    Case("one request", dict(prefix=20, lens=[3], page=16, hq=4, hkv=2, d=16)),
    Case("ragged suffixes, partial prefix page",
         dict(prefix=37, lens=[0, 1, 16, 17, 40], page=16, hq=4, hkv=2, d=16)),
    Case("MHA, D=24, page 5", dict(prefix=23, lens=[5, 11, 2], page=5, hq=3, hkv=3, d=24)),
    Case("no prefix", dict(prefix=0, lens=[4, 9], page=8, hq=4, hkv=1, d=32)),
]
_CASCADE_GPU = [
    Case("one request", dict(prefix=20, lens=[3], page=16, hq=32, hkv=8, d=128)),
    Case("ragged suffixes, partial prefix page",
         dict(prefix=3000 + 7, lens=[0, 1, 16, 17, 256] * 9, page=16, hq=32, hkv=8, d=128)),
    Case("MHA, D=24, page 5", dict(prefix=2323, lens=[5, 11, 2], page=5, hq=3, hkv=3, d=24)),
    Case("no prefix", dict(prefix=0, lens=[4, 900], page=8, hq=4, hkv=1, d=64)),
    Case("long prefix, many requests", dict(prefix=16384, lens=bench_lens(130, 256), page=16,
                                            hq=32, hkv=8, d=128)),
]

# =========================================================================================
# Diagnoses: the references recomputed under plausible mistakes
# =========================================================================================


def prefix_variant(inp, *, pages=None, head_map="group", prefix_len=None, zero_keys=0, score_factor=1.0,
                   stale_tile=0):
    """shared_prefix_reference with one mistake: other cache ``pages`` for the prefix, every
    query head reading kv head 0 (``head_map="zero"``), another ``prefix_len``, ``zero_keys``
    extra keys of score 0 and value 0 (masked loads, unmasked scores), scores times
    ``score_factor``, or the output accumulator not rescaled when the running max moves
    (``stale_tile`` keys per step). None for an empty prefix."""
    q, kc, vc = inp["q"].double(), inp["k_cache"], inp["v_cache"]
    P = int(inp["prefix_len"]) if prefix_len is None else prefix_len
    if P == 0:
        return None
    B, hq, d = q.shape
    hkv = kc.shape[2]
    k, v = prefix_kv(kc, vc, inp["prefix_pages"] if pages is None else pages, P)
    heads = torch.arange(hq) // (hq // hkv) if head_map == "group" else torch.zeros(hq, dtype=torch.long)
    k, v = k.double().cpu(), v.double().cpu()                              # [P, Hkv, D]
    if zero_keys:     # masked loads (zeros), unmasked scores: the extra keys score 0
        k = torch.cat([k, k.new_zeros(zero_keys, hkv, d)])
        v = torch.cat([v, v.new_zeros(zero_keys, hkv, d)])
    # one matmul per kv head with the query heads that read it (keys copied out to every
    # query head would take a gigabyte for a prefix of 16 384 tokens)
    groups = [(j, (heads == j).nonzero().flatten()) for j in range(hkv) if bool((heads == j).any())]
    q = q.cpu()
    s = torch.empty(B, hq, k.shape[0], dtype=torch.float64)
    for j, rows in groups:
        s[:, rows] = q[:, rows] @ k[:, j].T * (d ** -0.5 * score_factor)  # [B, heads, P]
    lse = torch.logsumexp(s, dim=-1)

    def weighted_values(p, t0=0):
        out = torch.empty(B, hq, d, dtype=torch.float64)
        for j, rows in groups:
            out[:, rows] = p[:, rows] @ v[t0:t0 + p.shape[-1], j]
        return out
    if not stale_tile:
        return {"o": weighted_values(torch.exp(s - lse[..., None])), "lse": lse}
    acc = torch.zeros(B, hq, d, dtype=torch.float64)
    m = torch.full((B, hq), -math.inf, dtype=torch.float64)
    for t0 in range(0, s.shape[-1], stale_tile):
        st = s[..., t0:t0 + stale_tile]
        m = torch.maximum(m, st.max(-1).values)
        acc = acc + weighted_values(torch.exp(st - m[..., None]), t0)
    return {"o": acc / torch.exp(lse - m)[..., None], "lse": lse}


def _prefix_tiles(**kw):
    def answer(inp):
        P = int(inp["prefix_len"])
        for t in KEY_TILES:
            if "stale_tile" in kw and t < P:
                yield prefix_variant(inp, stale_tile=t)
            elif "zero_keys" in kw and P % t:
                yield prefix_variant(inp, zero_keys=t - P % t)
    return answer


def _prefix_pages_skipped(inp):
    pages = torch.arange(inp["prefix_pages"].numel(), dtype=torch.int32)
    return None if torch.equal(pages, inp["prefix_pages"].cpu()) else prefix_variant(inp, pages=pages)


PREFIX_HYPOTHESES = (
    Hypothesis("the page table is skipped: prefix token t lies in cache page prefix_pages[t // page_size], "
               "slot t % page_size, not in cache page t // page_size.", _prefix_pages_skipped),
    Hypothesis("every query head reads KV head 0: the KV head of a program is its program_id(1) (kvh), "
               "so the K/V offsets need + kvh · stride_kh.",
               lambda inp: prefix_variant(inp, head_map="zero") if inp["k_cache"].shape[2] > 1 else None),
    Hypothesis("the keys past the prefix (t ≥ prefix_len) in the last tile count with score 0: their loads "
               "are masked, but their scores must be set to -inf too (tl.where(t < prefix_len, s, -inf)).",
               _prefix_tiles(zero_keys=True), outputs=("o",)),
    Hypothesis("the scores carry log2(e) (qk_scale = scale · log2 e) but are exponentiated with exp: use exp2 "
               "(2^(s · log2 e) = e^s), or leave log2(e) out of the scale.",
               lambda inp: prefix_variant(inp, score_factor=1 / math.log(2.0)), outputs=("o",)),
    Hypothesis("the output accumulator is not rescaled when the running max moves: acc = acc · alpha + p·v, "
               "with alpha = 2^(m_old - m_new), like l.", _prefix_tiles(stale_tile=True), outputs=("o",)),
)


def _first_requests(t: torch.Tensor) -> torch.Tensor:
    """The first 8 requests: each computes the same thing over the shared prefix, so a
    mistake shows there as on all 256 of a GPU case (minutes to recompute whole)."""
    return t[:8]


PREFIX_HINT = narrowed_hint(hypotheses_hint(*PREFIX_HYPOTHESES), _first_requests, ("q", "block_table", "seq_lens"))


def _suffix_state(inp):
    return paged_decode_reference(inp["q"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["seq_lens"])


def _cascade_merged(inp, prefix=None, how="merge"):
    p = shared_prefix_reference(**inp) if prefix is None else prefix
    s = _suffix_state(inp)
    if how == "lse swapped":
        return merge_state_reference(p["o"], s["lse"], s["o"], p["lse"])
    if how == "average":
        return {"o": (p["o"] + s["o"]) / 2}
    return merge_state_reference(p["o"], p["lse"], s["o"], s["lse"])


def _prefix_whole_pages(inp):
    P, ps = int(inp["prefix_len"]), inp["k_cache"].shape[1]
    if P % ps == 0:
        return None
    return _cascade_merged(inp, prefix=prefix_variant(inp, prefix_len=-(-P // ps) * ps))


CASCADE_HINT = narrowed_hint(hypotheses_hint(
    Hypothesis("the result is the suffix's state alone: the prefix state (o_p, lse_p) is never merged in; "
               "merge it with the suffix state (o_s, lse_s).",
               lambda inp: _suffix_state(inp) if int(inp["prefix_len"]) else None),
    Hypothesis("the result is the prefix's state alone: the suffix state (paged decode over block_table, "
               "seq_lens) is never merged in.",
               lambda inp: shared_prefix_reference(**inp) if bool((inp["seq_lens"] > 0).any()) else None,
               outputs=("o",)),
    Hypothesis("the merge takes the prefix's o with the suffix's lse (lse_p and lse_s swapped): each state "
               "is weighted by its own LSE.",
               # (an empty prefix gives o = 0, as the prefix's state alone would)
               lambda inp: _cascade_merged(inp, how="lse swapped") if int(inp["prefix_len"]) else None),
    Hypothesis("o is the plain average of the prefix and suffix outputs: each state counts with its weight "
               "exp(lse - max lse) / Σ exp(lse - max lse).", lambda inp: _cascade_merged(inp, how="average"),
               outputs=("o",)),
    Hypothesis("the prefix is read as whole pages: tokens past prefix_len in its last page are attended; "
               "pass prefix_len itself (the last page is partial).", _prefix_whole_pages),
    Hypothesis("lse is the prefix's LSE alone: the suffix's lse_s is never merged in; the merged LSE is "
               "log(exp(lse_p) + exp(lse_s)), the merge's own lse output.",
               lambda inp: {"lse": shared_prefix_reference(**inp)["lse"]} if bool((inp["seq_lens"] > 0).any())
               else None, outputs=("lse",)),
), _first_requests, ("q", "block_table", "seq_lens"))


CASCADE_DECODE_ATTENTION = KernelSpec(
    name="cascade_decode_attention",
    expected_fp_warnings=("divide",),   # a learner's log(0) in tl.where (interpreter)
    summary="decode for requests sharing a prefix: prefix read once (multi-query), suffixes paged, merged",
    args=("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "block_table", "seq_lens", "o", "lse"),
    make_inputs=make_cascade_inputs,
    reference=cascade_reference,
    outputs=decode_outputs,
    implementation=cascade_decode_into,
    hint=CASCADE_HINT,
    cases={
        "cpu": _CASCADE_CPU,
        "gpu": _CASCADE_GPU,
        # The sizes first (GQA 32/8 and MHA 32/32), then a sweep over batch and
        # prefix length for the speed-up plot of notebook 06.
        "bench": [Case(f"P{P} B{B} {hq}/{hkv}",
                       dict(prefix=P, lens=bench_lens(B, 256), page=16, hq=hq, hkv=hkv, d=128,
                            spare=0, pad=0, full=True))
                  for P, B, hq, hkv in ((32768, 256, 32, 8), (32768, 256, 32, 32), (32768, 64, 32, 8),
                                        (32768, 16, 32, 8), (8192, 256, 32, 8), (8192, 64, 32, 8),
                                        (8192, 16, 32, 8), (2048, 256, 32, 8))],
    },
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    bytes_moved=cascade_bytes,
    flops=cascade_flops,
    bench_impl=cascade_as_called,     # the public function as called leads; then the graph, peers
    baselines={GRAPH_ROW: cuda_graph_replay(cascade_planned), NONCASCADE_ROW: noncascade_baseline,
               **({FLASHINFER_CASCADE_ROW: flashinfer_cascade_baseline()} if FLASHINFER_INSTALLED else {})},
    compile_baselines=False,   # every baseline is a Triton kernel or a library's own
    read_inputs=("q", "k_cache", "v_cache"),
    bench_dtypes=[torch.bfloat16],
    notes="gpulab = cascade_decode_attention as called; baseline: gpulab's paged decode on the same "
          "requests, prefix pages in every block table" + (f"; {PEER_NOTE}" if PEER_NOTE else ""),
)


def _rising_prefix_scores(inputs, params, dtype, gen):
    """keys whose scores rise along the prefix for about half of the queries, so their
    running max moves in every tile (random data can leave it almost still)."""
    q, k = inputs["q"].float(), inputs["k_cache"].clone()
    pages, n = inputs["prefix_pages"].long(), int(inputs["prefix_len"])
    hkv, d, page = k.shape[2], k.shape[3], k.shape[1]
    direction = q.reshape(q.shape[0], hkv, -1, d).mean(dim=(0, 2))          # [Hkv, D]
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    reach = (q.reshape(q.shape[0], hkv, -1, d) @ direction[None, :, :, None]).abs().mean().clamp_min(1e-3)
    t = torch.arange(n, device=k.device)
    rise = (8.0 * d ** 0.5 / float(reach)) * t / max(n - 1, 1)            # up to ~8 in score units
    k[pages[t // page], t % page] += (rise[:, None, None] * direction[None]).to(k.dtype)
    return {**inputs, "k_cache": k}


SHARED_PREFIX_ATTENTION = KernelSpec(
    name="shared_prefix_attention",
    summary="multi-query attention of all requests' queries over one shared paged prefix",
    args=("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "o", "lse"),
    make_inputs=make_cascade_inputs,
    reference=shared_prefix_reference,
    outputs=decode_outputs,
    implementation=shared_prefix_into,
    hint=PREFIX_HINT,
    cases={"cpu": _CASCADE_CPU[:3], "gpu": _CASCADE_GPU[1:3] + _CASCADE_GPU[4:]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16]},
    tolerances=DECODE_TOLERANCES,
    output_tolerances={"lse": LSE_TOLERANCES},
    read_inputs=("q", "k_cache", "v_cache"),
    edge_data=_rising_prefix_scores,
)

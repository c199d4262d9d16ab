"""Attention-state merge and cascade (shared-prefix) decode attention."""
import doctest
import math

import pytest
import torch

import gpulab
from gpulab import cascade, paged, runtime
from gpulab.grading import cascade as CG
from gpulab.grading import paged as PG
from gpulab.harness.checking import rejects
from gpulab.harness.spec import get

DEV = runtime.device()
GPU = runtime.mode() == "compiled"
WHERE = "gpu" if GPU else "cpu"


@pytest.mark.parametrize("name", ["merge_state", "merge_states", "shared_prefix_attention",
                                  "cascade_decode_attention"])
def test_implementation_passes(name):
    gpulab.check(name, get(name).implementation)


# -- the merge operator -----------------------------------------------------------------------
def _state(keys, q, scale=0.3):
    """Exact state (o, lse) of queries q [N, H, D] over keys/values keys [N, K, H, D] (float64)."""
    if keys.shape[1] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], -math.inf, dtype=q.dtype)
    s = torch.einsum("nhd,nkhd->nhk", q, keys) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("nhk,nkhd->nhd", torch.softmax(s, -1), keys), lse


def test_merge_equals_attention_over_the_union_and_is_assoc_comm():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 16, generator=g, dtype=torch.float64)
    keys = torch.randn(4, 11, 3, 16, generator=g, dtype=torch.float64) * 2
    parts = [keys[:, :3], keys[:, 3:4], keys[:, 4:], keys[:, :0]]          # the last: empty
    st = [tuple(t.to(DEV) for t in (_state(p, q)[0].float(), _state(p, q)[1].float())) for p in parts]
    o_all, lse_all = _state(keys, q)
    m = cascade.merge_state
    ab = m(*st[0], *st[1])
    ab_c = m(*ab, *st[2])
    a_bc = m(*st[0], *m(*st[1], *st[2]))
    for o, lse in (ab_c, a_bc, m(*st[2], *m(*st[0], *st[1])), m(*ab_c, *st[3]), m(*st[3], *ab_c)):
        torch.testing.assert_close(o.double().cpu(), o_all, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double().cpu(), lse_all, atol=1e-5, rtol=1e-6)
    # commutativity, exactly
    x, y = m(*st[0], *st[1]), m(*st[1], *st[0])
    torch.testing.assert_close(x[0], y[0], atol=1e-6, rtol=0)
    # multi-state merge agrees
    o_s = torch.stack([s[0] for s in st], 1)
    l_s = torch.stack([s[1] for s in st], 1)
    o, lse = cascade.merge_states(o_s, l_s)
    torch.testing.assert_close(o.double().cpu(), o_all, atol=1e-5, rtol=1e-5)


def test_empty_states_merge_to_the_other_and_never_nan():
    o = torch.randn(2, 3, 16, device=DEV)
    lse = torch.randn(2, 3, device=DEV) * 50
    empty_o = torch.zeros_like(o)
    empty_l = torch.full_like(lse, -math.inf)
    for a, b in (((o, lse), (empty_o, empty_l)), ((empty_o, empty_l), (o, lse))):
        r_o, r_l = cascade.merge_state(*a, *b)
        torch.testing.assert_close(r_o, o)
        torch.testing.assert_close(r_l, lse)
    r_o, r_l = cascade.merge_state(empty_o, empty_l, empty_o, empty_l)
    assert (r_o == 0).all() and torch.isneginf(r_l).all()
    # huge LSEs: no overflow
    r_o, r_l = cascade.merge_state(o, lse + 1000, o, lse + 1000)
    torch.testing.assert_close(r_l, lse + 1000 + math.log(2))
    torch.testing.assert_close(r_o, o)


def test_base2_conversion():
    lse = torch.tensor([0.0, 1.0, -math.inf, 30.0])
    assert torch.allclose(cascade.lse_from_base2(cascade.lse_to_base2(lse))[[0, 1, 3]], lse[[0, 1, 3]])
    assert torch.isneginf(cascade.lse_to_base2(lse)[2])
    # FlashInfer's definition: lse2 = log2(sum 2^(s·log2 e)) for scores s
    s = torch.randn(10, dtype=torch.float64)
    assert torch.allclose(cascade.lse_to_base2(torch.logsumexp(s, 0)), torch.log2(torch.exp(s).sum()))


def test_merge_validation():
    o = torch.randn(2, 3, 16, device=DEV)
    lse = torch.zeros(2, 3, device=DEV)
    gpulab.show_error(cascade.merge_state, o, lse.double(), o, lse)
    gpulab.show_error(cascade.merge_state, o, lse[:1], o, lse)
    gpulab.show_error(cascade.merge_state, o, lse, o.half(), lse)
    bad = lse.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        cascade.merge_state(o, lse, o, bad, validate=True)
    with pytest.raises(ValueError, match="no states"):
        cascade.merge_states(o[:, :0, None].expand(2, 0, 3, 16).contiguous(), torch.zeros(2, 0, 3, device=DEV))


# -- cascade decode ---------------------------------------------------------------------------
def _cascade_inputs(prefix, lens, page=4, hq=4, hkv=2, d=16, dtype=torch.float32, full=False):
    g = torch.Generator(device=DEV).manual_seed(3)
    return CG.make_cascade_inputs(dict(prefix=prefix, lens=lens, page=page, hq=hq, hkv=hkv, d=d,
                                            full=full), dtype, DEV, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cascade_equals_noncascade_paged_decode(dtype):
    inp = _cascade_inputs(prefix=24, lens=[0, 1, 4, 5, 13], page=4, dtype=dtype, full=True)
    o, lse = cascade.cascade_decode_attention(**{k: v for k, v in inp.items() if not k.startswith("full")},
                                              return_lse=True)
    o2, lse2 = paged.paged_decode_attention(inp["q"], inp["k_cache"], inp["v_cache"],
                                            inp["full_block_table"], inp["full_seq_lens"], return_lse=True)
    ref = cascade.cascade_reference(**inp)
    atol, rtol = PG.DECODE_TOLERANCES[dtype]
    torch.testing.assert_close(o.double(), ref["o"], atol=atol, rtol=rtol)
    torch.testing.assert_close(o.double(), o2.double(), atol=2 * atol, rtol=rtol)
    torch.testing.assert_close(lse, lse2, atol=PG.LSE_TOLERANCES[dtype][0], rtol=1e-3)


def test_cascade_validation():
    inp = _cascade_inputs(prefix=10, lens=[3, 7])
    P = inp["k_cache"].shape[0]
    pages = inp["prefix_pages"].clone()
    pages[1] = P + 5
    with pytest.raises(IndexError, match=r"prefix_pages\[1\]"):
        cascade.cascade_decode_attention(**{**inp, "prefix_pages": pages}, validate=True)
    with pytest.raises(ValueError, match="needs 4 pages"):
        cascade.cascade_decode_attention(**{**inp, "prefix_len": 13})
    with pytest.raises(ValueError, match="non-negative int"):
        cascade.cascade_decode_attention(**{**inp, "prefix_len": -1})
    bt = inp["block_table"].clone()
    bt[0, 0] = -3
    with pytest.raises(IndexError, match=r"block_table\[0, 0\]"):
        cascade.cascade_decode_attention(**{**inp, "block_table": bt}, validate=True)
    with pytest.raises(TypeError, match="int32"):
        cascade.shared_prefix_attention(inp["q"], inp["k_cache"], inp["v_cache"], inp["prefix_pages"].long(), 10)


# -- the checks reject wrong implementations ------------------------------------------------
def _merge_mutant(kind):
    def fn(o_a, lse_a, o_b, lse_b, o, lse):
        la, lb = lse_a.double(), lse_b.double()
        if kind == "no_max":           # e^lse directly, in float32 as a kernel would: overflows
            wa, wb = torch.exp(lse_a).double(), torch.exp(lse_b).double()
        elif kind == "nan_empty":      # max subtracted, but -inf - (-inf) = NaN
            mm = torch.maximum(la, lb)
            wa, wb = torch.exp(la - mm), torch.exp(lb - mm)
        else:
            mm = torch.maximum(la, lb)
            mm = torch.where(torch.isfinite(mm), mm, 0)
            wa, wb = torch.exp(la - mm), torch.exp(lb - mm)
            if kind == "average":      # plain average of the two outputs
                wa, wb = torch.ones_like(wa), torch.ones_like(wb)
            if kind == "base2":        # FlashInfer's base-2 LSE mixed with natural log
                wa, wb = torch.exp2(la - mm), torch.exp2(lb - mm)
            if kind == "b_unread":
                o_b = torch.zeros_like(o_b)
        tot = wa + wb
        safe = torch.where(tot > 0, tot, 1.0) if kind != "nan_empty" else tot
        out = (wa[..., None] * o_a.double() + wb[..., None] * o_b.double()) / safe[..., None]
        o.copy_(out.to(o.dtype))
        if kind == "tail_rows":        # last row never written
            o[-1:].fill_(0)
        new_lse = torch.log(tot) + (mm if kind not in ("no_max",) else 0)
        lse.copy_(new_lse.float())
        if kind == "oob":
            torch.as_strided(lse, (lse.numel() + 8,), (1,))[lse.numel():] = 0
    return fn


@pytest.mark.parametrize("kind, expect", [("no_max", "NaN"), ("nan_empty", "NaN"), ("average", "wrong"),
                                          ("base2", "wrong"), ("b_unread", "o_b"), ("oob", "past the end"),
                                          ("tail_rows", "wrong")])
def test_merge_check_rejects(kind, expect):
    msg = rejects("merge_state", _merge_mutant(kind), dtypes=[torch.float32])
    assert expect in msg, msg


def test_merge_diagnosis_of_exponentials_without_the_max_is_not_base_2():
    """The no-max mistake, on a seed where no LSE overflows and one underflows (float32
    e^-101 keeps a few digits): an LSE off by 0.03 at -101 was once diagnosed as base 2,
    whose relative tolerance grew with the LSE. Now the mistake's own recomputation names it,
    and the base-2 mistake keeps its diagnosis."""
    empty = [c for c in CG.MERGE_STATE.cases["cpu"] if c.params.get("both_empty")]
    msg = rejects("merge_state", _merge_mutant("no_max"), dtypes=[torch.float32], cases=empty, seed=1703997960)
    assert "without subtracting M" in msg and "base 2" not in msg, msg

    def lse_in_base_2(o_a, lse_a, o_b, lse_b, o, lse):       # FlashInfer's convention, o right
        _merge_mutant("right")(o_a, lse_a, o_b, lse_b, o, lse)
        lse.mul_(1 / math.log(2))
    msg = rejects("merge_state", lse_in_base_2, dtypes=[torch.float32], cases=empty, seed=1703997960)
    assert "base 2" in msg, msg


def _prefix_mutant(kind):
    def fn(q, k_cache, v_cache, prefix_pages, prefix_len, o, lse):
        pages = prefix_pages
        n = prefix_len
        if kind == "wrong_page":              # pages in cache order, prefix_pages ignored
            pages = torch.arange(prefix_pages.numel(), dtype=torch.int32, device=q.device)
        if kind == "full_pages":              # no mask on the partial last page
            n = prefix_pages.numel() * k_cache.shape[1]
        ref = cascade.shared_prefix_reference(q, k_cache, v_cache, pages, n,
                                              scale=q.shape[-1] ** -0.5 * (1.3 if kind == "scale" else 1))
        o.copy_(ref["o"].to(o.dtype))
        lse.copy_(ref["lse"].float())
        if kind == "group":                   # every query head reads kv head 0
            hkv = k_cache.shape[2]
            k0 = k_cache[:, :, :1].expand_as(k_cache).contiguous()
            v0 = v_cache[:, :, :1].expand_as(v_cache).contiguous()
            r = cascade.shared_prefix_reference(q, k0, v0, pages, n)
            if hkv > 1:
                o.copy_(r["o"].to(o.dtype))
                lse.copy_(r["lse"].float())
            else:                             # MHA: same thing; break it another way
                o.mul_(1.1)
    return fn


@pytest.mark.parametrize("kind", ["wrong_page", "full_pages", "scale", "group"])
def test_shared_prefix_check_rejects(kind):
    cases = get("shared_prefix_attention").cases[WHERE][:2]
    msg = rejects("shared_prefix_attention", _prefix_mutant(kind), cases=cases, dtypes=[torch.float32])
    assert "wrong" in msg, msg


def test_cascade_check_rejects_prefix_only_and_suffix_only():
    def prefix_only(q, k, v, pp, pl, bt, sl, o, lse):
        cascade.shared_prefix_into(q, k, v, pp, pl, o, lse)

    def suffix_only(q, k, v, pp, pl, bt, sl, o, lse):
        paged.paged_decode_into(q, k, v, bt, sl, o, lse)

    def unmerged_sum(q, k, v, pp, pl, bt, sl, o, lse):     # outputs added, not weighted
        o1, l1 = torch.empty_like(o), torch.empty_like(lse)
        cascade.shared_prefix_into(q, k, v, pp, pl, o1, l1)
        paged.paged_decode_into(q, k, v, bt, sl, o, lse)
        o.add_(o1)
        lse.copy_(torch.logaddexp(l1, lse))

    cases = get("cascade_decode_attention").cases[WHERE][1:2]
    for fn in (prefix_only, suffix_only, unmerged_sum):
        msg = rejects("cascade_decode_attention", fn, cases=cases, dtypes=[torch.float32])
        assert "wrong" in msg, msg


# -- plan/run --------------------------------------------------------------------------------
def _cascade_planned(inp):
    q, kc = inp["q"], inp["k_cache"]
    casc = cascade.CascadeDecodeWrapper()
    casc.plan(inp["prefix_pages"], inp["prefix_len"], inp["block_table"], inp["seq_lens"], q.shape[1],
              kc.shape[2], q.shape[2], kc.shape[1], kc.shape[0], q.dtype)
    return casc


def _args(inp):
    return {k: inp[k] for k in ("q", "k_cache", "v_cache", "prefix_pages", "prefix_len", "block_table",
                                "seq_lens")}


def test_cascade_run_reads_no_device_value_on_the_host_while_the_layout_changes():
    inp = _cascade_inputs(prefix=37, lens=[0, 1, 16, 17, 9], page=4)
    real = inp["seq_lens"].clone()
    inp["seq_lens"].copy_(torch.div(real, 2, rounding_mode="floor"))
    casc = _cascade_planned(inp)
    casc.run(inp["q"], inp["k_cache"], inp["v_cache"])
    inp["seq_lens"].copy_(real)
    for step in range(2):
        if step == 1:                                     # the prefix moves to other pages, in place
            ref_pages = inp["prefix_pages"].clone()
            inp["k_cache"][inp["prefix_pages"].long()] = inp["k_cache"][ref_pages.flip(0).long()]
            inp["v_cache"][inp["prefix_pages"].long()] = inp["v_cache"][ref_pages.flip(0).long()]
            inp["prefix_pages"].copy_(ref_pages.flip(0))
        with PG.no_host_sync("run()"):
            o, lse = casc.run(inp["q"], inp["k_cache"], inp["v_cache"], return_lse=True)
        ref = cascade.cascade_reference(**_args(inp))
        torch.testing.assert_close(o.double(), ref["o"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse.double(), ref["lse"], atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not GPU, reason="CUDA graphs and sync debug mode need a GPU")
def test_cascade_graph_replay_equals_eager_and_never_syncs():
    inp = _cascade_inputs(prefix=3000, lens=[1, 16, 200, 17] * 8, page=16, hq=32, hkv=8, d=128,
                          dtype=torch.bfloat16)
    casc = _cascade_planned(inp)
    casc.run(inp["q"], inp["k_cache"], inp["v_cache"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        casc.run(inp["q"], inp["k_cache"], inp["v_cache"])
        cascade.cascade_decode_attention(**_args(inp))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with gpulab.runtime.cuda_graph_capture(graph):
        out = casc.run(inp["q"], inp["k_cache"], inp["v_cache"])
    for lens in ([2, 17, 201, 18] * 8, [0, 0, 220, 5] * 8):     # capacity: 14 pages of 16
        inp["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        expect = cascade.cascade_decode_attention(**_args(inp))
        torch.testing.assert_close(out, expect, atol=0, rtol=0)


def test_cascade_bad_prefix_page_without_validation_stays_in_the_cache_and_is_reported():
    inp = _cascade_inputs(prefix=10, lens=[3, 7])
    P = inp["k_cache"].shape[0]
    bad = inp["prefix_pages"].clone()
    bad[1] = P + 5
    o = cascade.cascade_decode_attention(**{**_args(inp), "prefix_pages": bad})
    assert torch.isfinite(o).all()
    assert paged.fault_flag(DEV).tolist()[0] == paged.FAULT_PREFIX_PAGE
    with pytest.raises(paged.LayoutFault, match="shared-prefix page"):
        cascade.cascade_decode_attention(**_args(inp), validate=True)
    with pytest.raises(IndexError, match=r"prefix_pages\[1\]"):
        _cascade_planned({**inp, "prefix_pages": bad})


def test_cascade_wrapper_docstring_example_runs():
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(cascade.CascadeDecodeWrapper, globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0

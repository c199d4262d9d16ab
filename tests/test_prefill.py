"""Append (paged-prefill) attention and append_kv: kernels, plan/run, validation, safety,
and the checks against wrong kernels."""
import contextlib
import functools
import math

import numpy as np
import pytest
import torch

import gpulab
from gpulab import attention, paged, prefill
from gpulab.grading import prefill as G
from gpulab.harness.checking import Guarded, rejects
from gpulab.harness.spec import Case

from helpers import mutant_module, on_gpu

DEV = gpulab.device()
WHERE = "gpu" if on_gpu() else "cpu"


def _inputs(new, hist, page=8, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0, **kw):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return G.make_append_inputs(dict(new=new, hist=hist, page=page, hq=hq, hkv=hkv, d=d, **kw), dtype, DEV, g)


def _layout(inp):
    return {k: inp[k] for k in ("qo_indptr", "block_tables", "kv_lens")}


def _assert_matches(o, lse, ref, dtype):
    atol, rtol = G.APPEND_TOL[dtype]
    torch.testing.assert_close(o.double(), ref["o"], atol=atol, rtol=rtol)
    if lse is not None:
        latol, lrtol = G.APPEND_LSE_TOL[dtype]
        torch.testing.assert_close(lse.double(), ref["lse"], atol=latol, rtol=lrtol)


# -- the package passes its own checks (GPU cases, compiled, when a GPU is present) ----------
@pytest.mark.parametrize("name", ["append_attention", "append_attention_plan", "append_attention_split", "append_kv"])
def test_implementation_passes(name):
    gpulab.check(name, gpulab.get_spec(name).implementation, quiet=True)


# -- public function ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_public_matches_reference(dtype):
    inp = _inputs([3, 20, 1, 0], [9, 0, 33, 4], page=4, hq=6, hkv=2, d=24, dtype=dtype)
    ref = prefill.append_attention_reference(**inp)
    o, lse = prefill.append_attention(inp["q"], inp["k_cache"], inp["v_cache"], **_layout(inp),
                                      return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == inp["q"].shape
    _assert_matches(o, lse, ref, dtype)
    # out=, a custom scale, no mask
    out = torch.full_like(inp["q"], 7.0)
    res = prefill.append_attention(inp["q"], inp["k_cache"], inp["v_cache"], **_layout(inp), causal=False,
                                   sm_scale=0.11, out=out)
    assert res is out
    _assert_matches(out, None, prefill.append_attention_reference(**{**inp, "causal": False, "sm_scale": 0.11}),
                    dtype)


def test_strided_q_from_a_fused_projection():
    inp = _inputs([3, 8], [4, 0])
    qkv = torch.randn(11, 4 + 2 + 2, 16, device=DEV)          # [tokens, Hq + 2 Hkv, D]
    q = qkv[:, :4]                                               # a view: row stride 8·16
    o = prefill.append_attention(q, inp["k_cache"], inp["v_cache"], **_layout(inp))
    _assert_matches(o, None, prefill.append_attention_reference(**{**inp, "q": q}), torch.float32)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        prefill.append_attention(q.transpose(1, 2), inp["k_cache"], inp["v_cache"], **_layout(inp))


def test_empty_batch_and_empty_rows():
    inp = _inputs([2], [0], page=4)
    empty = dict(qo_indptr=torch.zeros(1, dtype=torch.int32, device=DEV),
                 block_tables=torch.zeros((0, 1), dtype=torch.int32, device=DEV),
                 kv_lens=torch.zeros(0, dtype=torch.int32, device=DEV))
    q0 = inp["q"][:0]
    o = prefill.append_attention(q0, inp["k_cache"], inp["v_cache"], **empty)
    assert o.shape == (0, 4, 16)
    # kv_len = 0 with no new tokens next to a normal request: the normal one is right
    inp = _inputs([0, 5], [0, 3], page=4)
    o, lse = prefill.append_attention(inp["q"], inp["k_cache"], inp["v_cache"], **_layout(inp), return_lse=True)
    _assert_matches(o, lse, prefill.append_attention_reference(**inp), torch.float32)


def test_against_contiguous_attention_through_a_paged_cache_in_chunks():
    """An independent reference: notebook 04's attention on contiguous tensors. Prompts go
    into a PagedKVCache chunk by chunk (chunked prefill): append_kv writes each chunk's
    K/V, append_attention attends over history + chunk; the outputs equal one causal
    attention over the whole prompt."""
    hq, hkv, d, ps = 4, 2, 16, 4
    g = torch.Generator().manual_seed(3)
    prompts = [13, 6, 1]
    qs = [torch.randn(n, hq, d, generator=g) for n in prompts]
    ks = [torch.randn(n, hkv, d, generator=g) for n in prompts]
    vs = [torch.randn(n, hkv, d, generator=g) for n in prompts]
    cache = paged.PagedKVCache(num_pages=16, page_size=ps, num_kv_heads=hkv, head_dim=d, device=DEV)
    seqs = [cache.allocate() for _ in prompts]
    outs = [[] for _ in prompts]
    chunks = [(5, 4, 1), (8, 2, 0)]          # tokens per request per step
    done = [0, 0, 0]
    for step in chunks:
        for s, n in zip(seqs, step):         # reserve the chunk's slots (the engine's block manager)
            cache.append(s, torch.zeros(n, hkv, d), torch.zeros(n, hkv, d))
        take = [(done[i], min(done[i] + n, prompts[i])) for i, n in enumerate(step)]
        indptr = torch.tensor([0] + list(np.cumsum([b - a for a, b in take])), dtype=torch.int32, device=DEV)
        q = torch.cat([qs[i][a:b] for i, (a, b) in enumerate(take)]).to(DEV)
        k = torch.cat([ks[i][a:b] for i, (a, b) in enumerate(take)]).to(DEV)
        v = torch.cat([vs[i][a:b] for i, (a, b) in enumerate(take)]).to(DEV)
        bt, lens = cache.block_table(seqs), cache.seq_lens(seqs)
        prefill.append_kv(k, v, cache.k_cache, cache.v_cache, indptr, bt, lens, validate=True)
        o = prefill.append_attention(q, cache.k_cache, cache.v_cache, indptr, bt, lens, validate=True)
        for i, (a, b) in enumerate(take):
            outs[i].append(o[int(indptr[i]):int(indptr[i + 1])].cpu())
            done[i] = b
    for i in range(len(prompts)):
        ref = attention.attention_reference(qs[i].transpose(0, 1)[None], ks[i].transpose(0, 1)[None],
                                            vs[i].transpose(0, 1)[None], causal=True)["o"][0].transpose(0, 1)
        torch.testing.assert_close(torch.cat(outs[i]).double(), ref, atol=1e-5, rtol=1e-5)


# -- plan / run -------------------------------------------------------------------------------
def _plan_for(inp, **kw):
    _, ps, hkv, d = inp["k_cache"].shape
    return prefill.AppendAttention(inp["q"].shape[1], hkv, d, page_size=ps, num_pages=inp["k_cache"].shape[0],
                                   dtype=inp["q"].dtype, device=DEV, **kw)


def test_plan_run_matches_and_replans_in_place():
    layouts = [([5, 17, 1], [7, 0, 20]), ([1, 1], [30, 2]), ([12, 3, 4, 1], [0, 9, 1, 15])]
    attn = None
    for i, (new, hist) in enumerate(layouts):
        used = sum(-(-(n + h) // 8) for n, h in zip(new, hist))
        inp = _inputs(new, hist, seed=i, spare=16 - used)          # one pool of 16 pages
        if attn is None:     # fixed buffers, sized for all three layouts
            attn = _plan_for(inp, max_batch_size=4, max_num_tokens=24, max_pages_per_request=8)
            bufs = [t.data_ptr() for t in (attn.qo_indptr, attn.block_tables, attn.kv_lens, attn.work_req,
                                            attn.out, attn.lse)]
        host = {k: v.cpu() for k, v in _layout(inp).items()}           # host arrays: no sync in plan
        attn.plan(**host)
        ref = prefill.append_attention_reference(**inp)
        o, lse = attn.run(inp["q"], inp["k_cache"], inp["v_cache"], return_lse=True)
        _assert_matches(o, lse, ref, torch.float32)
        assert [t.data_ptr() for t in (attn.qo_indptr, attn.block_tables, attn.kv_lens, attn.work_req,
                                       attn.out, attn.lse)] == bufs
    # q padded past the planned tokens (a graph bucket): the padding rows are not written
    qpad = torch.cat([inp["q"], torch.randn(3, *inp["q"].shape[1:], device=DEV)])
    out = torch.full_like(qpad, 5.0)
    attn.run(qpad, inp["k_cache"], inp["v_cache"], out=out)
    _assert_matches(out[:-3], None, ref, torch.float32)
    assert (out[-3:] == 5.0).all()
    # the same buffers fed to a kernel launch each time (what a CUDA graph captures)
    assert attn.work_req.shape[0] == -(-24 // attn.tile_tokens) + 4


def test_plan_fits_tiles_to_short_requests():
    inp = _inputs([1, 1, 2], [30, 2, 9])
    attn = _plan_for(inp).plan(**_layout(inp))
    default = prefill.append_tile_config(torch.float32, 16, 2)["BLOCK_M"]
    assert attn.config["BLOCK_M"] == 16 < default
    _assert_matches(attn.run(inp["q"], inp["k_cache"], inp["v_cache"]), None,
                    prefill.append_attention_reference(**inp), torch.float32)
    fixed = _plan_for(inp, max_batch_size=3, max_num_tokens=4, max_pages_per_request=8)
    assert fixed.plan(**_layout(inp)).config["BLOCK_M"] == default     # a graph keeps its kernel


def test_plan_append_kv_and_lists():
    inp = _inputs([3, 6], [5, 0], page=4)
    attn = _plan_for(inp)
    attn.plan(inp["qo_indptr"].tolist(), inp["block_tables"].tolist(), inp["kv_lens"].tolist())
    k = torch.randn(9, 2, 16, device=DEV)
    v = torch.randn(9, 2, 16, device=DEV)
    kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
    attn.append_kv(k, v, kc, vc)
    ref = prefill.append_kv_reference(k, v, inp["k_cache"], inp["v_cache"], **_layout(inp))
    assert torch.equal(kc, ref["k_cache"]) and torch.equal(vc, ref["v_cache"])


def test_schedules_cover_every_tile_once_heaviest_first():
    indptr = np.array([0, 5, 5, 40, 41, 100])
    lens = np.array([5, 7, 300, 2, 59])
    req, tile = prefill.append_schedule(indptr, lens, tile_tokens=16, causal=True)
    n = np.diff(indptr)
    assert sorted(zip(req.tolist(), tile.tolist())) == [(b, t) for b in range(5) for t in range(-(-n[b] // 16))]
    cost = [lens[b] - n[b] + min(n[b], (t + 1) * 16) for b, t in zip(req, tile)]
    assert cost == sorted(cost, reverse=True) and req[0] == 2
    dreq, dtile = prefill.append_schedule_device(torch.tensor(indptr, dtype=torch.int32, device=DEV), 100, 16)
    assert dreq.shape[0] == -(-100 // 16) + 5
    pairs = [(int(b), int(t)) for b, t in zip(dreq, dtile) if b >= 0]
    assert sorted(pairs) == sorted(zip(req.tolist(), tile.tolist()))
    assert pairs[:3] == [(0, 0), (2, 2), (2, 1)]       # within a request: last tile first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_schedule_kernel_builds_the_work_list_the_pytorch_ops_build(seed):
    """append_schedule_device is one kernel (requests and items 64 at a time): the same
    work list as its dozen PyTorch ops on random ragged batches, empty requests among
    them, up to 300 requests and rows beyond the last request's."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(8):
        b = int(torch.randint(1, 300, (1,), generator=g))
        n = torch.randint(0, 70, (b,), generator=g)
        n[torch.rand(b, generator=g) < 0.3] = 0
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]).int().to(DEV)
        total_q = int(indptr[-1]) + int(torch.randint(0, 9, (1,), generator=g))
        tile = int(torch.randint(1, 33, (1,), generator=g))
        got, want = (prefill.append_schedule_device(indptr, total_q, tile),
                     prefill.append_schedule_device_ref(indptr, total_q, tile))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (b, total_q, tile)


@contextlib.contextmanager
def _no_host_sync_or_allocation():
    """Fail on anything that turns a tensor into a Python value (a host sync on a GPU)
    or allocates a tensor, while the kernel launch itself is replaced by a recorder."""
    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"run path called {name}")
        return f
    saved = {}
    targets = [(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")]
    targets += [(torch, n) for n in ("empty", "zeros", "full", "empty_like", "zeros_like", "tensor",
                                     "as_tensor", "arange", "ones")]
    launches = []
    saved[(prefill, "launch_append_attention")] = prefill.launch_append_attention
    saved[(prefill, "append_kv_into")] = prefill.append_kv_into
    prefill.launch_append_attention = lambda *a, **k: launches.append(a)
    prefill.append_kv_into = lambda *a, **k: launches.append(a)
    for obj, name in targets:
        saved[(obj, name)] = getattr(obj, name)
        setattr(obj, name, boom(name))
    try:
        yield launches
    finally:
        for (obj, name), f in saved.items():
            setattr(obj, name, f)


def test_run_has_no_host_sync_and_no_allocation():
    inp = _inputs([5, 17, 1], [7, 0, 20])
    attn = _plan_for(inp).plan(**_layout(inp))
    out = torch.empty_like(inp["q"])
    k = torch.randn(23, 2, 16, device=DEV)
    with _no_host_sync_or_allocation() as launches:
        attn.run(inp["q"], inp["k_cache"], inp["v_cache"])
        attn.run(inp["q"], inp["k_cache"], inp["v_cache"], out=out, return_lse=True)
        attn.append_kv(k, k, inp["k_cache"], inp["v_cache"])
    assert len(launches) == 3


def test_public_function_has_no_host_sync():
    inp = _inputs([5, 17, 1], [7, 0, 20])
    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__")}
    launches = []
    real = prefill.launch_append_attention
    prefill.launch_append_attention = lambda *a, **k: launches.append(a)
    try:
        for n in saved:
            setattr(torch.Tensor, n, lambda *a, _n=n, **k: (_ for _ in ()).throw(AssertionError(_n)))
        prefill.append_attention(inp["q"], inp["k_cache"], inp["v_cache"], **_layout(inp), return_lse=True,
                                 validate=False)
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        prefill.launch_append_attention = real
    assert len(launches) == 1


# -- validation ------------------------------------------------------------------------------
def test_bad_layouts_rejected_with_validation_and_by_plan():
    inp = _inputs([3, 6], [5, 9], page=4)
    q, kc, vc = inp["q"], inp["k_cache"], inp["v_cache"]
    P = kc.shape[0]
    attn = _plan_for(inp)

    def both(exc, match, **change):
        lay = {**_layout(inp), **change}
        with pytest.raises(exc, match=match):
            prefill.append_attention(q, kc, vc, **lay, validate=True)
        with pytest.raises(exc, match=match):
            attn.plan(**lay)

    bt = inp["block_tables"].clone()
    bt[1, 2] = P
    both(IndexError, rf"block_tables\[1, 2\] = {P} is not a page", block_tables=bt)
    bt[1, 2] = -1
    both(IndexError, "block_tables", block_tables=bt)
    i32 = dict(dtype=torch.int32, device=DEV)
    both(ValueError, "smaller than request 1's 6 new tokens", kv_lens=torch.tensor([8, 5], **i32))
    both(ValueError, "exceeds the block table's capacity", kv_lens=torch.tensor([8, 10 ** 4], **i32))
    both(ValueError, "decreases", qo_indptr=torch.tensor([0, 5, 3], **i32))
    both(ValueError, "must start at 0", qo_indptr=torch.tensor([1, 4, 9], **i32))
    with pytest.raises(ValueError, match="q has only 9 rows"):
        prefill.append_attention(q, kc, vc, **{**_layout(inp), "qo_indptr": torch.tensor([0, 3, 10], **i32)},
                                 validate=True)
    # entries past a request's pages are never read: garbage there is fine
    bt = inp["block_tables"].clone()
    bt[0, 2:] = 10 ** 6
    prefill.append_attention(q, kc, vc, **{**_layout(inp), "block_tables": bt}, validate=True)
    attn.plan(**{**_layout(inp), "block_tables": bt})


def test_bad_arguments_rejected():
    inp = _inputs([3, 6], [5, 9], page=4)
    q, kc, vc, lay = inp["q"], inp["k_cache"], inp["v_cache"], _layout(inp)
    with pytest.raises(TypeError, match="int32"):
        prefill.append_attention(q, kc, vc, **{**lay, "qo_indptr": lay["qo_indptr"].long()})
    with pytest.raises(TypeError, match="k_cache must be float16"):
        prefill.append_attention(q.half(), kc, vc, **lay)
    with pytest.raises(ValueError, match="not a multiple"):
        prefill.append_attention(q[:, :3].contiguous(), kc, vc, **lay)
    with pytest.raises(ValueError, match="head_dim"):
        prefill.append_attention(q[..., :8].contiguous(), kc, vc, **lay)
    with pytest.raises(ValueError, match="one row and one length per request"):
        prefill.append_attention(q, kc, vc, **{**lay, "kv_lens": lay["kv_lens"][:1].contiguous()})
    with pytest.raises(ValueError, match="sm_scale"):
        prefill.append_attention(q, kc, vc, **lay, sm_scale=float("nan"))
    with pytest.raises(ValueError, match="out must have shape"):
        prefill.append_attention(q, kc, vc, **lay, out=q[:2])
    with pytest.raises(ValueError, match=r"k must be \[total_new, 2, 16\]"):
        prefill.append_kv(q, q, kc, vc, **lay)
    with pytest.raises(ValueError, match="num_qo_heads"):
        prefill.AppendAttention(6, 4, 16, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="give all of"):
        prefill.AppendAttention(4, 2, 16, page_size=4, num_pages=8, max_batch_size=4)
    attn = _plan_for(inp)
    with pytest.raises(RuntimeError, match="before run"):
        attn.run(q, kc, vc)
    attn.plan(**lay)
    with pytest.raises(ValueError, match=r"q must be \[T, 4, 16\] with 9 ≤ T ≤ 9"):
        attn.run(q[:4], kc, vc)
    with pytest.raises(ValueError, match="k_cache must have shape"):
        attn.run(q, kc[:3], vc)
    small = _plan_for(inp, max_batch_size=1, max_num_tokens=9, max_pages_per_request=8)
    with pytest.raises(ValueError, match="does not fit the fixed buffers"):
        small.plan(**lay)


# -- memory safety without validation --------------------------------------------------------
def test_bad_layout_without_validation_stays_in_bounds_and_is_reported():
    inp = _inputs([3, 6], [5, 9], page=4)
    P = inp["k_cache"].shape[0]
    g = {n: Guarded.wrap(inp[n].shape, inp[n].dtype, DEV, like=inp[n]) for n in ("q", "k_cache", "v_cache")}
    o = Guarded.wrap(inp["q"].shape, inp["q"].dtype, DEV)
    lse = Guarded.wrap(inp["q"].shape[:2], torch.float32, DEV)
    bt = inp["block_tables"].clone()
    bt[0, 0], bt[1, 1] = 10 ** 7, -(10 ** 7)
    bad = dict(qo_indptr=torch.tensor([0, 7, 50], dtype=torch.int32, device=DEV), block_tables=bt,
               kv_lens=torch.tensor([10 ** 6, -5], dtype=torch.int32, device=DEV))
    _clear_faults()
    prefill.append_attention(g["q"].inner, g["k_cache"].inner, g["v_cache"].inner, **bad, out=o.inner)
    prefill.append_attention_into(g["q"].inner, g["k_cache"].inner, g["v_cache"].inner,
                                  *bad.values(), True, None, o.inner, lse.inner)
    for buf in (*g.values(), o, lse):
        assert buf.guard_damage() == (0, 0)
    with pytest.raises(paged.LayoutFault, match="block-table entry was not a page.*negative or above"):
        prefill.append_attention(inp["q"], inp["k_cache"], inp["v_cache"], **_layout(inp), validate=True)
    # append_kv with bad page ids: nothing written outside the cache, nothing to a bad page
    kc = Guarded.wrap(inp["k_cache"].shape, inp["k_cache"].dtype, DEV, like=inp["k_cache"])
    vc = Guarded.wrap(inp["v_cache"].shape, inp["v_cache"].dtype, DEV, like=inp["v_cache"])
    k = torch.randn(9, 2, 16, device=DEV)
    prefill.append_kv(k, k, kc.inner, vc.inner, **bad)
    assert kc.guard_damage() == (0, 0) and vc.guard_damage() == (0, 0)
    with pytest.raises(paged.LayoutFault):
        paged.raise_recorded_faults(DEV)
    attn = _plan_for(inp).plan(**_layout(inp))
    attn.block_tables[0, 0] = P + 3           # the plan's own buffer corrupted after plan()
    attn.run(inp["q"], inp["k_cache"], inp["v_cache"])
    with pytest.raises(paged.LayoutFault, match="first sequence affected: 0"):
        attn.plan(**_layout(inp))
    attn.plan(**_layout(inp))                 # reported once, then cleared


def _clear_faults():
    try:
        paged.raise_recorded_faults(DEV)
    except paged.LayoutFault:
        pass


# -- the checks reject wrong kernels ---------------------------------------------------------
def _mutant_module(name, *edits):
    """The package's own kernel file with source edits: a real wrong kernel."""
    return mutant_module(prefill, name, *edits).append_attention_into


KERNEL_MUTANTS = {
    "causal_minus_one": [("limit = history + tok + 1 ", "limit = history + tok ")],
    "square_mask": [("limit = history + tok + 1 ", "limit = tok + 1 "),
                    ("hi = tl.minimum(tl.maximum(history + t0 + n_tile, 0), kv_len)",
                     "hi = tl.minimum(t0 + n_tile, kv_len)"),
                    ("full = tl.maximum(history + t0 + 1, 0)", "full = t0 + 1")],
    "gqa_modulo": [("head = kvh * GROUP + r % GROUP", "head = kvh + (r % GROUP) * tl.num_programs(1)")],
    "no_table_row": [("bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb", "bt_row_ptr = bt_ptr")],
    "no_tail_mask": [("row_ok = (r < TILE * GROUP) & (tok < t0 + n_tile)", "row_ok = r < TILE * GROUP")],
    "lse_base2": [("out, lse = state_epilogue(m, l, acc)",
                   "out, lse = state_epilogue(m, l, acc)\n    lse = lse * 1.4426950408889634")],
    "scale_natural": [("scale * LOG2E, qo_indptr.shape[0] - 1", "scale, qo_indptr.shape[0] - 1")],
    "v_unread": [("return s, v, bad\n", "return s, v * 0, bad\n")],
}


def _mutant_cases(*labels):
    return [c for c in gpulab.get_spec("append_attention").cases[WHERE] if c.label in labels]


def test_mutant_template_is_correct():
    fn = _mutant_module("none")
    gpulab.check("append_attention", fn, dtypes=[torch.float32], quiet=True)


_RAGGED = ("ragged with history", "ragged, longest fills its table")


@pytest.mark.parametrize("mutant, labels, expect", [
    ("causal_minus_one", _RAGGED, "causal mask off by one"),
    ("square_mask", _RAGGED, "square causal mask"),
    ("gqa_modulo", _RAGGED + ("G=3, D=24, page 5, fills its table",), "h // (Hq // Hkv)"),
    ("no_table_row", _RAGGED, "block_tables row 0"),
    ("no_tail_mask", _RAGGED, "mask the tile's rows"),
    ("lse_base2", _RAGGED, "base 2"),
    ("scale_natural", _RAGGED, "log2(e)"),
    ("v_unread", _RAGGED, "v_cache"),
])
def test_check_rejects_wrong_kernels(mutant, labels, expect):
    fn = _mutant_module(mutant, *KERNEL_MUTANTS[mutant])
    with pytest.raises(gpulab.CheckFailure) as info:
        G.check_append_attention(fn, cases=_mutant_cases(*labels), dtypes=[torch.float32], quiet=True)
    # (a sentence's first word or not: the stray-store hint and the rows hint both name it)
    assert expect.lower() in str(info.value).lower(), str(info.value)


def test_missing_row_mask_is_named_when_only_surplus_items_write_outside():
    """Compiled, the GPU case's last request filled whole tiles: the only stores outside o
    and lse were those of the work list's surplus items (request -1, tile index < 0), rows
    before the start. Here the same on the interpreter's tiles (16 tokens for G = 2): the
    last request has 16 new tokens, and 38 tokens in 4 tiles leave 2 surplus items. (The
    package's kernel returns at once from a surplus item; a learner's need not: this one
    does not.)"""
    fn = _mutant_module("no_tail_mask_no_exit", *KERNEL_MUTANTS["no_tail_mask"],
                        ("    if not has_work:\n        return", ""))
    whole_tiles = Case("ragged, last request whole tiles",
                       dict(new=[5, 17, 16], hist=[7, 0, 20], page=8, hq=4, hkv=2, d=16))
    if on_gpu():   # the GPU's float32 tile is 16 tokens as well (BLOCK_M 64, G = 4)
        whole_tiles = _mutant_cases("ragged, longest fills its table")[0]
    msg = rejects("append_attention", fn, cases=[whole_tiles], dtypes=[torch.float32])
    assert "before the start of output `o`" in msg and "past the end" not in msg, msg
    assert "mask the tile's rows" in msg and "surplus item" in msg, msg


def test_a_shifted_store_is_still_named_a_wrong_base_pointer():
    """Rows stored one row early: one row before o's start, and o's last row never written:
    a shifted pointer, not extra rows."""
    fn = _mutant_module("o_row_minus_one", ("tl.store(o_ptr + part * stride_os + row[:, None] * stride_ot",
                                            "tl.store(o_ptr + part * stride_os + (row[:, None] - 1) * stride_ot"))
    msg = rejects("append_attention", fn, cases=_mutant_cases(*_RAGGED), dtypes=[torch.float32])
    assert "before the start of output `o`: a negative offset or a wrong base pointer" in msg, msg
    assert "mask the tile's rows" not in msg, msg


def test_split_kv_equals_one_part_for_any_number_of_parts():
    """Split-KV gives the unsplit result (o and lse), with parts that do not divide the
    histories, more parts than some requests' positions (empty parts: o 0, lse -inf
    merged with weight 0), and rows past the batch's tokens left as they were."""
    inp = _inputs([5, 17, 1, 0], [7, 0, 40, 3], page=4, hq=4, hkv=2, d=16, pad=3)
    q, kc, vc, lay = inp["q"], inp["k_cache"], inp["v_cache"], _layout(inp)
    ref = prefill.append_attention_reference(**inp)
    capacity = lay["block_tables"].shape[1] * kc.shape[1]
    for parts in (2, 3, 7):
        o, lse = torch.full_like(q, 5.0), torch.full(q.shape[:2], 5.0, device=DEV)
        prefill.append_attention_into(q, kc, vc, **lay, causal=True, sm_scale=None, o=o, lse=lse,
                                      num_splits=parts)
        assert prefill.plan_kv_split(1, 1, capacity, 1, 1, 1, 16, DEV, parts).num_splits > 1
        n = int(lay["qo_indptr"][-1])
        _assert_matches(o[:n], lse[:n], {k: v[:n] for k, v in ref.items()}, torch.float32)
        assert (o[n:] == 5.0).all() and (lse[n:] == 5.0).all()       # padding rows untouched


def test_split_kv_leaves_rows_before_the_first_request_alone():
    """A qo_indptr that starts past row 0 (the engine's big whole-step graphs give the rows
    before it to the paged decode kernel): with split-KV, the merge writes only the rows the
    requests own, so rows before qo_indptr[0] keep what another kernel wrote there."""
    inp = _inputs([5, 17], [7, 20], page=4, hq=4, hkv=2, d=16, pad=2)
    ref = prefill.append_attention_reference(**inp)
    lay, skip = _layout(inp), 3
    q = torch.cat([torch.randn(skip, *inp["q"].shape[1:], device=DEV), inp["q"]])
    lay["qo_indptr"] = lay["qo_indptr"] + skip
    o, lse = torch.full_like(q, 5.0), torch.full(q.shape[:2], 5.0, device=DEV)
    prefill.append_attention_into(q, inp["k_cache"], inp["v_cache"], **lay, causal=True, sm_scale=None,
                                  o=o, lse=lse, num_splits=3)
    n = int(lay["qo_indptr"][-1])
    assert (o[:skip] == 5.0).all() and (lse[:skip] == 5.0).all()
    assert (o[n:] == 5.0).all() and (lse[n:] == 5.0).all()
    _assert_matches(o[skip:n], lse[skip:n], {k: v[:n - skip] for k, v in ref.items()}, torch.float32)


def test_split_workspace_shorter_than_q_is_never_overrun():
    """A layout that claims more rows than the split's workspace holds (a bad qo_indptr,
    or a workspace planned for fewer rows): the kernel and the merge stay inside the
    workspace (guard rows after it unchanged) and leave o's rows past it alone."""
    inp = _inputs([5, 17], [7, 20], page=4, hq=4, hkv=2, d=16, pad=0)
    q, kc, vc, lay = inp["q"], inp["k_cache"], inp["v_cache"], _layout(inp)
    rows, short = q.shape[0], 9
    cfg = prefill.append_tile_config(q.dtype, 16, 2)
    work = prefill.append_schedule_device(lay["qo_indptr"], rows, cfg["BLOCK_M"] // 2)
    plan = prefill.plan_kv_split(1, 1, lay["block_tables"].shape[1] * 4, short, 4, 16, cfg["BLOCK_N"], DEV, 2)
    o_big = torch.full((short + 3, 4, plan.num_splits, 16), 7.0, device=DEV)
    lse_big = torch.full((short + 3, 4, plan.num_splits), 7.0, device=DEV)
    split = prefill.KVSplit(plan.part_len, o_big[:short], lse_big[:short])
    o, lse = torch.full_like(q, 5.0), torch.full(q.shape[:2], 5.0, device=DEV)
    prefill.launch_append_attention(q, kc, vc, lay["qo_indptr"], lay["block_tables"], lay["kv_lens"], *work,
                                    o, lse, paged.fault_flag(DEV), True, None, cfg, split)
    assert (o_big[short:] == 7.0).all() and (lse_big[short:] == 7.0).all()
    assert (o[short:] == 5.0).all() and (lse[short:] == 5.0).all()
    ref = prefill.append_attention_reference(**inp)             # request 0 fits: still right
    _assert_matches(o[:5], lse[:5], {k: v[:5] for k, v in ref.items()}, torch.float32)


def test_kv_split_plan_fills_idle_sms_only(monkeypatch):
    """The split's plan on a GPU's terms (no device needed): few programs over a long
    history get parts of whole blocks, at least four each, about two programs per SM,
    covering the capacity; enough programs, or a short history, get one part."""
    monkeypatch.setattr(prefill.runtime, "interpreting", lambda: False)
    monkeypatch.setattr(prefill.runtime, "num_sms", lambda: 132)
    split = prefill.plan_kv_split(3, 4, 2096, 40, 16, 128, 64, "cpu")   # the cached-prompt step
    assert split.num_splits == 7 and split.part_len == 320
    assert split.o_part.shape == (40, 16, 7, 128) and split.lse_part.shape == (40, 16, 7)
    assert split.o_part.dtype == split.lse_part.dtype == torch.float32
    assert prefill.plan_kv_split(33, 4, 2096, 40, 16, 128, 64, "cpu") is None     # 132 programs
    assert prefill.plan_kv_split(3, 4, 511, 40, 16, 128, 64, "cpu") is None       # < 2 parts of 4 blocks
    forced = prefill.plan_kv_split(300, 4, 1000, 8, 2, 16, 64, "cpu", num_splits=3)
    assert forced.num_splits == 3 and forced.part_len % 64 == 0 and forced.part_len * 3 >= 1000
    assert prefill.plan_kv_split(3, 4, 2096, 40, 16, 128, 64, "cpu", num_splits=1) is None


SPLIT_MUTANTS = {
    "parts_overlap": [("    hi = tl.minimum(hi, lo + part_len)\n", "")],
    "no_merge": [("        split_reduce_into(o_part, lse_part, o, lse if lse is not None else lse_part[:, :, 0], rows=qo_indptr)",
                  "        n = int(qo_indptr[-1])\n"
                  "        o[:n].copy_(o_part[:n, :, 0])\n"
                  "        lse[:n].copy_(lse_part[:n, :, 0])")],
}


@pytest.mark.parametrize("mutant, expect", [("parts_overlap", "KV parts overlap"),
                                            ("no_merge", "first KV part's state alone")])
def test_split_check_names_split_mistakes(mutant, expect):
    fn = _mutant_module(mutant, *SPLIT_MUTANTS[mutant])
    split_fn = functools.partial(_call_split, fn)
    msg = rejects("append_attention_split", split_fn, cases=_mutant_cases(*_RAGGED), dtypes=[torch.float32])
    assert expect in msg, msg


def _call_split(fn, *args):
    fn(*args, num_splits=3)


def _torch_mutant(**mistake):
    """A PyTorch 'kernel' with one of the mistakes the hints name."""
    def fn(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal, sm_scale, o, lse):
        res = G.append_attention_variant(q, k_cache, v_cache, qo_indptr, block_tables, kv_lens, causal,
                                         sm_scale, **mistake)
        o.copy_(res["o"])
        lse.copy_(res["lse"])
    return fn


@pytest.mark.parametrize("mistake, expect", [
    (dict(limit_shift=1), "lets it see the next token"),
    (dict(new_keys_only=True), "history"),
    (dict(no_mask=True), "without the causal mask"),
])
def test_check_names_more_mistakes(mistake, expect):
    msg = rejects("append_attention", _torch_mutant(**mistake), cases=_mutant_cases(*_RAGGED),
                  dtypes=[torch.float32])
    assert expect in msg, msg


def test_append_kv_check_rejects_wrong_positions():
    def off_by_one(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache):
        prefill.append_kv_into(k, v, qo_indptr, block_tables, kv_lens + 1, k_cache, v_cache)

    def row0(k, v, qo_indptr, block_tables, kv_lens, k_cache, v_cache):
        prefill.append_kv_into(k, v, qo_indptr, block_tables[:1].expand_as(block_tables).contiguous(), kv_lens,
                               k_cache, v_cache)
    # a case whose longest request fills its table exactly (as the GPU's ragged case does):
    # off_by_one's last token is one past the table's capacity there, which the kernel
    # skips and records in the fault flag; this test planted that fault, so it reports it
    # (else the next plan in this process, e.g. an engine's warm-up, would)
    cases = [c for c in gpulab.get_spec("append_kv").cases[WHERE]
             if c.label in _RAGGED + ("G=3, D=24, page 5, fills its table",)]
    for fn in (off_by_one, row0):
        with pytest.raises(gpulab.CheckFailure, match="wrong"):
            G.check_append_kv(fn, cases=cases, dtypes=[torch.float32], quiet=True)
        if fn is off_by_one:
            with pytest.raises(paged.LayoutFault, match="negative or above the block table's capacity"):
                paged.raise_recorded_faults(DEV)
    G.check_append_kv(prefill.append_kv_into, cases=cases, dtypes=[torch.float32], quiet=True)


def test_roofline_figures():
    p = dict(new=[2, 3], hist=[4, 0], hq=4, hkv=2, d=8)
    assert G.append_flops(p, torch.float16) == 4 * (2 * 4 + 3 + 6) * 4 * 8
    assert G.append_flops({**p, "causal": False}, torch.float16) == 4 * (2 * 6 + 3 * 3) * 4 * 8
    assert G.append_bytes(p, torch.float16) == 2 * 5 * 4 * 8 * 2 + 2 * 9 * 2 * 8 * 2 + 4 * 5 * 4
    assert math.isclose(G.append_kv_bytes(p, torch.float32), 4 * 5 * 2 * 8 * 4)

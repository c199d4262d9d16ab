"""Notebook 04: online softmax, attention-state merging, FlashAttention and FA4's options."""
import math

import pytest
import torch
import triton
import triton.language as tl

import gpulab
from gpulab import attention as A
from gpulab import attention_state as S
from gpulab.grading import attention as AG
from gpulab.harness.checking import rejects

from helpers import on_gpu


def dev():
    return gpulab.device()


def attn_dtypes():
    return [torch.float16, torch.bfloat16] if on_gpu() else [torch.float32, torch.float16]


def tol(dtype):
    return gpulab.get_spec("flash_attention").tolerance(dtype)


def qkv(B, Hq, Hkv, Sq, Skv, D, dtype, seed=0):
    g = torch.Generator(device=dev()).manual_seed(seed)
    inp = AG.make_attention_inputs(dict(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D), dtype, dev(), g)
    return inp["q"], inp["k"], inp["v"]


# -- the package's kernels pass their own checks ------------------------------------------
@pytest.mark.parametrize("name", ["online_softmax", "merge_state_torch", "exp2_poly3",
                                  "flash_attention", "flash_attention_fa4"])
def test_implementation_passes_check(name):
    spec = gpulab.get_spec(name)
    gpulab.check(spec, spec.implementation, quiet=True)


# -- softmax ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 70_001)])
def test_online_softmax_matches_fp64(shape):
    x = torch.randn(shape, device=dev()) * 5 + 40
    y = A.online_softmax(x)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), atol=1e-6, rtol=1e-5)


def test_softmax_torch_versions():
    x = torch.randn(5, 300) * 3
    x[0, 5] = 100.0                      # overflows exp in float32
    ref = torch.softmax(x.double(), -1)
    assert not torch.isfinite(A.softmax_unsafe(x)).all()
    torch.testing.assert_close(A.softmax_safe(x).double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(A.softmax_online_torch(x, block=64).double(), ref, atol=1e-6, rtol=1e-5)
    # merging (m, d) of two halves gives the state of the whole row
    xa, xb = x[:, :123], x[:, 123:]
    m, d = A.merge_softmax_states(xa.max(-1).values, torch.exp(xa - xa.max(-1, keepdim=True).values).sum(-1),
                                  xb.max(-1).values, torch.exp(xb - xb.max(-1, keepdim=True).values).sum(-1))
    torch.testing.assert_close((m + d.log()).double(), torch.logsumexp(x.double(), -1), atol=1e-5, rtol=1e-6)


def test_online_softmax_rejects_bad_input():
    with pytest.raises(ValueError, match="2 dimensions"):
        A.online_softmax(torch.randn(3, device=dev()))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        A.online_softmax(torch.ones(2, 3, dtype=torch.int32, device=dev()))
    with pytest.raises(ValueError, match="length 0"):
        A.online_softmax(torch.empty(2, 0, device=dev()))
    with pytest.raises(ValueError, match="contiguous"):
        A.online_softmax(torch.randn(4, 6, device=dev()).t())


def test_the_exp2_hint_needs_the_outputs_on_each_rows_scale():
    """The softmax check names exp2 without log2(e) for that mistake, and not for a running
    sum left unrescaled whose tiny probabilities fall within the absolute tolerance of the
    exp2 variant's (this row's inputs, float16: it did until 2026-12-05)."""
    def online(x, base2):                             # blocks of 1024, as the learner's kernel
        x, B = x.float(), 1024
        m, d = torch.full((x.shape[0],), -math.inf), torch.zeros(x.shape[0])
        exp = torch.exp2 if base2 else torch.exp
        for s in range(0, x.shape[1], B):
            m_new = torch.maximum(m, x[:, s:s + B].max(1).values)
            d = (d * exp(m - m_new) if base2 else d) + exp(x[:, s:s + B] - m_new[:, None]).sum(1)
            m = m_new
        return exp(x - m[:, None]) / d[:, None]

    inputs = AG.make_softmax_inputs(dict(rows=2, cols=5120), torch.float16, "cpu",
                                    torch.Generator().manual_seed(46))
    expected = AG.softmax_reference(inputs["x"])["y"]
    assert AG.softmax_hint("y", online(inputs["x"], False).half(), expected, inputs) is None
    assert "exp2" in AG.softmax_hint("y", online(inputs["x"], True).half(), expected, inputs)


# -- attention ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", attn_dtypes())
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Skv,D,causal", [
    (1, 1, 1, 1, 1, 16, False),
    (2, 4, 2, 19, 45, 32, True),        # GQA, causal with a KV cache (S_q < S_kv)
    (1, 3, 1, 33, 33, 64, True),        # MQA, square causal
    (1, 2, 2, 13, 50, 128, False),
])
def test_flash_attention_matches_fp64(dtype, B, Hq, Hkv, Sq, Skv, D, causal):
    if on_gpu():
        Sq, Skv = Sq * 31, Skv * 29
    q, k, v = qkv(B, Hq, Hkv, Sq, Skv, D, dtype)
    o, lse = A.flash_attention(q, k, v, causal=causal, return_lse=True)
    ref = A.attention_reference(q, k, v, causal)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq)
    atol, rtol = tol(dtype)
    torch.testing.assert_close(o.double(), ref["o"], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref["lse"], atol=1e-4, rtol=1e-5)
    # the LSE is the natural log of the sum of exponentials of the scaled scores
    s = (q.double() @ A.repeat_kv(k.double(), Hq).transpose(-1, -2)) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~A.causal_mask(Sq, Skv, q.device), -math.inf)
    torch.testing.assert_close(lse.double(), torch.log(torch.exp(s).sum(-1)), atol=1e-4, rtol=1e-5)


def test_flash_attention_scale_empty_rows_and_empty_keys():
    dtype = attn_dtypes()[0]
    q, k, v = qkv(1, 2, 2, 12, 5, 32, dtype)
    o, lse = A.flash_attention(q, k, v, causal=True, scale=0.3, return_lse=True)
    ref = A.attention_reference(q, k, v, True, scale=0.3)
    torch.testing.assert_close(o.double(), ref["o"], atol=tol(dtype)[0], rtol=tol(dtype)[1])
    # causal with S_q > S_kv: the first 7 rows see no key -> o = 0, lse = -inf, never NaN
    assert torch.isneginf(lse[..., :7]).all() and (o[..., :7, :] == 0).all()
    assert torch.isfinite(lse[..., 7:]).all()
    o0, lse0 = A.flash_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert (o0 == 0).all() and torch.isneginf(lse0).all()


def test_merge_states_associative_and_matches_full_attention():
    dtype = attn_dtypes()[0]
    q, k, v = qkv(2, 4, 2, 21, 90, 64, dtype)
    full_o, full_lse = A.flash_attention(q, k, v, return_lse=True)
    parts = [A.flash_attention(q, k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous(), return_lse=True)
             for a, b in ((0, 17), (17, 60), (60, 90))]
    # fold left and fold right, in float32
    (oa, la), (ob, lb), (oc, lc) = [(o.float(), lse) for o, lse in parts]
    left = A.merge_state_torch(*A.merge_state_torch(oa, la, ob, lb), oc, lc)
    right = A.merge_state_torch(oa, la, *A.merge_state_torch(ob, lb, oc, lc))
    swapped = A.merge_state_torch(oc, lc, *A.merge_state_torch(ob, lb, oa, la))
    for o, lse in (left, right, swapped):
        torch.testing.assert_close(o, left[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(o, full_o.float(), atol=2 * tol(dtype)[0], rtol=2 * tol(dtype)[1])
    # an empty state is the identity, two empty states stay empty (never NaN)
    empty_o, empty_lse = torch.zeros_like(oa), torch.full_like(la, -math.inf)
    o, lse = A.merge_state_torch(oa, la, empty_o, empty_lse)
    assert torch.equal(lse, la) and torch.allclose(o, oa, atol=1e-7, rtol=1e-6)
    o, lse = A.merge_state_torch(empty_o, empty_lse, empty_o, empty_lse)
    assert (o == 0).all() and torch.isneginf(lse).all()
    # FlashInfer's base-2 LSE: log2 of the sum of 2^(scores·log2 e)
    s = (q.double() @ A.repeat_kv(k.double(), 4).transpose(-1, -2)) / 8.0
    torch.testing.assert_close((full_lse / math.log(2)).double(),
                               torch.log2(torch.exp2(s * S.LOG2E).sum(-1)), atol=1e-4, rtol=1e-5)


def test_merge_states_rejects_bad_input():
    o, lse = torch.zeros(3, 4, 8), torch.zeros(3, 4)
    with pytest.raises(TypeError, match="float32"):
        A.merge_state_torch(o, lse.double(), o, lse)
    with pytest.raises(ValueError, match=r"lse_b.shape \+ \(D,\)"):
        A.merge_state_torch(o, lse, o, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="one shape"):
        A.merge_state_torch(o, lse, torch.zeros(3, 4, 9), lse)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        A.merge_state_torch(o.int(), lse, o, lse)


def test_flash_attention_rejects_bad_input():
    dt = attn_dtypes()[0]
    q, k, v = qkv(1, 4, 2, 5, 6, 32, dt)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        A.flash_attention(q[:, :3].contiguous(), k, v)
    with pytest.raises(ValueError, match="D=48 is not supported"):
        A.flash_attention(*(torch.zeros(1, 2, 3, 48, dtype=dt, device=dev()) for _ in range(3)))
    with pytest.raises(TypeError, match="share a dtype"):
        A.flash_attention(q, k.to(attn_dtypes()[1]), v)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        A.flash_attention(q, k, v[:, :, :3].contiguous())
    with pytest.raises(ValueError, match=r"k must be \[B=1"):
        A.flash_attention(q, k[..., :16].contiguous(), v[..., :16].contiguous())
    with pytest.raises(ValueError, match="4 dimensions"):
        A.flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="contiguous"):
        A.flash_attention(q.transpose(1, 2), k, v)
    with pytest.raises(ValueError, match="exp2_impl"):
        A.flash_attention(q, k, v, exp2_impl="fast")
    with pytest.raises(ValueError, match="rescale_threshold"):
        A.flash_attention(q, k, v, rescale_threshold=-1)
    with pytest.raises(TypeError, match="bfloat16|float32"):
        bad = torch.bfloat16 if not on_gpu() else torch.float32
        A.flash_attention(q.to(bad), k.to(bad), v.to(bad))


# -- FlashAttention-4 options -------------------------------------------------------------
def test_exp2_poly3_torch_and_triton_agree_within_documented_error():
    x = torch.linspace(-126, 30, 20001)
    ref = torch.exp2(x.double())
    for y in (S.exp2_poly3_torch(x), S.exp2_poly3_torch(x.to(dev())).cpu()):
        assert float(((y.double() - ref) / ref).abs().max()) < S.POLY3_MAX_REL_ERROR
    y = torch.empty_like(x, device=dev())
    A.exp2_poly3_into(x.to(dev()), y)
    assert torch.equal(y.cpu(), S.exp2_poly3_torch(x)) or \
        float(((y.cpu().double() - ref) / ref).abs().max()) < S.POLY3_MAX_REL_ERROR


def test_fa4_options_error_budget():
    """poly3 adds at most ~1e-4 relative error per probability; lazy rescaling (τ = 8) is
    exact up to float rounding. Errors against fp64, measured on float32 (CPU) or fp16."""
    dtype = torch.float32 if not on_gpu() else torch.float16
    q, k, v = qkv(1, 2, 2, 40, 150 if not on_gpu() else 3000, 64, dtype, seed=3)
    ref = A.attention_reference(q, k, v, True)
    err = {}
    for impl in ("native", "poly3"):
        for tau in (0.0, 8.0):
            o, lse = A.flash_attention(q, k, v, causal=True, return_lse=True, exp2_impl=impl,
                                       rescale_threshold=tau)
            err[impl, tau] = (float((o.double() - ref["o"]).abs().max()),
                              float((lse.double() - ref["lse"]).abs().max()))
    base_o, base_lse = err["native", 0.0]
    if dtype == torch.float32:
        assert base_o < 2e-5 and base_lse < 2e-5
        assert err["native", 8.0][0] < 2e-5 and err["native", 8.0][1] < 2e-5
        assert err["poly3", 0.0][0] < 2e-4 and err["poly3", 0.0][1] < 2e-4
        assert err["poly3", 8.0][0] < 2e-4 and err["poly3", 8.0][1] < 3e-4
    else:
        for key, (eo, el) in err.items():
            assert eo < 2 * base_o + 1e-3 and el < 3e-4, (key, err)


def test_lazy_rescaling_avoids_most_rescales():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 64, generator=g)
    k = torch.randn(1, 4, 1024, 64, generator=g)
    v = torch.randn(1, 4, 1024, 64, generator=g)
    ref = A.attention_reference(q, k, v)
    counts = {}
    for tau in (0.0, 8.0):
        stats = {}
        o, lse = A.attention_tiled_torch(q, k, v, block_m=64, block_n=64, rescale_threshold=tau, stats=stats)
        torch.testing.assert_close(o.double(), ref["o"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref["lse"], atol=1e-5, rtol=1e-6)
        counts[tau] = stats["rescales"]
    assert counts[0.0] > 0 and counts[8.0] * 5 <= counts[0.0], counts
    true_max, used, flags = A.running_max_trace(torch.linspace(0, 30, 1000), 100, 8.0)
    assert len(flags) == 10 and flags[0] is False and all(u <= t for u, t in zip(used, true_max))
    assert all(t - u <= 8.0 for u, t in zip(used, true_max))


def test_tiled_torch_mirror_matches_reference_causal_gqa():
    q, k, v = qkv(1, 4, 2, 37, 70, 32, torch.float32)
    for causal in (False, True):
        o, lse = A.attention_tiled_torch(q, k, v, causal=causal, block_m=16, block_n=16)
        ref = A.attention_reference(q, k, v, causal)
        torch.testing.assert_close(o.double(), ref["o"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref["lse"], atol=1e-5, rtol=1e-6)


# -- the checks reject wrong implementations ----------------------------------------------
@triton.jit
def _softmax_mutant(x_ptr, y_ptr, n_cols, sx, sy, BLOCK: tl.constexpr, MUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        if MUT == 1:     # missing mask
            x = tl.load(x_ptr + row * sx + start + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if MUT == 4:     # input never read
            x = tl.where(mask, 0.0, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        if MUT == 2:     # missing rescale of the running sum
            d = d + tl.sum(tl.exp(x - m_new), axis=0)
        elif MUT == 5:   # stale running max in the sum
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m), axis=0)
        else:
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * sx + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if MUT == 4:
            x = tl.where(mask, 0.0, float("-inf"))
        y = tl.exp(x - m) / d
        if MUT == 6:     # wrong scale
            y = y * 0.5
        if MUT == 3:     # out-of-bounds write
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + row * sy + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _softmax_launcher(mut):
    def launch(x, y):
        _softmax_mutant[(x.shape[0],)](x, y, x.shape[1], x.stride(0), y.stride(0), BLOCK=256, MUT=mut)
    return launch


_SM_CASES = [gpulab.Case("blocks + tail", dict(rows=3, cols=600))]


@pytest.mark.parametrize("mut,expected", [
    (1, "past the end of"), (2, "factor"), (3, "past the end of output `y`"),
    (4, "ever loaded"), (5, "wrong"), (6, "same factor"),
])
def test_online_softmax_check_rejects(mut, expected):
    msg = rejects("online_softmax", _softmax_launcher(mut), cases=_SM_CASES, dtypes=[torch.float32])
    assert expected in msg, msg


@triton.jit
def _attn_mutant(Q, K, V, O, LSE, H, GROUP, S_q, S_kv, qk_scale, HEAD_DIM: tl.constexpr,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MUT: tl.constexpr):
    """A compact FlashAttention forward (every block masked) with one deliberate bug."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    if MUT == 8:         # wrong GQA mapping
        hk = h % (H // GROUP)
    Hkv = H // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + ((b * H + h) * S_q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < S_q, other=0.0)
    if MUT == 4:         # q never read
        q = q * 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv = (b * Hkv + hk) * S_kv
    for start_n in range(0, S_kv, BLOCK_N):
        cols = start_n + offs_n
        if MUT == 1:     # missing tail mask on K (and on the scores)
            k = tl.load(K + (kv + cols[:, None]) * HEAD_DIM + offs_d[None, :])
        else:
            k = tl.load(K + (kv + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < S_kv, other=0.0)
        s = tl.dot(q, tl.trans(k))
        if MUT == 2:     # softmax scale without log2(e)
            s = s * (qk_scale * 0.6931471805599453)
        else:
            s = s * qk_scale
        valid = cols[None, :] < S_kv
        if CAUSAL and MUT != 7:
            valid = valid & (cols[None, :] <= offs_m[:, None] + (S_kv - S_q))
        if MUT != 1:
            s = tl.where(valid, s, float("-inf"))
        v = tl.load(V + (kv + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < S_kv, other=0.0)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        if MUT == 6:     # stale running max: probabilities against the old max
            p = tl.exp2(s - tl.where(m_i == float("-inf"), m_use, m_i)[:, None])
        else:
            p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MUT != 5:     # 5: missing rescale of the accumulator
            acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rows = offs_m[:, None] < S_q
    if MUT == 3:         # out-of-bounds write
        rows = offs_m[:, None] < S_q + BLOCK_M
    tl.store(O + ((b * H + h) * S_q + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rows)
    tl.store(LSE + bh * S_q + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=offs_m < S_q)


def _attn_launcher(mut):
    def launch(q, k, v, causal, o, lse):
        B, H, Sq, D = q.shape
        _attn_mutant[(triton.cdiv(Sq, 32), B * H)](q, k, v, o, lse, H, H // k.shape[1], Sq, k.shape[2],
                                                   S.LOG2E / math.sqrt(D), HEAD_DIM=D, CAUSAL=bool(causal),
                                                   BLOCK_M=32, BLOCK_N=32, MUT=mut)
    return launch


def _c(label, **p):
    return gpulab.Case(label, dict(B=1, Hq=2, Hkv=2, D=32, causal=False) | p)


_GPU_SCALE = 17   # on a GPU, cases become larger (still awkward)


def _cases(*cases):
    if not on_gpu():
        return list(cases)
    return [gpulab.Case(c.label, c.params | dict(Sq=c.params["Sq"] * _GPU_SCALE,
                                                       Skv=c.params["Skv"] * _GPU_SCALE)) for c in cases]


def test_attention_mutant_template_is_correct():
    # The mutant kernel with no bug passes: every rejection below is about the bug.
    gpulab.check("flash_attention", _attn_launcher(0), cases=_cases(
        _c("tail", Sq=37, Skv=45), _c("causal GQA", Hq=4, Hkv=2, Sq=20, Skv=67, causal=True)),
        dtypes=[attn_dtypes()[0]], quiet=True)


@pytest.mark.parametrize("mut,case,expected", [
    (1, _c("tail", Sq=37, Skv=45), "past the end of"),
    (2, _c("tail", Sq=37, Skv=45), "scale × ln 2"),
    (3, _c("tail", Sq=37, Skv=45), "past the end of output `o`"),
    (4, _c("tail", Sq=37, Skv=45), "ever loaded"),
    (5, _c("tail", Sq=37, Skv=100), "rescaled by alpha"),
    (6, _c("tail", Sq=37, Skv=100), "same max"),
    (7, _c("causal", Sq=40, Skv=40, causal=True), "causal mask the wrong way round"),
    (8, _c("GQA", Hq=4, Hkv=2, Sq=20, Skv=40), "h // (Hq // Hkv)"),
])
def test_attention_check_rejects(mut, case, expected):
    # Through the notebook's check, which adds attention-specific hints to gpulab.check's.
    with pytest.raises(gpulab.CheckFailure) as info:
        gpulab.check("flash_attention", _attn_launcher(mut), cases=_cases(case), dtypes=[attn_dtypes()[0]],
                     quiet=True)
    msg = str(info.value)
    assert expected in msg, msg
    if mut == 3:   # the generic harness alone already explains this one
        assert expected in rejects("flash_attention", _attn_launcher(mut), cases=_cases(case),
                                   dtypes=[attn_dtypes()[0]])


def test_attention_check_hints_through_public_checks():
    with pytest.raises(gpulab.CheckFailure, match="scale × ln 2"):
        gpulab.check("flash_attention_noncausal", _attn_launcher(2), cases=_cases(_c("tail", Sq=37, Skv=45)))


def _merge_mutant(kind):
    def merge(o_a, lse_a, o_b, lse_b):
        if kind == "nan":        # no empty-state handling
            lse = torch.logaddexp(lse_a, lse_b)
            wa, wb = torch.exp(lse_a - lse), torch.exp(lse_b - lse)
            return (wa[..., None] * o_a.float() + wb[..., None] * o_b.float()).to(o_a.dtype), lse
        o, lse = A.merge_state_torch(o_a, lse_a, o_b, lse_b)
        if kind == "base2":      # returns FlashInfer's base-2 LSE
            return o, lse / math.log(2)
        if kind == "unread":     # o_b never used
            o, lse = A.merge_state_torch(o_a, lse_a, torch.zeros_like(o_b), lse_b)
        if kind == "unnormalised":
            o = o * 2
        return o, lse
    return merge


@pytest.mark.parametrize("kind,expected", [("nan", "NaN"), ("base2", "base 2"),
                                           ("unread", "o_b"), ("unnormalised", "same factor")])
def test_merge_check_rejects(kind, expected):
    msg = rejects("merge_state_torch", _merge_mutant(kind), dtypes=[torch.float32])
    assert expected in msg, msg


@triton.jit
def _exp2_mutant(x_ptr, y_ptr, n, BLOCK: tl.constexpr, MUT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0), -127.0)
    if MUT == 2:         # truncation instead of floor
        j = x.to(tl.int32).to(tl.float32)
    else:
        j = tl.floor(x)
    f = x - j
    p = 1.0 + f * (0.695146143 + f * (0.227564394 + f * 0.0771190897))
    if MUT == 1:         # exponent never inserted
        y = p
    else:
        y = (p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)).to(tl.float32, bitcast=True)
    if MUT == 3:
        tl.store(y_ptr + offs, y)
    else:
        tl.store(y_ptr + offs, y, mask=mask)


@pytest.mark.parametrize("mut,expected", [(1, "wrong"), (2, "wrong"), (3, "past the end")])
def test_exp2_check_rejects(mut, expected):
    def launch(x, y):
        _exp2_mutant[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, MUT=mut)
    msg = rejects("exp2_poly3", launch)
    assert expected in msg, msg

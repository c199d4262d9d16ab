"""RoPE of q and k in one kernel (gpulab.rope): against the PyTorch ops it replaces, in
place on views of a QKV projection's output, through its check, and in the engine's
transformer block."""
import pytest
import torch

import gpulab
from gpulab import runtime
from gpulab.engine import model as engine_model
from gpulab.engine.model import TINY, TernaryTransformer, TransformerBlock, apply_rope, run_bitlinear
from gpulab.grading.rope import ROPE, rope_kv_launch
from gpulab.rope import rope_qk, rope_qk_into, rope_qk_store_kv, rope_reference

DEVICE = runtime.device()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if runtime.supports(torch.bfloat16) else [])


def angles(t, d, seed=0):
    """cos, sin [t, d/2] of distinct random positions, as the engine gathers them."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (t,), generator=g).double()
    ang = pos[:, None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


def qkv_views(t, hq, hkv, d, dtype, seed=0):
    """A QKV projection's output [t, (hq + 2 hkv)·d] and its q, k views [t, h, d]."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype).to(DEVICE)
    q = qkv[:, :hq * d].unflatten(-1, (hq, d))
    k = qkv[:, hq * d:(hq + hkv) * d].unflatten(-1, (hkv, d))
    return qkv, q, k


def assert_rounded_like(got, want):
    """Bit for bit; bfloat16 in the interpreter one unit in the last place off at most
    (it truncates where a GPU rounds to nearest, as PyTorch does)."""
    if got.dtype == torch.bfloat16 and runtime.interpreting():
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want), f"{int((got != want).sum())} elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 37])
@pytest.mark.parametrize("hq, hkv, d", [(4, 2, 16), (4, 2, 32), (6, 2, 24)])
def test_rotates_q_and_k_in_place_as_the_pytorch_ops_do(dtype, t, hq, hkv, d):
    """On strided views of a QKV buffer (row stride (hq + 2 hkv)·d): q and k equal
    rope_reference's, v and everything else unchanged."""
    qkv, q, k = qkv_views(t, hq, hkv, d, dtype)
    cos, sin = angles(t, d)
    want_q, want_k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    v = qkv[:, (hq + hkv) * d:].clone()
    got_q, got_k = rope_qk(q, k, cos, sin)
    assert got_q is q and got_k is k
    assert_rounded_like(q, want_q)
    assert_rounded_like(k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v), "v changed"


def test_q_into_its_own_tensor_and_k_in_place():
    """The engine's form: q into a contiguous tensor, its view in the buffer untouched."""
    qkv, q, k = qkv_views(5, 4, 2, 16, torch.float32)
    cos, sin = angles(5, 16)
    before = qkv.clone()
    q_out = torch.empty(q.shape, device=DEVICE)
    rope_qk_into(q, k, cos, sin, q_out)
    assert torch.equal(q_out, rope_reference(q, cos, sin)) and torch.equal(q, before[:, :64].view(5, 4, 16))
    assert torch.equal(k, rope_reference(before[:, 64:96].view(5, 2, 16), cos, sin))
    assert torch.equal(qkv[:, 96:], before[:, 96:])


def test_nothing_to_rotate():
    q, k = torch.zeros(0, 4, 16, device=DEVICE), torch.zeros(0, 2, 16, device=DEVICE)
    cos = torch.zeros(0, 8, device=DEVICE)
    assert rope_qk(q, k, cos, cos)[0].shape == (0, 4, 16)


# -- the check ----------------------------------------------------------------------------------
def test_the_check_accepts_the_kernel(capsys):
    gpulab.check("rope", ROPE.implementation)
    assert "✔ rope" in capsys.readouterr().out


def _wrong_direction(q, k, cos, sin, q_out, k_out):
    rope_qk_into(q, k, cos, -sin, q_out, k_out)


def _interleaved(q, k, cos, sin, q_out, k_out):
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out.copy_(torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2))


def _forgets_k(q, k, cos, sin, q_out, k_out):
    rope_qk_into(q, q, cos, sin, q_out, q_out)          # q's heads twice, k's never


def _k_unrotated(q, k, cos, sin, q_out, k_out):
    rope_qk_into(q, k, cos, sin, q_out, k_out)
    k_out.copy_(k)


def _sin_never_loaded(q, k, cos, sin, q_out, k_out):
    rope_qk_into(q, k, cos, torch.zeros_like(sin), q_out, k_out)


def _one_token_past_the_end(q, k, cos, sin, q_out, k_out):
    """A row mask that lets one token more through: reads past q and cos, writes past q_out."""
    def longer(x):
        return x.as_strided((x.shape[0] + 1, *x.shape[1:]), x.stride())
    rope_qk_into(longer(q), longer(k), longer(cos), longer(sin), longer(q_out), longer(k_out))


@pytest.mark.parametrize("wrong, says", [
    (_wrong_direction, "the rotation goes the wrong way"),
    (_interleaved, "the interleaved (GPT-J) layout"),
    (_forgets_k, "`k_out` is wrong"),
    (_k_unrotated, "`k_out` is k unrotated"),
    (_sin_never_loaded, "sin set to zero: is it ever loaded"),
    (_one_token_past_the_end, "past the end of"),
])
def test_the_check_rejects_wrong_kernels(wrong, says):
    with pytest.raises(gpulab.CheckFailure) as info:
        gpulab.check("rope", wrong)
    assert says in str(info.value), str(info.value)
    if wrong is _forgets_k:
        assert "never written" in str(info.value)


# -- public function's errors ---------------------------------------------------------------------
def test_rope_qk_rejects_bad_input_clearly():
    qkv, q, k = qkv_views(3, 4, 2, 16, torch.float32)
    cos, sin = angles(3, 16)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        rope_qk(q.flatten(1), k, cos, sin)
    with pytest.raises(ValueError, match="same tokens and head_dim"):
        rope_qk(q, k[:2], cos, sin)
    with pytest.raises(ValueError, match="same tokens and head_dim"):
        rope_qk(q, k[..., :8], cos, sin)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_qk(q[..., :15], k[..., :15], cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rope_qk(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)
    with pytest.raises(ValueError, match=r"cos must have shape \(3, 8\)"):
        rope_qk(q, k, cos[:, :4], sin)
    with pytest.raises(TypeError, match="sin must be float32"):
        rope_qk(q, k, cos, sin.half())
    with pytest.raises(TypeError, match="k must be float32"):
        rope_qk(q, k.half(), cos, sin)
    with pytest.raises(TypeError, match="q must be one of"):
        rope_qk(q.int(), k, cos, sin)
    with pytest.raises(ValueError, match=r"q_out must have shape \(3, 4, 16\)"):
        rope_qk(q, k, cos, sin, q_out=torch.empty(3, 4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="heads of 16 elements"):
        rope_qk(torch.zeros(1, 1025, 16, device=DEVICE), torch.zeros(1, 1, 16, device=DEVICE),
                cos[:1], sin[:1])
    assert torch.equal(qkv, qkv_views(3, 4, 2, 16, torch.float32)[0]), "a refused call wrote"


# -- k and v into the KV cache in the same launch --------------------------------------------------
def cache_rows(slots_total, hkv, d, dtype):
    """A layer's cache as rows of slots, poisoned: an unwritten row keeps its NaNs."""
    return (torch.full((slots_total, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
            torch.full((slots_total, hkv, d), float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stores_rotated_k_and_v_at_their_slots_and_nowhere_else(dtype):
    """The engine's call: q into its own tensor, k in place, and row slots[t] of the caches
    (twice as many slots as tokens, scattered) gets token t's rotated k and its v, bit for
    bit as rope_reference and index_copy_; every other slot keeps its poison."""
    t, hq, hkv, d = 11, 4, 2, 16
    qkv, q, k = qkv_views(t, hq, hkv, d, dtype, seed=3)
    v = qkv[:, (hq + hkv) * d:].unflatten(-1, (hkv, d))
    cos, sin = angles(t, d, seed=3)
    want_q, want_k = rope_reference(q, cos, sin), rope_reference(k, cos, sin)
    v_before = v.clone()
    slots = torch.randperm(2 * t, generator=torch.Generator().manual_seed(3))[:t].to(DEVICE)
    k_cache, v_cache = cache_rows(2 * t, hkv, d, dtype)
    q_out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
    got_q, got_k = rope_qk_store_kv(q, k, v, cos, sin, slots, k_cache, v_cache, q_out=q_out)
    assert got_q is q_out and got_k is k
    assert_rounded_like(q_out, want_q)
    assert_rounded_like(k, want_k)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v_before) and torch.equal(v, v_before)
    others = torch.ones(2 * t, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()


def test_a_slot_outside_the_cache_stores_nothing():
    """The launcher (no validation, as the engine's graphs call it): a negative slot or one
    past the cache writes nowhere, the other tokens still land; the public function
    refuses such slots with the entry named."""
    t, hkv, d = 4, 2, 16
    _, q, k = qkv_views(t, 4, hkv, d, torch.float32, seed=4)
    v = torch.randn(t, hkv, d, device=DEVICE)
    cos, sin = angles(t, d, seed=4)
    k_cache, v_cache = cache_rows(6, hkv, d, torch.float32)
    guard = torch.full((8, hkv, d), float("nan"), device=DEVICE)
    big_k = torch.cat([k_cache, guard])                  # rows 6.. of the buffer: past the cache
    slots = torch.tensor([5, -1, 6, 0], device=DEVICE)
    with pytest.raises(IndexError, match=r"slots\[1\] = -1 is outside \[0, 6\)"):
        rope_qk_store_kv(q, k, v, cos, sin, slots, k_cache, v_cache)
    rope_qk_into(q, k, cos, sin, None, None, v, slots, big_k[:6], v_cache)
    assert torch.equal(big_k[5], k[0]) and torch.equal(v_cache[0], v[3])
    assert big_k[6:].isnan().all() and big_k[1:5].isnan().all() and v_cache[1:5].isnan().all()


def test_rope_qk_store_kv_rejects_bad_input_clearly():
    _, q, k = qkv_views(3, 4, 2, 16, torch.float32)
    v = torch.zeros(3, 2, 16, device=DEVICE)
    cos, sin = angles(3, 16)
    kc, vc = torch.zeros(8, 2, 16, device=DEVICE), torch.zeros(8, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"v must have shape \(3, 2, 16\)"):
        rope_qk_store_kv(q, k, v[:2], cos, sin, slots, kc, vc)
    with pytest.raises(TypeError, match="slots must be int64"):
        rope_qk_store_kv(q, k, v, cos, sin, slots.int(), kc, vc)
    with pytest.raises(ValueError, match=r"k_cache must be \[slots, 2, 16\]"):
        rope_qk_store_kv(q, k, v, cos, sin, slots, torch.zeros(8, 4, 16, device=DEVICE), vc)
    with pytest.raises(ValueError, match="same slots, got 8 and 7"):
        rope_qk_store_kv(q, k, v, cos, sin, slots, kc, vc[:7])
    with pytest.raises(TypeError, match="v_cache must be float32"):
        rope_qk_store_kv(q, k, v, cos, sin, slots, kc, vc.half())
    assert (kc == 0).all() and (vc == 0).all(), "a refused call wrote"


def test_the_kv_check_accepts_the_kernel(capsys):
    gpulab.check("rope_kv", rope_kv_launch)
    assert "✔ rope_kv" in capsys.readouterr().out


def _kv_at_token_rows(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache):
    rope_kv_launch(q, k, v, cos, sin, torch.arange(len(slots), device=slots.device), q_out, k_out, k_cache, v_cache)


def _k_stored_unrotated(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache):
    rope_kv_launch(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache)
    k_cache.index_copy_(0, slots, k)


def _k_stored_as_v(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache):
    rope_kv_launch(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache)
    v_cache.index_copy_(0, slots, k_out)


def _v_never_stored(q, k, v, cos, sin, slots, q_out, k_out, k_cache, v_cache):
    rope_qk_into(q, k, cos, sin, q_out, k_out)
    k_cache.index_copy_(0, slots, k_out)


@pytest.mark.parametrize("wrong, says", [
    (_kv_at_token_rows, "went to cache row t: they belong in row slots[t]"),
    (_k_stored_unrotated, "`k_cache` holds k unrotated"),
    (_k_stored_as_v, "`v_cache` holds the rotated k, not v"),
    (_v_never_stored, "never written"),
])
def test_the_kv_check_rejects_wrong_stores_and_names_the_cause(wrong, says):
    """A store at the token's row instead of its slot, k stored before its rotation, the
    rotated k stored as v, v never stored: each fails with its cause."""
    with pytest.raises(gpulab.CheckFailure) as info:
        gpulab.check("rope_kv", wrong)
    assert says in str(info.value), str(info.value)


# -- the engine's transformer block ----------------------------------------------------------------
@pytest.fixture(scope="module")
def block():
    torch.manual_seed(7)
    return TernaryTransformer(TINY).pack().to(DEVICE).blocks[0]


def test_packed_block_rotates_with_the_kernel_as_the_pytorch_path_does(block, monkeypatch):
    """pre_attention of a packed block (its BitLinears on gpulab's kernels, interpreted
    on a CPU): q, k, v equal the projection's output rotated by apply_rope, and the
    PyTorch ops never run; q comes back contiguous, k and v as views of one buffer."""
    c = TINY
    x = torch.randn(2, 19, c.d_model, device=DEVICE)           # [B, T] rows, as the training forward's
    cos, sin = angles(38, c.head_dim)
    cos, sin = cos.view(2, 19, -1), sin.view(2, 19, -1)
    with torch.no_grad():
        qkv = run_bitlinear(block.qkv_proj, x)
        qd, kd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        want_q = apply_rope(qkv[..., :qd].unflatten(-1, (c.n_heads, c.head_dim)), cos, sin)
        want_k = apply_rope(qkv[..., qd:qd + kd].unflatten(-1, (c.n_kv_heads, c.head_dim)), cos, sin)
        want_v = qkv[..., qd + kd:].unflatten(-1, (c.n_kv_heads, c.head_dim))

        def no_pytorch_rope(*args):
            raise AssertionError("apply_rope ran: the packed path should launch the kernel")
        monkeypatch.setattr(engine_model, "apply_rope", no_pytorch_rope)
        q, k, v = block.pre_attention(x, cos, sin)
    assert q.is_contiguous() and k.data_ptr() + kd * k.element_size() == v.data_ptr()
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)


def test_reference_and_autograd_keep_the_pytorch_ops(block):
    x = torch.randn(5, TINY.d_model, device=DEVICE)
    cos, sin = angles(5, TINY.head_dim)
    with torch.no_grad():
        q, k, _ = block.pre_attention(x, cos, sin, reference=True)
    assert q.is_contiguous() and k.is_contiguous()           # apply_rope's outputs, not views
    unpacked = TransformerBlock(TINY).to(DEVICE)
    q, k, _ = unpacked.pre_attention(x, cos, sin)           # training: gradients flow through RoPE
    assert q.requires_grad and k.grad_fn is not None


def test_packed_block_stores_k_and_v_in_the_rope_kernel(block, monkeypatch):
    """pre_attention with a cache destination: the packed block's RoPE kernel stores k and
    v (no index_copy_), the reference path stores the same rows with index_copy_."""
    c = TINY
    x = torch.randn(6, c.d_model, device=DEVICE)
    cos, sin = angles(6, c.head_dim, seed=5)
    slots = torch.tensor([9, 0, 4, 5, 13, 2], device=DEVICE)
    got, want = cache_rows(16, c.n_kv_heads, c.head_dim, torch.float32), cache_rows(16, c.n_kv_heads, c.head_dim,
                                                                                  torch.float32)
    with torch.no_grad():
        _, ref_k, ref_v = block.pre_attention(x, cos, sin, reference=True, kv_dest=(slots, *want))
        monkeypatch.setattr(engine_model, "store_kv", lambda *a: pytest.fail("index_copy_ path on the kernel path"))
        _, k, v = block.pre_attention(x, cos, sin, kv_dest=(slots, *got))
    assert torch.equal(got[0][slots], k) and torch.equal(got[1][slots], v)
    torch.testing.assert_close(got[0], want[0], equal_nan=True, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], equal_nan=True, atol=1e-5, rtol=1e-5)

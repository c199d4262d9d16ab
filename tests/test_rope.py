"""RoPE of q and k in one kernel (gpulab.rope): against the PyTorch ops it replaces, in
place on views of a QKV projection's output, through its check, and in the engine's
transformer block."""
import pytest
import torch

import gpulab
from gpulab import runtime
from gpulab.engine import model as engine_model
from gpulab.engine.model import TINY, TernaryTransformer, TransformerBlock, apply_rope, run_bitlinear
from gpulab.grading.rope import ROPE
from gpulab.rope import rope_qk, rope_qk_into, rope_reference

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

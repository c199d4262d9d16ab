"""The fused block step (gpulab.block_step): one kernel for a MatMul-free block's decode
step, against its float64 reference and the layered step it replaces."""
import pytest
import torch

from gpulab import runtime
from gpulab.block_step import block_step, block_step_ref, fits
from gpulab.model import MatMulFreeLM

DEVICE = runtime.device()


def _model(d_model=32, n_layers=2, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = MatMulFreeLM(d_model=d_model, n_layers=n_layers).to(DEVICE)
    with torch.no_grad():                     # non-uniform norms and embeddings, not the init's ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
        model.embed.weight.normal_()
    model.pack()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


@pytest.mark.parametrize("batch", [1, 5, 17])
def test_block_step_matches_its_float64_reference_and_the_layered_step(batch):
    model = _model()
    block = model.blocks[0]
    w = block.step_weights()
    x = torch.randn(batch, 32, device=DEVICE) * 2
    h = torch.randn(batch, 32, device=DEVICE)
    x_in, h_in = x.clone(), h.clone()
    got_x, got_h = block_step(x, h, w)
    ref_x, ref_h = block_step_ref(x, h, w)
    assert torch.equal(x, x_in) and torch.equal(h, h_in)            # inputs untouched
    assert got_x.dtype == x.dtype and got_h.dtype == torch.float32
    torch.testing.assert_close(got_x, ref_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, ref_h, atol=1e-4, rtol=1e-4)
    layered_x, layered_h = block.step(x, h)
    torch.testing.assert_close(got_x, layered_x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, layered_h, atol=1e-4, rtol=1e-4)


def test_fused_model_steps_follow_the_layered_ones():
    """Twenty greedy steps of a packed model, fused and layered, from the same tokens."""
    model = _model(seed=1)
    tokens = torch.tensor([72, 101, 10], device=DEVICE)
    layered = fused = [torch.zeros(3, 32, device=DEVICE) for _ in model.blocks]
    for _ in range(20):
        a, layered = model.step(tokens, layered)
        b, fused = model.step(tokens, fused, fused=True)
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
        tokens = a.argmax(-1)


def test_wrong_kernels_are_caught():
    """The comparison above fails for the learner-style slips a fused step invites: the
    forget gate's complement dropped, the state not carried, one shared quantization."""
    model = _model(seed=2)
    w = model.blocks[0].step_weights()
    x, h = torch.randn(4, 32, device=DEVICE), torch.randn(4, 32, device=DEVICE)
    ref_x, ref_h = block_step_ref(x, h, w)
    bad_scales = w.scales.clone()
    bad_scales[3] *= 2                                              # o's scale applied twice
    wrong = dict(w.__dict__, scales=bad_scales)
    got_x, _ = block_step(x, h, type(w)(**wrong))
    assert not torch.allclose(got_x, ref_x, atol=1e-4, rtol=1e-4)
    _, got_h = block_step(x, torch.zeros_like(h), w)                # the state not carried
    assert not torch.allclose(got_h, ref_h, atol=1e-4, rtol=1e-4)


def test_step_weights_follow_the_weights_and_refuse_what_the_kernel_cannot_run():
    model = _model(seed=3)
    block = model.blocks[0]
    first = block.step_weights()
    assert block.step_weights() is first                            # made once
    with torch.no_grad():
        block.mixer_norm.weight.mul_(2)                             # changed in place: made again
    again = block.step_weights()
    assert again is not first and torch.equal(again.norms[0], block.mixer_norm.weight.float())
    assert MatMulFreeLM(d_model=32).blocks[0].step_weights() is None          # not packed
    assert MatMulFreeLM(d_model=32, variant="code").pack().blocks[0].step_weights() is None
    assert MatMulFreeLM(d_model=48).pack().blocks[0].step_weights() is None   # 48: not a power of two
    assert fits(128, 512) and not fits(128, 300) and not fits(8, 64) and not fits(512, 1024)


def test_block_step_rejects_bad_input_clearly():
    w = _model(seed=4).blocks[0].step_weights()
    with pytest.raises(ValueError, match=r"x must be \[batch, 32\]"):
        block_step(torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(TypeError, match="x"):
        block_step(torch.zeros(2, 32, dtype=torch.int32, device=DEVICE), torch.zeros(2, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="h"):
        block_step(torch.zeros(2, 32, device=DEVICE), torch.zeros(3, 32, device=DEVICE), w)
    x, h = block_step(torch.zeros(0, 32, device=DEVICE), torch.zeros(0, 32, device=DEVICE), w)
    assert x.shape == (0, 32) and h.shape == (0, 32)

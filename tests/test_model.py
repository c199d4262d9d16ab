"""The tiny MatMul-free LM: forward/backward, constant-memory generation that matches the
full forward pass, a short training run that really lowers the loss, bad input."""
import math

import pytest
import torch

import gpulab
from gpulab import model as M


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """The model's ops are tiny: extra threads only wait on each other (and on the other
    test worker sharing the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(device, **kw):
    torch.manual_seed(0)
    return M.MatMulFreeLM(d_model=kw.pop("d_model", 32), n_layers=kw.pop("n_layers", 2), **kw).to(device)


def test_corpus_and_tokenizer():
    text = M.load_corpus()
    assert 5_000 < len(text.encode()) < 300_000
    assert "Tyger Tyger" in text
    tokens = M.encode(text)
    assert tokens.dtype == torch.long and int(tokens.max()) < 256
    assert M.decode(tokens) == text
    assert M.decode(M.encode("naïve")) == "naïve"


@pytest.mark.parametrize("variant", ["paper", "code"])
def test_forward_backward(variant, device):
    model = _tiny(device, variant=variant)
    tokens = torch.randint(0, 256, (3, 17), device=device)
    logits, states = model(tokens)
    assert logits.shape == (3, 17, 256) and logits.dtype == torch.float32
    assert len(states) == 2 and all(s.shape == (3, 32) for s in states)
    loss = model.loss(tokens)
    assert abs(loss.item() - math.log(256)) < 1.0
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reached {missing}"


def test_step_by_step_equals_full_forward(device):
    model = _tiny(device).eval()
    tokens = torch.randint(0, 256, (2, 12), device=device)
    with torch.no_grad():
        full, _ = model(tokens)
        # prompt through the scan, then one token at a time through the states
        logits, states = model(tokens[:, :5])
        torch.testing.assert_close(logits, full[:, :5], atol=1e-4, rtol=1e-4)
        for t in range(5, 12):
            logits, states = model.step(tokens[:, t], states)
            torch.testing.assert_close(logits, full[:, t], atol=1e-4, rtol=1e-4)


def test_right_padded_batch_gives_each_row_its_own_state(device):
    """Rows of different lengths in one pass (``lengths``): each row's states equal a pass
    over that row alone, from its own starting state; padding never moves a state."""
    model = _tiny(device).eval()
    rows = [torch.randint(0, 256, (n,), device=device) for n in (7, 1, 4)]
    tokens = torch.full((3, 7), 255, dtype=torch.long, device=device)   # padding: any byte
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    h0 = [torch.randn(3, 32, device=device) for _ in model.blocks]
    with torch.no_grad():
        logits, states = model(tokens, h0, lengths=torch.tensor([7, 1, 4], device=device))
        for b, r in enumerate(rows):
            alone_logits, alone = model(r[None], [h[b:b + 1] for h in h0])
            for k in range(len(h0)):
                torch.testing.assert_close(states[k][b], alone[k][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[b, :len(r)], alone_logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lengths, err, words", [
    ([7, 0, 4], IndexError, "between 1 and the padded length"),
    ([7, 8, 4], IndexError, "between 1 and the padded length"),
    ([7.0, 1.0, 4.0], TypeError, "int32, int64"),
    ([7, 1], ValueError, "shape"),
])
def test_model_rejects_bad_lengths(device, lengths, err, words):
    model = _tiny(device, n_layers=1)
    with pytest.raises(err, match=words):
        model(torch.zeros(3, 7, dtype=torch.long, device=device), lengths=torch.tensor(lengths, device=device))


def test_generate_is_consistent_and_constant_memory(device):
    model = _tiny(device).eval()
    prompt = M.encode("Tyger ")[None].to(device)
    out = model.generate(prompt, 10, temperature=0)
    assert out.shape == (1, 16) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():   # greedy: each new token is the argmax of the full forward pass
        logits, _ = model(out[:, :-1])
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])
    assert model.state_numel(batch=4) == 4 * 2 * 32
    g = torch.Generator(device=device).manual_seed(1)
    sampled = model.generate(prompt.repeat(3, 1), 8, temperature=0.8, top_k=20, generator=g)
    assert sampled.shape == (3, 14) and int(sampled.max()) < 256
    assert model.generate(prompt, 0).shape == (1, 6)


def test_short_training_run_lowers_the_loss(device):
    torch.manual_seed(0)
    model = M.MatMulFreeLM(d_model=32, n_layers=1).to(device)
    data = M.encode(M.load_corpus())
    losses = M.train(model, data, steps=40, batch_size=8, seq_len=32, lr=1e-2, seed=0, progress=False)
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert first > 5.0, losses[:3]             # starts near ln 256 = 5.55
    assert last < first - 1.5, (first, last)   # a real drop, not noise


@pytest.mark.parametrize("bad, err, words", [
    (lambda d: torch.randint(0, 256, (5,), device=d), ValueError, "2 dimensions"),
    (lambda d: torch.zeros(1, 3, dtype=torch.int32, device=d), TypeError, "int64"),
    (lambda d: torch.full((1, 3), 256, dtype=torch.long, device=d), IndexError, "vocab_size"),
    (lambda d: torch.zeros(1, 0, dtype=torch.long, device=d), ValueError, "at least one token"),
])
def test_model_rejects_bad_tokens(device, bad, err, words):
    model = _tiny(device, n_layers=1)
    with pytest.raises(err, match=words):
        model(bad(device))


def test_generate_rejects_bad_options(device):
    model = _tiny(device, n_layers=1)
    prompt = torch.zeros(1, 2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="scan"):
        M.MatMulFreeLM(scan="gpu")
    with pytest.raises(ValueError, match="seq_len"):
        next(M.batches(torch.arange(5), 2, 10, torch.Generator()))


@pytest.mark.skipif(gpulab.mode() != "compiled",
                    reason="packed BitLinear runs the ternary matmul kernel: slow in the interpreter")
def test_packed_model_matches_training_forward(device):
    model = _tiny(device, n_layers=1).eval()
    tokens = torch.randint(0, 256, (2, 40), device=device)
    with torch.no_grad():
        a, _ = model(tokens)
        model.pack()
        b, _ = model(tokens)
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert model.generate(tokens[:, :3], 4).shape == (2, 7)

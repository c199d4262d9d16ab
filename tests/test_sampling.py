"""The engine's sampler (gpulab/engine/sampling.py): seeded uniforms from a hash, computed
where the logits are, and Gumbel-max draws that follow softmax(logits / T)."""
import random
from types import SimpleNamespace

import pytest
import torch

import gpulab
from gpulab.engine import sampling
from gpulab.engine.sampling import mul32, gumbel, sample, token_seed, uniforms
from gpulab.engine.sequence import SamplingParams
from gpulab.grading.speculative import chi2_pvalue


def _mix32_int(x: int) -> int:
    """lowbias32 on Python ints: the hash written the plain way."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _uniform_int(key: int, v: int) -> float:
    row = _mix32_int(_mix32_int(key >> 32) ^ (key & 0xFFFFFFFF))
    col = _mix32_int((v * 0x9E3779B9) & 0xFFFFFFFF)
    return (_mix32_int(row ^ col) + 0.5) * 2.0 ** -32


def test_the_hash_is_exact_32_bit_arithmetic_on_any_device():
    """Products taken in 16-bit halves equal modular arithmetic on Python ints (no int64
    overflow anywhere), and the uniforms equal the hash written on Python ints, on the
    CPU and on gpulab's device alike."""
    rng = random.Random(0)
    xs = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(2000)]
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        assert mul32(torch.tensor(xs), c).tolist() == [(x * c) % 2 ** 32 for x in xs]
    keys = [0, 1, 2 ** 63 - 1] + [rng.getrandbits(63) for _ in range(20)]
    want = torch.tensor([[_uniform_int(k, v) for v in range(37)] for k in keys], dtype=torch.float64)
    for device in {"cpu", str(gpulab.device())}:
        got = uniforms(torch.tensor(keys, device=device), 37).cpu()
        assert torch.equal(got, want), device


def test_a_rows_noise_depends_on_its_key_alone():
    """Row b is the same alone or in any batch, in (0, 1), and rows of neighbouring keys
    (one token apart) are uncorrelated; the uniforms are uniform (χ² over 32 bins)."""
    keys = [token_seed(seed, 0, pos) for seed in range(8) for pos in range(64)]
    u = uniforms(torch.tensor(keys), 258)
    assert torch.equal(u[100:101], uniforms(torch.tensor(keys[100:101]), 258))
    assert torch.equal(u[3::5], uniforms(torch.tensor(keys[3::5]), 258))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert chi2_pvalue(torch.bincount((u.flatten() * 32).long(), minlength=32).double(),
                       torch.full((32,), 1 / 32, dtype=torch.float64)) > 1e-3
    c = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    assert abs(float(c)) < 0.02
    g = gumbel(keys[:4], 258)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()


def _draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """One draw from each of n requests (seeds 0..n-1) with the same logits."""
    seqs = [SimpleNamespace(params=params, seed=s, index=0, num_output_tokens=0) for s in range(n)]
    return torch.tensor(sample(logits.expand(n, -1).clone(), seqs))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gumbel_max_draws_follow_the_softmax(temperature):
    """Over many seeds the sampler's tokens are distributed as softmax(logits / T) (χ²),
    and a sampler with a wrong noise (exponential instead of Gumbel) fails the same test."""
    logits = torch.tensor([[1.5, 0.0, 1.0, -1.0, 0.3, -torch.inf]])
    want = torch.softmax(logits[0].double() / temperature, -1)
    params = SamplingParams(temperature=temperature)
    counts = torch.bincount(_draws(logits, params, 6000), minlength=6).double()
    assert chi2_pvalue(counts, want) > 1e-3


def test_the_distribution_test_fails_a_wrong_noise(monkeypatch):
    logits = torch.tensor([[1.5, 0.0, 1.0, -1.0, 0.3, -torch.inf]])
    want = torch.softmax(logits[0].double(), -1)

    def exponential(keys, vocab, device=None):        # -log u: not Gumbel
        keys = keys if isinstance(keys, torch.Tensor) else torch.tensor(keys).to(device)
        return (-torch.log(uniforms(keys, vocab))).float()

    monkeypatch.setattr(sampling, "gumbel", exponential)
    counts = torch.bincount(_draws(logits, SamplingParams(temperature=1.0), 6000), minlength=6).double()
    assert chi2_pvalue(counts, want) < 1e-6

"""The check harness itself: poison, guards, unchanged inputs, diagnoses, fresh seeds."""
import pytest
import torch

from gpulab.harness import checking
from gpulab.harness.checking import CheckFailure, Guarded, diagnose
from gpulab.harness.spec import Case, KernelSpec, randn


def _copy_spec(**kw):
    base = dict(
        name="test-copy", summary="y = 2x", args=("x", "y"),
        make_inputs=lambda p, dt, dev, g: {"x": randn((p["rows"], p["cols"]), dt, dev, g)},
        reference=lambda x: {"y": 2 * x.double()},
        outputs=lambda inp, dt: {"y": (inp["x"].shape, dt)},
        cases={"cpu": [Case("a", dict(rows=4, cols=33))], "gpu": [Case("a", dict(rows=4, cols=33))]},
        dtypes={"cpu": [torch.float32], "gpu": [torch.float32]},
        tolerances={torch.float32: (1e-6, 1e-6)}, read_inputs=("x",))
    base.update(kw)
    return KernelSpec(**base)


def test_a_correct_function_passes_and_reports():
    rep = checking.check(_copy_spec(), lambda x, y: y.copy_(2 * x), quiet=True)
    assert len(rep.cases) == 1 and "all 1 cases correct" in rep.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32])
def test_outputs_start_poisoned_and_guards_detect_writes(dtype):
    g = Guarded.wrap((3, 5), dtype, "cpu")
    assert bool(checking._poisoned(g.inner).all())
    g.buf[g.guard + 15] = 1        # one element past the end
    g.buf[g.guard - 1] = 1         # one before the start
    assert g.guard_damage() == (1, 1)


def test_input_guards_are_nan_and_data_is_copied():
    x = torch.randn(7)
    g = Guarded.wrap(x.shape, x.dtype, "cpu", like=x)
    assert torch.equal(g.inner, x)
    assert torch.isnan(g.buf[: g.guard]).all() and torch.isnan(g.buf[g.guard + 7:]).all()


def test_fresh_inputs_each_run():
    seen = []
    spec = _copy_spec()
    checking.check(spec, lambda x, y: (seen.append(x.clone()), y.copy_(2 * x)), quiet=True)
    checking.check(spec, lambda x, y: (seen.append(x.clone()), y.copy_(2 * x)), quiet=True)
    assert not torch.equal(seen[0], seen[1])


def test_seed_reproduces_inputs():
    seen = []
    spec = _copy_spec()
    for _ in range(2):
        checking.check(spec, lambda x, y: (seen.append(x.clone()), y.copy_(2 * x)), quiet=True, seed=5)
    assert torch.equal(seen[0], seen[1])


def test_inputs_are_non_uniform():
    x = randn((64, 100), torch.float32, "cpu", torch.Generator().manual_seed(0))
    stds = x.std(dim=1)
    assert stds.max() / stds.min() > 2


def test_modifying_an_input_is_reported():
    with pytest.raises(CheckFailure, match="input `x` was modified"):
        checking.check(_copy_spec(), lambda x, y: (y.copy_(2 * x), x.mul_(2)), quiet=True)


def test_the_learners_own_exception_propagates_with_a_note():
    def stub(x, y):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError) as info:
        checking.check(_copy_spec(), stub, quiet=True)
    assert "gpulab: raised while checking test-copy" in "".join(getattr(info.value, "__notes__", []))


def test_returning_spec():
    spec = _copy_spec(name="test-return", outputs=None, returns=("y",))
    checking.check(spec, lambda x: 2 * x, quiet=True)
    with pytest.raises(CheckFailure, match="expected 1 returned"):
        checking.check(spec, lambda x: (2 * x, x), quiet=True)


def _msg(got, exp, atol=1e-6, rtol=1e-6):
    m, _ = diagnose("y", got, exp, atol, rtol)
    return m


def test_diagnose_shape_mismatch():
    assert "shape" in _msg(torch.zeros(3, 4), torch.zeros(4, 3))


def test_diagnose_tail_columns():
    e = torch.randn(6, 40).double()
    g = e.clone()
    g[:, 32:] += 1
    assert "columns 32..39 of every row" in _msg(g, e)


def test_diagnose_some_rows():
    e = torch.randn(6, 40).double()
    g = e.clone()
    g[2:4] += 1
    assert "only rows 2..3" in _msg(g, e)


def test_diagnose_constant_and_per_row_factor():
    e = torch.rand(6, 40).double() + 0.5
    assert "same factor ≈ 3" in _msg(3 * e, e)
    per_row = e * torch.arange(2, 8).double()[:, None]
    assert "own constant factor" in _msg(per_row, e)


def test_diagnose_nan():
    e = torch.rand(5, 8).double()
    g = e.clone()
    g[1, 3] = float("nan")
    assert "NaN" in _msg(g, e)


def test_diagnose_flat_tail_never_written():
    spec = _copy_spec(name="test-tail")

    def half(x, y):
        y.view(-1)[: x.numel() // 2].copy_(2 * x.view(-1)[: x.numel() // 2])
    msg = checking.rejects(spec, half)
    assert "never written" in msg


def test_rejects_complains_when_a_check_accepts():
    with pytest.raises(AssertionError, match="accepted a wrong implementation"):
        checking.rejects(_copy_spec(), lambda x, y: y.copy_(2 * x))

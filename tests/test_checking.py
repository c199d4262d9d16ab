"""The check harness itself: poison, guards, unchanged inputs, diagnoses, fresh seeds."""
import pytest
import torch

from gpulab import runtime
from gpulab.harness import checking
from gpulab.harness.checking import CheckFailure, Guarded, diagnose
from gpulab.harness.spec import Case, KernelSpec, get, randn


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
    rep = checking.run_check(_copy_spec(), lambda x, y: y.copy_(2 * x), quiet=True)
    assert checking.check(_copy_spec(), lambda x, y: y.copy_(2 * x), quiet=True) is None
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


def test_a_gpu_fault_ends_the_check_with_a_clear_message():
    """A kernel that stores far outside every buffer makes CUDA fail the call (sticky: the
    process cannot use the GPU after it). The check says so and runs nothing more. On a CPU
    the same error is raised by hand."""
    calls = []

    def wild(x, y):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(checking.DeviceFault) as info:
        checking.check(_copy_spec(), wild, quiet=True)
    assert len(calls) == 1 and "outside every buffer" in str(info.value) and "restart" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


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


def test_diagnose_row_factors_that_differ_a_little_are_still_per_row():
    # a running sum that is never rescaled: each row off by its own factor, 0.512 and 0.515
    e = torch.rand(2, 64).double() + 0.5
    assert "own constant factor" in _msg(e * torch.tensor([[0.512], [0.515]]).double(), e)
    # one factor for every row, rounded to float16: the same factor, not a per-row one
    e16 = torch.rand(8, 64) + 0.5
    assert "same factor ≈ 0.5" in _msg((0.5 * e16).half(), e16.half().double())


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


# -- what the check watches while the learner's function runs ---------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import gpulab  # noqa: E402
from gpulab import basics  # noqa: E402


@triton.jit
def _add_unmasked_loads(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)                      # no mask: reads past the end...
    y = tl.load(y_ptr + offs)
    tl.store(out_ptr + offs, x + y, mask=offs < n)  # ...but never stores those lanes


@triton.jit
def _add_ok(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


def _launch(kernel):
    def add(x, y, out):
        kernel[(triton.cdiv(out.numel(), 256),)](x, y, out, out.numel(), BLOCK=256)
    return add


_SMALL_ADD = dict(cases=[Case("tail", dict(n=300))], dtypes=[torch.float32])


@pytest.mark.skipif(gpulab.mode() == "compiled", reason="load addresses are checked in the interpreter")
def test_a_load_past_the_end_is_reported_even_when_never_stored():
    msg = checking.rejects("vector_add", _launch(_add_unmasked_loads), **_SMALL_ADD)
    assert "a load past the end of input `x`" in msg and "missing its mask" in msg


def test_a_kernel_exercise_needs_the_learners_own_kernel():
    with checking.enforce_learner_kernels():
        checking.check("vector_add", _launch(_add_ok), quiet=True, **_SMALL_ADD)
        msg = checking.rejects("vector_add", lambda x, y, out: torch.add(x, y, out=out), **_SMALL_ADD)
        assert "asks for a Triton kernel of your own" in msg and "no Triton kernel at all" in msg
        msg = checking.rejects("vector_add", basics.add_into, **_SMALL_ADD)
        assert "not yours (gpulab.basics.add_kernel)" in msg
        # a PyTorch-level exercise says so
        checking.check("vector_add", lambda x, y, out: torch.add(x, y, out=out), learner_kernel=False,
                       quiet=True, **_SMALL_ADD)
    # outside notebooks (package tests) gpulab's own kernels are checked as they are
    checking.check("vector_add", basics.add_into, quiet=True, **_SMALL_ADD)


def test_kernel_origin():
    assert checking.kernel_origin(basics.add_kernel) == "gpulab.basics"
    assert checking.kernel_origin(_add_ok) is None


def test_a_broadcast_result_fails_with_a_shape_message():
    spec = _copy_spec(name="test-bcast")
    msg = checking.rejects(spec, lambda x, y: y.copy_((2 * x)[:, :1]))
    assert "broadcasting a result of shape (4, 1)" in msg and "exact shape" in msg


def test_nan_everywhere_does_not_report_largest_error_0():
    msg = checking.rejects(_copy_spec(name="test-nan"), lambda x, y: y.fill_(float("nan")))
    assert "largest error 0" not in msg and "every element is NaN or Inf" in msg
    assert "arithmetic" in msg and "past the end" not in msg


def test_inf_is_named_an_overflow():
    def overflows(x, y):
        y.copy_(2 * x)
        y[:, 3] = float("inf")
    msg = checking.rejects(_copy_spec(name="test-inf"), overflows)
    assert "overflow" in msg


def test_check_prints_one_line_and_returns_none(capsys):
    assert checking.check(_copy_spec(), lambda x, y: y.copy_(2 * x)) is None
    out = capsys.readouterr()
    assert out.out.count("\n") == 1 and out.out.startswith("✔ test-copy") and not out.err


def test_runtime_warnings_of_the_learners_call_stay_silent(capsys):
    import warnings

    def noisy(x, y):
        warnings.warn("divide by zero encountered in log", RuntimeWarning)
        y.copy_(2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checking.check(_copy_spec(), noisy, quiet=True)


def test_returned_dtype_is_part_of_the_contract():
    spec = _copy_spec(name="test-ret-dtype", outputs=None, returns=("y",),
                      implementation=lambda x: (2 * x).to(x.dtype))
    checking.check(spec, lambda x: 2 * x, quiet=True)
    msg = checking.rejects(spec, lambda x: (2 * x).double())
    assert "dtype float64, expected float32" in msg
    ints = _copy_spec(name="test-int-dtype", outputs=None, returns=("y",),
                      reference=lambda x: {"y": (x > 0).to(torch.int8)})
    msg = checking.rejects(ints, lambda x: (x > 0).long())
    assert "dtype int64, expected int8" in msg


def test_no_cases_is_a_failure_not_a_pass():
    with pytest.raises(CheckFailure, match="no cases"):
        checking.check(_copy_spec(), lambda x, y: None, cases=[])


# strided buffers: the row stride of x is not the row stride of y
@triton.jit
def _scale_rows(x_ptr, y_ptr, n_cols, sx, sy, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    tl.store(y_ptr + r * sy + c, 2 * tl.load(x_ptr + r * sx + c, mask=m), mask=m)


def _rows_launcher(which):
    def fn(x, y):
        sx, sy = x.stride(0), y.stride(0)
        sx, sy = {"ok": (sx, sy), "x for y": (sx, sx), "contiguous": (x.shape[1], x.shape[1])}[which]
        _scale_rows[(x.shape[0],)](x, y, x.shape[1], sx, sy, BLOCK=64)
    return fn


def test_strided_variant_catches_a_shared_stride():
    spec = _copy_spec(name="test-strided", strided=("x", "y"))
    rep = checking.run_check(spec, _rows_launcher("ok"), quiet=True)
    assert "strided" in rep.summary()
    for wrong in ("x for y", "contiguous"):
        msg = checking.rejects(spec, _rows_launcher(wrong))
        assert "strided" in msg and ("padding between the rows" in msg or "between the rows of" in msg), msg
    # without the opt-in the same mistake passes: strides are only varied where the contract takes them
    checking.check(_copy_spec(name="test-unstrided"), _rows_launcher("x for y"), quiet=True)


def test_guarded_strided_view_layout():
    x = torch.randn(3, 5)
    g = Guarded.wrap(x.shape, x.dtype, "cpu", like=x, pad=3)
    assert torch.equal(g.inner, x) and g.inner.stride() == (8, 1)
    assert int(g.valid.sum()) == 15 and g.guard_damage() == (0, 0)
    g.buf[g.guard + 6] = 1            # in the padding after row 0
    assert g.gap_damage() == 1


def test_edge_rows_zero_and_constant():
    seen = []
    spec = _copy_spec(name="test-edge", edge_rows=("x",))
    rep = checking.run_check(spec, lambda x, y: (seen.append(x.clone()), y.copy_(2 * x)), quiet=True)
    assert "edge data" in rep.summary()
    last = seen[-1]
    assert bool((last[0] == 0).all()) and bool((last[-1] == last[-1, 0]).all())
    # a kernel that divides by the row's range breaks on a constant row
    msg = checking.rejects(spec, lambda x, y: y.copy_(2 * x * (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) /
                                                     (x.amax(1, keepdim=True) - x.amin(1, keepdim=True))))
    assert "edge data" in msg and "NaN" in msg


def test_edge_data_hook():
    def halves(inputs, params, dtype, gen):
        """exact .5 ties"""
        return {"x": torch.full_like(inputs["x"], 2.5)}
    spec = _copy_spec(name="test-ties", edge_data=halves,
                      reference=lambda x: {"y": torch.round(x.double())})     # half to even: 2.5 -> 2
    checking.check(spec, lambda x, y: y.copy_(torch.round(x)), quiet=True)
    msg = checking.rejects(spec, lambda x, y: y.copy_(torch.floor(x + 0.5)))
    assert "exact .5 ties" in msg


def test_region_in_the_specs_axes():
    e = torch.randn(2, 4, 3, 8).double()
    g = e.clone()
    g[:, 1] += 1
    m, _ = diagnose("o", g, e, 1e-6, 1e-6, axes=("batch", "head", "token", "dim"))
    assert "head 1 (of 4)" in m


def test_guard_nan_hint_only_with_the_guard_pattern():
    x = torch.randn(4, 8)
    g = Guarded.wrap(x.shape, x.dtype, "cpu", like=x)
    guard_nan = g.buf[0].clone()                      # an input guard value
    e = torch.rand(4, 8).double()
    got = e.float().clone()
    got[1, 2] = guard_nan
    m, _ = diagnose("y", got, e, 1e-6, 1e-6)
    assert "past the end of an input" in m
    got[1, 2] = float("nan")                          # an arithmetic NaN
    m, _ = diagnose("y", got, e, 1e-6, 1e-6)
    assert "past the end" not in m and "arithmetic" in m


def test_compiled_mode_tells_reads_outside_from_arithmetic(monkeypatch):
    """On a GPU loads are not watched and NaNs lose their payload: the check re-runs with
    harmless guard values to see whether the wrong elements came from outside the inputs."""
    monkeypatch.setattr(checking.runtime, "interpreting", lambda: False)

    def reads_one_past(x, y):
        beyond = torch.as_strided(x, (x.numel() + 1,), (1,))[-1]
        canonical = torch.where(torch.isnan(beyond), torch.tensor(float("nan")), beyond)
        y.copy_(2 * x)
        y.view(-1)[-1] = canonical
    msg = checking.rejects(_copy_spec(name="test-probe"), reads_one_past)
    assert "a load past the end of input `x`" in msg
    msg = checking.rejects(_copy_spec(name="test-probe2"), lambda x, y: y.copy_(2 * x).view(-1).__setitem__(-1, float("nan")))
    assert "arithmetic" in msg and "past the end" not in msg

    def nan_and_zero_look_alike(x, y):
        # as an RMS norm's floored scale on a GPU: a row of NaNs and a row of zeros give one answer
        beyond = torch.as_strided(x, (x.numel() + 1,), (1,))[-1]
        y.copy_(2 * x)
        y.view(-1)[-1] = torch.nan_to_num(beyond, nan=0.0) + 7
    msg = checking.rejects(_copy_spec(name="test-probe3"), nan_and_zero_look_alike)
    assert "a load past the end of input `x`" in msg


def test_compiled_mode_names_the_input_read_past_its_end(monkeypatch):
    """Compiled, the guard re-runs change one input's guards at a time, so the diagnosis names
    the input a load ran past (a block table read one entry too far, on the H200 2026-12-01),
    not only "an input"."""
    monkeypatch.setattr(checking.runtime, "interpreting", lambda: False)
    spec = _copy_spec(name="test-two-inputs", args=("x", "idx", "y"),
                      make_inputs=lambda p, dt, dev, g: {
                          "x": randn((p["rows"], p["cols"]), dt, dev, g),
                          # a permutation, so idx[r + 1] != idx[r] and the mistake shows in every
                          # run (random entries, now and then all equal, hid it: a failed CI run)
                          "idx": torch.randperm(p["rows"], generator=g, device=g.device).to(dev)},
                      reference=lambda x, idx: {"y": 2 * x.double()[idx]},
                      read_inputs=("x", "idx"))

    def index_one_too_far(x, idx, y):
        # row r gathers row idx[r + 1]: the last row reads the entry past idx's end, and any
        # value there (a guard, a neighbour) picks a row, as a page index would on a GPU
        beyond = torch.as_strided(idx, (idx.numel() + 1,), (1,))[1:]
        y.copy_(2 * x[beyond.clamp(0, x.shape[0] - 1)])
    msg = checking.rejects(spec, index_one_too_far)
    assert "a load past the end of input `idx`" in msg and "`x`" not in msg, msg


def test_fresh_case_defeats_a_hard_coded_grid():
    spec = _copy_spec(name="test-fresh", fresh_case=lambda g: Case(
        "random", dict(rows=int(torch.randint(5, 40, (1,), generator=g)), cols=33)))

    def four_rows_only(x, y):
        y[:4].copy_(2 * x[:4])           # covers the listed case (4 rows) and nothing more
    msg = checking.rejects(spec, four_rows_only)
    assert "random size" in msg and "never written" in msg
    checking.check(spec, lambda x, y: y.copy_(2 * x), quiet=True)


# -- spec hints from hypotheses (the reference recomputed under a mistake) -------------------
def test_a_hypothesis_names_the_mistake_it_reproduces_and_nothing_else():
    x = torch.linspace(-3, 3, 40, dtype=torch.float64).reshape(4, 10)
    expected = x * 2
    hint = checking.hypotheses_hint(
        checking.Hypothesis("doubled twice", lambda inp: {"y": inp["x"] * 4}),
        checking.Hypothesis("all zero", lambda inp: {"y": torch.zeros_like(inp["x"])}),
        checking.Hypothesis("a hair off the answer", lambda inp: {"y": inp["x"] * 2 + 1e-4}),
        checking.Hypothesis("another output", lambda inp: {"z": inp["x"]}, outputs=("z",)))
    assert hint("y", x * 4, expected, {"x": x}) == "doubled twice"
    # an all-zero answer is left to the generic diagnoses ("never loaded", "all zeros")
    assert hint("y", torch.zeros_like(x), expected, {"x": x}) is None
    # a hypothesis a hair off the answer does not claim an unrelated small error
    off = expected.clone()
    off[0, 0] += 5e-4
    assert hint("y", off, expected, {"x": x}) is None
    # one answer among several (a free parameter), and a share below 1
    several = checking.Hypothesis("x times k", lambda inp: ({"y": inp["x"] * k} for k in (3, 5, 7)))
    assert several.explains("y", x * 5, {"x": x}, expected)
    most = checking.Hypothesis("mostly", lambda inp: {"y": inp["x"] * 3}, share=0.9)
    nearly = x * 3
    nearly[0, 0] += 1
    assert most.explains("y", nearly, {"x": x}, expected)
    assert not checking.Hypothesis("all", lambda inp: {"y": inp["x"] * 3}).explains("y", nearly, {"x": x}, expected)


def test_of_two_matching_hypotheses_the_closer_one_is_named():
    """Two mistakes whose answers lie within tolerance of each other (a split-decode
    partition of 32 tokens against the 33 that floor(capacity / splits) gives, when the
    33rd weighs little): the hint names the one that reproduces the output, whichever
    comes first."""
    x = torch.linspace(1, 3, 40, dtype=torch.float64).reshape(4, 10)
    got = x * 4 + 2e-4                                       # the second mistake, exactly
    hint = checking.hypotheses_hint(
        checking.Hypothesis("near", lambda inp: {"y": inp["x"] * 4}),
        checking.Hypothesis("exact", lambda inp: {"y": inp["x"] * 4 + 2e-4}))
    assert hint("y", got, x * 2, {"x": x}) == "exact"
    assert hint("y", x * 4, x * 2, {"x": x}) == "near"        # and the first on its own output


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 0x7FFFFFFF), (torch.float32, 0x7FC00000),
                                         (torch.bfloat16, 0x7FFF), (torch.bfloat16, 0x7FC0),
                                         (torch.float16, 0x7FFF), (torch.float16, 0x7E00)])
def test_arithmetic_nans_are_not_blamed_on_a_read_past_the_end(dtype, bits):
    """A GPU makes 0/0 and inf - inf the NaN with every payload bit set, a CPU the one with
    none; a float conversion can leave either where a guard's payload was. Neither is
    evidence of a stray load: the diagnosis must look at the arithmetic."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    width = torch.iinfo(view).bits
    signed = bits - (1 << width) if bits >= 1 << (width - 1) else bits
    got = torch.ones(4, 8, dtype=dtype)
    got[1, 3:] = torch.tensor(signed, dtype=view).view(dtype)
    msg, _ = diagnose("y", got, torch.ones(4, 8, dtype=dtype), 1e-3, 1e-3, poisoned=False)
    assert "bit pattern gpulab puts around every input" not in msg, msg
    guard = torch.ones(4, 8, dtype=dtype)       # a guard's own NaN still is
    guard.view(view)[1, 3:] = checking._signed(checking._GUARD_BITS[dtype], view)
    msg, _ = diagnose("y", guard, torch.ones(4, 8, dtype=dtype), 1e-3, 1e-3, poisoned=False)
    assert "bit pattern gpulab puts around every input" in msg, msg


def test_compiled_diagnosis_tells_a_read_between_the_rows_from_one_past_the_end(monkeypatch):
    """Compiled, loads are not watched: a re-run with zeros only in the padding between a strided
    input's rows (and one with zeros only before and after it) tells a read between the rows
    (offsets that assume contiguous rows) from one past the end."""
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    spec = get("row_sum")

    def n_as_row_stride(x, y):
        M, N = x.shape
        y.copy_(torch.as_strided(x, (M, N), (N, 1)).float().sum(1).to(y.dtype))

    def four_columns_too_many(x, y):
        M, N = x.shape
        y.copy_(torch.as_strided(x, (M, N + 4), (x.stride(0), 1)).float().sum(1).to(y.dtype))

    with pytest.raises(checking.CheckFailure) as e:
        checking.run_check(spec, n_as_row_stride, quiet=True)
    assert "between the rows" in str(e.value)
    with pytest.raises(checking.CheckFailure) as e:
        checking.run_check(spec, four_columns_too_many, quiet=True)
    # the guards' NaN pattern in the output, or (on a GPU, where NaNs lose it) a re-run
    assert any(s in str(e.value) for s in ("a load read past the end of an input", "a load past the end of input `x`")) \
        and "between the rows" not in str(e.value), str(e.value)


def test_only_the_reported_failure_is_diagnosed_and_it_is_the_most_telling():
    """A wrong kernel fails every run; recomputing a mistake's answer can take seconds a
    run on the GPU's cases, so the check diagnoses the failure it reports, not every one.
    The choice is the one diagnosing every run would make: here the largest case, where
    the spec's own hint speaks (the small cases have no hint)."""
    asked = []

    def hint(output, got, expected, inputs):
        asked.append(inputs["x"].shape[0])
        return "y is 3x: the factor is 2" if inputs["x"].shape[0] > 2 else None

    cases = [Case(f"{r} rows", dict(rows=r, cols=9)) for r in (1, 2, 5, 7)]
    spec = _copy_spec(name="test-lazy-hint", hint=hint, cases={"cpu": cases, "gpu": cases},
                      dtypes={"cpu": [torch.float32, torch.float64], "gpu": [torch.float32, torch.float64]},
                      tolerances={torch.float32: (1e-6, 1e-6), torch.float64: (1e-9, 1e-9)})
    msg = checking.rejects(spec, lambda x, y: y.copy_(3 * x))
    assert "8 of 8 runs failed" in msg and "case 7 rows" in msg and "float32" in msg.split("\n")[1]
    assert "the factor is 2" in msg
    assert asked == [7]          # one diagnosis: the first run of the largest case


def test_a_narrowed_hint_sees_the_same_part_of_the_output_the_answer_and_the_inputs():
    from gpulab.harness.checking import narrowed_hint
    seen = {}

    def hint(output, got, expected, inputs):
        seen.update(got=tuple(got.shape), expected=tuple(expected.shape),
                    **{k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return "cause"
    first_two = narrowed_hint(hint, lambda t: t[:2], inputs=("q",))
    got = torch.zeros(5, 3)
    assert first_two("o", got, got, {"q": torch.zeros(5, 4), "pages": torch.zeros(7), "n": 3}) == "cause"
    assert seen == {"got": (2, 3), "expected": (2, 3), "q": (2, 4), "pages": (7,)}


def test_row_slack_forgives_a_few_rows_moved_a_little_and_nothing_more():
    """KernelSpec.row_slack = (share, bound): up to that share of the rows, and one in a
    case of fewer, may miss the tolerance by at most ``bound`` (a cascade of int8 flips);
    more rows, a larger error, a NaN or a one-row case still fail."""
    e = torch.randn(64, 8, dtype=torch.float64)
    slack = (1 / 32, 1.0)

    def judged(rows, by, n=64):
        g = e[:n].clone()
        g[rows] += by
        return diagnose("x_out", g, e[:n], 1e-3, 1e-3, row_slack=slack)[0]

    assert judged([], 0.0) is None
    assert judged([5], 0.5) is None and judged([5, 40], 0.9) is None      # 2 of 64 rows
    assert "8 of 512 elements" in judged([5], 1.5)                          # beyond the bound
    assert judged([5, 9, 40], 0.5) is not None                              # 3 rows > 64 / 32
    assert judged([0], 0.5, n=31) is None and judged([0, 3], 0.5, n=31) is not None   # one row under 32
    assert judged([0], 0.5, n=1) is not None                                # none in a one-row case
    g = e.clone()
    g[5, 0] = float("nan")
    assert diagnose("x_out", g, e, 1e-3, 1e-3, row_slack=slack)[0] is not None
    assert diagnose("x_out", e[:, 0] + 0.5, e[:, 0], 1e-3, 1e-3, row_slack=slack)[0] is not None   # 1-D: none
    # rows are every axis but the last: a state [L, B·(k+1), D] of 2 x 20 rows has 40 (one may
    # miss), though its first axis has 2
    s3 = e[:40].reshape(2, 20, 8)
    g = s3.clone()
    g[1, 13] += 0.5
    assert diagnose("state_out", g, s3, 1e-3, 1e-3, row_slack=slack)[0] is None
    g[0, 2] += 0.5
    assert "16 of 320 elements" in diagnose("state_out", g, s3, 1e-3, 1e-3, row_slack=slack)[0]
    # row_group: consecutive rows one flip moves together (a rollout's k + 1 steps of a
    # sequence) count as one: steps 1 and 3 of a sequence, of 2 x 4 sequences of 5 steps
    g = s3.clone()
    g[1, 6] += 0.5
    g[1, 8] += 0.3
    assert diagnose("state_out", g, s3, 1e-3, 1e-3, row_slack=slack)[0] is not None
    assert diagnose("state_out", g, s3, 1e-3, 1e-3, row_slack=slack, row_group=5)[0] is None
    g[0, 12] += 0.5                                                         # a second sequence
    assert "24 of 320 elements" in diagnose("state_out", g, s3, 1e-3, 1e-3, row_slack=slack, row_group=5)[0]

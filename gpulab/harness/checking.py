"""Graded checks: run an implementation on fresh inputs and explain what is wrong.

For every case of a :class:`~gpulab.harness.spec.KernelSpec` a check

1. makes fresh random inputs (a new seed each run, printed on failure),
2. copies each input tensor into the middle of a larger buffer whose ends hold
   NaN (floats) or the largest integer (ints): a load past the end then poisons the
   result instead of silently reading a neighbour's data,
3. allocates each output inside a guarded buffer filled with a marked NaN
   ("poison"), so elements the kernel never wrote are recognisable,
4. calls the implementation, then verifies the guard regions are untouched (the
   interpreter never faults on out-of-bounds stores: this is how they are caught),
   that the inputs are unchanged, and that every output matches the reference,
5. on a mismatch raises :class:`CheckFailure` (an ``AssertionError``) saying which
   case, how many and which elements, the largest error against the tolerance, and a
   hint when the pattern is recognisable (missing mask, wrong scale, unread input...).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import runtime
from .spec import Case, KernelSpec, generator, get

# Marked NaNs: an output element still holding POISON was never written; a NaN
# carrying GUARD came from reading past the end of an input.
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16, torch.float64: torch.int64}
_POISON_BITS = {torch.float32: 0x7FC0BEEF, torch.float16: 0x7E5B,
                torch.bfloat16: 0x7FDB, torch.float64: 0x7FF80000DEADBEEF}
_GUARD_BITS = {torch.float32: 0x7FC0DEAD, torch.float16: 0x7E5D,
               torch.bfloat16: 0x7FDD, torch.float64: 0x7FF80000BAADF00D}
# Integer poisons are legal values, so an element that holds one and is right counts as
# written; -128 and 0xFF are chosen because symmetric int8 quantization (|q| <= 127) and
# 2-bit packing (codes 0..2) never produce them.
_INT_POISON = {torch.int8: -128, torch.uint8: 0xFF, torch.int16: -12345,
               torch.int32: -123456789, torch.int64: -123456789}


class CheckFailure(AssertionError):
    """Raised by a check with a diagnosis of what is wrong."""


@dataclass
class CheckReport:
    name: str
    cases: list = field(default_factory=list)   # (case, dtype, max_abs_error)
    mode: str = ""

    def summary(self) -> str:
        dtypes = sorted({str(d).replace("torch.", "") for _, d, _ in self.cases})
        worst = max((e for _, _, e in self.cases), default=0.0)
        return (f"✔ {self.name}: all {len(self.cases)} cases correct "
                f"({len({c.label for c, _, _ in self.cases})} shapes × {', '.join(dtypes)}; "
                f"{self.mode}); largest error {worst:.2e}, guards and inputs intact")

    def __repr__(self) -> str:
        return self.summary()


# -- guarded buffers ----------------------------------------------------------------------
def _fill_bits(buf: torch.Tensor, bits: dict, ints: dict | None) -> None:
    dt = buf.dtype
    if dt in _INT_VIEW:
        buf.view(_INT_VIEW[dt]).fill_(_signed(bits[dt], _INT_VIEW[dt]))
    elif dt == torch.bool:
        buf.fill_(True)
    elif ints is not None:
        buf.fill_(ints[dt])
    else:  # input guard for integers: the largest value, an index far out of range
        buf.fill_(torch.iinfo(dt).max)


def _signed(bits: int, int_dtype: torch.dtype) -> int:
    width = torch.iinfo(int_dtype).bits
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _guard_len(n: int) -> int:
    # Wide enough to absorb a whole unmasked block past the end (in the interpreter a
    # store beyond the allocation itself can crash the process).
    return max(1 << 16, min(n, 1 << 20))


@dataclass
class Guarded:
    """A tensor living in the middle of a larger buffer with marked guard regions."""
    buf: torch.Tensor
    inner: torch.Tensor
    guard: int
    pristine: torch.Tensor  # copy of the whole buffer before the call

    @classmethod
    def wrap(cls, shape, dtype, device, *, like: torch.Tensor | None = None) -> "Guarded":
        n = 1
        for s in shape:
            n *= int(s)
        g = _guard_len(n)
        buf = torch.empty(n + 2 * g, dtype=dtype, device=device)
        if like is None:        # an output: poison everything
            _fill_bits(buf, _POISON_BITS, _INT_POISON)
        else:                   # an input: guards around a copy of the data
            _fill_bits(buf, _GUARD_BITS, None)
            buf[g:g + n].copy_(like.reshape(-1))
        inner = buf[g:g + n].view(shape)
        return cls(buf, inner, g, buf.clone())

    def guard_damage(self) -> tuple[int, int]:
        """Number of changed elements (before the data, after the data)."""
        changed = ~_same_bits(self.buf, self.pristine)
        n_inner = self.inner.numel()
        return int(changed[:self.guard].sum()), int(changed[self.guard + n_inner:].sum())

    def last_damaged_after(self) -> int:
        changed = ~_same_bits(self.buf, self.pristine)
        tail = changed[self.guard + self.inner.numel():].nonzero()
        return int(tail.max()) + 1 if tail.numel() else 0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype in _INT_VIEW:
        return a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[b.dtype])
    return a == b


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """Elements of an output that still hold the poison value (never written)."""
    dt = t.dtype
    if dt in _INT_VIEW:
        return t.view(_INT_VIEW[dt]) == _signed(_POISON_BITS[dt], _INT_VIEW[dt])
    if dt in _INT_POISON:
        return t == _INT_POISON[dt]
    return torch.zeros_like(t, dtype=torch.bool)


# -- checks of exercises that are not kernels ---------------------------------------------------
# Data structures, policies and distributed algorithms (a block manager, an acceptance
# rule, a ring all-reduce) are checked by scripted scenarios, not by a KernelSpec's
# cases. Their grading modules register them by name; gpulab.check calls them the same
# way as kernel checks.
SCENARIO_CHECKS: dict[str, Callable] = {}


def scenario_check(name: str):
    """Decorator: register ``fn(learner_object, *args)`` as the check called ``name``."""
    def register(fn):
        if SCENARIO_CHECKS.get(name, fn) is not fn:
            raise ValueError(f"two checks are named {name!r}")
        SCENARIO_CHECKS[name] = fn
        return fn
    return register


# -- the check ----------------------------------------------------------------------------
def check(spec: KernelSpec | str, fn: Callable, *scenario_args, cases: list[Case] | None = None,
          dtypes: list | None = None, device=None, seed: int | None = None,
          quiet: bool = False) -> CheckReport:
    """Run ``fn`` on every case of ``spec``; raise :class:`CheckFailure` with a diagnosis
    on the first wrong case, else print and return a :class:`CheckReport`."""
    if isinstance(spec, str) and spec in SCENARIO_CHECKS:
        SCENARIO_CHECKS[spec](fn, *scenario_args)
        return None
    spec = get(spec) if isinstance(spec, str) else spec
    where = "gpu" if runtime.mode() == "compiled" else "cpu"
    device = torch.device(device) if device is not None else runtime.device()
    cases = cases if cases is not None else spec.cases[where]
    dtypes = dtypes if dtypes is not None else [d for d in spec.dtypes[where] if runtime.supports(d)]
    base = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    report = CheckReport(spec.name, mode=runtime.mode())
    failures = []   # (has_hint, size, message, short)
    for i, case in enumerate(cases):
        for j, dtype in enumerate(dtypes):
            s = base + 1000 * i + j
            try:
                err = _check_one(spec, fn, case, dtype, device, s, base)
            except CheckFailure as f:
                text = str(f)
                failures.append(("Hint:" in text or "wrote" in text, i, text,
                                 f"{case}, {str(dtype).replace('torch.', '')}"))
                continue
            report.cases.append((case, dtype, err))
    if failures:
        total = len(cases) * len(dtypes)
        # Explain the most telling failure: one with a hint, from the largest case.
        best = max(failures, key=lambda f: (f[0], f[1]))
        head = (f"{spec.name}: {len(failures)} of {total} cases failed: "
                + "; ".join(f[3] for f in failures[:6]) + ("; ..." if len(failures) > 6 else ""))
        raise CheckFailure(head + "\n" + best[2])
    if not quiet:
        print(report.summary())
    return report


def _check_one(spec, fn, case, dtype, device, seed, base) -> float:
    inputs = spec.make_inputs(case.params, dtype, device, generator(seed, device))
    expected = spec.reference(**inputs)
    where = (f"case {case}, dtype {str(dtype).replace('torch.', '')}, seed {seed} "
             f"(re-run with seed={base})")

    guarded_in, call_inputs = {}, {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_contiguous() and v.numel() > 0:
            guarded_in[k] = Guarded.wrap(v.shape, v.dtype, v.device, like=v)
            call_inputs[k] = guarded_in[k].inner
        else:
            call_inputs[k] = v
    guarded_out = {}
    if spec.outputs is not None:
        for k, (shape, odt) in spec.outputs(inputs, dtype).items():
            guarded_out[k] = Guarded.wrap(shape, odt, device)
    try:
        result = spec.call(fn, call_inputs, {k: g.inner for k, g in guarded_out.items()})
    except Exception as e:  # keep the learner's own error type, add where it happened
        if hasattr(e, "add_note"):
            e.add_note(f"gpulab: raised while checking {spec.name}, {where}")
        raise
    if runtime.mode() == "compiled":
        torch.cuda.synchronize()

    problems = []
    for k, g in guarded_out.items():
        before, after = g.guard_damage()
        if after:
            problems.append(
                f"wrote {after} element(s) past the end of output `{k}` (up to "
                f"{g.last_damaged_after()} elements beyond it): a store is missing its mask, "
                f"or the mask lets through offsets ≥ the length (mask = offsets < n).")
        if before:
            problems.append(f"wrote {before} element(s) before the start of output `{k}`: "
                            f"a negative offset or a wrong base pointer.")
    for k, g in guarded_in.items():
        before, after = g.guard_damage()
        if before or after:
            problems.append(f"wrote {before + after} element(s) just outside input `{k}`: "
                            f"a store through an input pointer, or an unmasked store.")
        if not bool(_same_bits(g.inner, inputs[k]).all()):
            problems.append(f"input `{k}` was modified: a kernel must not write to its inputs.")
    if problems:
        raise CheckFailure(f"{spec.name}: {where}:\n  " + "\n  ".join(problems))

    if spec.outputs is not None:
        got = {k: g.inner for k, g in guarded_out.items()}
    else:
        values = result if isinstance(result, (tuple, list)) else (result,)
        if len(values) != len(spec.returns):
            raise CheckFailure(f"{spec.name}: {where}: expected {len(spec.returns)} returned "
                               f"value(s) ({', '.join(spec.returns)}), got {len(values)}.")
        got = dict(zip(spec.returns, values))
    worst = 0.0
    for k, exp in expected.items():
        custom = (lambda k=k, exp=exp: spec.hint(k, got[k], exp, inputs)) if spec.hint else None
        msg, err = diagnose(k, got[k], exp, *spec.tolerance(dtype, k),
                            unread=_unread_inputs(spec, inputs, k, got[k]), custom_hint=custom)
        if msg:
            raise CheckFailure(f"{spec.name}: output `{k}` is wrong for {where}.\n{msg}")
        worst = max(worst, err)
    return worst


def _unread_inputs(spec, inputs, out_name, got) -> Callable[[], list[str]]:
    """Lazily: names of inputs whose zeroing reproduces the (wrong) output."""
    def find():
        names = []
        for name in spec.read_inputs:
            v = inputs[name]
            zeroed = {**inputs, name: torch.zeros_like(v)}
            try:
                alt = spec.reference(**zeroed)[out_name]
            except Exception:
                continue
            if got.shape == alt.shape and torch.allclose(got.double().nan_to_num(),
                                                         alt.double().nan_to_num(), atol=1e-3, rtol=1e-2):
                names.append(name)
        return names
    return find


# -- diagnosis ----------------------------------------------------------------------------
def diagnose(name: str, got: torch.Tensor, exp: torch.Tensor, atol: float, rtol: float,
             unread: Callable[[], list[str]] | None = None,
             custom_hint: Callable[[], str | None] | None = None) -> tuple[str | None, float]:
    """Compare one output with its reference. Returns (message or None, max abs error)."""
    if not isinstance(got, torch.Tensor):
        return f"  `{name}` should be a tensor, got {type(got).__name__}.", float("inf")
    if tuple(got.shape) != tuple(exp.shape):
        return (f"  `{name}` has shape {tuple(got.shape)}, expected {tuple(exp.shape)}.",
                float("inf"))
    g = got.detach().double().cpu()
    e = exp.detach().double().cpu()
    close = torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=True)
    # Still holding the poison value and wrong: never written. (An integer poison is a
    # legal value, so an element that happens to be right is not counted.)
    unwritten = _poisoned(got).cpu() & ~close
    close &= ~unwritten
    diff = (g - e).abs()
    finite = torch.isfinite(diff)
    max_err = float(diff[finite].max()) if finite.any() else 0.0
    if bool(close.all()):
        return None, max_err
    bad = ~close
    n, nbad = bad.numel(), int(bad.sum())
    lines = [f"  {nbad} of {n} elements ({100 * nbad / n:.1f}%) are wrong; "
             f"largest error {max_err:.3g} (tolerance: atol {atol:g}, rtol {rtol:g})."]
    idx = bad.nonzero()[:5]
    shown = []
    for ix in idx:
        t = tuple(int(i) for i in ix)
        gv = "never written" if bool(unwritten[t]) else f"{g[t].item():.6g}"
        shown.append(f"[{', '.join(map(str, t))}]: got {gv}, expected {e[t].item():.6g}")
    lines.append("  first wrong elements: " + "; ".join(shown))
    hint = None if bool(unwritten.any()) or custom_hint is None else custom_hint()
    hint = hint or _hint(g, e, bad, unwritten, atol, rtol, unread)
    if hint:
        lines.append("  Hint: " + hint)
    return "\n".join(lines), max_err


def _hint(g, e, bad, unwritten, atol, rtol, unread) -> str | None:
    n = bad.numel()
    flat_bad = bad.reshape(-1)
    if bool(unwritten.all()):
        return ("nothing was written to this output: is the store missing, does the kernel "
                "write somewhere else, or was the grid empty?")
    if bool(unwritten.any()):
        return _region_hint(unwritten, "never written",
                            tail="the grid does not cover the whole tensor: launch "
                                 "triton.cdiv(n, BLOCK) programs",
                            cols="the block is narrower than the row (BLOCK must be at least "
                                 "the row length, e.g. triton.next_power_of_2(n_cols)) or the "
                                 "mask cuts the row short",
                            rows="check the grid size and how program_id maps to rows")
    nan_bad = bad & ~torch.isfinite(g) & torch.isfinite(e)
    if bool(nan_bad.any()):
        return (f"{int(nan_bad.sum())} element(s) are NaN/Inf where the answer is finite. gpulab "
                "surrounds every input with NaN, so this usually means a load read past the end "
                "of an input (a missing mask), or masked-out lanes without a safe `other=` value "
                "fed a max or a sum.")
    if unread is not None:
        names = unread()
        if names:
            return (f"the output is exactly what you get with input(s) {', '.join(names)} set to "
                    f"zero: {'is it' if len(names) == 1 else 'are they'} ever loaded?")
    if bool((g == 0).all()) and not bool((e == 0).all()):
        return "the output is all zeros: were the results stored?"
    big = bad & (e.abs() > 10 * atol) & torch.isfinite(g)
    if int(big.sum()) >= 2:
        ratio = g[big] / e[big]
        med = float(ratio.median())
        if abs(med) > 0 and float((ratio - med).abs().max()) < 1e-2 * abs(med) + rtol and \
                abs(med - 1) > max(rtol, 1e-3):
            return (f"every wrong element is off by the same factor ≈ {med:.4g}: a scale is "
                    f"wrong or missing (a 1/sum, a 127/absmax, a softmax scale...).")
        if g.dim() >= 2:
            rows = g.reshape(-1, g.shape[-1])
            er = e.reshape(-1, e.shape[-1])
            with torch.no_grad():
                r = rows / er
                okr = (er.abs() > 10 * atol)
                per_row = [r[i][okr[i]] for i in range(rows.shape[0]) if okr[i].sum() >= 2]
                consistent = [x for x in per_row if float((x - x.median()).abs().max()) <
                              1e-2 * abs(float(x.median())) + rtol]
                if per_row and len(consistent) == len(per_row):
                    return ("each row is off by its own constant factor: the row's normalisation "
                            "is wrong (e.g. a stale running max, or a sum that includes "
                            "masked-out lanes).")
    region = _region_hint(bad, "wrong",
                          tail="the last, partial block is mishandled: check its mask",
                          cols="the tail of each row (the last, partial block) is mishandled: "
                               "check the mask and the `other=` value",
                          rows="check how program_id maps to rows and the row stride")
    if region:
        return region
    if int(flat_bad.sum()) < n:
        return "the errors are scattered: compare your math with the reference step by step."
    return None


def _region_hint(mask, what, *, tail, cols, rows) -> str | None:
    """Describe where in the tensor the True elements of ``mask`` are, if it has a shape."""
    flat = mask.reshape(-1)
    idx = flat.nonzero().flatten()
    n = flat.numel()
    first = int(idx.min())
    if first > 0 and bool(flat[first:].all()):
        return f"elements from flat index {first} on ({n - first} of {n}) are {what}: {tail}."
    if mask.dim() >= 2 and mask.shape[-1] > 1:
        m2 = mask.reshape(-1, mask.shape[-1])
        col_bad = m2.any(0)
        c0 = int(col_bad.nonzero().min())
        if c0 > 0 and bool(m2[:, c0:].all()):
            return f"columns {c0}..{mask.shape[-1] - 1} of every row are {what}: {cols}."
        row_bad = m2.any(1)
        if bool(row_bad.any()) and not bool(row_bad.all()):
            rb = row_bad.nonzero().flatten()
            return (f"only rows {_ranges(rb.tolist())} (of {m2.shape[0]}) are {what}: {rows}.")
    return None


def _ranges(xs: list[int], limit: int = 4) -> str:
    out, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append((start, prev))
            start = prev = x
    if start is not None:
        out.append((start, prev))
    s = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in out[:limit])
    return s + (", ..." if len(out) > limit else "")


def rejects(spec: KernelSpec | str, fn: Callable, **kw) -> str:
    """For tests of the checks themselves: the failure message ``check`` gives ``fn``.
    Raises AssertionError if the check wrongly accepts ``fn``."""
    try:
        check(spec, fn, quiet=True, **kw)
    except CheckFailure as e:
        return str(e)
    raise AssertionError(f"the check for {spec if isinstance(spec, str) else spec.name} "
                         f"accepted a wrong implementation")

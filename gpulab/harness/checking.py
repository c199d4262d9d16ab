"""Graded checks: run an implementation on fresh inputs and explain what is wrong.

For every case of a :class:`~gpulab.harness.spec.KernelSpec` a check

1. makes fresh random inputs (a new seed each run, printed on failure),
2. copies each input tensor into the middle of a larger buffer whose ends hold
   NaN (floats) or the largest integer (ints): a load past the end then poisons the
   result instead of silently reading a neighbour's data,
3. allocates each output inside a guarded buffer filled with a marked NaN
   ("poison"), so elements the kernel never wrote are recognisable,
4. calls the implementation while watching it: which ``@triton.jit`` kernels it
   launches (an exercise that asks for a kernel must launch one of the learner's own),
   in the interpreter every address a ``tl.load`` reads (a load outside an argument's
   real extent is reported even when its value is never stored), and any PyTorch
   copy that broadcasts a smaller result into an output,
5. verifies the guard regions are untouched (the interpreter never faults on
   out-of-bounds stores: this is how they are caught), that the inputs are unchanged,
   and that every output matches the reference with the exact shape and dtype,
6. on a mismatch raises :class:`CheckFailure` (an ``AssertionError``) saying which
   case, how many and which elements, the largest error against the tolerance, and a
   hint when the pattern is recognisable (missing mask, wrong scale, unread input,
   NaN from arithmetic...).

Beyond the spec's cases, a spec may ask for extra runs: row-padded strided buffers
(``strided``), zero and constant rows (``edge_rows``) and other deliberate data
(``edge_data``); see :mod:`gpulab.harness.spec`.

``check`` prints one line and returns None (so a notebook cell displays nothing more);
:func:`run_check` returns the :class:`CheckReport`.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

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


class DeviceFault(CheckFailure):
    """The GPU stopped the learner's kernel (an access outside every buffer): the check
    ends there, since the process's CUDA context cannot run anything after it."""


# What CUDA reports when a kernel touches memory that is not mapped (a sticky error: every
# later CUDA call of the process fails with it too).
_ILLEGAL_ACCESS = "illegal memory access"


@dataclass
class CheckReport:
    name: str
    cases: list = field(default_factory=list)   # (case, dtype, max_abs_error)
    mode: str = ""
    extra_runs: list = field(default_factory=list)   # labels of strided / edge-data runs

    def summary(self) -> str:
        dtypes = sorted({str(d).replace("torch.", "") for _, d, _ in self.cases})
        worst = max((e for _, _, e in self.cases), default=0.0)
        extra = f" + {', '.join(sorted(set(self.extra_runs)))}" if self.extra_runs else ""
        return (f"✔ {self.name}: all {len(self.cases)} cases correct "
                f"({len({c.label for c, _, _ in self.cases})} shapes × {', '.join(dtypes)}{extra}; "
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
    """A tensor living in the middle of a larger buffer with marked guard regions.

    With ``pad`` > 0 (and two or more dimensions) every row of the tensor is followed by
    ``pad`` guard elements: the tensor is then a strided view whose row stride is
    ``shape[-1] + pad``, and the padding counts as outside the tensor."""
    buf: torch.Tensor
    inner: torch.Tensor
    guard: int
    pristine: torch.Tensor  # copy of the whole buffer before the call
    valid: torch.Tensor     # bool per element of buf: part of the tensor

    @classmethod
    def wrap(cls, shape, dtype, device, *, like: torch.Tensor | None = None, pad: int = 0,
             zero_guards: bool | str = False) -> "Guarded":
        shape = tuple(int(s) for s in shape)
        pad = pad if len(shape) >= 2 and shape[-1] > 0 else 0
        n = 1
        for s in shape:
            n *= s
        extent = n if not pad else (n // shape[-1]) * (shape[-1] + pad)
        g = _guard_len(extent)
        buf = torch.empty(extent + 2 * g, dtype=dtype, device=device)
        if like is None:        # an output: poison everything
            _fill_bits(buf, _POISON_BITS, _INT_POISON)
        elif zero_guards == "gaps":     # zeros only in the padding between rows
            _fill_bits(buf, _GUARD_BITS, None)
            buf[g:g + extent].zero_()
        elif zero_guards == "ends":     # zeros only before the first row and after the last
            buf.zero_()
            _fill_bits(buf[g:g + extent], _GUARD_BITS, None)
        elif zero_guards == "ones":     # finite guards that are not zero (see guards_matter);
            buf.fill_(1 if dtype.is_floating_point else 0)   # indices stay 0: a valid page, row...
        elif zero_guards:       # an input with harmless guards (to test whether they are read)
            buf.zero_()
        else:                   # an input: guards around a copy of the data
            _fill_bits(buf, _GUARD_BITS, None)
        if pad:
            inner = buf[g:g + extent].view(*shape[:-1], shape[-1] + pad)[..., :shape[-1]]
        else:
            inner = buf[g:g + n].view(shape)
        if like is not None:
            inner.copy_(like)
        valid = torch.zeros(buf.numel(), dtype=torch.bool)
        positions = torch.arange(buf.numel())
        valid[positions.as_strided(inner.shape, inner.stride(), inner.storage_offset()).reshape(-1)] = True
        return cls(buf, inner, g, buf.clone(), valid)

    @property
    def extent(self) -> int:
        return self.buf.numel() - 2 * self.guard

    def guard_damage(self) -> tuple[int, int]:
        """Number of changed elements outside the tensor (before its first element, after)."""
        changed = (~_same_bits(self.buf, self.pristine)).cpu() & ~self.valid
        return int(changed[:self.guard].sum()), int(changed[self.guard:].sum())

    def gap_damage(self) -> int:
        """Changed elements in the padding between rows (strided views only)."""
        changed = (~_same_bits(self.buf, self.pristine)).cpu() & ~self.valid
        return int(changed[self.guard:self.guard + self.extent].sum())

    def stray_rows(self) -> list[int]:
        """Indices along the tensor's first axis of the elements changed outside it:
        negative before its start, its length or more past its end (not the padding
        between its rows)."""
        changed = (~_same_bits(self.buf, self.pristine)).cpu() & ~self.valid
        pos = changed.nonzero().reshape(-1) - self.guard        # from the tensor's first element
        pos = pos[(pos < 0) | (pos >= self.extent)]
        stride = self.inner.stride(0) if self.inner.dim() else 1
        return sorted(set(torch.div(pos, stride, rounding_mode="floor").tolist()))

    def last_damaged_after(self) -> int:
        changed = (~_same_bits(self.buf, self.pristine)).cpu()
        tail = changed[self.guard + self.extent:].nonzero()
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


def _canonical_nans(dt: torch.dtype) -> set[int]:
    """Bit patterns (as signed ints of dt's width) of the NaNs hardware and conversions
    make: the quiet NaN with no payload (x86, PyTorch) and with every payload bit set
    (NVIDIA GPUs), of either sign."""
    width = torch.finfo(dt).bits
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float64: 52}[dt]
    quiet = ((1 << (width - 1)) - 1) ^ ((1 << (mantissa - 1)) - 1)     # exponent ones + quiet bit
    every = (1 << (width - 1)) - 1
    sign = 1 << (width - 1)
    view = _INT_VIEW[dt]
    return {_signed(b, view) for b in (quiet, every, quiet | sign, every | sign)}


def _guard_derived(t: torch.Tensor) -> torch.Tensor:
    """Elements of a float output holding a NaN whose payload is an input guard's (as
    stored, or after a float conversion): a value loaded from past an input's end."""
    dt = t.dtype
    if dt not in _INT_VIEW:
        return torch.zeros_like(t, dtype=torch.bool)
    bits = t.reshape(-1).view(_INT_VIEW[dt])
    marks = set()
    for src, b in _GUARD_BITS.items():
        one = torch.tensor([_signed(b, _INT_VIEW[src])], dtype=_INT_VIEW[src]).view(src)
        for route in (one, one.float()):
            marks.add(int(route.to(dt).view(_INT_VIEW[dt])[0]))
    # a conversion that drops the payload leaves a canonical NaN, which arithmetic (0/0,
    # inf - inf) also makes, on a GPU as on a CPU: that carries no trace of a guard
    marks -= _canonical_nans(dt)
    hit = torch.zeros_like(bits, dtype=torch.bool)
    for m in marks:
        hit |= bits == m
    return (hit & torch.isnan(t.reshape(-1))).view(t.shape)


# -- which kernels did the learner's function launch? --------------------------------------
_LIBRARY_ROOTS = tuple(str(Path(p).resolve()) for p in
                       {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})
_GPULAB_ROOT = str(Path(__file__).resolve().parents[1])
_LIBRARY_MODULES = ("gpulab", "torch", "triton")


def kernel_origin(fn) -> str | None:
    """Where the Python function of a ``@triton.jit`` kernel comes from: None when the
    learner wrote it (a notebook cell, or any file outside gpulab and the installed
    libraries), else the library module that defines it."""
    fn = getattr(fn, "fn", fn)
    module = getattr(fn, "__module__", "") or ""
    if module.split(".")[0] in _LIBRARY_MODULES:
        return module
    code = getattr(fn, "__code__", None)
    path = str(Path(code.co_filename).resolve()) if code is not None and code.co_filename else ""
    if path.startswith(_GPULAB_ROOT) or (path and any(path.startswith(r) for r in _LIBRARY_ROOTS)):
        return module or path
    return None


def _kernel_name(fn) -> str:
    fn = getattr(fn, "fn", fn)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


_ENFORCE_OVERRIDE: list[bool] = []


@contextlib.contextmanager
def enforce_learner_kernels(on: bool = True):
    """Within this block, kernel exercises must launch a kernel of the learner's own
    (on) or may launch any (off). Outside it the rule holds in notebooks (an IPython
    kernel is running) and not in plain Python (package tests check gpulab's kernels)."""
    _ENFORCE_OVERRIDE.append(on)
    try:
        yield
    finally:
        _ENFORCE_OVERRIDE.pop()


def learner_kernel_rule_active() -> bool:
    if _ENFORCE_OVERRIDE:
        return _ENFORCE_OVERRIDE[-1]
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


@contextlib.contextmanager
def new_memory_is_nan():
    """Within this block ``torch.empty`` (and ``empty_like``, ``new_empty``) returns NaN
    (floats) or the largest integer, so a tensor a learner's function allocates and never
    writes is recognisable. Outside it, on a GPU the caching allocator hands back a freed
    block as it is, which may hold an earlier call's right answer. PyTorch's deterministic
    mode does the filling (``warn_only``: operations without a deterministic version run
    as usual, their warnings silenced)."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


# -- watching the learner's call -------------------------------------------------------------
@dataclass
class _Watched:
    name: str
    kind: str            # "input" or "output"
    g: Guarded
    lo: int = 0
    hi: int = 0
    elsize: int = 1
    valid_np: np.ndarray | None = None
    bad: list = field(default_factory=list)   # element indices into buf
    first_program: tuple | None = None

    def __post_init__(self):
        self.elsize = self.g.buf.element_size()
        self.lo = self.g.buf.data_ptr()
        self.hi = self.lo + self.g.buf.numel() * self.elsize
        self.valid_np = self.g.valid.numpy()


class _BroadcastWatch(TorchFunctionMode):
    """Records PyTorch writes into an output that broadcast a smaller result
    (``y.copy_(r)`` with r of shape (rows, 1)) or resize it (``out=`` of another shape)."""

    def __init__(self, outputs: dict[str, torch.Tensor]):
        super().__init__()
        self.outputs = outputs
        self.found: list[str] = []

    def _which(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        for name, o in self.outputs.items():
            if o.numel() and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() \
                    and tuple(t.shape) == tuple(o.shape) and t.storage_offset() == o.storage_offset():
                return name
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            name = self._which(dst)
            if name and src.dim() >= 1 and src.numel() != dst.numel():
                self.found.append(f"`{name}` (shape {tuple(dst.shape)}) was filled by broadcasting a "
                                  f"result of shape {tuple(src.shape)} into it")
        out = kwargs.get("out")
        out_name = self._which(out) if out is not None else None
        shape = tuple(out.shape) if out_name else None
        result = func(*args, **kwargs)
        if out_name and tuple(out.shape) != shape:
            self.found.append(f"`{out_name}` was resized from {shape} to {tuple(out.shape)} by an "
                              f"`out=` argument")
        return result


class _CallWatch:
    """Everything watched while the learner's function runs (see the module docstring)."""

    def __init__(self, guarded_in: dict, guarded_out: dict):
        self.launched: list = []
        self.watched = [_Watched(k, "input", g) for k, g in guarded_in.items()] + \
                       [_Watched(k, "output", g) for k, g in guarded_out.items()]
        self.broadcast = _BroadcastWatch({k: g.inner for k, g in guarded_out.items()})
        self._undo: list = []

    # launches
    def _hook_runs(self):
        classes = []
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
        if runtime.interpreting():
            from triton.runtime.interpreter import InterpretedFunction
            classes.append(InterpretedFunction)
        for cls in classes:
            original = cls.__dict__.get("run")
            if original is None:
                continue

            def run(kernel, *args, _original=original, **kwargs):
                self.launched.append(getattr(kernel, "fn", kernel))
                return _original(kernel, *args, **kwargs)
            cls.run = run
            self._undo.append((cls, "run", original))

    # loads (interpreter only: there every address is a Python integer we can check)
    def _hook_loads(self):
        if not runtime.interpreting() or not self.watched:
            return
        from triton.runtime.interpreter import InterpreterBuilder
        original = InterpreterBuilder.__dict__["create_masked_load"]
        watched = self.watched

        def create_masked_load(builder, ptrs, mask, other, *args, **kwargs):
            try:
                addrs = np.asarray(ptrs.data)
                m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addrs.shape)
                used = addrs[m].astype(np.uint64, copy=False)
                if used.size:
                    for w in watched:
                        sel = (used >= w.lo) & (used < w.hi)
                        if sel.any():
                            idx = ((used[sel] - np.uint64(w.lo)) // np.uint64(w.elsize)).astype(np.int64)
                            outside = idx[~w.valid_np[idx]]
                            if outside.size:
                                if not w.bad:
                                    w.first_program = tuple(getattr(builder, "grid_idx", None) or ())
                                w.bad.append(outside)
            except Exception:   # never let the watcher break a learner's kernel
                pass
            return original(builder, ptrs, mask, other, *args, **kwargs)
        InterpreterBuilder.create_masked_load = create_masked_load
        self._undo.append((InterpreterBuilder, "create_masked_load", original))

    def __enter__(self):
        self._hook_runs()
        self._hook_loads()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        # Expected numerical warnings (log(0) of an empty state in the interpreter...)
        # must not reach stderr: nbgrader scores a cell that writes to stderr as failed.
        warnings.simplefilter("ignore", RuntimeWarning)
        self._np = np.errstate(all="ignore")
        self._np.__enter__()
        self.broadcast.__enter__()
        return self

    def __exit__(self, *exc):
        self.broadcast.__exit__(*exc)
        self._np.__exit__(*exc)
        self._warnings.__exit__(*exc)
        for cls, name, original in reversed(self._undo):
            setattr(cls, name, original)
        return False

    def load_problems(self) -> list[str]:
        out = []
        for w in self.watched:
            if not w.bad:
                continue
            idx = np.concatenate(w.bad)
            g = w.g
            start, end = g.guard, g.guard + g.extent
            before, after = idx[idx < start], idx[idx >= end]
            gap = idx[(idx >= start) & (idx < end)]
            prog = (f" (first by program {w.first_program[:3] if len(w.first_program) > 3 else w.first_program})"
                    if w.first_program else "")
            what = f"{w.kind} `{w.name}`"
            if after.size:
                beyond = int(after.max()) - end + 1
                where = _row_of(g, int(after.min()))
                out.append(f"a load past the end of {what}: {after.size} element(s) read up to {beyond} "
                           f"beyond its last element{where}{prog}, even if the value is never stored. A "
                           f"tl.load is missing its mask, or the mask lets through offsets ≥ the length "
                           f"(on a GPU this reads another tensor's memory or faults)."
                           + _swapped_strides(g.inner, after - start, w.name))
            if before.size:
                out.append(f"a load before the start of {what}: {before.size} element(s) read up to "
                           f"{start - int(before.min())} before its first element{prog}: a negative "
                           f"offset or a wrong base pointer.")
            if gap.size:
                rs = g.inner.stride(-2) if g.inner.dim() >= 2 else 0
                out.append(f"a load between the rows of {what}: {gap.size} element(s) read in the padding "
                           f"after a row's {g.inner.shape[-1]} elements{prog}. `{w.name}` is a strided view "
                           f"here (row stride {rs}): index rows with its own stride ({w.name}.stride(...)), "
                           f"not the row length or another tensor's stride.")
        return out


def _swapped_strides(t: torch.Tensor, offsets: np.ndarray, name: str) -> str:
    """A sentence when every offset read past the end of 2-D ``t`` (rows of unit column
    stride) is one that rows · stride(1) + cols · stride(0) reaches for some row < M and
    column < N: the two strides used the wrong way round. (Many such offsets are asked
    for, so that a read just past the end, which fits the pattern by chance, does not.)"""
    # (one row is enough: swapped, its reads land on multiples of the row length)
    if t.dim() != 2 or t.shape[1] < 2 or t.stride(1) != 1 or t.stride(0) <= 1:
        return ""
    (m, n), row_stride = t.shape, t.stride(0)
    o = np.unique(offsets)
    if o.size < max(8, n // 2) or not bool(((o % row_stride < m) & (o // row_stride < n)).all()):
        return ""
    return (f" Every such offset is row·{name}.stride(1) + col·{name}.stride(0) for a row < {m} and a "
            f"col < {n}: the row and column strides look swapped (offsets = rows·stride(0) + "
            f"cols·stride(1)).")


def _row_of(g: Guarded, index: int) -> str:
    """' (as if row r)' for a read past the end of a tensor with rows."""
    if g.inner.dim() < 2:
        return ""
    rs = g.inner.stride(-2)
    r = (index - g.guard) // rs if rs else 0
    return f" (as if from row {r} of a tensor with {g.inner.reshape(-1, g.inner.shape[-1]).shape[0]} rows)"


# -- the check ----------------------------------------------------------------------------
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


def check(spec: KernelSpec | str, fn: Callable, *scenario_args, cases: list[Case] | None = None,
          dtypes: list | None = None, device=None, seed: int | None = None,
          quiet: bool = False, learner_kernel: bool | None = None) -> None:
    """Run ``fn`` on every case of ``spec``; raise :class:`CheckFailure` with a diagnosis
    on the first wrong case, else print one line. Returns None, so that a notebook cell
    ending in a check shows only that line.

    ``learner_kernel`` overrides the spec's ``learner_kernel`` (False: the exercise is
    PyTorch-level, any computation is fine). A name registered with
    :func:`scenario_check` runs that check instead: ``check(name, learner_object, *args)``."""
    if isinstance(spec, str) and spec in SCENARIO_CHECKS:
        SCENARIO_CHECKS[spec](fn, *scenario_args)
        return None
    run_check(spec, fn, cases=cases, dtypes=dtypes, device=device, seed=seed, quiet=quiet,
              learner_kernel=learner_kernel)


def run_check(spec: KernelSpec | str, fn: Callable, *, cases: list[Case] | None = None,
              dtypes: list | None = None, device=None, seed: int | None = None,
              quiet: bool = False, learner_kernel: bool | None = None) -> CheckReport:
    """:func:`check`, returning the :class:`CheckReport`."""
    spec = get(spec) if isinstance(spec, str) else spec
    fn = spec.adapt(fn) if spec.adapt is not None else fn
    where = "gpu" if runtime.mode() == "compiled" else "cpu"
    device = torch.device(device) if device is not None else runtime.device()
    cases_given = cases
    cases = list(cases) if cases is not None else list(spec.cases[where])
    dtypes = dtypes if dtypes is not None else [d for d in spec.dtypes[where] if runtime.supports(d)]
    if not cases or not dtypes:
        raise CheckFailure(f"{spec.name}: no cases to run (cases={cases}, dtypes={dtypes})")
    wants_kernel = spec.wants_learner_kernel if learner_kernel is None else learner_kernel
    must_be_own = wants_kernel and learner_kernel_rule_active()
    base = seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    report = CheckReport(spec.name, mode=runtime.mode())
    runs = [(i, case, dtype, None) for i, case in enumerate(cases) for dtype in dtypes]
    if spec.strided:
        runs.append((len(cases) - 1, cases[-1], dtypes[0], "strided"))
    if spec.fresh_case is not None and cases_given is None:
        fresh = spec.fresh_case(generator(base, "cpu"))
        runs.append((len(cases), fresh, dtypes[0], "random size"))
    if spec.edge_rows or spec.edge_data is not None:
        runs += [(i, case, dtypes[0], "edge data") for i, case in enumerate(cases)]
    # Every run is compared with its tolerances; only the failure reported is diagnosed
    # (recomputing a mistake's answer can take seconds a run on the GPU's cases). The run
    # likeliest to be reported, the first of the largest listed case, is diagnosed as it runs.
    first_choice = max(range(len(runs)), key=lambda n: (runs[n][0] < len(cases), runs[n][0], -n))
    failures: list[RunFailure] = []
    own_kernel_seen = False
    for n_run, (i, case, dtype, variant) in enumerate(runs):
        s = base + 1000 * i + (dtypes.index(dtype) if variant is None else 500 + n_run)
        label = f"{case}, {str(dtype).replace('torch.', '')}" + (f", {variant}" if variant else "")
        hints = n_run == first_choice
        try:
            err, launched = _check_one(spec, fn, case, dtype, device, s, base, variant, hints=hints)
        except DeviceFault:
            raise           # nothing more can run on this GPU
        except CheckFailure as f:
            failures.append(RunFailure(_telling(f), i < len(cases), i, str(f), label, runs[n_run], s, hints))
            continue
        if must_be_own and not own_kernel_seen:
            if not any(kernel_origin(k) is None for k in launched):
                raise CheckFailure(_shortcut_message(spec, launched))
            own_kernel_seen = True
        report.cases.append((case, dtype, err))
        if variant:
            report.extra_runs.append(variant)
    if failures:
        total = len(runs)
        best = _most_telling(spec, fn, device, base, failures)
        head = (f"{spec.name}: {len(failures)} of {total} runs failed: "
                + "; ".join(f.label for f in failures[:6]) + ("; ..." if len(failures) > 6 else ""))
        raise CheckFailure(head + "\n" + best)
    if not quiet:
        print(report.summary())
    return report


# How telling a failure is: 3 for stores and loads outside the buffers (found without a
# diagnosis); a wrong output with a hint 1, on more than two elements 2, with a cause the
# spec's own diagnosis names + 0.5; no hint 0.
MOST_TELLING_OUTPUT = 2.5


def _telling(failure: CheckFailure) -> float:
    return getattr(failure, "telling", 1 if "Hint:" in str(failure) else 0)


@dataclass
class RunFailure:
    telling: float
    listed: bool            # a listed case, not the random-size one (its size may be too small to tell)
    index: int              # the case's index: larger cases tell more
    message: str
    label: str
    run: tuple              # (case index, case, dtype, variant)
    seed: int
    diagnosed: bool         # the message has its hint, if any

    def rank(self) -> tuple:
        return self.listed, self.index

    def key(self) -> tuple:
        return self.telling, self.listed, self.index


def _most_telling(spec, fn, device, base, failures: list[RunFailure]) -> str:
    """The message of the failure that explains best: the most telling, then a listed case,
    then the largest, then the first run. A failure not diagnosed yet runs again with its
    hints, best candidates first, until one is as telling as a failure can be: the same
    choice as diagnosing every run, at the cost of one or a few."""
    outside = [f for f in failures if f.telling >= 3]       # their message is complete already
    if outside:
        return max(outside, key=RunFailure.key).message
    best = None
    for f in sorted(failures, key=RunFailure.rank, reverse=True):   # stable: equal ranks keep run order
        if not f.diagnosed:
            i, case, dtype, variant = f.run
            try:
                _check_one(spec, fn, case, dtype, device, f.seed, base, variant)
            except CheckFailure as again:
                f.telling, f.message = _telling(again), str(again)
            # (it passed this time, a race in the kernel?: what was seen stands)
        if best is None or f.key() > best.key():
            best = f
        if best.telling >= MOST_TELLING_OUTPUT:
            break
    return best.message


def _shortcut_message(spec: KernelSpec, launched: list) -> str:
    if launched:
        names = sorted({_kernel_name(k) for k in launched})
        did = (f"it launched only kernels that are not yours ({', '.join(names[:4])}): calling gpulab's "
               f"(or another library's) implementation does not count")
    else:
        did = "it launched no Triton kernel at all (computing the result with PyTorch does not count)"
    return (f"{spec.name}: this exercise asks for a Triton kernel of your own: your function must "
            f"launch a @triton.jit kernel written in your notebook, but {did}. Write the kernel in "
            f"the exercise cell and launch it from your function (kernel[grid](...)).")


def _strided_pads(spec: KernelSpec) -> dict[str, int]:
    """A different row padding for each strided argument, so strides differ pairwise."""
    return {name: 3 + 2 * k for k, name in enumerate(spec.strided)}


def _apply_edge_rows(inputs: dict, names: tuple[str, ...]) -> dict:
    out = dict(inputs)
    for name in names:
        t = out.get(name)
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or not t.is_floating_point():
            continue
        t = t.clone()
        rows = t.reshape(-1, t.shape[-1]) if t.dim() >= 1 else t.reshape(1, 1)
        rows[0] = 0
        if rows.shape[0] >= 2:
            rows[-1] = rows[-1, :1].clone() if rows.shape[1] else 0
        out[name] = t
    return out


_RETURN_DTYPES: dict = {}


def _expected_return_dtypes(spec: KernelSpec, inputs: dict, dtype) -> dict:
    """For specs whose function returns its results: the dtypes gpulab's own
    implementation returns (the exercise's contract), cached per dtype."""
    key = (spec.name, dtype)
    if key not in _RETURN_DTYPES:
        found = {}
        if spec.implementation is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    values = spec.call(spec.implementation, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                             for k, v in inputs.items()})
                values = values if isinstance(values, (tuple, list)) else (values,)
                found = {k: v.dtype for k, v in zip(spec.returns, values) if isinstance(v, torch.Tensor)}
            except Exception:
                found = {}
        _RETURN_DTYPES[key] = found
    return _RETURN_DTYPES[key]


def _check_one(spec, fn, case, dtype, device, seed, base, variant=None, hints=True) -> tuple[float, list]:
    gen = generator(seed, device)
    inputs = spec.make_inputs(case.params, dtype, device, gen)
    if variant == "edge data":
        inputs = _apply_edge_rows(inputs, spec.edge_rows)
        if spec.edge_data is not None:
            inputs = spec.edge_data(inputs, case.params, dtype, gen)
    expected = spec.reference(**inputs)
    where = (f"case {case}, dtype {str(dtype).replace('torch.', '')}"
             + (f" ({variant}: {_variant_note(spec, variant)})" if variant else "")
             + f", seed {seed} (re-run with seed={base})")
    pads = _strided_pads(spec) if variant == "strided" else {}

    guarded_in, guarded_out, result, watch = _guarded_call(spec, fn, inputs, dtype, device, pads, where)
    problems = watch.load_problems()
    stray_hints = []
    for k, g in guarded_out.items():
        before, after = g.guard_damage()
        gap = g.gap_damage()
        after -= gap
        cause = None        # the spec's own reading of the stray stores (then given as the hint)
        if (before or after) and spec.stray_write_hint is not None:
            cause = spec.stray_write_hint(k, g.stray_rows(), int(_poisoned(g.inner).sum()), inputs)
            if cause and cause not in stray_hints:
                stray_hints.append(cause)
        if after:
            problems.append(
                f"wrote {after} element(s) past the end of output `{k}` (up to "
                f"{g.last_damaged_after()} elements beyond it)" + (": see the hint." if cause else
                ": a store is missing its mask, or the mask lets through offsets ≥ the length "
                "(mask = offsets < n)."))
        if before:
            problems.append(f"wrote {before} element(s) before the start of output `{k}`"
                            + (": see the hint." if cause else ": a negative offset or a wrong base pointer."))
        if gap:
            problems.append(f"wrote {gap} element(s) into the padding between the rows of output `{k}`: "
                            f"it is a strided view here (row stride {g.inner.stride(-2)}); index its rows "
                            f"with its own stride, not the row length or another tensor's stride.")
    for k, g in guarded_in.items():
        before, after = g.guard_damage()
        if before or after:
            problems.append(f"wrote {before + after} element(s) just outside input `{k}`: "
                            f"a store through an input pointer, or an unmasked store.")
        if not bool(_same_bits(g.inner, inputs[k]).all()):
            problems.append(f"input `{k}` was modified: a kernel must not write to its inputs.")
    problems += [f"{b}: write a result of the output's exact shape." for b in watch.broadcast.found]
    problems += [f"Hint: {h}" for h in stray_hints]
    if problems:
        failure = CheckFailure(f"{spec.name}: {where}:\n  " + "\n  ".join(problems))
        failure.telling = 3
        raise failure

    if spec.outputs is not None:
        got = {k: g.inner for k, g in guarded_out.items()}
    else:
        values = result if isinstance(result, (tuple, list)) else (result,)
        if len(values) != len(spec.returns):
            raise CheckFailure(f"{spec.name}: {where}: expected {len(spec.returns)} returned "
                               f"value(s) ({', '.join(spec.returns)}), got {len(values)}.")
        got = dict(zip(spec.returns, values))
        want = _expected_return_dtypes(spec, inputs, dtype)
        for k, v in got.items():
            exp_dt = want.get(k)
            if exp_dt is None and isinstance(expected.get(k), torch.Tensor) and \
                    not expected[k].is_floating_point():
                exp_dt = expected[k].dtype     # integer results: the reference's dtype is the contract
            if isinstance(v, torch.Tensor) and exp_dt is not None and v.dtype != exp_dt:
                raise CheckFailure(
                    f"{spec.name}: output `{k}` is wrong for {where}.\n  `{k}` has dtype "
                    f"{str(v.dtype).replace('torch.', '')}, expected {str(exp_dt).replace('torch.', '')} "
                    f"(convert with .to({exp_dt})).")
    if spec.follow_ties is not None:          # a near tie the kernel resolved the other way
        expected = spec.follow_ties(got, expected, inputs, spec.tolerance(dtype))
    worst = 0.0

    def guards_matter(name: str) -> bool | str | tuple[str, ...]:
        """Does output ``name`` change when only the inputs' guard values change? Then
        the kernel read outside its inputs (the interpreter's load watch says so directly):
        "gaps" if the padding between the rows of a strided input alone changes it, else the
        names of the inputs whose guards alone change it (True if no one input's do)."""
        if runtime.interpreting():
            return False

        def output_of(zero_guards, keep=None):
            _, alt_out, alt_result, _ = _guarded_call(spec, fn, inputs, dtype, device, pads, where,
                                                      zero_guards=zero_guards, keep=keep)
            alt = ({k: g.inner for k, g in alt_out.items()} if spec.outputs is not None else
                   dict(zip(spec.returns, alt_result if isinstance(alt_result, (tuple, list)) else (alt_result,))))
            return alt.get(name)

        def differ(a, b) -> bool:
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
                return False
            atol, rtol = spec.tolerance(dtype, name)
            return not bool(torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=True).all())

        def changes(zero_guards) -> bool:
            return differ(output_of(zero_guards), got.get(name))

        # NaN guards and zero guards can give one answer (an RMS norm of NaNs and of zeros
        # both floor to the same scale): ones are the second opinion
        harmless = True if changes(True) else "ones" if changes("ones") else None
        if harmless is None:
            return False
        # only between the rows: the padding matters, what lies before and after does not
        if pads and changes("gaps") and not changes("ends"):
            return "gaps"
        # Which input: harmless guards everywhere but around one input, which keeps the
        # guards of the first call. Every guard then holds a value one of the two calls
        # already read, so no probe follows an index neither of them did (a stray index can
        # leave every buffer: the GPU then stops with an illegal address, and the process
        # with it).
        base = output_of(harmless)
        read = tuple(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.numel() > 0
                     and differ(output_of(harmless, keep=k), base))
        return read or True

    named = []   # the spec's own diagnosis named a cause (it says more than a generic hint)

    def spec_hint(k, exp):
        cause = (spec.hint(k, got[k], exp, inputs, outputs=got) if spec.hint_sees_outputs else
                 spec.hint(k, got[k], exp, inputs))
        named.append(bool(cause))
        return cause

    for k, exp in expected.items():
        custom = (lambda k=k, exp=exp: spec_hint(k, exp)) if spec.hint else None
        group = spec.slack_row_group(k, inputs) if spec.slack_row_group else 1
        msg, err = diagnose(k, got[k], exp, *spec.tolerance(dtype, k), row_slack=spec.row_slack, row_group=group,
                            unread=_unread_inputs(spec, inputs, k, got[k], exp, *spec.tolerance(dtype, k),
                                                   spec.row_slack, group),
                            custom_hint=custom,
                            axes=spec.axes.get(k), reads_outside=lambda k=k: guards_matter(k),
                            poisoned=spec.outputs is not None, hints=hints)
        if msg:
            failure = CheckFailure(f"{spec.name}: output `{k}` is wrong for {where}.\n{msg}")
            # Which failure explains best: a hint on an output of a few elements says less
            # than one on a real tensor.
            big = isinstance(got[k], torch.Tensor) and got[k].numel() > 2
            # and a cause the spec's own diagnosis names beats a generic hint on the same size.
            failure.telling = ((2 if big else 1) + (0.5 if any(named) else 0)) if "Hint:" in msg else 0
            raise failure
        worst = max(worst, err)
    return worst, watch.launched


def _guarded_call(spec, fn, inputs, dtype, device, pads, where, zero_guards=False, keep=None):
    """Call ``fn`` once on guarded copies of ``inputs`` and poisoned outputs, watched.
    ``zero_guards`` (see :meth:`Guarded.wrap`) applies to every input but ``keep``."""
    guarded_in, call_inputs = {}, {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and (v.is_contiguous() or k in pads) and v.numel() > 0:
            guarded_in[k] = Guarded.wrap(v.shape, v.dtype, v.device, like=v, pad=pads.get(k, 0),
                                         zero_guards=zero_guards if k != keep else False)
            call_inputs[k] = guarded_in[k].inner
        else:
            call_inputs[k] = v
    guarded_out = {}
    if spec.outputs is not None:
        for k, (shape, odt) in spec.outputs(inputs, dtype).items():
            guarded_out[k] = Guarded.wrap(shape, odt, device, pad=pads.get(k, 0))
    watch = _CallWatch(guarded_in, guarded_out)
    try:
        with watch, spec.expected_warnings():
            result = spec.call(fn, call_inputs, {k: g.inner for k, g in guarded_out.items()})
            if runtime.mode() == "compiled":
                torch.cuda.synchronize()
    except Exception as e:  # keep the learner's own error type, add where it happened
        if _ILLEGAL_ACCESS in str(e):
            raise DeviceFault(
                f"{spec.name}: {where}:\n  the GPU stopped the call: an {_ILLEGAL_ACCESS} (CUDA). A load or "
                f"store went far outside every buffer, beyond the guard regions around the inputs and outputs: "
                f"typically a missing mask, or an index meant for a larger tensor (one row per input row "
                f"where the output has fewer rows, say).\n  This Python process cannot use the GPU any "
                f"more: restart it (in Jupyter, restart the kernel). To see which access, run the check "
                f"on a CPU (Triton's interpreter, smaller cases), where stray stores land in the guard "
                f"regions and are reported.") from e
        if hasattr(e, "add_note") and not zero_guards:
            e.add_note(f"gpulab: raised while checking {spec.name}, {where}")
        raise
    return guarded_in, guarded_out, result, watch


def _variant_note(spec, variant) -> str:
    if variant == "random size":
        return "sizes drawn at random"
    if variant == "strided":
        return "row-padded buffers, " + ", ".join(f"`{k}` row stride = row length + {p}"
                                                  for k, p in _strided_pads(spec).items())
    parts = []
    if spec.edge_rows:
        parts.append(f"first row of {', '.join(spec.edge_rows)} all zero, last row constant")
    if spec.edge_data is not None:
        doc = (spec.edge_data.__doc__ or "").strip().split("\n")[0]
        parts.append(doc or "deliberate edge data")
    return "; ".join(parts)


def _unread_inputs(spec, inputs, out_name, got, expected=None, atol: float = 0.0, rtol: float = 0.0,
                   row_slack: tuple[float, float] | None = None, row_group: int = 1) -> Callable[[], list[str]]:
    """Lazily: what reproduces the (wrong) output: ["x", ...] for inputs whose zeroing
    does, or one sentence for two inputs swapped or one read in place of the other.

    "Reproduces" within the check's own tolerance for the output (``atol``, ``rtol``) at
    least: a compiled kernel that never loads h still rounds differently from the float64
    reference (a quantized kernel flips an int8 code here and there), which the check
    allows for. With the spec's ``row_slack`` (a flip can move a whole row), a case of
    several rows may have its share of rows, and at least one, off by up to the bound. An
    alteration that gives the right answer (within the same tolerance) explains no wrong
    output and is never named."""
    atol, rtol = max(atol, 1e-3), max(rtol, 1e-2)

    def close(a, b) -> bool:
        if a.shape != b.shape:
            return False
        a, b = a.double().nan_to_num(), b.double().nan_to_num()
        ok = torch.isclose(a, b, atol=atol, rtol=rtol)
        if bool(ok.all()):
            return True
        if row_slack is None or a.dim() < 2:
            return False
        near = ok | ((a - b).abs() <= row_slack[1])
        return _rows_forgiven(ok, near, row_slack, row_group) is not None

    def same(alt) -> bool:
        if isinstance(expected, torch.Tensor) and close(alt, expected.to(alt.device)):
            return False
        return close(got.to(alt.device), alt)

    def find():
        names = []
        if not isinstance(got, torch.Tensor):
            return names
        for name in spec.read_inputs:
            v = inputs[name]
            zeroed = {**inputs, name: torch.zeros_like(v)}
            try:
                alt = spec.reference(**zeroed)[out_name]
            except Exception:
                continue
            if same(alt):
                names.append(name)
        if names:
            return names
        tensors = [k for k in spec.read_inputs if isinstance(inputs.get(k), torch.Tensor)]
        for i, a in enumerate(tensors):
            for b in tensors[i + 1:]:
                va, vb = inputs[a], inputs[b]
                if va.shape != vb.shape or va.dtype != vb.dtype:
                    continue
                for change, text in (({a: vb, b: va}, f"`{a}` and `{b}` swapped"),
                                     ({b: va}, f"`{a}` read where `{b}` is meant"),
                                     ({a: vb}, f"`{b}` read where `{a}` is meant")):
                    try:
                        alt = spec.reference(**{**inputs, **change})[out_name]
                    except Exception:
                        continue
                    if same(alt):
                        return [f"the output is exactly what you get with {text}: check which pointer "
                                f"(or argument) each load uses."]
        return names
    return find


def _rows_forgiven(ok: torch.Tensor, near: torch.Tensor, row_slack: tuple[float, float],
                   group: int = 1) -> torch.Tensor | None:
    """A row slack's verdict: the rows (every axis but the last: a state [L, B, D] has L·B
    rows; ``group`` consecutive ones count as one) where ``ok`` fails somewhere, as a mask of
    ``ok.shape[:-1]``, if they are at most the slack's share of the rows, and at least one
    where there are several, and ``near`` holds on all of their elements; else None. At
    least one: a single int8 flip moved one row of block_step's 17-row case past the
    tolerance in 3 runs of 300 on a CPU (by up to 0.22); a one-row case has none."""
    shape = ok.shape[:-1]
    group = group if group > 1 and shape[-1] % group == 0 else 1
    if group > 1:
        ok, near = (t.reshape(*shape[:-1], shape[-1] // group, group * t.shape[-1]) for t in (ok, near))
    rows = ok[..., 0].numel()
    allowed = max(1, int(rows * row_slack[0])) if rows > 1 else 0
    rows_off = ~ok.all(-1)
    if int(rows_off.sum()) <= allowed and bool(near.all(-1)[rows_off].all()):
        return rows_off.repeat_interleave(group, -1).reshape(shape) if group > 1 else rows_off
    return None


# -- diagnosis ----------------------------------------------------------------------------
def rounding_tolerance(dtype: torch.dtype, atol: float, rtol: float) -> tuple[float, float]:
    """``atol, rtol`` widened to what storing in ``dtype`` moves: a kernel that makes a mistake
    in bfloat16 lands within bfloat16's rounding of the mistake recomputed in float64, not
    within 1e-3 of it."""
    floor = {torch.bfloat16: (1.5e-2, 2e-2), torch.float16: (2e-3, 2e-3)}.get(dtype, (0.0, 0.0))
    return max(atol, floor[0]), max(rtol, floor[1])


@dataclass(frozen=True)
class Hypothesis:
    """A plausible mistake, recomputed: ``answer(inputs)`` returns the outputs (a dict) that
    a kernel making that mistake computes on ``inputs`` (or several dicts, for a mistake with
    a free parameter such as the block size), or None where the mistake cannot show; a
    wrong output that matches them is explained by ``cause``. ``outputs`` limits it to
    some outputs (empty: any); ``share``: the fraction of elements that must match
    (below 1 for mistakes such as truncation, where float rounding moves a few). An answer
    of all zeros is ignored unless ``zeros_count``: "never loaded" says more there."""
    cause: str
    answer: Callable[[dict], dict | None]
    outputs: tuple[str, ...] = ()
    atol: float = 1e-3
    rtol: float = 1e-3
    share: float = 1.0
    # an answer of all zeros counts too (else the generic "all zeros" diagnoses speak)
    zeros_count: bool = False
    # ``answer(inputs, output, got)``: a mistake with a free parameter too costly to try
    # value by value (a cut at any of 20 000 tokens) reads the likely values off the output
    sees_output: bool = False

    def explains(self, output: str, got, inputs: dict, expected=None) -> bool:
        return self.mismatch(output, got, inputs, expected) is not None

    def mismatch(self, output: str, got, inputs: dict, expected=None) -> float | None:
        """How far the wrong output is from this mistake's answer (the mean absolute
        difference of the closest answer that explains it), or None if none does."""
        if self.outputs and output not in self.outputs:
            return None
        if not isinstance(got, torch.Tensor) or got.numel() == 0:
            return None
        try:
            # references on the CPU: an answer builds index tensors without a device
            cpu_inputs = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            alts = (self.answer(cpu_inputs, output, got.detach().cpu()) if self.sees_output
                    else self.answer(cpu_inputs))
            # one answer, or several (a mistake with a free parameter, e.g. the block size)
            alts = [alts] if alts is None or isinstance(alts, dict) else list(alts)
        except Exception:
            return None
        g = got.detach().double().cpu()
        e = expected.detach().double().cpu() if isinstance(expected, torch.Tensor) else None
        atol, rtol = rounding_tolerance(got.dtype, self.atol, self.rtol)
        best = None
        for alt in alts:
            value = alt.get(output) if isinstance(alt, dict) else None
            if not isinstance(value, torch.Tensor) or tuple(got.shape) != tuple(value.shape):
                continue
            v = value.detach().double().cpu()
            if self.share == 1.0 and not _close_on_a_sample(g, v, atol, rtol):
                continue    # already wrong on a sample: most hypotheses end here, at a tiny cost
            if e is not None and e.shape == v.shape and bool(torch.allclose(v, e, rtol=1e-9, atol=1e-12,
                                                                             equal_nan=True)):
                continue    # the mistake gives the right answer here: it cannot explain a wrong one
            if not self.zeros_count and not bool((v != 0).any()):
                continue    # all zero: the generic "all zeros" and "never loaded" diagnoses say more
            close = torch.isclose(g, v, atol=atol, rtol=rtol, equal_nan=True)
            if float(close.double().mean()) >= self.share and (expected is None or self._closer(g, v, expected)):
                d = (g - v).abs().masked_fill(torch.isnan(g) & torch.isnan(v), 0.0)
                d = float(torch.nan_to_num(d, nan=math.inf).mean())
                best = d if best is None else min(best, d)
        return best

    @staticmethod
    def _closer(g, v, expected) -> bool:
        """The mistake explains the output at least as well as the answer does, on the
        elements where the output or the mistake differ from the answer (so a hypothesis
        that barely differs from the answer does not claim a small unrelated error)."""
        e = expected.detach().double().cpu()
        if e.shape != g.shape:
            return True
        ok = torch.isfinite(g) & torch.isfinite(v) & torch.isfinite(e) & \
            ~(torch.isclose(g, e, atol=1e-7, rtol=1e-7) & torch.isclose(v, e, atol=1e-7, rtol=1e-7))
        return float((g - v)[ok].abs().sum()) <= 1.05 * float((g - e)[ok].abs().sum())


def _close_on_a_sample(g: torch.Tensor, v: torch.Tensor, atol: float, rtol: float, n: int = 4096) -> bool:
    """Are ``n`` elements spread over the two tensors (all of them, if fewer) close?
    Comparing tensors of millions of elements takes a second on one CPU thread."""
    if g.numel() <= n:
        return bool(torch.isclose(g, v, atol=atol, rtol=rtol, equal_nan=True).all())
    idx = torch.linspace(0, g.numel() - 1, n).long()
    return bool(torch.isclose(g.reshape(-1)[idx], v.reshape(-1)[idx], atol=atol, rtol=rtol, equal_nan=True).all())


def narrowed_hint(hint, narrow: Callable[[torch.Tensor], torch.Tensor], inputs: tuple[str, ...] | None = None):
    """``hint`` asked on a part of the problem: ``narrow`` slices the wrong output, the
    answer and the tensor ``inputs`` (None: all of them) alike. For problems whose parts
    all compute the same thing (the channels of an elementwise recurrence, the requests of
    a batch), where a mistake shows on a few parts as on all and recomputing every mistake
    on a GPU case costs a minute or more."""
    def hint_on_a_part(output, got, expected, given):
        part = {k: narrow(v) if isinstance(v, torch.Tensor) and v.dim() and (inputs is None or k in inputs)
                else v for k, v in given.items()}
        return hint(output, narrow(got), narrow(expected), part)
    return hint_on_a_part


def hypotheses_hint(*hypotheses: Hypothesis, then=None):
    """A spec ``hint`` that names the one of ``hypotheses`` whose recomputed answer is
    closest to the wrong output among those that match it (the first, on a tie), then
    asks ``then``, another hint, if none does. Closest, not first: two mistakes can
    give answers within tolerance of each other (a partition of 32 tokens against one
    of 33 when the 33rd token weighs little), and the exact one is the cause."""
    def hint(output, got, expected, inputs):
        best = None
        for h in hypotheses:
            d = h.mismatch(output, got, inputs, expected)
            if d is not None and (best is None or d < best[0]):
                best = (d, h.cause)
        if best is not None:
            return best[1]
        return then(output, got, expected, inputs) if then is not None else None
    return hint


def diagnose(name: str, got: torch.Tensor, exp: torch.Tensor, atol: float, rtol: float,
             unread: Callable[[], list[str]] | None = None,
             custom_hint: Callable[[], str | None] | None = None,
             axes: tuple[str, ...] | None = None,
             reads_outside: Callable[[], bool | str] | None = None,
             poisoned: bool = True, hints: bool = True,
             row_slack: tuple[float, float] | None = None, row_group: int = 1) -> tuple[str | None, float]:
    """Compare one output with its reference. Returns (message or None, max abs error).
    ``poisoned``: the output was allocated by the check and filled with poison (False for
    results a function returns, where no element can be "never written"); ``hints=False``:
    the message without a hint (none of the probes a hint may run); ``row_slack``, ``row_group``:
    the spec's (:attr:`~gpulab.harness.spec.KernelSpec.row_slack`, ``slack_row_group``)."""
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
    unwritten = (_poisoned(got).cpu() if poisoned else torch.zeros_like(close)) & ~close
    close &= ~unwritten
    diff = (g - e).abs()
    finite = torch.isfinite(diff)
    max_err = float(diff[finite].max()) if finite.any() else 0.0
    if row_slack is not None and g.dim() >= 2 and not bool(close.all()):
        near = close | ((diff <= row_slack[1]) & finite & ~unwritten)
        rows = _rows_forgiven(close, near, row_slack, row_group)
        if rows is not None:
            close[rows] = True              # a few rows a cascade of int8 flips moved a little
    if bool(close.all()):
        return None, max_err
    bad = ~close
    n, nbad = bad.numel(), int(bad.sum())
    nonfinite = int((bad & ~finite & ~unwritten).sum())
    if bool(unwritten.any()) and int((bad & ~unwritten).sum()) == 0:
        err_text = f"{int(unwritten.sum())} of them were never written"
    elif nonfinite == nbad:
        err_text = (f"no wrong element is even finite ({nonfinite} NaN/Inf)" if nonfinite < n else
                    "every element is NaN or Inf")
    elif nonfinite:
        err_text = (f"largest finite error {float(diff[bad & finite].max()):.3g}, and {nonfinite} "
                    f"element(s) NaN/Inf")
    else:
        err_text = f"largest error {float(diff[bad & finite].max()):.3g}" if bool((bad & finite).any()) \
            else "largest error: none finite"
    lines = [f"  {nbad} of {n} elements ({100 * nbad / n:.1f}%) are wrong; "
             f"{err_text} (tolerance: atol {atol:g}, rtol {rtol:g})."]
    idx = bad.nonzero()[:5]
    shown = []
    for ix in idx:
        t = tuple(int(i) for i in ix)
        gv = "never written" if bool(unwritten[t]) else f"{g[t].item():.6g}"
        shown.append(f"[{', '.join(map(str, t))}]: got {gv}, expected {e[t].item():.6g}")
    lines.append("  first wrong elements: " + "; ".join(shown))
    # An integer poison is also what a NaN converted to an integer can give: the spec's own
    # diagnosis may still explain an integer output that looks unwritten.
    if not hints:
        return "\n".join(lines), max_err
    hint = None if custom_hint is None or (bool(unwritten.any()) and got.is_floating_point()) \
        else custom_hint()
    hint = hint or _hint(g, e, bad, unwritten, atol, rtol, unread, got, axes, reads_outside)
    if hint:
        lines.append("  Hint: " + hint)
    return "\n".join(lines), max_err


def _hint(g, e, bad, unwritten, atol, rtol, unread, raw=None, axes=None, reads_outside=None) -> str | None:
    n = bad.numel()
    flat_bad = bad.reshape(-1)
    if bool(unwritten.all()):
        return ("nothing was written to this output: is the store missing, does the kernel "
                "write somewhere else, or was the grid empty?")
    if bool(unwritten.any()):
        return _region_hint(unwritten, "never written", axes,
                            tail="the grid does not cover the whole tensor: launch "
                                 "triton.cdiv(n, BLOCK) programs",
                            cols="the block is narrower than the row (BLOCK must be at least "
                                 "the row length, e.g. triton.next_power_of_2(n_cols)) or the "
                                 "mask cuts the row short",
                            rows="check the grid size and how program_id maps to rows")
    nonfinite = bad & ~torch.isfinite(g) & torch.isfinite(e)
    guard = _guard_derived(raw).cpu() & nonfinite if raw is not None else nonfinite & False
    # compiled (no load watch): re-run with other guard values to see where a stray load read
    outside = _safely(reads_outside) if reads_outside is not None else False
    if outside == "gaps":
        return ("the wrong elements change when only the padding between the rows of a strided input "
                "changes: a load between the rows. The offsets assume contiguous rows (row · N); step "
                "from row to row by the input's own row stride (x.stride(0)).")
    if bool(guard.any()):
        return (f"{int(guard.sum())} element(s) are NaN where the answer is finite, and they carry the "
                f"bit pattern gpulab puts around every input: a load read past the end of an input (a "
                f"missing mask, or masked-out lanes without a safe `other=`) and its value reached the "
                f"output.")
    if isinstance(outside, tuple):
        names = " and ".join(f"`{k}`" for k in outside)
        return (f"the wrong elements change when only the values just outside input {names} change: "
                f"a load past the end of input {names} (a missing mask, or an offset beyond the "
                f"tensor) and its value reached the output.")
    if outside:
        return ("the wrong elements change when only the values around the inputs change: a load "
                "read past the end of an input (a missing mask, or an offset beyond the tensor) and "
                "its value reached the output.")
    if bool(nonfinite.any()):
        k = int(nonfinite.sum())
        n_inf = int((nonfinite & torch.isinf(g)).sum())
        n_nan = k - n_inf
        if n_nan == 0:
            return (f"{k} element(s) are ±Inf where the answer is finite: an overflow in arithmetic, "
                    f"e.g. exp of a large score without subtracting the running max first, or a "
                    f"float16 accumulator.")
        return (f"{k} element(s) are NaN ({n_inf} Inf) where the answer is finite, and nothing read "
                f"outside the inputs: the NaN comes from arithmetic: 0/0 (a sum over an empty or fully masked row "
                f"divided by itself), inf − inf (exp(−inf − (−inf)) when a running max is still −inf, "
                f"or an overflowed exp), or inf·0. Check the max subtraction (max, not min) and how "
                f"empty/masked rows and lanes are handled.")
    fin = bad & torch.isfinite(g) & torch.isfinite(e) & (e != 0)
    if bool(fin.any()):
        gb, eb = g[fin], e[fin]
        if bool(torch.isclose(gb * eb, torch.ones_like(gb), rtol=1e-2, atol=0).all()) and \
                not bool(torch.isclose(eb.abs(), torch.ones_like(eb), rtol=1e-2).all()):
            return ("the wrong elements are the reciprocals of the answer: a scale (or a division) is "
                    "inverted, e.g. mean|w| where 1/mean|w| is meant.")
    if unread is not None and n > 2:
        names = unread()
        if len(names) == 1 and names[0].startswith("the output is exactly"):
            return names[0]
        if names:
            return (f"the output is exactly what you get with input(s) {', '.join(names)} set to "
                    f"zero: {'is it' if len(names) == 1 else 'are they'} ever loaded?")
    if bool((g == 0).all()) and not bool((e == 0).all()):
        return "the output is all zeros: were the results stored?"
    axis_hint = _normalisation_axis_hint(g, e)
    if axis_hint:
        return axis_hint
    repeated = _broadcast_axis(g, e, atol, rtol)
    if repeated is not None:
        return (f"along axis {repeated} every slice holds one repeated value, and the answer does not: "
                f"a result of size 1 on that axis (e.g. shape (rows, 1)) was broadcast into the output; "
                f"compute the output at its full shape.")
    big = bad & (e.abs() > 10 * atol) & torch.isfinite(g)
    if int(big.sum()) == 1 and n == 1:
        ratio = float((g[big] / e[big]).reshape(-1)[0])
        return (f"the single value is off by a factor {ratio:.4g} (got/expected): a scale or a "
                f"reduction (mean, max, sum) differs from the answer's.")
    if int(big.sum()) >= 2:
        ratio = g[big] / e[big]
        med = float(ratio.median())
        if abs(med) > 0 and float((ratio - med).abs().max()) < 1e-2 * abs(med) + rtol and \
                abs(med - 1) > max(rtol, 1e-3):
            rows_bad = bad.reshape(-1, bad.shape[-1]).any(1) if bad.dim() >= 2 else None
            # rows that are right although they hold values a scale would change
            rows_right = (~rows_bad & (e.abs() > 10 * atol).reshape(-1, e.shape[-1]).any(1)
                          if rows_bad is not None else None)
            if rows_right is not None and bool(rows_right.any()):
                return (f"rows {format_ranges(rows_bad.nonzero().flatten().tolist())} are off by a constant "
                        f"factor (≈ {med:.4g}) and the other rows are right: those rows' normalisation is "
                        f"wrong (e.g. a stale running max, or a sum that includes masked-out lanes: "
                        f"each row is off by its own constant factor).")
            if _rows_differ_in_factor(g, e, big, raw):
                return _OWN_ROW_FACTOR
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
                    return _OWN_ROW_FACTOR
    clamp = _clamp_hint(g, e, bad, atol)
    if clamp:
        return clamp
    region = _region_hint(bad, "wrong", axes,
                          tail="the last, partial block is mishandled: check its mask",
                          cols="the tail of each row (the last, partial block) is mishandled: "
                               "check the mask and the `other=` value",
                          rows="check how program_id maps to rows and the row stride")
    if region:
        return region
    if int(flat_bad.sum()) < n:
        return "the errors are scattered: compare your math with the reference step by step."
    return ("every element is wrong, with no pattern the check recognises: compare your math with "
            "the reference step by step (on one small case).")


_OWN_ROW_FACTOR = ("each row is off by its own constant factor: the row's normalisation is wrong "
                   "(e.g. a stale running max, or a sum that includes masked-out lanes).")


def _rows_differ_in_factor(g: torch.Tensor, e: torch.Tensor, big: torch.Tensor,
                           raw: torch.Tensor | None) -> bool:
    """True when each row is off by one constant factor but the rows' factors differ from
    one another by more than the rounding spread inside a row (factors 0.512 and 0.515 are
    two normalisations gone wrong, not one missing scale)."""
    if g.dim() < 2:
        return False
    ratio = (g / e).reshape(-1, g.shape[-1])
    big = big.reshape(-1, g.shape[-1])
    medians, spread = [], 0.0
    for i in range(ratio.shape[0]):
        r = ratio[i][big[i]]
        if r.numel() >= 2:
            med = r.median()
            medians.append(float(med))
            spread = max(spread, float((r - med).abs().max()))
    if len(medians) < 2:
        return False
    # the output's own rounding bounds how far apart two equal factors can look
    eps = torch.finfo(raw.dtype).eps if raw is not None and raw.is_floating_point() else 1e-6
    return max(medians) - min(medians) > 4 * spread + 2 * eps * max(abs(m) for m in medians)


def _safely(probe: Callable[[], bool | str]) -> bool | str:
    try:
        return probe()
    except DeviceFault:
        raise               # the process has lost the GPU: say so, not a later op's CUDA error
    except Exception:
        return False


def _clamp_hint(g, e, bad, atol) -> str | None:
    """The answer saturates at its bounds (many elements equal its min or max) and every
    wrong element lies beyond them: a clamp is missing."""
    finite_e = e[torch.isfinite(e)]
    gbad = g[bad & torch.isfinite(g)]
    if not finite_e.numel() or not gbad.numel():
        return None
    lo, hi = float(finite_e.min()), float(finite_e.max())
    saturated = int(((e == lo) | (e == hi)).sum())
    if lo < hi and saturated >= max(3, e.numel() // 100) and \
            bool(((gbad > hi + atol) | (gbad < lo - atol)).all()):
        return (f"every wrong element lies outside [{lo:g}, {hi:g}], the range the answer saturates "
                f"at: a clamp to that range is missing.")
    return None


def _normalisation_axis_hint(g, e) -> str | None:
    """For outputs whose rows sum to 1 (softmax): the output sums to 1 along another axis."""
    if g.dim() < 2 or g.shape[-1] < 2 or not bool(torch.isfinite(g).all()):
        return None
    if not bool(torch.allclose(e.sum(-1), torch.ones_like(e.sum(-1)), atol=1e-3)):
        return None
    if bool(torch.allclose(g.sum(-1), torch.ones_like(g.sum(-1)), atol=1e-3)):
        return None
    for axis in range(g.dim() - 1):
        if g.shape[axis] > 1 and bool(torch.allclose(g.sum(axis), torch.ones_like(g.sum(axis)), atol=1e-3)):
            return (f"the output sums to 1 along axis {axis}, the answer along the last axis: the "
                    f"max and the sum run over the wrong axis (use dim=-1).")
    return None


def _broadcast_axis(g, e, atol, rtol) -> int | None:
    """An axis (size > 1) along which the output is constant while the answer is not (and
    the constants are not just 0 and 1, which a saturated result gives too)."""
    for axis in range(g.dim() - 1, -1, -1):
        if g.shape[axis] < 2:
            continue
        first_g = g.narrow(axis, 0, 1)
        first_e = e.narrow(axis, 0, 1)
        trivial = bool(((first_g == 0) | (first_g.abs() == 1)).all())
        if not trivial and \
                bool(torch.isclose(g, first_g.expand_as(g), atol=atol, rtol=rtol, equal_nan=True).all()) and \
                not bool(torch.isclose(e, first_e.expand_as(e), atol=atol, rtol=rtol, equal_nan=True).all()):
            return axis - g.dim()
    return None


def _region_hint(mask, what, axes=None, *, tail, cols, rows) -> str | None:
    """Describe where in the tensor the True elements of ``mask`` are, if it has a shape."""
    flat = mask.reshape(-1)
    idx = flat.nonzero().flatten()
    n = flat.numel()
    first = int(idx.min())
    if axes and len(axes) == mask.dim():
        named = _axes_hint(mask, what, axes)
        if named:
            return named
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
            rb = row_bad.nonzero().flatten().tolist()
            if _n_ranges(rb) > 3:
                return (f"rows {format_ranges(rb)} (of {m2.shape[0]}) are {what} and the rest right, with no "
                        f"pattern in where they are: the mistake depends on each row's data (e.g. which "
                        f"states are empty, which values are largest), not on its position.")
            return (f"only rows {format_ranges(rb)} (of {m2.shape[0]}) are {what}: {rows}.")
    return None


def _axes_hint(mask, what, axes) -> str | None:
    """'only head 1, 3 (of 4) are wrong' in the spec's own axis names, for the axes
    along which the wrong elements are confined to some indices."""
    parts = []
    for d, axis_name in enumerate(axes):
        size = mask.shape[d]
        if size < 2:
            continue
        other = tuple(i for i in range(mask.dim()) if i != d)
        hit = mask.any(dim=other) if other else mask
        if bool(hit.any()) and not bool(hit.all()):
            parts.append(f"{axis_name} {format_ranges(hit.nonzero().flatten().tolist())} (of {size})")
    if not parts:
        return None
    return f"the {what} elements are confined to " + ", ".join(parts) + "."


def _n_ranges(xs: list[int]) -> int:
    return sum(1 for i, x in enumerate(xs) if i == 0 or x != xs[i - 1] + 1)


def format_ranges(xs: list[int], limit: int = 4) -> str:
    """Indices as runs: [0, 1, 2, 7] -> "0..2, 7" (at most ``limit`` runs shown)."""
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
        run_check(spec, fn, quiet=True, **kw)
    except CheckFailure as e:
        return str(e)
    raise AssertionError(f"the check for {spec if isinstance(spec, str) else spec.name} "
                         f"accepted a wrong implementation")

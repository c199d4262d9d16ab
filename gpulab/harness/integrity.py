"""What ``gpulab grade`` runs inside a notebook's kernel so that the notebook cannot
change its own grade by rebinding the checks.

Before any cell of the notebook runs, :func:`protect` imports what the course's own
(released) setup cells import and records, by identity, every function, class, module
and spec of gpulab, and the functions of torch, numpy and builtins that checks rely on.
Each graded test then runs through :func:`run_graded_cell`, which

1. puts back anything the notebook replaced (``gpulab.check = lambda *a: None``,
   a spec whose cases were emptied, a module swapped in ``sys.modules``...) and says so,
2. runs the released test source (visible and hidden tests) in a copy of the
   notebook's namespace in which the names the course imports (``gpulab``, ``torch``,
   ``Case``, ``bl``...) are bound afresh, so a notebook's own ``gpulab = Fake()`` or
   ``def check(...)`` is not what the test calls,
3. requires kernel exercises to launch a kernel of the learner's own, and
4. fails the exercise if anything protected changed while the test ran (the learner's
   function replacing a check from inside).

This raises the bar, it is no sandbox: code in the notebook runs in the same process
and can, with effort, reach anything (README, "What the grader guarantees").
"""
from __future__ import annotations

import builtins
import sys
import types
from dataclasses import dataclass, field

from . import checking
from .spec import KernelSpec, all_specs, register

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class GradingIntegrityError(AssertionError):
    """The notebook changed gpulab (or what its checks rely on) while being graded."""


def _protected_module_names() -> list[str]:
    names = [n for n in list(sys.modules) if n == "gpulab" or n.startswith("gpulab.")]
    names += [n for n in ("torch", "torch.nn.functional", "numpy", "builtins", "triton", "warnings", "math")
              if n in sys.modules]
    return sorted(set(names))


def _kept(module_name: str, value) -> bool:
    """Which module attributes are recorded: in gpulab everything but plain values (lazily
    filled caches start as None), elsewhere functions, classes and modules."""
    if module_name == "builtins":
        return isinstance(value, (types.BuiltinFunctionType, type))
    if module_name.startswith("gpulab"):
        return not isinstance(value, _PLAIN)
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)) \
        or callable(value)


def _spec_state(spec: KernelSpec) -> dict:
    state = dict(vars(spec))
    for name in ("cases", "dtypes", "tolerances", "output_tolerances", "baselines", "axes"):
        value = state.get(name)
        if isinstance(value, dict):
            state[name] = {k: (list(v) if isinstance(v, list) else v) for k, v in value.items()}
    return state


@dataclass
class Snapshot:
    modules: dict = field(default_factory=dict)      # name -> (module, {attr: value})
    types: dict = field(default_factory=dict)        # class -> {attr: value}
    specs: dict = field(default_factory=dict)        # name -> (spec, state)
    shell: object = None

    @classmethod
    def take(cls) -> "Snapshot":
        snap = cls()
        for name in _protected_module_names():
            mod = sys.modules[name]
            attrs = {k: v for k, v in list(vars(mod).items()) if _kept(name, v)}
            snap.modules[name] = (mod, attrs)
        import torch
        snap.types[torch.Tensor] = dict(vars(torch.Tensor))
        snap.specs = {name: (spec, _spec_state(spec)) for name, spec in all_specs().items()}
        ipython = sys.modules.get("IPython")
        snap.shell = ipython.get_ipython() if ipython is not None else None
        return snap

    def differences(self, callables_only: bool = False) -> list[tuple]:
        """(description, undo) for every recorded thing that is not what it was."""
        out = []
        for name, (mod, attrs) in self.modules.items():
            if sys.modules.get(name) is not mod:
                out.append((f"sys.modules[{name!r}]", lambda n=name, m=mod: sys.modules.__setitem__(n, m)))
            current = vars(mod)
            for attr, value in attrs.items():
                now = current.get(attr, _MISSING)
                if now is not value:
                    if callables_only and not (callable(value) or isinstance(value, types.ModuleType)):
                        continue
                    out.append((f"{name}.{attr}", lambda m=mod, a=attr, v=value: setattr(m, a, v)))
        for cls, attrs in self.types.items():
            current = vars(cls)
            for attr, value in attrs.items():
                if current.get(attr, _MISSING) is not value:
                    out.append((f"{cls.__module__}.{cls.__qualname__}.{attr}",
                                lambda c=cls, a=attr, v=value: setattr(c, a, v)))
        registry_now = all_specs()
        for name, (spec, state) in self.specs.items():
            if registry_now.get(name) is not spec:
                out.append((f"the spec registry entry {name!r}",
                            lambda s=spec: register(s)))
            if _spec_state(spec) != state:
                out.append((f"the spec {name!r}", lambda s=spec, st=state: _restore_spec(s, st)))
        return out


_MISSING = object()


def _restore_spec(spec: KernelSpec, state: dict) -> None:
    for k, v in state.items():
        if isinstance(v, dict):
            v = {kk: (list(vv) if isinstance(vv, list) else vv) for kk, vv in v.items()}
        setattr(spec, k, v)


_SNAPSHOT: list[Snapshot] = []


def protect(imports: list[str] = ()) -> None:
    """Run the course's imports, then record what must not change (once per kernel)."""
    scratch: dict = {}
    for line in imports:
        try:
            exec(line, scratch)
        except Exception as e:   # an import the course itself cannot do: the test will say so
            print(f"gpulab grade: `{line}` failed in the grading kernel: {type(e).__name__}: {e}")
    _SNAPSHOT[:] = [Snapshot.take()]


def _restore_all(snap: Snapshot) -> list[str]:
    restored = []
    for _ in range(3):                 # undoing a module swap can expose more differences
        diffs = snap.differences()
        if not diffs:
            break
        for what, undo in diffs:
            undo()
            restored.append(what)
    return sorted(set(restored))


def run_graded_cell(grade_id: str, source: str, imports: list[str]) -> None:
    """Run one released test as described in the module docstring."""
    if not _SNAPSHOT:
        protect(imports)
    snap = _SNAPSHOT[0]
    restored = _restore_all(snap)
    if restored:
        shown = ", ".join(restored[:6]) + (f" and {len(restored) - 6} more" if len(restored) > 6 else "")
        print(f"gpulab grade: this notebook had replaced {shown}; the test ran with gpulab's originals.")
    user_ns = snap.shell.user_ns if snap.shell is not None else vars(sys.modules["__main__"])
    namespace = dict(user_ns)
    namespace["__builtins__"] = builtins
    for line in imports:
        exec(line, namespace)
    code = compile(source, f"<released test {grade_id}>", "exec")
    with checking.enforce_learner_kernels(True):
        try:
            exec(code, namespace)
        finally:
            changed = [what for what, _ in snap.differences(callables_only=True)]
            if changed:
                _restore_all(snap)
    if changed:
        raise GradingIntegrityError(
            f"{grade_id}: the code under test replaced {', '.join(changed[:6])} while it was being "
            f"graded; this exercise gets no points.")

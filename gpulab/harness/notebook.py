"""Small helpers that keep notebooks free of dead ends."""
from __future__ import annotations

import ast
import json
import linecache
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import runtime
from .spec import get as get_spec

# What an unfinished exercise raises: the generated stub (NotImplementedError) or, inside
# a @triton.jit body, the static-assert TODO (compiled or interpreted).
STUB_ERRORS = ("NotImplementedError", "CompileTimeAssertionFailure", "InterpreterError",
               "CompilationError")


def mine_or_reference(mine: Callable, reference: Callable, *probe_args, name: str = "your kernel") -> Callable:
    """Return ``mine`` if it runs on ``probe_args``, else ``reference`` with a note.

    Profiling and later cells use this, so a learner who has not finished an
    exercise yet can still run the rest of the notebook (on gpulab's kernel)."""
    try:
        mine(*probe_args)
        return mine
    except Exception as e:  # an unfinished stub, or a kernel that fails to compile
        if type(e).__name__ in STUB_ERRORS or "TODO (" in str(e):
            print(f"{name} is not written yet: using gpulab's version here instead.")
        else:
            print(f"{name} raised {type(e).__name__}: {str(e).splitlines()[0][:200]}\n"
                  f"-> using gpulab's version here instead.")
        return reference


def show_error(fn: Callable, *args, **kwargs) -> str:
    """Call ``fn`` expecting it to reject its input; print and return the error.
    Raises AssertionError if nothing was raised (so a validation demo proves something)."""
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, IndexError, RuntimeError) as e:
        text = f"{type(e).__name__}: {e}"
        print(text)
        return text
    raise AssertionError(f"{getattr(fn, '__name__', fn)} accepted input it should reject")


# -- a later notebook running the learner's kernels from earlier ones ------------------------
def notebook_functions(notebook: str | Path, *names: str) -> dict[str, Callable | None]:
    """The functions ``names`` as defined by the exercise cells of an earlier notebook.

    ``notebook`` is a file name next to the running notebook (the kernel's working
    directory), e.g. ``"01_ternary_bitlinear.ipynb"``: in ``notebooks/`` that is the
    learner's own saved copy. Runs the notebook's top-level imports and its solution
    cells (``metadata.nbgrader.solution``), nothing else, in a fresh namespace; each
    cell's source is registered with ``linecache`` so ``@triton.jit`` can read it.
    A name the notebook does not define (or a notebook that is not there) maps to None,
    with one printed line saying why."""
    path = Path(notebook)
    found: dict[str, Callable | None] = dict.fromkeys(names)
    if not path.exists():
        print(f"{path.name} is not next to this notebook: gpulab's versions of "
              f"{', '.join(names)} run instead.")
        return found
    nb = json.loads(path.read_text(encoding="utf-8"))
    namespace: dict = {"__name__": f"gpulab_notebook_{path.stem}"}
    code_cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    sources = [("".join(c.get("source", "")), c.get("metadata", {}).get("nbgrader", {}))
               for c in code_cells]
    imports = [_imports_of(src) for src, _ in sources]
    plan = [(f"imports of {path.name}", "\n".join(filter(None, imports)))]
    plan += [(f"{path.name}, cell {meta.get('grade_id', k)}", src)
             for k, (src, meta) in enumerate(sources) if meta.get("solution")]
    for label, src in plan:
        filename = f"<{label}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        try:
            exec(compile(src, filename, "exec"), namespace)
        except Exception as e:   # the learner's code: report, keep what did define
            print(f"{label} raised {type(e).__name__} while loading: {str(e).splitlines()[0][:200] if str(e) else ''}")
    for name in names:
        fn = namespace.get(name)
        found[name] = fn if callable(fn) else None
    return found


def _imports_of(source: str) -> str:
    """The top-level import statements of a cell (to run a notebook's cells out of it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    lines = source.splitlines()
    return "\n".join("\n".join(lines[n.lineno - 1:n.end_lineno]) for n in tree.body
                     if isinstance(n, (ast.Import, ast.ImportFrom)) and not _is_future(n))


def _is_future(node) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def _disagreement(spec, mine: dict, ref: dict) -> str | None:
    """Which output of ``mine`` differs from ``ref`` beyond twice the spec's float32
    tolerance (None: they agree)."""
    for name, want in ref.items():
        got = mine.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"{name} has another shape"
        atol, rtol = spec.tolerance(torch.float32, name)
        g, w = got.detach().double().cpu(), want.detach().double().cpu()
        bad = (g - w).abs() > 2 * atol + 2 * rtol * w.abs()
        if bad.any():
            return f"{int(bad.sum())} of {bad.numel()} values of {name} differ"
    return None


def _results(spec, fn, inputs: dict) -> dict:
    """Run ``fn`` on copies of ``inputs`` (outputs preallocated for a launcher) and name
    what it produced: the returned values, or the written outputs."""
    inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    outputs = {k: torch.zeros(shape, dtype=dtype, device=runtime.device())
               for k, (shape, dtype) in (spec.outputs(inputs, torch.float32) if spec.outputs else {}).items()}
    result = spec.call(fn, inputs, outputs)
    if outputs:
        return outputs
    values = result if isinstance(result, (tuple, list)) else (result,)
    return {k: torch.as_tensor(v) for k, v in zip(spec.returns, values)}


@dataclass
class KernelSources:
    """Picks, kernel by kernel, the learner's version or gpulab's, and says which ran.

    ``pick(spec_name, mine, exercise)`` runs the learner's function and the spec's
    implementation on the spec's first CPU cases (small, awkward sizes, float32): the
    learner's is used if it runs and agrees within twice the check's tolerance, else
    gpulab's, with the reason and the exercise to finish. ``report()`` prints the table:
    which kernels were the learner's and which gpulab's. (A probe, not a grade: the
    notebook's own check is what grades an exercise.)"""
    cases: int = 2
    rows: list = field(default_factory=list)

    def pick(self, spec_name: str, mine: Callable | None, exercise: str) -> Callable:
        spec = get_spec(spec_name)
        if mine is None:
            return self._fallback(spec, f"not found: do {exercise}")
        for case in spec.cases["cpu"][:self.cases]:
            inputs = spec.inputs(case, torch.float32, runtime.device(), seed=1)
            with spec.expected_warnings():
                want = _results(spec, spec.implementation, inputs)
                try:
                    got = _results(spec, mine, inputs)
                except Exception as e:   # an unfinished stub, or the learner's bug
                    if type(e).__name__ in STUB_ERRORS or "TODO (" in str(e):
                        return self._fallback(spec, f"not written yet: finish {exercise}")
                    first = str(e).splitlines()[0][:100] if str(e) else ""
                    return self._fallback(spec, f"raised {type(e).__name__}: {first}; fix {exercise}")
            why = _disagreement(spec, got, want)
            if why:
                return self._fallback(spec, f"disagrees with gpulab's on case {case} ({why}): "
                                            f"re-check {exercise}")
        self.rows.append((spec_name, "yours", exercise))
        return mine

    def _fallback(self, spec, why: str) -> Callable:
        self.rows.append((spec.name, "gpulab's", why))
        return spec.implementation

    def note(self, label: str, source: str, why: str = "") -> None:
        """Record a part that is not picked by probing (e.g. a PyTorch path on a CPU)."""
        self.rows.append((label, source, why))

    def report(self) -> None:
        width = max([len(r[0]) for r in self.rows] + [6])
        who = max([len(r[1]) for r in self.rows] + [4])
        lines = [f"{'kernel':{width}}  {'runs':{who}}  exercise, or why gpulab's runs"] + [
            f"{label:{width}}  {source:{who}}  {why}" for label, source, why in self.rows]
        print("\n".join(lines))

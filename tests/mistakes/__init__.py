"""A catalogue of plausible learner mistakes, per graded exercise.

Each :class:`Mistake` is a wrong implementation a learner could write, run against the
exercise's visible check exactly as the grade cell runs it (notebook rules: the kernel
must be the learner's own), with the words a diagnosis naming the right cause must
contain. ``needs`` names spec fields the check needs to catch it that the exercise's
spec does not set yet (the catalogue then runs it against ``spec.variant(**needs)``
and the report counts it apart). ``python -m tests.mistakes.report`` prints the catch
rate and the hint accuracy; tests/test_mistakes.py asserts every entry.

Scenario checks (registered with ``checking.scenario_check``: the serving engine's
block manager and scheduler, speculative decoding, collectives) have no KernelSpec:
there ``spec`` is the check's name and ``args`` its positional arguments, as in the
grade cell ``gpulab.check(name, learner_object, *args)``.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

from gpulab import runtime
from gpulab.harness import checking
from gpulab.harness.spec import get

MODULES = ("nb00", "nb01", "nb02", "nb03", "nb04", "nb05", "nb06", "nb07", "nb08", "nb09", "nb10")


@dataclass
class Mistake:
    exercise: str                 # notebook/grade id, e.g. "00/check-add"
    spec: str
    name: str                     # what the learner did
    fn: Callable
    expect: tuple[str, ...]       # the message names the right cause if it contains one of these
    kw: dict = field(default_factory=dict)      # extra check arguments, as in the grade cell
    needs: dict = field(default_factory=dict)   # spec fields not set yet that catch it
    weak: str = ""    # why the generic diagnosis cannot name this cause (it counts as a miss)
    args: tuple = ()  # a scenario check's positional arguments, as in the grade cell
    interpreter_only: str = ""    # why a compiled run cannot see it (it leaves no trace in any output)
    weak_compiled: str = ""       # why, compiled, the diagnosis cannot name the cause (a miss there)
    faults_compiled: str = ""     # why, compiled, its kernel faults (it then runs in a fresh process:
                                  # an illegal address ends the CUDA context of the process it hits)

    @property
    def id(self) -> str:
        return f"{self.exercise}: {self.name}"


@dataclass
class Outcome:
    caught: bool
    right_cause: bool
    message: str


def run(m: Mistake, with_needs: bool = True) -> Outcome:
    if m.spec in checking.SCENARIO_CHECKS:
        return _run_scenario(m)
    spec = get(m.spec)
    if m.needs and with_needs:
        spec = spec.variant(**m.needs)
    try:
        with checking.enforce_learner_kernels(True):
            checking.run_check(spec, m.fn, quiet=True, **m.kw)
    except Exception as e:   # a CheckFailure, or the learner's own error
        text = f"{type(e).__name__}: {e}"
        return Outcome(True, any(x in text for x in expected_phrases(m)), text)
    return Outcome(False, False, "")


def run_in_subprocess(m: Mistake, env: dict, timeout_s: float = 600) -> Outcome:
    """:func:`run` in a fresh Python process: for a mistake whose kernel faults compiled,
    which would leave the calling process unable to use the GPU."""
    tests = Path(__file__).resolve().parent.parent
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(tests)!r})\n"
            "import gpulab\n"
            "from mistakes import catalogue, run\n"
            f"m = next(x for x in catalogue() if x.id == {m.id!r})\n"
            "o = run(m)\n"
            "print('OUTCOME ' + json.dumps([o.caught, o.right_cause, o.message]))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("OUTCOME "):
            return Outcome(*json.loads(line[len("OUTCOME "):]))
    raise RuntimeError(f"{m.id}: the subprocess reported no outcome (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _run_scenario(m: Mistake) -> Outcome:
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # a passing check prints one line
            checking.check(m.spec, m.fn, *m.args, **m.kw)
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        return Outcome(True, any(x in text for x in m.expect), text)
    return Outcome(False, False, "")


# Compiled, loads cannot be watched: a stray load is seen only where its value reaches the
# output. Re-runs with one input's guards changed name the input; where the stray value is
# the guard's own NaN pattern, the diagnosis names the cause without knowing which input.
COMPILED_LOAD_PHRASE = "a load read past the end of an input"


def expected_phrases(m: Mistake) -> tuple[str, ...]:
    """The words that name ``m``'s cause in this mode."""
    if runtime.mode() == "compiled" and any(x.startswith("a load past the end of input") for x in m.expect):
        return m.expect + (COMPILED_LOAD_PHRASE,)
    return m.expect


def catalogue() -> list[Mistake]:
    out = []
    for name in MODULES:
        out += importlib.import_module(f"{__name__}.{name}").MISTAKES
    return out

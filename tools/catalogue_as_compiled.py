"""Run the mistake catalogue on a CPU with the check's compiled-mode diagnosis.

Compiled, a check cannot watch loads (the interpreter can: every address is a Python
integer there); it re-runs the kernel with other guard values instead. This runs each kernel
entry of ``tests/mistakes`` in Triton's interpreter, but with the load watch off and the
guard re-runs on, as on a GPU, and lists the entries whose compiled diagnosis would miss
the mistake or name the wrong cause. It finds on a laptop, in a minute, what an hour of
compiled GPU runs found before (it cannot see what only real GPU execution shows: programs
running out of order, illegal addresses, NaN bit patterns). Entries marked
``interpreter_only`` are left out, as the compiled test skips them.

usage: python tools/catalogue_as_compiled.py [-v] [ID_SUBSTRING]   (-v: every diagnosis, not only the failures)
"""
from __future__ import annotations

import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gpulab import runtime  # noqa: E402
from gpulab.harness import checking  # noqa: E402

import mistakes  # noqa: E402


def runtime_view(**answers) -> types.SimpleNamespace:
    """``gpulab.runtime`` with some of its questions answered otherwise."""
    view = types.SimpleNamespace(**{k: getattr(runtime, k) for k in dir(runtime) if not k.startswith("__")})
    for name, value in answers.items():
        setattr(view, name, lambda value=value: value)
    return view


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv
    argv = [a for a in argv if a != "-v"]
    wanted = argv[0] if argv else ""
    # the check diagnoses as compiled (no load watch, guard re-runs) on the CPU cases; the
    # catalogue expects the compiled words; kernels still launch, watched, in the interpreter
    checking_view = runtime_view(interpreting=False)
    checking.runtime, mistakes.runtime = checking_view, runtime_view(mode="compiled")
    hook_runs = checking._CallWatch._hook_runs

    def hook_interpreted_runs(watch):
        checking.runtime = runtime
        try:
            hook_runs(watch)
        finally:
            checking.runtime = checking_view
    checking._CallWatch._hook_runs = hook_interpreted_runs
    expected_phrases = mistakes.expected_phrases
    try:
        failures = []
        for m in mistakes.catalogue():
            if wanted not in m.id or m.spec in checking.SCENARIO_CHECKS or m.interpreter_only:
                continue
            t0 = time.perf_counter()
            outcome = mistakes.run(m)
            weak = m.weak or m.weak_compiled
            verdict = "ok" if outcome.caught and (outcome.right_cause or weak) else \
                "MISSED" if not outcome.caught else "WRONG CAUSE"
            print(f"{verdict:11} {time.perf_counter() - t0:5.1f} s  {m.id}", flush=True)
            if verbose:
                print("    " + outcome.message.strip().splitlines()[-1][-300:], flush=True)
            if verdict != "ok":
                failures.append((m, outcome))
        for m, outcome in failures:
            print(f"\n== {m.id} (expected one of {expected_phrases(m)})\n{outcome.message[-800:]}")
        print(f"\n{len(failures)} entr{'y' if len(failures) == 1 else 'ies'} would fail compiled")
        return 1 if failures else 0
    finally:
        checking.runtime = mistakes.runtime = runtime
        checking._CallWatch._hook_runs = hook_runs


if __name__ == "__main__":
    sys.exit(main())

"""``gpulab grade``: execute notebooks headless and grade each exercise from the course's
own tests.

What is graded comes from the released tests shipped in the package
(``gpulab/data/grading/NN_topic.json``, written by ``gpulab generate`` from
``solutions/``), not from the submitted notebook:

* every test cell is rebuilt by its ``grade_id`` from the released source, hidden tests
  included, whatever the notebook's copy says; the maximum points come from the
  release too, so a deleted test cell scores 0 out of its points;
* each test runs through :func:`gpulab.harness.integrity.run_graded_cell`: checks the
  notebook replaced are put back, the course's imports are bound afresh, kernel
  exercises must launch a kernel of the learner's own, and changing a check while it
  runs fails the exercise;
* every cell has a timeout (default 300 s, per exercise ``metadata.gpulab.timeout``):
  a hang is interrupted, a dead or stuck kernel is restarted and the cells that ran
  before are run again, and grading goes on; the exercise that hung or crashed fails
  with "timed out after N s" or "the kernel died: ...";
* the table and the JSON are written whatever happens, also when grading itself stops
  on an exception.

Errors in ungraded cells are reported too: a notebook should never break outside its
exercises.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..harness.notebook import STUB_ERRORS
from .authoring import find_released, load_released, nbgrader_meta
from .progress import record as record_progress

DEFAULT_TIMEOUT_S = 300
# After a timeout: how long an interrupted kernel may take to answer again before it
# is restarted.
RECOVER_S = 20


@dataclass
class CellResult:
    index: int | None       # position among all cells (None: the cell is missing)
    grade_id: str | None
    points: float
    graded: bool
    error: str | None       # exception name (or "Timeout", "DeadKernel", "Missing"); None: ran cleanly
    message: str = ""
    output: str = ""        # what the cell printed (graded cells)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None

    @property
    def score(self) -> float:
        return self.points if self.passed and self.graded else 0.0

    @property
    def is_stub(self) -> bool:
        return self.error is not None and (self.error in STUB_ERRORS or "TODO (" in self.message)


@dataclass
class NotebookResult:
    path: str
    released: str | None = None        # the released tests used, None: the notebook's own cells
    cells: list[CellResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exercises(self) -> list[CellResult]:
        return [c for c in self.cells if c.graded]

    @property
    def other_errors(self) -> list[CellResult]:
        return [c for c in self.cells if not c.graded and c.error]

    @property
    def score(self) -> tuple[float, float]:
        ex = self.exercises
        return sum(c.score for c in ex), sum(c.points for c in ex)


@dataclass
class _Outcome:
    status: str              # "ok", "error", "timeout", "died"
    ename: str | None = None
    evalue: str = ""
    stdout: str = ""
    seconds: float = 0.0


class _Kernel:
    """One Jupyter kernel driven cell by cell through nbclient, restartable."""

    def __init__(self, cwd: Path, env: dict):
        import nbformat
        import nbclient
        self._nbformat = nbformat
        self._nbclient = nbclient
        self.cwd = cwd
        self.env = env
        self.client = None

    def start(self) -> None:
        nb = self._nbformat.v4.new_notebook()
        nb.cells.append(self._nbformat.v4.new_code_cell(""))   # the slot each run uses
        self.client = self._nbclient.NotebookClient(
            nb, timeout=DEFAULT_TIMEOUT_S, kernel_name="python3", allow_errors=True,
            interrupt_on_timeout=False, resources={"metadata": {"path": str(self.cwd)}})
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel(env=self.env)
        self.client.start_new_kernel_client()

    def stop(self) -> None:
        if self.client is None:
            return
        from nbclient.util import run_sync
        km = self.client.km
        try:
            if self.client.kc is not None:
                self.client.kc.stop_channels()
            if km is not None and km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
        except Exception:
            pass
        try:
            if km is not None:
                run_sync(km.cleanup_resources)()
        except Exception:
            pass
        self.client = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def exit_detail(self) -> str:
        try:
            proc = getattr(self.client.km.provisioner, "process", None)
            code = proc.poll() if proc is not None else None
        except Exception:
            code = None
        if code is None:
            return "the process stopped answering"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def run(self, source: str, timeout: float) -> _Outcome:
        from nbclient.exceptions import CellTimeoutError, DeadKernelError
        cell = self._nbformat.v4.new_code_cell(source)
        self.client.nb.cells[0] = cell
        self.client.timeout = int(timeout)
        t0 = time.monotonic()
        try:
            self.client.execute_cell(cell, 0, store_history=False)
        except CellTimeoutError:
            return _Outcome("timeout", "Timeout", f"timed out after {timeout:g} s",
                            seconds=time.monotonic() - t0)
        except DeadKernelError:
            return _Outcome("died", "DeadKernel", f"the kernel died: {self.exit_detail()}",
                            seconds=time.monotonic() - t0)
        dt = time.monotonic() - t0
        text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        err = next((o for o in cell.outputs if o.get("output_type") == "error"), None)
        if err is not None:
            return _Outcome("error", err.get("ename"), (err.get("evalue") or "").strip(), text, dt)
        return _Outcome("ok", stdout=text, seconds=dt)

    def recover(self) -> bool:
        """After a timeout: interrupt, and check the kernel answers again."""
        from nbclient.util import run_sync
        try:
            run_sync(self.client.km.interrupt_kernel)()
        except Exception:
            return False
        probe = self.run("pass", RECOVER_S)
        return probe.status == "ok"


def _kernel_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _prelude(imports: list[str]) -> str:
    return (f'__import__("gpulab.harness.integrity", fromlist=["protect"]).protect({imports!r})')


def _graded_source(test: dict, imports: list[str]) -> str:
    return (f'__import__("gpulab.harness.integrity", fromlist=["run_graded_cell"]).run_graded_cell('
            f'{test["grade_id"]!r}, {test["source"]!r}, {imports!r})')


def grade_notebook(path: str | Path, released: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                   env: dict | None = None, use_released: bool = True) -> NotebookResult:
    """Execute one notebook in its own folder and grade it (see the module docstring).

    ``released``: the released tests (default: those shipped for the notebook's name, or
    whose grade ids match); ``use_released=False`` grades the notebook's own test cells
    as they are (for authors trying a notebook that has no release yet)."""
    import nbformat

    path = Path(path)
    result = NotebookResult(str(path))
    nb = nbformat.read(path, as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    by_id: dict[str, int] = {}
    for i, c in code:
        gid = nbgrader_meta(c).get("grade_id")
        if gid and gid not in by_id:
            by_id[gid] = i
    if use_released and released is None:
        released = load_released(path.name) or find_released(set(by_id))
    if use_released and released is None:
        result.notes.append("no released tests for this notebook: graded with its own test cells, "
                            "which the notebook could have changed")
    if released is not None:
        result.released = released["notebook"]
        tests = {t["grade_id"]: t for t in released["tests"]}
        imports = released["imports"]
    else:
        tests = {nbgrader_meta(c)["grade_id"]: {"grade_id": nbgrader_meta(c)["grade_id"],
                                               "points": float(nbgrader_meta(c).get("points", 0)),
                                               "source": c.source, "timeout": None}
                 for _, c in code if nbgrader_meta(c).get("grade")}
        imports = []
    test_at = {by_id[gid]: t for gid, t in tests.items() if gid in by_id}

    # Results for every released test, in release order; missing cells score 0 now.
    graded: dict[str, CellResult] = {}
    for gid, t in tests.items():
        graded[gid] = CellResult(index=by_id.get(gid), grade_id=gid, points=float(t["points"]), graded=True,
                                 error=None if gid in by_id else "Missing",
                                 message="" if gid in by_id else
                                 "this test cell is not in the notebook (deleted, or its grade_id "
                                 "changed): 0 points")
    others: list[CellResult] = []
    result.cells = list(graded.values())      # so a crash below still reports every exercise
    pending = {gid for gid in tests if gid in by_id}

    kernel = _Kernel(path.parent, {**_kernel_env(), **(env or {})})
    replay: list[int] = []      # ungraded cells that ran cleanly: re-run after a restart
    try:
        kernel.start()
        kernel.run(_prelude(imports), timeout)
        for i, cell in code:
            test = test_at.get(i)
            limit = float((test or {}).get("timeout") or timeout)
            source = _graded_source(test, imports) if test is not None and released is not None else (
                test["source"] if test is not None else cell.source)
            if not source.strip():
                continue
            out = kernel.run(source, limit)
            if test is not None:
                r = graded[test["grade_id"]]
                r.error = out.ename if out.status != "ok" else None
                r.message, r.output, r.seconds = out.evalue, out.stdout, out.seconds
                pending.discard(test["grade_id"])
            else:
                if out.status == "ok":
                    replay.append(i)
                else:
                    others.append(CellResult(index=i, grade_id=nbgrader_meta(cell).get("grade_id"), points=0,
                                             graded=False, error=out.ename, message=out.evalue))
            if out.status == "timeout" and kernel.recover():
                continue
            if out.status in ("timeout", "died"):
                result.notes.append(f"cell {i}: {out.evalue}; kernel restarted, earlier cells run again")
                kernel.restart()
                kernel.run(_prelude(imports), timeout)
                cells = dict(code)
                for j in replay:
                    again = kernel.run(cells[j].source, timeout)
                    if again.status in ("timeout", "died"):
                        kernel.restart()
                        kernel.run(_prelude(imports), timeout)
    except BaseException as e:
        for gid in pending:
            r = graded[gid]
            if r.error is None:
                r.error = "GradingStopped"
                r.message = f"grading stopped before this test ran: {type(e).__name__}: {e}"
        result.notes.append(f"grading stopped: {type(e).__name__}: {e}")
        if not isinstance(e, Exception):      # Ctrl-C: the caller still reports this result
            e.gpulab_partial_result = result
            raise
    finally:
        kernel.stop()
        result.cells = list(graded.values()) + others
    return result


# Kept for callers of the old name: grade with the released tests.
execute = grade_notebook


def table(results: list[NotebookResult]) -> str:
    rows = []
    for r in results:
        got, total = r.score
        src = f" (tests from the release of {r.released})" if r.released else ""
        rows.append(f"{Path(r.path).name}: {got:g}/{total:g} points{src}")
        for c in r.exercises:
            status = "passed" if c.passed else {"Missing": "MISSING", "Timeout": "TIMEOUT",
                                                "DeadKernel": "DIED"}.get(c.error, "FAILED")
            line = f"  {status:7} {c.grade_id:32} {c.score:g}/{c.points:g} pt"
            if not c.passed:
                diag = c.message.split("\n")
                line += f"  {c.error}: " + diag[0][:200]
                line += "".join(f"\n{'':45}{d[:200]}" for d in diag[1:8])
            rows.append(line)
        for c in r.other_errors:
            first = c.message.splitlines()[0][:160] if c.message else ""
            rows.append(f"  ERROR   ungraded cell {c.index}: {c.error}: {first}")
        for n in r.notes:
            rows.append(f"  note: {n}")
    return "\n".join(rows)


def to_json(results: list[NotebookResult]) -> list[dict]:
    return [{"notebook": r.path, "released": r.released, "score": r.score[0], "max_score": r.score[1],
             "notes": r.notes,
             "cells": [asdict(c) | {"passed": c.passed, "score": c.score} for c in r.cells
                       if c.graded or c.error]}
            for r in results]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab grade", description="Execute notebooks and grade their exercises "
                                "with the course's released tests.")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--json", default="grades.json", help="where to write the results (default grades.json)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds per cell (default {DEFAULT_TIMEOUT_S}; an exercise may set its own)")
    p.add_argument("--tests", help="released tests (JSON) to use instead of the shipped ones")
    p.add_argument("--own-tests", action="store_true",
                   help="grade with the notebook's own test cells (authors: a notebook without a release)")
    a = p.parse_args(argv)
    results: list[NotebookResult] = []
    stopped = None
    try:
        for nb in a.notebooks:
            released = load_released(a.tests) if a.tests else None
            try:
                results.append(grade_notebook(nb, released=released, timeout=a.timeout,
                                              use_released=not a.own_tests))
            except Exception as e:   # this notebook could not be graded: report it, go on
                failed = NotebookResult(nb, notes=[f"could not be graded: {type(e).__name__}: {e}"])
                results.append(failed)
    except BaseException as e:      # Ctrl-C: still write what we have
        partial = getattr(e, "gpulab_partial_result", None)
        if partial is not None:
            results.append(partial)
        stopped = e
    finally:
        print(table(results))
        Path(a.json).write_text(json.dumps(to_json(results), indent=2))
        print(f"results written to {a.json}")
        if results:
            print(f"progress recorded in {record_progress(to_json(results))} (see `gpulab progress`)")
    if stopped is not None:
        raise stopped
    failed = any(not c.passed for r in results for c in r.exercises) or \
        any(r.other_errors for r in results) or any(not r.cells for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

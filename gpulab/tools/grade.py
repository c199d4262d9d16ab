"""``gpulab grade``: run notebooks headless and report each graded exercise.

Every cell runs (nbclient, ``allow_errors``), so one broken exercise does not hide
the others. A grade cell (``metadata.nbgrader.grade``) passes when it raises
nothing; its diagnosis is the error it raised (gpulab's checks explain what is
wrong). Errors in ungraded cells are reported too: a notebook should never break
outside its exercises.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..harness.notebook import STUB_ERRORS
from .authoring import nbgrader_meta
from .progress import record as record_progress


@dataclass
class CellResult:
    index: int              # position among all cells
    grade_id: str | None
    points: float
    graded: bool
    error: str | None       # exception name, None when the cell ran cleanly
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.error is None

    @property
    def is_stub(self) -> bool:
        return self.error is not None and (self.error in STUB_ERRORS or "TODO (" in self.message)


@dataclass
class NotebookResult:
    path: str
    cells: list[CellResult] = field(default_factory=list)

    @property
    def exercises(self) -> list[CellResult]:
        return [c for c in self.cells if c.graded]

    @property
    def other_errors(self) -> list[CellResult]:
        return [c for c in self.cells if not c.graded and c.error]

    @property
    def score(self) -> tuple[float, float]:
        ex = self.exercises
        return sum(c.points for c in ex if c.passed), sum(c.points for c in ex)


def _first_line_of_error(out: dict) -> str:
    value = out.get("evalue", "")
    return value.strip()


def execute(path: str | Path, timeout: int = 1200, env: dict | None = None) -> NotebookResult:
    """Execute one notebook in its own folder; record every cell's error, if any."""
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    old_env = dict(os.environ)
    os.environ.update(env or {})
    # Make the package importable from the kernel even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = root + (os.pathsep + old_env["PYTHONPATH"] if old_env.get("PYTHONPATH") else "")
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                         allow_errors=True,
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    result = NotebookResult(str(path))
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = nbgrader_meta(cell)
        err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        result.cells.append(CellResult(
            index=i, grade_id=meta.get("grade_id"), points=float(meta.get("points", 0)),
            graded=bool(meta.get("grade")), error=err["ename"] if err else None,
            message=_first_line_of_error(err) if err else ""))
    return result


def table(results: list[NotebookResult]) -> str:
    rows = []
    for r in results:
        got, total = r.score
        rows.append(f"{Path(r.path).name}: {got:g}/{total:g} points")
        for c in r.exercises:
            status = "passed" if c.passed else "FAILED"
            line = f"  {status:7} {c.grade_id:32} {c.points:g} pt"
            if not c.passed:
                diag = c.message.split("\n")
                line += f"  {c.error}: " + diag[0][:160]
                line += "".join(f"\n{'':45}{d[:160]}" for d in diag[1:8])
            rows.append(line)
        for c in r.other_errors:
            rows.append(f"  ERROR   ungraded cell {c.index}: {c.error}: {c.message.splitlines()[0][:160] if c.message else ''}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab grade", description="Execute notebooks and grade their exercises.")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--json", default="grades.json", help="where to write the results (default grades.json)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    a = p.parse_args(argv)
    results = [execute(nb, timeout=a.timeout) for nb in a.notebooks]
    print(table(results))
    payload = [{"notebook": r.path, "score": r.score[0], "max_score": r.score[1],
                "cells": [asdict(c) | {"passed": c.passed} for c in r.cells if c.graded or c.error]}
               for r in results]
    Path(a.json).write_text(json.dumps(payload, indent=2))
    print(f"results written to {a.json}")
    print(f"progress recorded in {record_progress(payload)} (see `gpulab progress`)")
    failed = any(not c.passed for r in results for c in r.exercises) or any(r.other_errors for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

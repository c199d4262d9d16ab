"""``gpulab progress``: every exercise of the course with its status and points.

The course's exercises come from ``gpulab/data/exercises.json``, written by ``gpulab
generate`` from the solutions' graded cells (so the list ships with the package, in
Colab too). Their status comes from the last grading of each notebook: ``gpulab grade``
records its results in ``~/.gpulab/progress.json`` (``GPULAB_HOME`` moves that folder),
one entry per notebook, replaced by each new grading of that notebook.

Statuses: ``passed``, ``failed`` (the check found a mistake or the code raised),
``not started`` (the exercise's placeholder is still there) and ``not graded`` (no
grading of that notebook yet).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

from ..harness.notebook import STUB_ERRORS

EXERCISES = Path(__file__).resolve().parents[1] / "data" / "exercises.json"


def home() -> Path:
    return Path(os.environ.get("GPULAB_HOME") or Path.home() / ".gpulab")


def progress_file() -> Path:
    return home() / "progress.json"


# -- the course's exercises (written by `gpulab generate`) -------------------------------------
def load_index() -> list[dict]:
    """[{notebook, title, exercises: [{grade_id, points}]}] (see gpulab.tools.authoring)."""
    return json.loads(EXERCISES.read_text()) if EXERCISES.exists() else []


# -- results of gradings ------------------------------------------------------------------------
def status_of(cell: dict) -> str:
    if cell.get("passed"):
        return "passed"
    if cell.get("error") in STUB_ERRORS or "TODO (" in (cell.get("message") or ""):
        return "not started"
    return "failed"


def record(payload: list[dict], where: Path | None = None) -> Path:
    """Store ``gpulab grade``'s results (its JSON payload), one entry per notebook."""
    where = where or progress_file()
    data = json.loads(where.read_text()) if where.exists() else {}
    now = _dt.datetime.now().isoformat(timespec="seconds")
    for nb in payload:
        data[Path(nb["notebook"]).name] = {
            "graded_at": now, "path": str(nb["notebook"]),
            "exercises": {c["grade_id"]: {"status": status_of(c), "points": c["points"],
                                          "message": (c.get("message") or "").split("\n")[0][:200]}
                          for c in nb["cells"] if c.get("graded")}}
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(data, indent=1) + "\n")
    return where


def course_progress(index: list[dict] | None = None, results: dict | None = None) -> list[dict]:
    """Every exercise of the course: notebook, grade_id, points, status, earned."""
    index = load_index() if index is None else index
    if results is None:
        path = progress_file()
        results = json.loads(path.read_text()) if path.exists() else {}
    rows = []
    for nb in index:
        graded = results.get(nb["notebook"])
        for ex in nb["exercises"]:
            got = (graded or {}).get("exercises", {}).get(ex["grade_id"])
            status = got["status"] if got else "not graded"
            rows.append({"notebook": nb["notebook"], "title": nb["title"], "grade_id": ex["grade_id"],
                         "points": ex["points"], "status": status,
                         "earned": ex["points"] if status == "passed" else 0,
                         "graded_at": (graded or {}).get("graded_at")})
    return rows


MARK = {"passed": "✔", "failed": "✗", "not started": "·", "not graded": " "}


def format_progress(rows: list[dict], highlight: str | None = None) -> str:
    """A text table, one line per exercise, at most 88 columns."""
    if not rows:
        return "No exercises found (run `gpulab generate` to write gpulab/data/exercises.json)."
    lines = []
    for name in dict.fromkeys(r["notebook"] for r in rows):
        mine = [r for r in rows if r["notebook"] == name]
        got, total = sum(r["earned"] for r in mine), sum(r["points"] for r in mine)
        when = mine[0]["graded_at"]
        star = "▶ " if highlight and name.startswith(highlight) else ""
        title = mine[0]["title"].split(":")[0][:48]
        lines.append(f"{star}{title}: {got:g}/{total:g} points"
                     + (f" (graded {when.replace('T', ' ')[:16]})" if when else " (not graded yet)"))
        for r in mine:
            lines.append(f"  {MARK[r['status']]} {r['grade_id']:34} {r['points']:>3g} pt  {r['status']}")
    got = sum(r["earned"] for r in rows)
    total = sum(r["points"] for r in rows)
    done = sum(r["status"] == "passed" for r in rows)
    lines.append(f"Course: {got:g}/{total:g} points, {done} of {len(rows)} exercises passed. "
                 "Grade a notebook with `gpulab grade notebooks/NN_name.ipynb`.")
    return "\n".join(line[:88] for line in lines)


def show(notebook: str | None = None) -> None:
    """Notebook helper (the last cell of every notebook): print the course's progress,
    marking the notebook whose name starts with ``notebook`` (e.g. "04")."""
    print(format_progress(course_progress(), highlight=notebook))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab progress", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = p.parse_args(argv)
    rows = course_progress()
    print(json.dumps(rows, indent=1) if a.json else format_progress(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

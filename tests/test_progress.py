"""`gpulab progress`: every exercise of the course, with its status from the last
grading of its notebook (recorded by `gpulab grade` under GPULAB_HOME)."""
import json

import nbformat

from gpulab.tools import authoring, grade, progress


def test_the_index_lists_every_graded_cell_of_every_solution():
    index = {nb["notebook"]: nb for nb in progress.load_index()}
    for path in sorted((authoring.ROOT / "solutions").glob("*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        graded = [(authoring.nbgrader_meta(c)["grade_id"], authoring.nbgrader_meta(c)["points"])
                  for c in cells if authoring.nbgrader_meta(c).get("grade")]
        assert [(e["grade_id"], e["points"]) for e in index[path.name]["exercises"]] == graded


def payload(notebook, cells):
    return [{"notebook": f"/x/notebooks/{notebook}", "cells": cells}]


def test_statuses_come_from_the_last_grading_of_each_notebook(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAB_HOME", str(tmp_path))
    index = [{"notebook": "00_a.ipynb", "title": "00 — A: first", "exercises": [
                 {"grade_id": "check-1", "points": 2}, {"grade_id": "check-2", "points": 3},
                 {"grade_id": "check-3", "points": 1}]},
             {"notebook": "01_b.ipynb", "title": "01 — B", "exercises": [{"grade_id": "check-b", "points": 4}]}]
    cells = [{"grade_id": "check-1", "points": 2, "graded": True, "passed": True, "error": None, "message": ""},
             {"grade_id": "check-2", "points": 3, "graded": True, "passed": False, "error": "CheckFailure",
              "message": "softmax: 3 of 8 cases failed"},
             {"grade_id": "check-3", "points": 1, "graded": True, "passed": False, "error": "InterpreterError",
              "message": "AssertionError('TODO (ex3): write this part of the kernel')"},
             {"grade_id": None, "points": 0, "graded": False, "passed": False, "error": "ValueError", "message": ""}]
    path = progress.record(payload("00_a.ipynb", cells))
    assert path == tmp_path / "progress.json"
    rows = progress.course_progress(index)
    assert [(r["grade_id"], r["status"], r["earned"]) for r in rows] == [
        ("check-1", "passed", 2), ("check-2", "failed", 0), ("check-3", "not started", 0),
        ("check-b", "not graded", 0)]
    text = progress.format_progress(rows, highlight="00")
    assert "▶ 00 — A: 2/6 points (graded " in text and "01 — B: 0/4 points (not graded yet)" in text
    assert "Course: 2/10 points, 1 of 4 exercises passed." in text
    assert all(len(line) <= 88 for line in text.splitlines())
    # a new grading of the same notebook replaces the old one
    cells[1] = {**cells[1], "passed": True, "error": None}
    progress.record(payload("00_a.ipynb", cells))
    assert [r["status"] for r in progress.course_progress(index)][:2] == ["passed", "passed"]
    assert set(json.loads(path.read_text())) == {"00_a.ipynb"}


def test_gpulab_grade_records_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAB_HOME", str(tmp_path / "home"))
    nb = authoring.from_percent(
        "# %%\nimport gpulab\n\ngpulab.setup()\n"
        "# %% grade id=check-ok points=2\nassert 1 + 1 == 2\n"
        "# %% grade id=check-todo points=1\nraise NotImplementedError('TODO (ex-todo): write this cell')\n")
    path = tmp_path / "00_tiny.ipynb"
    nbformat.write(nb, path)
    assert grade.main([str(path), "--json", str(tmp_path / "grades.json")]) == 1
    saved = json.loads((tmp_path / "home" / "progress.json").read_text())["00_tiny.ipynb"]
    assert {k: v["status"] for k, v in saved["exercises"].items()} == \
        {"check-ok": "passed", "check-todo": "not started"}

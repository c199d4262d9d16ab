"""Learner notebooks fail exactly at their graded cells; `gpulab grade` reports it.

(The solutions themselves run under nbval: `solutions/` is in pytest's testpaths;
tests/test_grade.py tries to fool the grader.)"""
from pathlib import Path

import nbformat
import pytest

from gpulab.tools import grade
from gpulab.tools.authoring import nbgrader_meta

ROOT = Path(__file__).resolve().parent.parent
LEARNER = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_solution_has_a_learner_notebook():
    assert LEARNER, "no learner notebooks: run `gpulab generate`"
    assert {p.name for p in LEARNER} == {p.name for p in (ROOT / "solutions").glob("*.ipynb")}


def _fails_only_at_graded_cells(path):
    nb = nbformat.read(path, as_version=4)
    graded = {nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c).get("grade")}
    assert graded, f"{path.name} has no graded cells"
    result = grade.grade_notebook(path)
    failed = {c.grade_id: c for c in result.exercises if not c.passed}
    assert set(failed) == graded, f"graded cells that did not fail: {graded - set(failed)}"
    for gid, cell in failed.items():
        assert cell.is_stub, f"{gid} failed with {cell.error}: {cell.message[:300]}, not the stub's error"
    others = [(c.index, c.error, c.message[:300]) for c in result.other_errors]
    assert not others, f"ungraded cells raised: {others}"


# One test class per learner notebook, so pytest-xdist (--dist loadscope) spreads them
# over workers.
for _path in LEARNER:
    _name = "TestLearner_" + _path.stem.replace("-", "_")
    globals()[_name] = type(_name, (), {
        "test_untouched_notebook_fails_only_at_graded_cells":
            (lambda self, p=_path: _fails_only_at_graded_cells(p))})

"""`gpulab grade` cannot be fooled and never loses a report: tampering, shortcuts, hidden
tests, hangs and crashes, on copies of notebook 00 (each run starts a real kernel)."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gpulab.tools import grade
from gpulab.tools.authoring import load_released, nbgrader_meta
from helpers import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
NB00 = "00_triton_basics.ipynb"
ENV = subprocess_env(ROOT)


def _variant(tmp_path, base: str, edits: dict, insert_after_setup: str | None = None,
             delete: tuple = ()) -> Path:
    """A copy of notebook 00 (``base``: "solutions" or "notebooks") with cells replaced by
    grade_id, an extra cell after the setup cell, and cells deleted."""
    nb = nbformat.read(ROOT / base / NB00, as_version=4)
    cells = []
    for cell in nb.cells:
        gid = nbgrader_meta(cell).get("grade_id")
        if gid in delete:
            continue
        if gid in edits:
            cell.source = edits[gid]
        cells.append(cell)
        if insert_after_setup and "gpulab.setup()" in cell.source:
            cells.append(nbformat.v4.new_code_cell(insert_after_setup))
    nb.cells = cells
    out = tmp_path / NB00        # same file name: graded with 00's released tests
    nbformat.write(nb, out)
    return out


def _by_id(result):
    return {c.grade_id: c for c in result.exercises}


def test_released_tests_are_shipped_for_every_notebook():
    for sol in sorted((ROOT / "solutions").glob("*.ipynb")):
        data = load_released(sol.name)
        assert data is not None, f"no released tests for {sol.name}: run `gpulab generate`"
        nb = nbformat.read(sol, as_version=4)
        ids = [nbgrader_meta(c)["grade_id"] for c in nb.cells if nbgrader_meta(c).get("grade")]
        assert [t["grade_id"] for t in data["tests"]] == ids
    hidden = load_released(NB00)["tests"][0]["source"]
    assert "### BEGIN HIDDEN TESTS" in hidden     # hidden tests ship with the release


def test_tampering_does_not_change_the_grade(tmp_path):
    """Untouched stubs; `gpulab.check` replaced; one test edited to `pass`; one deleted."""
    path = _variant(tmp_path, "notebooks", edits={"check-add": "pass"}, delete=("check-softmax-kernel",),
                    insert_after_setup="gpulab.check = lambda *a, **k: None\n"
                                       "gpulab.get_spec('softmax').cases['cpu'].clear()")
    result = grade.grade_notebook(path, timeout=120)
    assert result.score == (0, 8), grade.table([result])
    ex = _by_id(result)
    assert ex["check-add"].is_stub and ex["check-softmax-torch"].error == "NotImplementedError"
    assert ex["check-softmax-kernel"].error == "Missing" and "0 points" in ex["check-softmax-kernel"].message
    assert "had replaced gpulab.check" in ex["check-add"].output


def test_shortcuts_and_hidden_tests(tmp_path):
    """A fixed grid that covers only the visible sizes fails the hidden test; the kernel
    exercise answered with gpulab's own kernel or with PyTorch fails with a message that
    says what is asked; the PyTorch exercise done right passes."""
    fixed_grid = ('BLOCK = 1024\n\n\ndef add(x, y, out):\n'
                  '    add_kernel[(4,)](x, y, out, out.numel(), BLOCK=BLOCK)   # 4 blocks: enough for the visible cases\n')
    nb = nbformat.read(ROOT / "solutions" / NB00, as_version=4)
    add_cell = next(c for c in nb.cells if nbgrader_meta(c).get("grade_id") == "ex1-add-kernel")
    kernel_part = add_cell.source.split("BLOCK = 1024")[0]
    path = _variant(tmp_path, "solutions", edits={
        "ex1-add-kernel": kernel_part + fixed_grid,
        "ex3-softmax-kernel": "softmax = gpulab.basics.softmax_into",
    })
    result = grade.grade_notebook(path, timeout=120)
    ex = _by_id(result)
    assert ex["check-softmax-torch"].passed
    # a grid sized for the listed cases fails: now already on the visible check's fresh random size
    assert not ex["check-add"].passed and ("many blocks + 1" in ex["check-add"].message
                                           or "random size" in ex["check-add"].message)
    assert "never written" in ex["check-add"].message
    assert "asks for a Triton kernel of your own" in ex["check-softmax-kernel"].message
    assert "gpulab.basics.softmax_kernel" in ex["check-softmax-kernel"].message
    assert result.score == (3, 8)   # the row-sum exercise (untouched) passes too

    torch_only = _variant(tmp_path, "solutions", edits={
        "ex3-softmax-kernel": "def softmax(x, y):\n    y.copy_(torch.softmax(x.float(), -1))",
        "ex1-add-kernel": add_cell.source.replace("add_kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)",
                                                  "torch.add(x, y, out=out)")})
    ex = _by_id(grade.grade_notebook(torch_only, timeout=120))
    for gid in ("check-add", "check-softmax-kernel"):
        assert "launched no Triton kernel at all" in ex[gid].message, ex[gid].message


def test_a_hang_and_a_crash_fail_their_exercise_and_grading_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(grade, "RECOVER_S", 5)
    nb = nbformat.read(ROOT / "solutions" / NB00, as_version=4)
    add_cell = next(c for c in nb.cells if nbgrader_meta(c).get("grade_id") == "ex1-add-kernel")
    hang = add_cell.source + ("\n\nimport signal as _signal\n_real_add = add\n\n\ndef add(x, y, out):\n"
                              "    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)   # not even an interrupt stops it\n"
                              "    while True:\n        pass\n")
    crash = "import os\n\n\ndef softmax_torch(x):\n    os._exit(3)\n"
    path = _variant(tmp_path, "solutions", edits={"ex1-add-kernel": hang, "ex2-softmax-torch": crash})
    result = grade.grade_notebook(path, timeout=8)
    ex = _by_id(result)
    assert ex["check-add"].error == "Timeout" and "timed out after 8 s" in ex["check-add"].message
    assert ex["check-softmax-torch"].error == "DeadKernel"
    assert "the kernel died: exit code 3" in ex["check-softmax-torch"].message
    assert ex["check-softmax-kernel"].passed, grade.table([result])    # graded after two restarts
    assert result.score == (5, 8)
    assert sum("kernel restarted" in n for n in result.notes) == 2


def test_grade_command_writes_table_and_json(tmp_path):
    out = tmp_path / "grades.json"
    sol = subprocess.run([sys.executable, "-m", "gpulab", "grade", str(ROOT / "solutions" / NB00),
                          "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, env=ENV)
    assert sol.returncode == 0, sol.stdout + sol.stderr
    data = json.loads(out.read_text())
    assert data[0]["score"] == data[0]["max_score"] == 8
    assert "passed  check-add" in sol.stdout
    # a notebook that cannot even be read is reported, and the JSON is still written
    bad = tmp_path / "broken.ipynb"
    bad.write_text("{not json")
    res = subprocess.run([sys.executable, "-m", "gpulab", "grade", str(bad), "--json", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, env=ENV)
    assert res.returncode == 1 and "could not be graded" in res.stdout
    assert json.loads(out.read_text())[0]["notes"]

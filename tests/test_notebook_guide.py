"""Each notebook opens with what to do first and how long it takes: prerequisites from
its metadata (earlier notebooks that exist), a working-time estimate labelled as one, and
run times only where they were measured (gpulab/data/notebook_times.json)."""
import re
from pathlib import Path

import nbformat

from gpulab.tools import authoring

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_every_notebook_opens_with_its_guide_line():
    names = {p.name[:2] for p in SOLUTIONS}
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        prereq = nb.metadata["gpulab"]["prerequisites"]
        assert all(p in names and p < path.name[:2] for p in prereq), (path.name, prereq)
        title = nb.cells[0].source
        line = next(l for l in title.splitlines() if l.startswith(authoring.GUIDE_PREFIX))
        assert "(an estimate" in line and re.search(r"about (\d+ minutes|\d h \d\d min) ", line), line
        for p in prereq:
            assert p in line.split("Working time")[0], (path.name, line)


def _nb(markdown_words: int, solution_lines: int):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 99 — title\n\n" + "word " * markdown_words),
                nbformat.v4.new_code_cell("x = 1\n" + f"{authoring.BEGIN}\n" + "y = 2\n" * solution_lines
                                          + f"{authoring.END}\n"),
                nbformat.v4.new_code_cell("check()")]
    nb.cells[1].metadata["nbgrader"] = {"solution": True, "grade_id": "ex1"}
    nb.cells[2].metadata["nbgrader"] = {"grade": True, "grade_id": "check-1", "points": 1}
    return nb


def test_working_time_estimate_grows_with_reading_and_writing():
    assert authoring.working_minutes(_nb(1200, 10)) == 30     # 10 + ~1 + 3 + 15, rounded to 5
    assert authoring.working_minutes(_nb(1200, 30)) > authoring.working_minutes(_nb(1200, 10))


def test_guide_line_states_only_measured_run_times():
    nb = _nb(100, 2)
    nb.metadata["gpulab"] = {"prerequisites": ["00", "01"]}
    times = {"cpu_ci": {"machine": "2 CPU cores", "date": "2026-11-30", "seconds": {"99_x.ipynb": 12.3}}}
    line = authoring.guide_line(nb, "99_x.ipynb", times)
    assert "Prerequisites: notebooks 00 and 01." in line
    assert "Running every cell: on a CPU (2 CPU cores, 2026-11-30) 12 s with demos shortened (`CI=true`); " \
           "on a GPU not measured yet." in line
    assert authoring.fill_guide(nb, "99_x.ipynb", times)
    assert not authoring.fill_guide(nb, "99_x.ipynb", times)          # idempotent
    assert nb.cells[0].source.count(authoring.GUIDE_PREFIX) == 1
    assert "Prerequisites: none." in authoring.guide_line(_nb(100, 2), "99_x.ipynb", {})


def test_numbered_sections_run_without_gaps():
    # a section dropped or merged must not leave "## 3." followed by "## 5.": learners
    # (and the text's own "see section 4") rely on the numbers
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        numbers = [int(m.group(1)) for cell in nb.cells if cell.cell_type == "markdown"
                   for m in re.finditer(r"^## (\d+)\.", cell.source, re.M)]
        assert numbers == list(range(1, len(numbers) + 1)), (path.name, numbers)

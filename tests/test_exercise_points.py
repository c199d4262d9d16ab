"""Every exercise a solution notebook announces matches what it grades: each markdown
header "**Exercise N (k points)**" is followed by exactly one grade cell, worth k points
in its nbgrader metadata, before the next header; exercises are numbered 1, 2, 3...; no
grade cell stands outside an exercise. One test per notebook."""
import re
from pathlib import Path

import nbformat
import pytest

from gpulab.tools.authoring import nbgrader_meta

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
HEADER = re.compile(r"Exercise\s+(\d+)\s*\((\d+)\s+points?\)")


def exercise_problems(nb) -> list[str]:
    """What disagrees between a notebook's exercise headers and its grade cells."""
    problems, exercises, current = [], [], None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for number, points in HEADER.findall(cell.source):
                current = {"number": int(number), "points": int(points), "cell": index, "grades": []}
                exercises.append(current)
        meta = nbgrader_meta(cell)
        if meta.get("grade"):
            if current is None:
                problems.append(f"grade cell {index} ({meta.get('grade_id')}) comes before any exercise header")
            else:
                current["grades"].append((meta.get("grade_id"), meta.get("points")))
    for expected, ex in enumerate(exercises, start=1):
        where = f"Exercise {ex['number']} (cell {ex['cell']})"
        if ex["number"] != expected:
            problems.append(f"{where} should be numbered {expected}")
        if len(ex["grades"]) != 1:
            problems.append(f"{where} is followed by {len(ex['grades'])} grade cells "
                            f"{[g for g, _ in ex['grades']]}: give each graded piece its own header")
        total = sum(p or 0 for _, p in ex["grades"])
        if ex["grades"] and total != ex["points"]:
            problems.append(f"{where} says {ex['points']} point(s), its grade cell metadata gives "
                            f"{', '.join(f'{g}: {p}' for g, p in ex['grades'])}")
    if not exercises:
        problems.append("no exercise headers")
    return problems


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_exercise_headers_match_grade_cells(path):
    problems = exercise_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


def test_the_points_test_catches_a_mismatch():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("**Exercise 1 (4 points).** Do it."),
                nbformat.v4.new_code_cell("check()"),
                nbformat.v4.new_code_cell("check_more()")]
    nb.cells[1].metadata["nbgrader"] = {"grade": True, "grade_id": "a", "points": 3}
    assert any("says 4 point(s)" in p and "a: 3" in p for p in exercise_problems(nb))
    nb.cells[2].metadata["nbgrader"] = {"grade": True, "grade_id": "b", "points": 1}
    assert any("2 grade cells" in p for p in exercise_problems(nb))

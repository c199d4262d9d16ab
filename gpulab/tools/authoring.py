"""Learner notebooks are generated from the solutions, never edited by hand.

``solutions/*.ipynb`` are the single source. They use nbgrader's markers, so the same
files work with nbgrader itself:

* ``### BEGIN SOLUTION`` / ``### END SOLUTION`` in a code cell: the region becomes
  ``# YOUR CODE HERE`` plus a stub at the same indent. In ordinary Python the stub is
  ``raise NotImplementedError("TODO (grade_id): ...")`` (the id lets gpulab name the
  unfinished exercise in its short error message); inside a ``@triton.jit`` function (where ``raise``
  does not compile) it is ``tl.static_assert(False, "TODO: ...")``, which fails both in
  the interpreter and when compiled for a GPU.
* A solution cell (``metadata.nbgrader.solution``) without markers is replaced whole;
  a markdown solution cell becomes ``YOUR ANSWER HERE``.
* ``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``: removed.
* Outputs and execution counts are cleared.

Next to the learner notebooks it writes the released tests,
``gpulab/data/grading/NN_topic.json``: every grade cell's full source (hidden tests
included), its points and optional timeout (``metadata.gpulab.timeout``), and the
imports of the course's own setup cells. ``gpulab grade`` rebuilds each test cell from
them, so instructors can keep ``solutions/`` private and a learner cannot edit, empty or
delete a test to change the grade.
Links are generated too (see :mod:`gpulab.tools.links`): in every solution the setup
cell's first part (the Colab install and ``gpulab.setup()``) is rewritten from
:data:`SETUP_TEMPLATE`, and the Colab/Binder badges under the title are rewritten to
open that notebook's learner version in the course repository; the README's badges
follow the same address. So ``gpulab generate`` also rewrites ``solutions/`` and
``README.md`` when the repository address changed, and ``--check`` reports them.
The title cell also gets a "Before you start" line (:func:`guide_line`): the notebooks to
do first (``metadata.gpulab.prerequisites``), an estimate of the working time, and how
long running every cell took where it was measured (``gpulab/data/notebook_times.json``,
written by ``tools/time_notebooks.py``).

``python -m gpulab.tools.authoring`` (or ``gpulab generate``) rewrites ``notebooks/``;
``--check`` only reports stale or missing files and exits 1 if there are any.
``from-percent SRC.py OUT.ipynb`` builds a solution notebook from a py:percent script
whose cell headers may carry ``solution id=...``, ``grade id=... points=N`` or
``tags=a,b``: handy for writing a new notebook in an editor.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import sys
from pathlib import Path

from .links import GitHubRepo, course_repo
from .progress import EXERCISES


ROOT = Path(__file__).resolve().parents[2]
RELEASED_TESTS = Path(__file__).resolve().parents[1] / "data" / "grading"
NOTEBOOK_TIMES = Path(__file__).resolve().parents[1] / "data" / "notebook_times.json"
RELEASE_FORMAT = 1
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


class AuthoringError(ValueError):
    pass


def nbgrader_meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _jit_def_at(lines: list[str], line_no: int, indent: int) -> bool:
    """Is line ``line_no`` (indented ``indent``) inside a function decorated @triton.jit?"""
    for k in range(line_no - 1, -1, -1):
        text = lines[k]
        stripped = text.lstrip()
        if not stripped:
            continue
        ind = len(text) - len(stripped)
        if ind < indent and stripped.startswith("def "):
            j = k - 1
            while j >= 0 and lines[j].lstrip().startswith("@"):
                if re.search(r"@(triton\.)?jit\b", lines[j]):
                    return True
                j -= 1
            return False
    return False


def stub_code(source: str, grade_id: str) -> str:
    lines = source.split("\n")
    out, i = [], 0
    found = False
    while i < len(lines):
        line = lines[i]
        if line.strip() == BEGIN:
            found = True
            indent = len(line) - len(line.lstrip())
            pad = line[:indent]
            j = i + 1
            while j < len(lines) and lines[j].strip() != END:
                j += 1
            if j == len(lines):
                raise AuthoringError(f"{grade_id}: {BEGIN} without {END}")
            out.append(f"{pad}# YOUR CODE HERE")
            if _jit_def_at(lines, i, indent):
                out.append(f'{pad}tl.static_assert(False, "TODO ({grade_id}): write this part of the kernel")')
            else:
                out.append(f'{pad}raise NotImplementedError("TODO ({grade_id}): write this part")')
            i = j + 1
            continue
        out.append(line)
        i += 1
    if not found:
        return f'# YOUR CODE HERE\nraise NotImplementedError("TODO ({grade_id}): write this cell")'
    return "\n".join(out)


def strip_hidden(source: str) -> str:
    out, hidden = [], False
    for line in source.split("\n"):
        if line.strip() == BEGIN_HIDDEN:
            hidden = True
            continue
        if line.strip() == END_HIDDEN:
            hidden = False
            continue
        if not hidden:
            out.append(line)
    return "\n".join(out)


def validate_solution(nb, name: str) -> None:
    seen = set()
    for n, cell in enumerate(nb.cells):
        meta = nbgrader_meta(cell)
        has_marker = BEGIN in cell.source
        if has_marker and not meta.get("solution"):
            raise AuthoringError(f"{name} cell {n}: has {BEGIN} but metadata.nbgrader.solution is not set")
        if meta.get("solution") or meta.get("grade"):
            gid = meta.get("grade_id")
            if not gid:
                raise AuthoringError(f"{name} cell {n}: nbgrader cell without grade_id")
            if gid in seen:
                raise AuthoringError(f"{name}: grade_id {gid!r} used twice")
            seen.add(gid)
            if meta.get("grade") and "points" not in meta:
                raise AuthoringError(f"{name} cell {n} ({gid}): grade cell without points")


def learner_version(nb) -> "nbformat.NotebookNode":
    nb = copy.deepcopy(nb)
    import nbformat  # noqa: F401  (only the authoring commands need it)
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            if meta.get("solution"):
                cell.source = stub_code(cell.source, meta["grade_id"])
            cell.source = strip_hidden(cell.source)
        elif meta.get("solution"):
            cell.source = "YOUR ANSWER HERE"
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


def top_level_imports(source: str) -> list[str]:
    """The import statements at the top level of a code cell (IPython magics skipped)."""
    lines = [l for l in source.split("\n") if not l.lstrip().startswith(("%", "!"))]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return []
    return [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def released_tests(nb, name: str) -> dict:
    """What ``gpulab grade`` needs from a solution notebook (see the module docstring)."""
    imports, tests, solutions = [], [], []
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code":
            continue
        if meta.get("grade") and not meta.get("solution"):
            tests.append({"grade_id": meta["grade_id"], "points": float(meta["points"]),
                          "source": cell.source,
                          "timeout": cell.get("metadata", {}).get("gpulab", {}).get("timeout")})
        elif meta.get("solution"):
            solutions.append(meta["grade_id"])
        else:
            imports += [i for i in top_level_imports(cell.source) if i not in imports]
    return {"format": RELEASE_FORMAT, "notebook": name, "imports": imports, "tests": tests,
            "solutions": solutions}


def _dump_json(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"
# The first part of every notebook's setup cell, up to and including ``gpulab.setup()``;
# what follows that line in a solution is the notebook's own and is kept.
SETUP_TEMPLATE = """\
# Setup. In Colab, install gpulab first. Everywhere: import gpulab BEFORE defining any
# kernel, because it decides (once) whether Triton compiles or interprets.
import subprocess
import sys

if "google.colab" in sys.modules and subprocess.call([sys.executable, "-c", "import gpulab"]) != 0:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           "{install}"])
import gpulab

gpulab.setup()"""
SETUP_LINE = "gpulab.setup()"
BADGE_LINE = re.compile(r"^\[!\[(Open In Colab|Binder)\]")


def fill_links(nb, learner_path: str, repo: GitHubRepo) -> bool:
    """Rewrite the templated parts of a solution in place: the setup cell's head and the
    badges under the title (added after the title when missing). Returns True if changed."""
    changed = False
    setup = next((c for c in nb.cells if c.cell_type == "code"
                  and any(l.strip() == SETUP_LINE for l in c.source.split("\n"))), None)
    if setup is not None:
        lines = setup.source.split("\n")
        end = next(i for i, l in enumerate(lines) if l.strip() == SETUP_LINE)
        new = "\n".join([SETUP_TEMPLATE.format(install=repo.pip_install())] + lines[end + 1:])
        changed |= new != setup.source
        setup.source = new
    title = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if title is not None and title.source.lstrip().startswith("#"):
        lines = [l for l in title.source.split("\n") if not BADGE_LINE.match(l)]
        at = 1                     # after the title line, separated by blank lines
        block = ["", *repo.badges(learner_path).split("\n")]
        rest = lines[at:]
        while rest and not rest[0].strip():
            rest.pop(0)
        new = "\n".join(lines[:at] + block + ([""] + rest if rest else []))
        changed |= new != title.source
        title.source = new
    return changed


GUIDE_PREFIX = "**Before you start.**"


def working_minutes(nb) -> int:
    """An estimate, not a measurement, of a learner's time on a notebook: reading the prose
    at 120 words a minute and the code at 15 lines a minute, plus 3 minutes per graded
    exercise and 1.5 minutes per line of its solution (writing, running, fixing);
    rounded to 5 minutes."""
    prose = "\n".join(l for c in nb.cells if c.cell_type == "markdown"
                      for l in c.source.splitlines() if not l.startswith(GUIDE_PREFIX))
    words = len(re.findall(r"\w+", prose))
    code = sum(len(c.source.splitlines()) for c in nb.cells if c.cell_type == "code")
    exercises = sum(1 for c in nb.cells if nbgrader_meta(c).get("grade"))
    solution_lines = 0
    for c in nb.cells:
        if nbgrader_meta(c).get("solution"):
            part = c.source.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in c.source else c.source
            solution_lines += len([l for l in part.splitlines() if l.strip()])
    minutes = words / 120 + code / 15 + 3 * exercises + 1.5 * solution_lines
    return max(5, int(5 * round(minutes / 5)))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def guide_line(nb, name: str, times: dict) -> str:
    """The title cell's "Before you start" line for notebook ``name``."""
    prereq = nb.metadata.get("gpulab", {}).get("prerequisites", [])
    before = f"notebook{'s' if len(prereq) > 1 else ''} {_and(list(prereq))}" if prereq else "none"
    minutes = working_minutes(nb)
    work = f"{minutes} minutes" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"
    parts = []
    for device, labels in (("a CPU", (("cpu_ci", "with demos shortened (`CI=true`)"), ("cpu", "in full"))),
                           ("a GPU", (("gpu", ""),))):
        got = [(times[l], what) for l, what in labels
               if name in ((times.get(l) or {}).get("seconds") or {}) and name not in times[l].get("failed", {})]
        if not got:
            parts.append(f"on {device} not measured yet")
            continue
        where = "; ".join(dict.fromkeys(f"{run['machine']}, {run['date']}" for run, _ in got))
        figures = ", ".join(f"{_duration(run['seconds'][name])}{' ' + what if what else ''}" for run, what in got)
        parts.append(f"on {device} ({where}) {figures}")
    measured = "; ".join(parts)
    return (f"{GUIDE_PREFIX} Prerequisites: {before}. Working time: about {work} of reading "
            f"and exercises (an estimate from the notebook's length and exercises). Running "
            f"every cell: {measured}.")


def fill_guide(nb, name: str, times: dict) -> bool:
    """Write the guide line as the title cell's paragraph after the badges (replacing an
    older one). Returns True if the cell changed."""
    title = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if title is None or not title.source.lstrip().startswith("#"):
        return False
    lines = title.source.split("\n")
    kept = [l for l in lines if not l.startswith(GUIDE_PREFIX)]
    at = max([i for i, l in enumerate(kept) if BADGE_LINE.match(l)], default=0) + 1
    rest = kept[at:]
    while rest and not rest[0].strip():
        rest.pop(0)
    new = "\n".join(kept[:at] + ["", guide_line(nb, name, times)] + ([""] + rest if rest else []))
    changed = new != title.source
    title.source = new
    return changed


def exercise_index(notebooks: list) -> list[dict]:
    """The course's graded exercises, for ``gpulab progress``: one entry per notebook
    ``{notebook, title, exercises: [{grade_id, points}]}``, from (solution) notebooks."""
    index = []
    for name, nb in notebooks:
        title = next((c.source.split("\n")[0].lstrip("# ").strip() for c in nb.cells
                      if c.cell_type == "markdown" and c.source.startswith("#")), Path(name).stem)
        exercises = [{"grade_id": nbgrader_meta(c)["grade_id"], "points": nbgrader_meta(c)["points"]}
                     for c in nb.cells if nbgrader_meta(c).get("grade")]
        index.append({"notebook": name, "title": title, "exercises": exercises})
    return index


def render_index(index: list[dict]) -> str:
    """The index as JSON, one exercise per line (readable diffs)."""
    notebooks = []
    for nb in index:
        exercises = ",\n".join("   " + json.dumps(ex, ensure_ascii=False) for ex in nb["exercises"])
        notebooks.append(f' {{"notebook": {json.dumps(nb["notebook"])}, "title": '
                         f'{json.dumps(nb["title"], ensure_ascii=False)},\n  "exercises": [\n{exercises}]}}')
    return "[\n" + ",\n".join(notebooks) + "\n]\n"


def _dump(nb) -> str:
    import nbformat
    return nbformat.writes(nb) + ("" if nbformat.writes(nb).endswith("\n") else "\n")


def generate(solutions: Path = ROOT / "solutions", notebooks: Path = ROOT / "notebooks",
             check: bool = False, released: Path | None = None, repo: GitHubRepo | None = None) -> list[str]:
    """Write (or, with check, compare) every learner notebook, released-test file, the
    links of every solution and the README's badges. Returns the stale files' names. The
    released tests go to the package's data (for the course's own solutions) or, by
    default for other folders, next to ``notebooks`` in ``released_tests/``."""
    import nbformat
    own = Path(solutions).resolve() == (ROOT / "solutions").resolve()
    if released is None:
        released = RELEASED_TESTS if own else Path(notebooks).parent / "released_tests"
    repo = repo or course_repo()
    root = solutions.parent
    stale = []
    expected, expected_tests = set(), set()

    def put(dst: Path, text: str, label: str) -> None:
        if not dst.exists() or dst.read_text() != text:
            stale.append(label)
            if not check:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(text)

    readme = root / "README.md"
    if readme.exists():
        text = readme.read_text()
        new = repo.retarget(text)
        if new != text:
            stale.append("README.md (links)")
            if not check:
                readme.write_text(new)
    read = []
    times = json.loads(NOTEBOOK_TIMES.read_text()) if NOTEBOOK_TIMES.exists() else {}
    for src in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(src, as_version=4)
        validate_solution(nb, src.name)
        read.append((src.name, nb))
        learner_path = (notebooks / src.name).relative_to(root).as_posix() \
            if notebooks.is_relative_to(root) else src.name
        if fill_links(nb, learner_path, repo) | fill_guide(nb, src.name, times):
            stale.append(f"{solutions.name}/{src.name} (links)")
            if not check:
                src.write_text(_dump(nb))
        dst = notebooks / src.name
        expected.add(dst.name)
        put(dst, _dump(learner_version(nb)), dst.name)
        tests = released / f"{src.stem}.json"
        expected_tests.add(tests.name)
        put(tests, _dump_json(released_tests(nb, src.name)), f"{released.name}/{tests.name}")
    if own:
        put(EXERCISES, render_index(exercise_index(read)), "gpulab/data/exercises.json")
    for extra in sorted(notebooks.glob("*.ipynb")):
        if extra.name not in expected:
            stale.append(extra.name + " (no solution)")
            if not check:
                extra.unlink()
    for extra in sorted(released.glob("*.json")):
        if extra.name not in expected_tests:
            stale.append(f"{released.name}/{extra.name} (no solution)")
            if not check:
                extra.unlink()
    return stale


def load_released(name_or_path: str | Path, released: Path = RELEASED_TESTS) -> dict | None:
    """The released tests of a notebook: from a JSON file given by path, else the one
    shipped for the notebook's file name (``05_paged_attention.ipynb`` -> ``05_paged_attention.json``)."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return json.loads(p.read_text())
    candidate = released / f"{p.stem}.json"
    if candidate.exists():
        return json.loads(candidate.read_text())
    return None


def find_released(grade_ids: set[str], released: Path = RELEASED_TESTS) -> dict | None:
    """The released tests whose grade ids overlap most with ``grade_ids`` (a renamed file)."""
    best, best_n = None, 0
    for path in sorted(released.glob("*.json")):
        data = json.loads(path.read_text())
        n = len(grade_ids & {t["grade_id"] for t in data["tests"]} | grade_ids & set(data["solutions"]))
        if n > best_n:
            best, best_n = data, n
    return best


# -- building a solution notebook from a py:percent script ------------------------------------
_HEADER = re.compile(r"^# %%(.*)$")


def from_percent(text: str) -> "nbformat.NotebookNode":
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    chunks: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        m = _HEADER.match(line)
        if m:
            chunks.append((m.group(1).strip(), []))
        elif chunks:
            chunks[-1][1].append(line)
    for header, body in chunks:
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
        is_md = header.startswith("[markdown]")
        header = header.replace("[markdown]", "").strip()
        opts = dict(kv.split("=", 1) for kv in header.split() if "=" in kv)
        words = {w for w in header.split() if "=" not in w}
        if is_md:
            src = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body)
            cell = nbformat.v4.new_markdown_cell(src)
        else:
            cell = nbformat.v4.new_code_cell("\n".join(body))
        if "solution" in words or "grade" in words:
            meta = {"schema_version": 3, "grade_id": opts["id"], "locked": "grade" in words,
                    "solution": "solution" in words, "grade": "grade" in words}
            if "grade" in words:
                meta["points"] = int(opts.get("points", 1))
            cell.metadata["nbgrader"] = meta
        if "tags" in opts:
            cell.metadata["tags"] = opts["tags"].split(",")
        nb.cells.append(cell)
    for cell in nb.cells:   # stable ids make diffs and the sync check deterministic
        cell.pop("id", None)
    nb.nbformat_minor = 4
    return nb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="fail if notebooks/ or the released tests are stale")
    p.add_argument("--from-percent", nargs=2, metavar=("SRC", "OUT"))
    a = p.parse_args(argv)
    if a.from_percent:
        import nbformat
        src, out = a.from_percent
        nbformat.write(from_percent(Path(src).read_text()), out)
        print(f"wrote {out}")
        return 0
    stale = generate(check=a.check)
    if a.check:
        if stale:
            print("notebooks/ is stale; run `gpulab generate`:\n  " + "\n  ".join(stale))
            return 1
        print("notebooks/ is up to date")
        return 0
    print(f"regenerated {len(stale)} file(s)" + (": " + ", ".join(stale) if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Running the course under nbgrader (0.9.x).

``nbgrader generate_assignment`` replaces a ``### BEGIN SOLUTION`` region with
``raise NotImplementedError()`` everywhere, also inside a ``@triton.jit`` body, where
``raise`` does not compile for a GPU (the learner would see a compiler error instead of
a TODO). :class:`TritonClearSolutions` stubs regions exactly as ``gpulab generate``
does (``tl.static_assert(False, "TODO ...")`` inside kernels), so the release nbgrader
writes is the learner notebook ``gpulab generate`` writes. In ``nbgrader_config.py``::

    from gpulab.tools.nbgrader_support import use_gpulab_stubs
    c = get_config()
    use_gpulab_stubs(c)

nbgrader does everything else itself: it restores the locked and graded cells from
its database before autograding (hidden tests included) and scores a grade cell 0 when
it raises or writes to stderr. What it cannot do is what ``gpulab grade`` adds: stop a
notebook from rebinding ``gpulab.check`` in its namespace, survive a hang or a dead
kernel per exercise (see README, "Grading").
"""
from __future__ import annotations

from nbgrader.converters.generate_assignment import GenerateAssignment
from nbgrader.preprocessors import ClearSolutions

from .authoring import BEGIN, stub_code


class TritonClearSolutions(ClearSolutions):
    """nbgrader's ClearSolutions, with gpulab's stubs for code cells."""

    def _replace_solution_region(self, cell, language):
        if cell.cell_type == "code" and language == "python" and BEGIN in cell.source:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "exercise")
            cell.source = stub_code(cell.source, gid)
            return True
        return super()._replace_solution_region(cell, language)


def use_gpulab_stubs(c) -> None:
    """Make ``nbgrader generate_assignment`` use :class:`TritonClearSolutions`."""
    c.GenerateAssignment.preprocessors = [TritonClearSolutions if p is ClearSolutions else p
                                          for p in GenerateAssignment.class_traits()["preprocessors"].default()]


# -- the whole course under real nbgrader (a script for CI or the lead's GPU host) ----------
def autograde_course(solutions, out, notebooks=None) -> dict:
    """Build an nbgrader course from ``solutions`` (one assignment per notebook), generate
    the release, autograde a solved copy (the solution) and an unsolved one (the release)
    of each, grade the same two copies with ``gpulab grade``, and return (and write to
    ``out/nbgrader.json``) the points each got."""
    import json
    import shutil
    from pathlib import Path

    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    from . import grade

    solutions, out = Path(solutions), Path(out)
    course = out / "course"
    shutil.rmtree(course, ignore_errors=True)
    paths = sorted(solutions.glob("*.ipynb"))
    if notebooks:
        paths = [p for p in paths if any(p.name.startswith(n) for n in notebooks)]
    c = Config()
    c.CourseDirectory.root = str(course)
    c.CourseDirectory.course_id = "gpulab"
    use_gpulab_stubs(c)
    api = NbGraderAPI(config=c)
    report = {}
    for path in paths:
        name = path.stem
        (course / "source" / name).mkdir(parents=True)
        shutil.copy(path, course / "source" / name / path.name)
        gen = api.generate_assignment(name, force=True, create=True)
        if not gen["success"]:
            report[name] = {"error": gen["error"][-2000:]}
            continue
        copies = {"solved": course / "source" / name / path.name,
                  "unsolved": course / "release" / name / path.name}
        entry = {}
        for who, src in copies.items():
            dst = course / "submitted" / who / name
            dst.mkdir(parents=True)
            shutil.copy(src, dst / path.name)
            res = api.autograde(name, who, force=True, create=True)
            with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
                sub = gb.find_submission(name, who)
                nbgrader_points = {g.name: g.score for nbk in sub.notebooks for g in nbk.grades}
                nbgrader_total = (sub.score, sub.max_score)
            graded = grade.grade_notebook(dst / path.name)
            entry[who] = {"nbgrader": {"score": nbgrader_total[0], "max_score": nbgrader_total[1],
                                       "cells": nbgrader_points, "success": res["success"]},
                          "gpulab": {"score": graded.score[0], "max_score": graded.score[1],
                                     "cells": {r.grade_id: r.score for r in graded.exercises},
                                     "errors": {r.grade_id: f"{r.error}: {r.message[:300]}"
                                                for r in graded.exercises if not r.passed}}}
        report[name] = entry
        (out / "nbgrader.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="Autograde every solution (full marks expected) and every "
                                "learner release (0 expected) under nbgrader and gpulab grade.")
    p.add_argument("out", help="folder for the course and nbgrader.json")
    p.add_argument("--solutions", default=str(Path(__file__).resolve().parents[2] / "solutions"))
    p.add_argument("--only", nargs="*", help="notebook name prefixes (e.g. 00 05)")
    a = p.parse_args(argv)
    report = autograde_course(a.solutions, a.out, a.only)
    bad = []
    for name, e in report.items():
        if "error" in e:
            bad.append(f"{name}: generate_assignment failed")
            continue
        for who, want_full in (("solved", True), ("unsolved", False)):
            for tool in ("nbgrader", "gpulab"):
                r = e[who][tool]
                ok = r["score"] == r["max_score"] if want_full else r["score"] == 0
                if not ok:
                    bad.append(f"{name} {who} under {tool}: {r['score']}/{r['max_score']}")
    print(json.dumps(report, indent=1))
    print("\n".join(bad) or "every solution full marks, every release 0, under both")
    return 1 if bad else 0


if __name__ == "__main__":
    import sys
    sys.exit(main())

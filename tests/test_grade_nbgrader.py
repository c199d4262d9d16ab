"""The course under real nbgrader: generate_assignment writes gpulab's own stubs, validate
and autograde score a correct submission full marks and an untouched one 0, the same
points `gpulab grade` gives. A small notebook keeps it short; `python -m
gpulab.tools.nbgrader_support OUT` does the same for every notebook of the course."""
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from gpulab.tools import authoring, grade

nbgrader = pytest.importorskip("nbgrader")
from nbgrader.api import Gradebook  # noqa: E402
from nbgrader.apps import NbGraderAPI  # noqa: E402
from nbgrader.validator import Validator  # noqa: E402
from traitlets.config import Config  # noqa: E402

from gpulab.tools.nbgrader_support import use_gpulab_stubs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

TINY = '''# %%
import gpulab

gpulab.setup()

import numpy as np
import torch
import triton
import triton.language as tl

from gpulab.harness.spec import Case
# %% solution id=ex1-add
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ### BEGIN SOLUTION
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)
    ### END SOLUTION


def add(x, y, out):
    np.log(np.zeros(1))      # an expected numerical warning: must not reach stderr
    add_kernel[(triton.cdiv(out.numel(), 1024),)](x, y, out, out.numel(), BLOCK=1024)
# %% grade id=check-add points=2
gpulab.check("vector_add", add)
### BEGIN HIDDEN TESTS
gpulab.check("vector_add", add, cases=[Case("many blocks + 1", dict(n=5 * 1024 + 1))])
### END HIDDEN TESTS
# %% solution id=ex2-softmax-torch
def softmax_torch(x):
    ### BEGIN SOLUTION
    e = torch.exp(x - x.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)
    ### END SOLUTION
# %% grade id=check-softmax-torch points=1
gpulab.check("softmax", lambda x, y: y.copy_(softmax_torch(x)), dtypes=[torch.float32], learner_kernel=False)
'''


def test_nbgrader_generate_validate_autograde(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.chdir(tmp_path)
    course = tmp_path / "course"
    (course / "source" / "ps0").mkdir(parents=True)
    solution = course / "source" / "ps0" / "tiny.ipynb"
    nb = authoring.from_percent(TINY)
    nbformat.write(nb, solution)

    c = Config()
    c.CourseDirectory.root = str(course)
    c.CourseDirectory.course_id = "gpulab-test"
    use_gpulab_stubs(c)
    api = NbGraderAPI(config=c)
    gen = api.generate_assignment("ps0", force=True, create=True)
    assert gen["success"], gen["error"]
    release = course / "release" / "ps0" / "tiny.ipynb"

    # nbgrader's release is gpulab's learner notebook: a static-assert TODO inside the kernel
    ours = [cell.source for cell in authoring.learner_version(nb).cells]
    theirs = [cell.source for cell in nbformat.read(release, as_version=4).cells]
    assert theirs == ours
    assert 'tl.static_assert(False, "TODO (ex1-add)' in theirs[1]

    validator = Validator(config=c)
    assert validator.validate(str(solution)) == {}
    assert "failed" in validator.validate(str(release))

    for who, src in (("alice", solution), ("bob", release)):
        (course / "submitted" / who / "ps0").mkdir(parents=True)
        shutil.copy(src, course / "submitted" / who / "ps0" / "tiny.ipynb")
        res = api.autograde("ps0", who, force=True, create=True)
        assert res["success"], res["error"]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {who: (gb.find_submission("ps0", who).score, gb.find_submission("ps0", who).max_score)
                  for who in ("alice", "bob")}
    assert scores == {"alice": (3, 3), "bob": (0, 3)}

    # gpulab grade with the same released tests gives the same points
    released = authoring.released_tests(nb, "tiny.ipynb")
    for who, expected in (("alice", 3), ("bob", 0)):
        result = grade.grade_notebook(course / "submitted" / who / "ps0" / "tiny.ipynb", released=released,
                                      timeout=120)
        assert result.score == (expected, 3), grade.table([result])

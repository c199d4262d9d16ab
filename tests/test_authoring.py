"""Learner notebooks are generated from solutions and kept in sync."""
import nbformat
import pytest

from gpulab.tools import authoring


def test_python_region_becomes_not_implemented():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n"
    out = authoring.stub_code(src, "ex")
    assert "return x + 1" not in out
    assert '    # YOUR CODE HERE\n    raise NotImplementedError("TODO (ex): write this part")' in out


def test_jit_region_becomes_static_assert():
    src = ("@triton.jit\ndef k(x_ptr, BLOCK: tl.constexpr):\n    pid = tl.program_id(0)\n"
           "    ### BEGIN SOLUTION\n    tl.store(x_ptr, 1)\n    ### END SOLUTION\n\n\n"
           "def launch(x):\n    ### BEGIN SOLUTION\n    k[(1,)](x, BLOCK=4)\n    ### END SOLUTION\n")
    out = authoring.stub_code(src, "ex9")
    assert 'tl.static_assert(False, "TODO (ex9)' in out
    assert out.count("raise NotImplementedError(") == 1      # the launcher is plain Python
    assert "tl.store(x_ptr, 1)" not in out and "pid = tl.program_id(0)" in out


def test_cell_without_markers_is_replaced_whole():
    assert authoring.stub_code("x = 1", "ex") == '# YOUR CODE HERE\nraise NotImplementedError("TODO (ex): write this cell")'


def test_unclosed_region_is_an_error():
    with pytest.raises(authoring.AuthoringError):
        authoring.stub_code("### BEGIN SOLUTION\nx = 1\n", "ex")


def test_hidden_tests_are_removed():
    src = "check(a)\n### BEGIN HIDDEN TESTS\ncheck(b)\n### END HIDDEN TESTS\ndone()"
    assert authoring.strip_hidden(src) == "check(a)\ndone()"


def test_from_percent_and_learner_version():
    nb = authoring.from_percent(
        "# %% [markdown]\n# # Title\n# %% solution id=ex1\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n"
        "    ### END SOLUTION\n# %% grade id=check1 points=3\nassert f() == 1\n"
        "# %% [markdown] solution id=q1\n# my answer\n")
    authoring.validate_solution(nb, "t")
    meta = [c.metadata.get("nbgrader", {}) for c in nb.cells]
    assert meta[2]["points"] == 3 and meta[2]["grade"] and meta[2]["locked"]
    learner = authoring.learner_version(nb)
    assert "raise NotImplementedError" in learner.cells[1].source
    assert learner.cells[3].source == "YOUR ANSWER HERE"
    assert nb.cells[1].source.count("return 1") == 1     # the solution itself is untouched


def test_marker_without_metadata_is_an_error():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx=1\n### END SOLUTION"))
    with pytest.raises(authoring.AuthoringError, match="solution is not set"):
        authoring.validate_solution(nb, "t")


def test_notebooks_are_in_sync_with_solutions():
    stale = authoring.generate(check=True)
    assert not stale, f"notebooks/ is stale, run `gpulab generate`: {stale}"


def test_generate_check_detects_a_stale_notebook(tmp_path):
    sol, nbs = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    nb = authoring.from_percent("# %% solution id=e\nx = 1\n")
    nbformat.write(nb, sol / "a.ipynb")
    assert authoring.generate(sol, nbs, check=True) == ["a.ipynb", "released_tests/a.json"]
    authoring.generate(sol, nbs)
    assert (tmp_path / "released_tests" / "a.json").exists()
    assert authoring.generate(sol, nbs, check=True) == []
    (nbs / "a.ipynb").write_text((nbs / "a.ipynb").read_text().replace("YOUR CODE", "edited"))
    assert authoring.generate(sol, nbs, check=True) == ["a.ipynb"]


def test_released_tests_keep_hidden_tests_points_and_imports():
    nb = authoring.from_percent(
        "# %%\nimport gpulab\nfrom gpulab import bitlinear as bl\n%matplotlib inline\nx = 1\n"
        "# %% solution id=ex1\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n"
        "# %% grade id=check1 points=3\nassert f() == 1\n### BEGIN HIDDEN TESTS\nassert f() + 1 == 2\n"
        "### END HIDDEN TESTS\n")
    data = authoring.released_tests(nb, "t.ipynb")
    assert data["imports"] == ["import gpulab", "from gpulab import bitlinear as bl"]
    assert data["solutions"] == ["ex1"]
    (test,) = data["tests"]
    assert test["grade_id"] == "check1" and test["points"] == 3 and "f() + 1 == 2" in test["source"]

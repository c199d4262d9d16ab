"""Every link a learner can click resolves: relative links and Colab/Binder/GitHub links
into the course repository point at files that exist, at the address set once in
pyproject.toml; a fork that changes that address gets every badge and install cell
rewritten by `gpulab generate`."""
import re
import shutil
from pathlib import Path

import nbformat
import pytest

tomllib = pytest.importorskip("tomllib")   # Python 3.11+

from gpulab.tools import authoring, links

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def _documents():
    """(file, folder links are relative to, markdown text) of every page a learner reads."""
    for md in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md",
               *sorted((ROOT / "docs").glob("*.md"))]:
        if md.exists():
            yield md, md.parent, md.read_text()
    for nb_path in sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        yield nb_path, nb_path.parent, text


def _targets(text):
    for m in MARKDOWN_LINK.finditer(text):
        yield m.group(1) or m.group(2)


def test_the_repository_address_is_the_one_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    assert links.repository() == declared.rstrip("/")
    links.GitHubRepo.parse(declared)        # a GitHub address: badges need one


def test_every_link_and_badge_points_at_a_file_that_exists():
    repo = links.course_repo()
    broken, foreign = [], []
    for doc, base, text in _documents():
        for target in _targets(text):
            where = f"{doc.relative_to(ROOT)}: {target}"
            if target in (links.COLAB_BADGE, links.BINDER_BADGE):
                continue
            for pattern in (links.COLAB_LINK, links.BINDER_LINK, links.GITHUB_LINK):
                m = pattern.fullmatch(target)
                if m:
                    owner, name, branch, path = m.groups()
                    if (owner, name) != (repo.owner, repo.name) or branch != repo.branch:
                        foreign.append(where)
                    elif not (ROOT / path.split("#")[0]).exists():
                        broken.append(where)
                    break
            else:
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue                  # other sites, mail, in-page anchors
                if not (base / target.split("#")[0]).exists():
                    broken.append(where)
    assert not broken, "links to files that do not exist:\n  " + "\n  ".join(broken)
    assert not foreign, (f"links into another repository than {repo.url} (branch {repo.branch}); "
                         "run `gpulab generate`:\n  " + "\n  ".join(foreign))


def test_each_notebook_badge_opens_its_own_learner_notebook():
    for nb_path in sorted((ROOT / "solutions").glob("*.ipynb")):
        title = next(c for c in nbformat.read(nb_path, as_version=4).cells if c.cell_type == "markdown")
        wanted = f"notebooks/{nb_path.name}"
        colab = [m.group(4) for m in links.COLAB_LINK.finditer(title.source)]
        binder = [m.group(4) for m in links.BINDER_LINK.finditer(title.source)]
        assert colab == [wanted] and binder == [wanted], f"{nb_path.name}: badges open {colab} {binder}"


def test_the_colab_install_cell_installs_the_course_repository():
    want = links.course_repo().pip_install()
    for nb_path in sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = nbformat.read(nb_path, as_version=4).cells
        setup = next(c for c in cells if c.cell_type == "code" and authoring.SETUP_LINE in c.source)
        assert f'"{want}"' in setup.source, nb_path.name


def test_a_fork_changes_one_value_and_every_link_follows(tmp_path):
    sol, nbs = tmp_path / "solutions", tmp_path / "notebooks"
    sol.mkdir()
    shutil.copy(ROOT / "solutions/00_triton_basics.ipynb", sol)
    shutil.copy(ROOT / "README.md", tmp_path)
    fork = links.GitHubRepo("someone", "gpulab-fork")
    stale = authoring.generate(sol, nbs, repo=fork)
    assert "README.md (links)" in stale and "solutions/00_triton_basics.ipynb (links)" in stale
    assert authoring.generate(sol, nbs, repo=fork, check=True) == []
    for path in (sol / "00_triton_basics.ipynb", nbs / "00_triton_basics.ipynb", tmp_path / "README.md"):
        text = path.read_text()
        assert "gpulab-course" not in text, path
        assert "someone/gpulab-fork" in text, path
    assert "git+https://github.com/someone/gpulab-fork" in (nbs / "00_triton_basics.ipynb").read_text()


def test_badges_are_added_under_a_new_notebooks_title(tmp_path):
    nb = authoring.from_percent("# %% [markdown]\n# # 99 — New\n#\n# Text.\n"
                                "# %%\nimport gpulab\n\ngpulab.setup()\nx = 1\n")
    assert authoring.fill_links(nb, "notebooks/99_new.ipynb", links.GitHubRepo("o", "r"))
    title, setup = nb.cells[0].source, nb.cells[1].source
    assert title.startswith("# 99 — New\n\n[![Open In Colab]") and title.endswith("\n\nText.")
    assert "/o/r/blob/main/notebooks/99_new.ipynb" in title and "gh/o/r/main?" in title
    assert setup.endswith("gpulab.setup()\nx = 1") and '"git+https://github.com/o/r"' in setup
    assert not authoring.fill_links(nb, "notebooks/99_new.ipynb", links.GitHubRepo("o", "r"))


def test_a_non_github_address_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="GitHub"):
        links.GitHubRepo.parse("https://gitlab.com/a/b")

"""Where the course lives online: one value, everything else derived from it.

The repository's address is set once, in ``pyproject.toml`` (``[project.urls]
Repository``). A fork changes that line and runs ``gpulab generate``: the Colab and
Binder badges of the README and of every notebook, and the Colab install cell at the
top of every notebook, are rewritten from it.

Where the address comes from, first found wins:

1. ``pyproject.toml`` next to the package, when gpulab runs from a checkout (authors
   run ``gpulab generate`` there, so a changed value takes effect without reinstalling);
2. the installed package's metadata (``importlib.metadata``: ``Project-URL:
   Repository, ...``), when gpulab was installed from a wheel or from git;
3. :data:`FALLBACK_REPOSITORY`, for a copy of the package with neither.
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

FALLBACK_REPOSITORY = "https://github.com/gpulab-course/gpulab"
BRANCH = "main"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"

# A badge line as the generator writes it (and rewrites it when the address changes).
COLAB_LINK = re.compile(r"https://colab\.research\.google\.com/github/([^/\s)]+)/([^/\s)]+)/blob/([^/\s)]+)/([^\s)]+)")
BINDER_LINK = re.compile(r"https://mybinder\.org/v2/gh/([^/\s)]+)/([^/\s)]+)/([^?\s)]+)\?urlpath=lab/tree/([^\s)]+)")
GITHUB_LINK = re.compile(r"https://github\.com/([^/\s)]+)/([^/\s)#]+)/(?:blob|tree)/([^/\s)]+)/([^\s)#]+)")
GIT_INSTALL = re.compile(r"git\+https://github\.com/[^\s\"'@]+")


def _from_pyproject(path: Path = PYPROJECT) -> str | None:
    """``[project.urls] Repository`` of a checkout's pyproject.toml (a small reader, so
    Python 3.10 needs no TOML package)."""
    if not path.exists():
        return None
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
            continue
        if section == "[project.urls]":
            m = re.match(r'''["']?Repository["']?\s*=\s*["']([^"']+)["']''', line)
            if m:
                return m.group(1)
    return None


def _from_metadata() -> str | None:
    try:
        urls = importlib.metadata.metadata("gpulab").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "repository":
            return url.strip()
    return None


def repository() -> str:
    """The course repository's address, e.g. ``https://github.com/OWNER/NAME``."""
    url = _from_pyproject() or _from_metadata() or FALLBACK_REPOSITORY
    return url.rstrip("/").removesuffix(".git")


@dataclass(frozen=True)
class GitHubRepo:
    owner: str
    name: str
    branch: str = BRANCH

    @classmethod
    def parse(cls, url: str, branch: str = BRANCH) -> "GitHubRepo":
        m = re.fullmatch(r"https://github\.com/([^/]+)/([^/]+)", url)
        if not m:
            raise ValueError(f"the repository address {url!r} is not https://github.com/OWNER/NAME: "
                             "Colab and Binder badges need a GitHub repository")
        return cls(m.group(1), m.group(2), branch)

    @property
    def url(self) -> str:
        return f"https://github.com/{self.owner}/{self.name}"

    def colab(self, path: str) -> str:
        return f"https://colab.research.google.com/github/{self.owner}/{self.name}/blob/{self.branch}/{path}"

    def binder(self, path: str) -> str:
        return f"https://mybinder.org/v2/gh/{self.owner}/{self.name}/{self.branch}?urlpath=lab/tree/{path}"

    def badges(self, path: str, sep: str = "\n") -> str:
        """The Colab and Binder badges (markdown) that open ``path`` (relative to the repo root)."""
        return (f"[![Open In Colab]({COLAB_BADGE})]({self.colab(path)})" + sep
                + f"[![Binder]({BINDER_BADGE})]({self.binder(path)})")

    def pip_install(self) -> str:
        return f"git+{self.url}"

    def retarget(self, text: str) -> str:
        """Rewrite every Colab/Binder/GitHub link and git install URL in ``text`` that points
        at *a* GitHub repository of the course to this one (paths kept)."""
        text = COLAB_LINK.sub(lambda m: self.colab(m.group(4)), text)
        text = BINDER_LINK.sub(lambda m: self.binder(m.group(4)), text)
        return GIT_INSTALL.sub(self.pip_install(), text)


def course_repo() -> GitHubRepo:
    return GitHubRepo.parse(repository())

"""Candidates: Triton source for a task, its genes and its lineage.

A candidate is the complete text of a Python module that defines ``launch(...)`` in the
task spec's argument order (inputs, then the outputs it must write). Candidates made
from a template (a seed in :mod:`gpulab.lab.seeds`) carry *genes*: module-level lines

    ROWS_PER_PROGRAM = 4  # gene

whose allowed values the template lists in ``GENE_SPACE``. :func:`render` rewrites those
lines; :func:`genes_of` reads them back. Code-level rewrites (:mod:`gpulab.lab.rewrites`)
change the rest of the text. A candidate's id is a hash of its text, so the same kernel
reached twice is evaluated once.
"""
from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

_GENE_LINE = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*) = (?P<value>.+?)  # gene$", re.MULTILINE)


@dataclass
class Candidate:
    """One kernel: its source and how it was made."""
    task: str
    source: str
    genes: dict = field(default_factory=dict)
    rewrites: tuple = ()
    parents: tuple = ()
    operator: str = "seed"
    proposer: str = "seed"

    @property
    def id(self) -> str:
        return source_id(self.source)

    def describe(self) -> str:
        genes = ", ".join(f"{k}={v}" for k, v in self.genes.items())
        extra = f" + {', '.join(self.rewrites)}" if self.rewrites else ""
        return f"{self.id} [{genes}{extra}]"

    def to_json(self) -> dict:
        return {"id": self.id, "task": self.task, "genes": self.genes, "rewrites": list(self.rewrites),
                "parents": list(self.parents), "operator": self.operator, "proposer": self.proposer,
                "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> "Candidate":
        return cls(task=d["task"], source=d["source"], genes=dict(d.get("genes", {})),
                   rewrites=tuple(d.get("rewrites", ())), parents=tuple(d.get("parents", ())),
                   operator=d.get("operator", "archive"), proposer=d.get("proposer", "archive"))


def source_id(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()[:12]


def genes_of(source: str) -> dict:
    """The gene values written in a candidate's source (empty for a hand-written one)."""
    return {m["name"]: ast.literal_eval(m["value"]) for m in _GENE_LINE.finditer(source)}


def gene_space(source: str) -> dict:
    """The template's ``GENE_SPACE`` (name -> list of allowed values), read without
    running the source."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GENE_SPACE" for t in node.targets):
            return {k: list(v) for k, v in ast.literal_eval(node.value).items()}
    return {}


def render(template: str, genes: dict) -> str:
    """The template's text with each gene line set to ``genes[name]`` (genes not given
    keep their value). Raises ValueError for a gene the template does not have."""
    present = {m["name"] for m in _GENE_LINE.finditer(template)}
    unknown = set(genes) - present
    if unknown:
        raise ValueError(f"the template has no gene(s) {', '.join(sorted(unknown))}; "
                         f"its genes are {', '.join(sorted(present))}")

    def line(m):
        name = m["name"]
        value = genes[name] if name in genes else ast.literal_eval(m["value"])
        return f"{name} = {value!r}  # gene"
    return _GENE_LINE.sub(line, template)


def invalid_genes(genes: dict, space: dict) -> list[str]:
    """Why ``genes`` is not a point of ``space`` (empty list: it is)."""
    problems = [f"{k} is not a gene of this template" for k in genes if k not in space]
    problems += [f"{k} is missing" for k in space if k not in genes]
    problems += [f"{k}={genes[k]!r} is not one of {space[k]}" for k in space
                 if k in genes and genes[k] not in space[k]]
    return problems


def random_genes(space: dict, rng: random.Random) -> dict:
    return {k: rng.choice(v) for k, v in space.items()}


def write(candidate: Candidate | str, directory: Path) -> Path:
    """Write the candidate's source to ``directory/cand_<id>.py`` (Triton reads kernel
    source from files, so candidates are imported from disk)."""
    source = candidate if isinstance(candidate, str) else candidate.source
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"cand_{source_id(source)}.py"
    if not path.exists():
        path.write_text(source)
    return path

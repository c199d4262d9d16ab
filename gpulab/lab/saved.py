"""Lab results measured on a GPU and shipped with the package (``gpulab/results/lab/``),
for learners on a CPU: ``suite.json`` and ``lab-bench.json`` as written by
``tools/lab-bench.py`` (copy them there after a run)."""
from __future__ import annotations

import json
from pathlib import Path

from .evaluate import Verdict

RESULTS = Path(__file__).resolve().parent.parent / "results" / "lab"


def load(name: str) -> dict | None:
    """A saved result (``suite``, ``lab-bench``), or None if none has been measured."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def suite_verdicts(result: dict, which: str = "best") -> list[Verdict]:
    """The per-task verdicts of a saved suite (``which`` = ``seeds`` or ``best``)."""
    out = []
    for task, row in result[which].items():
        out.append(Verdict(task, row["candidate"], row["status"], row["reason"], row.get("message", ""),
                           time_ms=row["time_ms"], eager_ms=row["eager_ms"], compiled_ms=row["compiled_ms"]))
    return out

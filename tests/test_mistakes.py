"""Every mistake of the catalogue (tests/mistakes/) is caught and its cause named.
Entries that need a spec field the exercise's spec does not set yet run against
``spec.variant(**needs)``: they prove the harness catches them once the spec opts in."""
from pathlib import Path

import pytest

import gpulab

from helpers import load_tool, subprocess_env
from mistakes import catalogue, run, run_in_subprocess

CATALOGUE = catalogue()


@pytest.mark.parametrize("mistake", CATALOGUE, ids=[m.id for m in CATALOGUE])
def test_mistake_is_caught_with_the_right_cause(mistake):
    if mistake.interpreter_only and gpulab.mode() == "compiled":
        pytest.skip(f"compiled, this mistake leaves no trace: {mistake.interpreter_only}")
    if mistake.faults_compiled and gpulab.mode() == "compiled":
        outcome = run_in_subprocess(mistake, subprocess_env(Path(__file__).resolve().parent.parent))
    else:
        outcome = run(mistake)
    assert outcome.caught, f"{mistake.id}: the check accepted it"
    weak = mistake.weak or (mistake.weak_compiled if gpulab.mode() == "compiled" else "")
    if weak:
        pytest.xfail(f"hint not specific: {weak}") if not outcome.right_cause else None
    assert outcome.right_cause, f"{mistake.id}: expected one of {mistake.expect} in:\n{outcome.message}"


def test_every_graded_exercise_of_the_catalogue_has_at_least_five_mistakes():
    counts = {}
    for m in CATALOGUE:
        counts[m.exercise] = counts.get(m.exercise, 0) + 1
    assert all(n >= 5 for n in counts.values()), counts


def test_compiled_diagnosis_rehearsed_on_the_cpu(capsys):
    """tools/catalogue_as_compiled.py runs entries with the check's compiled-mode diagnosis
    (no load watch, guard re-runs) in the interpreter: notebook 00's entries all pass it."""
    tool = load_tool("catalogue_as_compiled")
    if gpulab.mode() == "compiled":
        pytest.skip("compiled, the catalogue itself runs with this diagnosis")
    assert tool.main(["00/check-row-sum"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "00/check-row-sum: N as the row stride" in out and "0 entries would fail compiled" in out

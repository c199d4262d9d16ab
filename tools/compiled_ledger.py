"""Which tests have passed compiled on the GPU, and which are still to run there.

A compiled pass of the whole suite takes about 20 000 worker-seconds on the H200 host, most
of it Triton compiling; that is more than one session's GPU time. So each GPU call's
``junit.xml`` is kept with its run (``gpulab/results/runs/<run>/``), and this tool turns
them into a ledger: the node ids that passed (or were skipped or xfailed for a stated reason)
compiled, less those of test files changed since the runs' commit. ``tools/gpu-suite.sh``
with ``GPULAB_PASSED=FILE`` then runs everything else, which the GPU host collects itself,
so tests that exist only there are included.

usage:
    python tools/compiled_ledger.py RUN_DIR [RUN_DIR ...] [--commit SHA] [--keep FILE ...]
                                    [--drop TEXT ...] [--include LEDGER ...] [--out .gpurun/passed.txt]
                                    [--durations-out FILE.json]

``--commit``: the commit the runs tested (a test file changed since then runs again);
``--keep tests/x.py``: a changed test file whose passes still stand (say why in the run's
README); ``--drop TEXT``: node ids containing TEXT run again, because code they run changed
outside tests/ (say what in the run's README). Prints passed / failed / skipped per test
file and what must run again.
``--include``: an earlier ledger to extend. Chained calls on one warm GPU host: each call of
``tools/gpu-suite.sh`` also leaves its junit.xml in ``/tmp/gpulab-runs/``, so the next call
can start with ``python3 tools/compiled_ledger.py /tmp/gpulab-runs/* --include LEDGER --out
/tmp/passed.txt`` (no git there: leave out ``--commit``).
``--durations-out``: each test's longest time in the runs, for ``GPULAB_DURATIONS``: a call
cut at its time limit then loses short tests, not a 6-minute one begun at the end.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_SKIP = "gpulab-deadline:"   # tests/conftest.py's skip of a test a call had no time left for


def node_id(case: ET.Element) -> str | None:
    """``tests/test_x.py::[Class::]name`` from a junit testcase (None for collection entries)."""
    classname, name = case.get("classname") or "", case.get("name") or ""
    if not classname:
        return None
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            path = "/".join(parts[:i + 1]) + ".py"
            return "::".join([path, *parts[i + 1:], name])
    return None


def outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    skipped = case.find("skipped")
    if skipped is not None:
        if DEADLINE_SKIP in (skipped.get("message") or ""):
            return "not run"            # left for a later call (tests/conftest.py: GPULAB_DEADLINE)
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def read_durations(dirs: list[Path]) -> dict[str, float]:
    """node id -> the longest time it took in the runs (setup, call and teardown)."""
    took: dict[str, float] = {}
    for d in dirs:
        for xml in sorted(d.glob("*junit*.xml")):
            for case in ET.parse(xml).getroot().iter("testcase"):
                nid = node_id(case)
                if nid is not None:
                    took[nid] = max(took.get(nid, 0.0), float(case.get("time") or 0))
    return took


def read_runs(dirs: list[Path]) -> dict[str, str]:
    """node id -> its best outcome over the runs (a pass anywhere counts)."""
    rank = {"passed": 3, "xfailed": 2, "skipped": 2, "failed": 0}
    best: dict[str, str] = {}
    for d in dirs:
        for xml in sorted(d.glob("*junit*.xml")):
            for case in ET.parse(xml).getroot().iter("testcase"):
                nid = node_id(case)
                if nid is None:
                    continue
                o = outcome(case)
                if o == "not run":
                    continue
                if nid not in best or rank[o] > rank[best[nid]]:
                    best[nid] = o
    return best


def changed_test_files(commit: str) -> set[str]:
    out = subprocess.run(["git", "diff", "--name-only", commit, "--", "tests"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if line.endswith(".py")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--commit", help="the runs' commit: test files changed since then run again "
                                      "(needs git; left out, every pass stands)")
    ap.add_argument("--include", action="append", default=[], type=Path,
                    help="an earlier ledger whose node ids stand as done (chained GPU calls)")
    ap.add_argument("--keep", action="append", default=[])
    ap.add_argument("--drop", action="append", default=[],
                    help="node ids containing this text run again (code they run changed outside "
                         "tests/; say what in the run's README)")
    ap.add_argument("--out", type=Path, default=ROOT / ".gpurun" / "passed.txt")
    ap.add_argument("--durations-out", type=Path,
                    help="also write {node id: seconds} (GPULAB_DURATIONS: longest tests start first)")
    args = ap.parse_args(argv)
    best = read_runs(args.runs)
    changed = changed_test_files(args.commit) - set(args.keep) if args.commit else set()
    done = {n for n, o in best.items() if o != "failed" and n.split("::")[0] not in changed}
    for ledger in args.include:
        done |= {line for line in ledger.read_text().splitlines() if line}
    dropped = {n for n in done if any(text in n for text in args.drop)}
    done = sorted(done - dropped)
    per_file = collections.defaultdict(collections.Counter)
    for n, o in best.items():
        per_file[n.split("::")[0]][o] += 1
    print(f"{'test file':42} passed  skip/xfail  failed")
    for f, c in sorted(per_file.items()):
        mark = "  (changed since: runs again)" if f in changed else ""
        print(f"{f:42} {c['passed']:6} {c['skipped'] + c['xfailed']:11} {c['failed']:7}{mark}")
    if dropped:
        print(f"\n{len(dropped)} node ids dropped (--drop): they run again")
    failed = sorted(n for n, o in best.items() if o == "failed")
    print(f"\n{len(done)} node ids stand as done compiled; {len(failed)} failed and run again:")
    for n in failed:
        print("  " + n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(n + "\n" for n in done))
    if args.durations_out:
        took = read_durations(args.runs)
        args.durations_out.write_text(json.dumps(dict(sorted(took.items())), indent=0) + "\n")
        print(f"wrote {args.durations_out}: {len(took)} tests, {sum(took.values()):.0f} s in all")
    print(f"\nwrote {args.out} (GPULAB_PASSED={args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

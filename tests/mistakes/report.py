"""Catch rate and hint accuracy of the mistake catalogue:
``PYTHONPATH=. python -m tests.mistakes.report [--verbose] [--json FILE]``."""
import argparse
import json
import sys
from collections import defaultdict

import torch

import gpulab  # noqa: F401  (sets the Triton mode first)

from . import catalogue, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for m in catalogue():
        as_is = run(m, with_needs=False)
        opted = run(m, with_needs=True) if m.needs else as_is
        rows.append((m, as_is, opted))
        if a.verbose or not opted.caught or not opted.right_cause:
            flag = "ok " if opted.caught and opted.right_cause else "MISS" if not opted.caught else "HINT"
            print(f"{flag} {m.id}" + (f"  [needs {', '.join(m.needs)}]" if m.needs else ""))
            if a.verbose or opted.caught:
                print("     " + opted.message.replace("\n", "\n     ")[:1500])
    n = len(rows)
    by_ex = defaultdict(int)
    for m, _, _ in rows:
        by_ex[m.exercise] += 1

    def rates(which):
        caught = sum(o.caught for o in which)
        right = sum(o.caught and o.right_cause for o in which)
        return caught, right

    c0, r0 = rates([r[1] for r in rows])
    c1, r1 = rates([r[2] for r in rows])
    print(f"\n{n} mistakes over {len(by_ex)} graded exercises "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_ex.items()))})")
    print(f"specs as they are:          caught {c0}/{n} ({100 * c0 / n:.0f}%), right cause named "
          f"{r0}/{c0} of those caught ({100 * r0 / max(c0, 1):.0f}%)")
    print(f"with the proposed opt-ins:  caught {c1}/{n} ({100 * c1 / n:.0f}%), right cause named "
          f"{r1}/{c1} ({100 * r1 / max(c1, 1):.0f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"id": m.id, "needs": sorted(m.needs), "caught": o.caught, "right_cause": o.right_cause,
                        "caught_with_opt_ins": p.caught, "right_cause_with_opt_ins": p.right_cause,
                        "message": p.message[:2000]} for m, o, p in rows], f, indent=1)
    return 0 if c1 == n and r1 == c1 else 1


if __name__ == "__main__":
    sys.exit(main())

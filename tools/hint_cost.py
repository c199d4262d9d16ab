"""How long each spec's own diagnosis takes on its GPU cases, measured on this CPU.

A check diagnoses a wrong output by recomputing plausible mistakes (``KernelSpec.hint``),
on the CPU in float64, also on a GPU host. On the GPU's cases that can cost far more than
the check itself: on 2026-12-01 twelve compiled tests held every worker of two 10-minute
calls, their paged-decode diagnosis trying a cut after every one of 20 000 tokens. This
runs each hint on each GPU case with a wrong output no mistake explains (the answer
× 1.03 + 0.01), so every hypothesis is recomputed: the worst case. One torch thread, as
in the GPU suite's workers.

usage: python tools/hint_cost.py [SPEC_SUBSTRING ...] [--over SECONDS]
"""
from __future__ import annotations

import argparse
import time

import torch

from gpulab.harness.spec import all_specs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="only specs whose name contains one of these")
    ap.add_argument("--over", type=float, default=0.0, help="print only hints slower than this (s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    slowest = 0.0
    for name, spec in all_specs().items():
        if spec.hint is None or (args.specs and not any(s in name for s in args.specs)):
            continue
        dtype = (spec.dtypes.get("gpu") or spec.dtypes["cpu"])[-1]
        for case in spec.cases.get("gpu", []):
            inputs = spec.make_inputs(case.params, dtype, "cpu", torch.Generator().manual_seed(0))
            for output, answer in spec.reference(**inputs).items():
                if not isinstance(answer, torch.Tensor) or not answer.is_floating_point():
                    continue
                wrong = (answer.double() * 1.03 + 0.01).to(answer.dtype)
                start = time.perf_counter()
                spec.hint(output, wrong, answer, inputs)
                took = time.perf_counter() - start
                slowest = max(slowest, took)
                if took >= args.over:
                    print(f"{name:30s} {case.label[:40]:40s} {output:8s} {took:7.2f} s", flush=True)
    print(f"slowest: {slowest:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

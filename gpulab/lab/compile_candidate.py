"""Compile a candidate for GPUs on a machine without one.

Triton's interpreter runs constructs no GPU compiler accepts (a ``raise`` in a branch
never taken, say) and never runs out of shared memory, so a kernel can pass every check
on a CPU and fail on the learner's first GPU. This runs a candidate's launcher on the
task's GPU cases with Triton's launches replaced by compilation for each target
(:mod:`gpulab.harness.compile_check`), in a process of its own started in compile-only
mode, with the same audit hook as the evaluator's workers. It prints one JSON object:
``{"ok": bool, "compiled": n, "failures": [...]}``.

    python -m gpulab.lab.compile_candidate TASK FILE [--arch 75,80,90] [--cases N]

:func:`compile_in_subprocess` is what the evaluator calls.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def compile_in_subprocess(task: str, path: str, archs=(75, 80, 90), cases: int | None = None,
                          timeout_s: float = 600.0) -> dict:
    """Compile candidate ``path`` of ``task`` for ``archs`` in a fresh compile-only process."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "GPULAB_COMPILE_ONLY": "1"}
    cmd = [sys.executable, "-m", __name__, task, str(path), "--arch", ",".join(map(str, archs))]
    if cases:
        cmd += ["--cases", str(cases)]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                           start_new_session=True)
    except subprocess.TimeoutExpired:
        return {"ok": False, "compiled": 0, "failures": [f"compiling took more than {timeout_s:.0f} s"]}
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode not in (0, 1) or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-8:]
        return {"ok": False, "compiled": 0, "failures": [f"the compile process failed ({r.returncode}): "
                                                          + " | ".join(tail)]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m gpulab.lab.compile_candidate")
    p.add_argument("task")
    p.add_argument("file")
    p.add_argument("--arch", default="75,80,90")
    p.add_argument("--cases", type=int, help="only the first N GPU cases")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "0" or os.environ.get("GPULAB_COMPILE_ONLY") != "1":
        env = {**os.environ, "TRITON_INTERPRET": "0", "GPULAB_COMPILE_ONLY": "1"}
        # __spec__.name: run as ``python -m``, this module's __name__ is "__main__"
        return subprocess.call([sys.executable, "-m", __spec__.name, *(argv if argv is not None else sys.argv[1:])],
                               env=env)
    import torch

    from .. import runtime
    from ..harness import compile_check
    from . import worker
    from .tasks import get_task
    runtime.COMPILE_ONLY = True
    task = get_task(a.task)
    spec = task.spec
    worker.install_audit(os.path.realpath(a.file), [tempfile.gettempdir(), os.path.expanduser("~/.triton"),
                                                    os.path.expanduser("~/.cache")])
    failures, done = [], {}
    try:
        launch = worker.load_candidate(os.path.realpath(a.file)).launch
    except Exception as e:
        print(json.dumps({"ok": False, "compiled": 0, "failures": [f"import: {type(e).__name__}: {e}"]}))
        return 1
    cases = spec.cases["gpu"][:a.cases] if a.cases else spec.cases["gpu"]
    for arch in (int(x) for x in a.arch.split(",")):
        runtime.COMPILE_TARGET = (arch // 10, arch % 10)
        rec = compile_check.Recorder({arch: compile_check.TARGETS.get(arch, 227 * 1024)})
        rec.done = done
        compile_check.install(rec)
        for case in cases:
            for dtype in [d for d in spec.dtypes["gpu"] if runtime.supports(d)]:
                rec.context = f"sm_{arch} [{case}, {str(dtype).replace('torch.', '')}]"
                inputs = spec.make_inputs(case.params, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
                outs = {k: torch.empty(s, dtype=d) for k, (s, d) in spec.outputs(inputs, dtype).items()}
                try:
                    spec.call(launch, inputs, outs)
                except Exception as e:
                    rec.failures.append(f"{rec.context}: the launcher raised {type(e).__name__}: {e}")
        failures += rec.failures
    print(json.dumps({"ok": not failures, "compiled": len(done), "failures": [f[:1500] for f in failures]}))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

"""Running candidates inside *this* process: for teaching, and to show why not to.

:func:`load` imports a candidate's source here (Triton reads kernel source from files,
so it goes through a scratch file). Notebook 09 uses it to hand candidates to the
learner's own verifier, and :class:`WeakVerifier` is the hurried harness the notebook
compares with the real evaluator: one shape, one fixed seed, the reference computed
before the kernel runs, ``torch.allclose`` on a fresh ``torch.empty`` output, no guard
regions, no poison, no separate process. Kernels that cheat, or that are wrong on shapes
it never tries, pass it.

Only run kernels here that cannot write out of bounds: the interpreter does not fault
on a store past the end of a tensor, it corrupts this process's heap (and may crash
it much later). Untrusted candidates belong in :class:`gpulab.lab.evaluate.Evaluator`.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing

from .. import runtime
from ..harness.checking import Guarded
from ..harness.spec import Case
from . import candidate as cand
from . import costmodel
from .evaluate import Verdict
from .tasks import Task, get_task

_SCRATCH = Path(tempfile.gettempdir()) / "gpulab-lab-inprocess"


def load(source: str):
    """Import a candidate's source in this process and return its module."""
    path = cand.write(source, _SCRATCH)
    name = f"gpulab_lab_inprocess_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tidy_case(task: Task) -> Case:
    """The kind of shape a hurried test picks: the task's first CPU case whose last size
    (the row length, say) is a power of two of at least 16 (else its last CPU case)."""
    cases = task.spec.cases["cpu"]
    for c in cases:
        sizes = [v for v in c.params.values() if isinstance(v, int) and not isinstance(v, bool)]
        if sizes and sizes[-1] >= 16 and sizes[-1] & (sizes[-1] - 1) == 0:
            return c
    return cases[-1]


class WeakVerifier:
    """One tidy shape (:func:`tidy_case` unless given), seed 0, reference first, allclose,
    no guards: what not to trust."""

    def __init__(self, case: Case | dict | None = None, dtype=torch.float32, seed: int = 0,
                 cost_model: bool = True):
        self.case = case if isinstance(case, Case) or case is None else Case("case", dict(case))
        self.dtype = dtype
        self.seed = seed
        self.cost_model = cost_model

    def __call__(self, task: Task | str, candidate: cand.Candidate | str) -> Verdict:
        task = get_task(task) if isinstance(task, str) else task
        c = candidate if isinstance(candidate, cand.Candidate) else cand.Candidate(task.name, candidate)
        spec = task.spec
        case = self.case or tidy_case(task)
        device = runtime.device()
        try:
            launch = load(c.source).launch
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                      for k, v in spec.inputs(case, self.dtype, seed=self.seed).items()}
            expected = spec.reference(**inputs)
            outputs = {k: torch.empty(s, dtype=d, device=device)
                       for k, (s, d) in spec.outputs(inputs, self.dtype).items()}
            spec.call(launch, inputs, outputs)
            atol, rtol = spec.tolerance(self.dtype)
            ok = all(torch.allclose(outputs[k].double(), expected[k].double(), atol=atol, rtol=rtol)
                     for k in expected)
        except Exception as e:
            return Verdict(task.name, c.id, "error", "raised", f"raised: {type(e).__name__}: {e}")
        if not ok:
            return Verdict(task.name, c.id, "rejected", "wrong-output", "wrong-output on the one shape tried")
        v = Verdict(task.name, c.id, "correct", "correct", f"allclose on {case} (seed {self.seed})", trials=1)
        if runtime.mode() == "compiled":         # timed here, as a hurried harness would
            inputs = spec.inputs(task.bench_case, task.bench_dtype, device=device, seed=self.seed)
            outputs = {k: torch.empty(s, dtype=d, device=device)
                       for k, (s, d) in spec.outputs(inputs, task.bench_dtype).items()}
            try:        # a cheat that only knows the checked shape fails here: no time, no fitness
                v.time_ms = float(triton.testing.do_bench(lambda: spec.call(launch, inputs, outputs),
                                                          return_mode="median"))
            except Exception as e:
                v.message += f"; timing on {task.bench_case} raised {type(e).__name__}: {e}"
        elif self.cost_model:
            est = costmodel.estimate(task, costmodel.measure(task, launch))
            v.cost_ms, v.cost = est["ms"], est
        return v


def verify(task: Task | str, launch, dtypes=(torch.float32,), repeats: int = 2, device=None) -> str | None:
    """A strong verifier that runs in this process (notebook 09's reference answer):
    every CPU case ``repeats`` times with fresh seeds, inputs in guarded buffers and
    checked unchanged, outputs poisoned and guarded and read back from the buffers it
    owns, the reference computed only after the kernel returned. Returns None if
    ``launch`` is correct, else what is wrong."""
    task = get_task(task) if isinstance(task, str) else task
    spec = task.spec
    device = device or runtime.device()
    for case in spec.cases["cpu"]:
        for dtype in dtypes:
            for _ in range(repeats):
                seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
                inputs = spec.inputs(case, dtype, device=device, seed=seed)
                kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
                g_in = {k: Guarded.wrap(v.shape, v.dtype, v.device, like=v) for k, v in inputs.items()
                        if isinstance(v, torch.Tensor)}
                g_out = {k: Guarded.wrap(s, d, device) for k, (s, d) in spec.outputs(inputs, dtype).items()}
                call_in = {k: (g_in[k].inner if k in g_in else v) for k, v in inputs.items()}
                spec.call(launch, call_in, {k: g.inner for k, g in g_out.items()})
                if device.type == "cuda":
                    torch.cuda.synchronize()
                where = f"{case}, {dtype}, seed {seed}"
                for k, g in {**g_in, **g_out}.items():
                    if any(g.guard_damage()):
                        return f"wrote outside `{k}` ({where})"
                for k, g in g_in.items():
                    now = g.buf[g.guard:g.guard + g.inner.numel()].view(kept[k].shape)
                    if not torch.equal(now, kept[k]):
                        return f"modified input `{k}` ({where})"
                expected = spec.reference(**kept)            # only after the kernel returned
                for k, exp in expected.items():
                    g = g_out[k]
                    got = g.buf[g.guard:g.guard + exp.numel()].view(exp.shape)   # our buffer, not its tensor
                    atol, rtol = spec.tolerance(dtype, k)
                    if not bool(torch.isclose(got.double(), exp.double(), atol=atol, rtol=rtol).all()):
                        return f"output `{k}` is wrong ({where})"
    return None

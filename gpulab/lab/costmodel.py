r"""A stated cost model: the search's fitness where there is no GPU to time kernels on.

Timings in Triton's interpreter say nothing about a GPU, so on a CPU a candidate's
fitness is *modelled*. The model is simple, stated here in full, and measured from
what the candidate really does, not from what its source claims:

    t = L · t_launch + max(ρ · B / BW, F / peak) / (U · V)

* ``B`` and ``F``: the bytes and FLOPs the task needs at its timing size (the spec's
  ``bytes_moved`` and ``flops``: each input read once, each output written once).
* ``ρ`` (traffic ratio): the bytes the candidate's loads and stores really touched in
  the interpreter on the task's *model case* (masked-off lanes excluded), divided by the
  minimum for that case. ρ = 1 is ideal; an online softmax that reads x twice has
  ρ ≈ 1.5; a kernel that skips part of its work has ρ < 1 and looks *faster*: the model
  trusts the evaluator to reject it.
* ``L``: kernel launches at the timing size, from a *dry run* of the launcher on
  ``meta`` tensors with launches recorded instead of run; ``t_launch`` = 3 µs.
* ``U`` (utilisation), from the dry run's largest launch: ``P`` programs of ``W`` warps
  on 132 SMs holding ``s = min(32, 64 // W)`` programs each run in
  ``waves = ceil(P / (132 s))``; ``U = P / (waves · 132 s) · min(1, min(P, 132 s) · W / (132 · 32))``
  (the last wave's idle SMs, and too few warps in flight to cover memory latency).
* ``V`` (vector efficiency): ``e`` = elements of the largest load or store one program
  issues (measured in the interpreter) per thread, ``e = E / (32 W)``;
  ``V = min(1, e / 4) · min(1, 32 / e)``: fewer than 4 elements per thread cannot use
  128-bit accesses, more than 32 spill registers.
* Ceilings of an H200: BW = 4.0 TB/s (measured copy), peak = 700 TFLOP/s for
  ``matmul`` tasks (tensor cores), 60 TFLOP/s otherwise (CUDA cores, fp32).

It is a model: it ranks launch configurations the way a GPU roughly does (too few
programs, too few or too many elements per thread, extra passes over memory, extra
launches) and nothing more. :func:`measure` runs inside the candidate's process (it
needs the candidate's launcher); :func:`estimate` turns the measurements into a time in
the evaluator's process.
"""
from __future__ import annotations

import inspect
import math

import torch

SMS = 132
BANDWIDTH = 4.0e12
PEAK_TENSOR = 700e12
PEAK_CUDA_CORES = 60e12
LAUNCH_S = 3e-6
MODEL = ("t = L·3µs + max(ρ·B/4.0 TB/s, F/peak) / (U·V); ρ measured traffic ratio, "
         "U SM utilisation and V vector efficiency from the launch geometry (gpulab.lab.costmodel)")


# -- measurements (in the candidate's process) -----------------------------------------------
class _Traffic:
    """Counts the bytes the interpreter's loads and stores touch."""

    def __init__(self):
        self.loaded = 0
        self.stored = 0
        self.largest = 0

    def install(self):
        from triton.runtime import interpreter
        builder = interpreter.InterpreterBuilder
        self.builder = builder
        self.orig = (builder.create_masked_load, builder.create_masked_store)
        load, store = self.orig
        traffic = self

        def counted_load(b, ptrs, mask, other, *args):
            traffic.count(ptrs, mask, load=True)
            return load(b, ptrs, mask, other, *args)

        def counted_store(b, ptrs, value, mask, *args):
            traffic.count(ptrs, mask, load=False)
            return store(b, ptrs, value, mask, *args)
        builder.create_masked_load, builder.create_masked_store = counted_load, counted_store

    def count(self, ptrs, mask, load: bool):
        from triton.runtime import interpreter
        elem = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        n = int(mask.data.sum()) * elem
        if load:
            self.loaded += n
        else:
            self.stored += n
        self.largest = max(self.largest, int(ptrs.data.size))

    def remove(self):
        self.builder.create_masked_load, self.builder.create_masked_store = self.orig


def _constexpr_names(fn) -> set:
    names = set()
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        if ann is not inspect.Parameter.empty and "constexpr" in str(ann):
            names.add(p.name)
    return names


class _DryRun:
    """Records every kernel launch (grid, warps, constexprs) instead of running it."""

    def __init__(self):
        self.launches: list[dict] = []

    def install(self):
        from triton.runtime import interpreter
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        self.saved = [(interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run),
                      (JITFunction, "run", JITFunction.run), (Autotuner, "run", Autotuner.run)]
        rec = self

        def run(kernel, *args, grid=None, warmup=False, **kwargs):
            rec.record(kernel, args, grid, kwargs)

        def autotune_run(tuner, *args, **kwargs):
            config = tuner.configs[0]
            tuner.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        interpreter.InterpretedFunction.run = run
        JITFunction.run = run
        Autotuner.run = autotune_run

    def record(self, kernel, args, grid, kwargs):
        fn = kernel.fn
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
        bound.apply_defaults()
        meta = dict(bound.arguments)
        g = grid(meta) if callable(grid) else grid
        g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
        consts = {k: v for k, v in meta.items() if k in _constexpr_names(fn)
                  and isinstance(v, (int, bool, str, float))}
        self.launches.append({"kernel": fn.__name__, "programs": math.prod(g),
                              "num_warps": int(options.get("num_warps") or 4),
                              "num_stages": int(options.get("num_stages") or 3),
                              "constexprs": {k: (v if not isinstance(v, bool) else int(v)) for k, v in consts.items()
                                             if not isinstance(v, str)}})

    def remove(self):
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)


def _model_inputs(spec, case, dtype, device):
    gen = torch.Generator()           # a CPU generator also serves meta tensors
    gen.manual_seed(1234)
    inputs = spec.make_inputs(case.params, dtype, torch.device(device), gen)
    outputs = {k: torch.empty(s, dtype=d, device=device) for k, (s, d) in spec.outputs(inputs, dtype).items()}
    return inputs, outputs


def measure(task, launch) -> dict:
    """Run in the candidate's process, in the interpreter: traffic on the model case,
    geometry of a dry run at the timing size."""
    spec = task.spec
    inputs, outputs = _model_inputs(spec, task.model, task.model_dtype, "cpu")
    traffic = _Traffic()
    traffic.install()
    try:
        spec.call(launch, inputs, outputs)
    finally:
        traffic.remove()
    bench = task.bench_case
    meta_inputs, meta_outputs = _model_inputs(spec, bench, task.bench_dtype, "meta")
    dry = _DryRun()
    dry.install()
    try:
        spec.call(launch, meta_inputs, meta_outputs)
    finally:
        dry.remove()
    return {"loaded": traffic.loaded, "stored": traffic.stored, "largest_access": traffic.largest,
            "launches": dry.launches}


# -- the model (in the evaluator's process) ---------------------------------------------------
def utilisation(programs: int, warps: int) -> float:
    slots = max(1, min(32, 64 // max(1, warps)))
    capacity = SMS * slots
    waves = max(1, math.ceil(programs / capacity))
    tail = programs / (waves * capacity)
    in_flight = min(programs, capacity) * warps / (SMS * 32)
    return max(1e-3, tail * min(1.0, in_flight))


def vector_efficiency(elements: int, warps: int) -> float:
    e = max(elements, 1) / (32 * max(1, warps))
    return max(1e-3, min(1.0, e / 4) * min(1.0, 32 / e))


def estimate(task, measured: dict) -> dict:
    """Modelled time (ms) of a candidate from :func:`measure`'s numbers, with each term."""
    spec = task.spec
    minimum = spec.bytes_moved(task.model.params, task.model_dtype)
    rho = (measured["loaded"] + measured["stored"]) / max(1.0, minimum)
    rho = min(100.0, max(0.01, rho))
    bench, dtype = task.bench_case.params, task.bench_dtype
    b = spec.bytes_moved(bench, dtype)
    f = spec.flops(bench, dtype) if spec.flops else 0.0
    peak = PEAK_TENSOR if task.kind == "matmul" else PEAK_CUDA_CORES
    launches = measured["launches"] or [{"programs": 1, "num_warps": 4}]
    main = max(launches, key=lambda r: r["programs"] * r["num_warps"])
    u = utilisation(main["programs"], main["num_warps"])
    v = vector_efficiency(measured["largest_access"], main["num_warps"])
    work_s = max(rho * b / BANDWIDTH, f / peak)
    t = len(launches) * LAUNCH_S + work_s / (u * v)
    return {"ms": t * 1e3, "traffic_ratio": rho, "launches": len(launches), "programs": main["programs"],
            "num_warps": main["num_warps"], "utilisation": u, "vector_efficiency": v,
            "ideal_ms": max(b / BANDWIDTH, f / peak) * 1e3}

"""Compile every kernel for real GPUs on a machine without one.

The interpreter hides errors that only the compiler sees (constructs it cannot
lower, a ``raise`` in a kernel, blocks that overflow shared memory). This module
runs each spec's launcher on CPU tensors with Triton's launch replaced by
``triton.compile`` for sm_75 (Colab's T4), sm_80 (A100) and sm_90 (H100/H200),
so kernels are compiled with exactly the arguments, block sizes and autotune
configurations their launchers would use on a GPU.

Run as ``python -m gpulab.harness.compile_check`` (it must start in a fresh process:
Triton's mode is fixed at import). Exit status 1 on any failure. Of each autotuned
kernel's configs it compiles the first and the one with the largest tiles, and a kernel
with the same constants for float16 or for bfloat16 pointers, not both;
``GPULAB_COMPILE_ALL_CONFIGS=1`` compiles them all. The inputs hold no random data here
(only shapes and dtypes reach the compiler: ``spec.randn``).
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

TARGETS = {75: 64 * 1024, 80: 163 * 1024, 90: 227 * 1024}   # arch -> shared memory per block
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
           "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64",
           "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def _signature(kernel, args, kwargs):
    import torch
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs and kwargs[k] is not None}
    for k in list(kwargs):
        if k in _OPTIONS:
            kwargs.pop(k)
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    sig, consts = {}, {}
    for p in kernel.params:
        v = bound.arguments[p.name]
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[str(v.dtype).replace("torch.", "")]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {p.name}={v!r}")
    return sig, consts, options


def _half_as_one(sig: dict) -> dict:
    """The signature with float16 and bfloat16 pointers alike: a kernel compiled for one is
    not compiled again for the other with the same constants (the two lower alike; float16
    is compiled on sm_75, which has no bfloat16, and bfloat16 on sm_80/90). Compiling both
    took a fifth of the check's time on a machine with a cold Triton cache.
    ``GPULAB_COMPILE_ALL_CONFIGS=1`` compiles both."""
    if os.environ.get("GPULAB_COMPILE_ALL_CONFIGS") == "1":
        return sig
    return {k: ("*half" if v in ("*fp16", "*bf16") else v) for k, v in sig.items()}


class Recorder:
    """Replaces kernel launches with compilation for every target."""

    def __init__(self, targets=TARGETS):
        self.targets = targets
        self.done: dict = {}
        self.failures: list[str] = []
        self.context = ""

    def compile(self, kernel, args, kwargs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        sig, consts, options = _signature(kernel, args, kwargs)
        for arch, smem_limit in self.targets.items():
            key = (kernel.fn.__qualname__, kernel.fn.__module__, tuple(sorted(_half_as_one(sig).items())),
                   tuple(sorted((k, repr(v)) for k, v in consts.items())),
                   tuple(sorted(options.items())), arch)
            if key in self.done:
                continue
            label = (f"{kernel.fn.__name__} sm_{arch} "
                     + ", ".join(f"{k}={v}" for k, v in {**consts, **options}.items()))
            try:
                t = time.time()
                c = triton.compile(ASTSource(kernel, signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", arch, 32), options=options)
                shared = int(getattr(c.metadata, "shared", 0) or 0)
                if shared > smem_limit:
                    raise RuntimeError(f"needs {shared} bytes of shared memory, sm_{arch} has {smem_limit}")
                self.done[key] = (label, time.time() - t, shared)
            except Exception as e:
                self.done[key] = (label, 0.0, -1)
                self.failures.append(f"{self.context}: {label}: {type(e).__name__}: {str(e).strip()[:600]}")


def _footprint(config) -> int:
    size = 1
    for k, v in config.kwargs.items():
        if k.startswith("BLOCK") and isinstance(v, int):
            size *= v
    return size * max(1, config.num_stages or 1)


def _representatives(configs) -> list:
    """The first autotune config and the one with the largest tiles (the likeliest to
    overflow shared memory): compiling every config of every kernel for three targets
    would take CI far longer than the rest of the suite."""
    if len(configs) <= 2 or os.environ.get("GPULAB_COMPILE_ALL_CONFIGS") == "1":
        return list(configs)
    biggest = max(configs, key=_footprint)
    return [configs[0]] + ([biggest] if biggest is not configs[0] else [])


def install(recorder: Recorder) -> None:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid=None, warmup=False, **kwargs):
        recorder.compile(self, args, kwargs)

    def autotune_run(self, *args, **kwargs):
        for config in _representatives(self.configs):
            merged = {**kwargs, **config.all_kwargs()}
            self.fn.run(*args, **merged)

    JITFunction.run = run
    Autotuner.run = autotune_run


def check_all(names=None, verbose=True, archs=None) -> Recorder:
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["GPULAB_COMPILE_ONLY"] = "1"
    import torch
    from gpulab import runtime
    runtime.refresh_mode()
    runtime.COMPILE_ONLY = True
    from gpulab.harness.spec import all_specs
    specs = all_specs()
    done, failures = {}, []
    for arch, smem in TARGETS.items():
        if archs and arch not in archs:
            continue
        # Launchers ask runtime.compute_capability() to choose architecture-dependent
        # paths (int8 dots, big tiles): answer as the target GPU would.
        runtime.COMPILE_TARGET = (arch // 10, arch % 10)
        runtime.COMPILE_SHARED_MEMORY = smem
        rec = Recorder({arch: smem})
        rec.done = done
        install(rec)
        _launch_all(rec, specs, names)
        failures += rec.failures
    rec.failures = failures
    if verbose:
        for label, secs, shared in rec.done.values():
            if shared >= 0:
                print(f"ok  {label} ({secs:.1f}s, {shared} B shared)")
        for f in rec.failures:
            print("FAIL", f)
    return rec


def _launch_all(rec, specs, names):
    import torch

    from gpulab import runtime
    for name in names or sorted(specs):
        spec = specs[name]
        if spec.implementation is None:
            continue
        # Every target compiles the GPU cases; the small CPU cases (tiny head dims, float32)
        # only for sm_75, where a learner on a free Colab T4 is likeliest to run them.
        arch = next(iter(rec.targets))
        for where in (("gpu", "cpu") if arch == 75 else ("gpu",)):
            for case in spec.cases.get(where, []):
                # What each GPU really runs: no bf16 below sm_80 (runtime.supports).
                for dtype in [d for d in spec.dtypes[where] if runtime.supports(d)]:
                    rec.context = f"{name} sm_{next(iter(rec.targets))} [{case}, {str(dtype).replace('torch.', '')}]"
                    inputs = spec.make_inputs(case.params, dtype, torch.device("cpu"),
                                              torch.Generator().manual_seed(0))
                    outs = ({k: torch.empty(s, dtype=d) for k, (s, d) in spec.outputs(inputs, dtype).items()}
                            if spec.outputs is not None else None)
                    try:
                        spec.call(spec.implementation, inputs, outs)
                    except Exception as e:
                        rec.failures.append(f"{rec.context}: launcher raised {type(e).__name__}: {e}")


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if os.environ.get("TRITON_INTERPRET") != "0" or os.environ.get("GPULAB_COMPILE_ONLY") != "1":
        # gpulab is already imported in interpreter mode: start over in compile-only mode.
        import subprocess
        # every config compiled, also under the test suite (which turns autotuning off)
        env = {**os.environ, "TRITON_INTERPRET": "0", "GPULAB_COMPILE_ONLY": "1", "GPULAB_AUTOTUNE": "1"}
        return subprocess.call([sys.executable, "-m", "gpulab.harness.compile_check", *argv], env=env)
    ap = argparse.ArgumentParser(prog="gpulab compile-check",
                                 description="Compile every kernel (or the named specs' kernels) for "
                                             "sm_75, sm_80 and sm_90 without a GPU.")
    ap.add_argument("names", nargs="*", help="kernel specs to compile (default: all)")
    ap.add_argument("--arch", default=None,
                    help="targets, comma-separated (e.g. 75 or 80,90; default: " +
                         ",".join(str(a) for a in TARGETS) + "); CI runs them in parallel")
    a = ap.parse_args(argv)
    archs = None
    if a.arch is not None:
        try:
            archs = {int(x) for x in a.arch.split(",")}
        except ValueError:
            ap.error(f"--arch takes numbers such as 75 or 80,90, got {a.arch!r}")
        if not archs <= set(TARGETS):
            ap.error(f"--arch: unknown target(s) {sorted(archs - set(TARGETS))}; "
                     f"the targets are {sorted(TARGETS)}")
    from gpulab.harness.spec import all_specs
    unknown = [n for n in a.names if n not in all_specs()]
    if unknown:
        ap.error(f"no kernel spec named {', '.join(unknown)}; the specs are: {', '.join(sorted(all_specs()))}")
    names = a.names or None
    rec = check_all(names, archs=archs)
    print(f"{len(rec.done)} compilations, {len(rec.failures)} failures")
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())

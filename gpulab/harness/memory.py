"""Activation memory: what autograd keeps alive between a layer's forward and backward.

* :func:`saved_bytes` counts the tensors autograd saves for the backward of one call
  (through ``torch.autograd.graph.saved_tensors_hooks``): the same figure on a CPU and
  a GPU, so notebooks can show it anywhere.
* :func:`gpu_activation_memory` measures it the direct way with ``torch.cuda``'s
  allocator: what is still allocated after the forward, and the peak over forward and
  backward.
* :func:`activation_memory` compares several implementations of one layer: measured
  now on a GPU (``save=True`` writes ``gpulab/results/memory/NAME.json``), the saved
  GPU figures elsewhere, like :mod:`gpulab.harness.bench` does for timings.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Callable

import torch

from .. import runtime

RESULTS = Path(__file__).resolve().parent.parent / "results" / "memory"


def saved_bytes(fn: Callable, *args) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(*args)`` (each
    distinct tensor counted once, inputs included)."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def gpu_activation_memory(fn: Callable, rows: int, cols: int, dtype=torch.bfloat16) -> dict:
    """GPU only: the memory ``fn(x, w)`` (x [rows, cols], w [cols]) keeps alive after its
    forward for the backward, its output excluded, and its peak over forward + backward,
    in MiB above what was allocated before (x, w and dy)."""
    x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.ones(cols, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, cols, device="cuda", dtype=dtype)
    fn(x, w).backward(dy)                     # compile and autotune outside the measurement
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn(x, w)
    kept = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"kept_MiB": kept / 2**20, "peak_MiB": peak / 2**20}


def activation_memory(name: str, what: str, fns: dict[str, Callable], rows: int, cols: int,
                      dtype=torch.bfloat16, save: bool = False) -> dict:
    """Activation memory of each ``fns`` entry (the first is the one the others are
    compared with): measured on a GPU, loaded from ``RESULTS/NAME.json`` elsewhere."""
    if runtime.mode() != "compiled":
        return load(name)
    result = {"what": what, "date": datetime.date.today().isoformat(), "gpu": runtime.gpu_name(),
              "versions": runtime.versions(),
              "rows": {label: gpu_activation_memory(fn, rows, cols, dtype) for label, fn in fns.items()}}
    if save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def format_memory(result: dict) -> str:
    """One line per implementation, then each one against the first."""
    rows = list(result["rows"].items())
    lines = [f"{result['what']}, {result['gpu']} ({result['date']})"]
    for label, r in rows:
        lines.append(f"  {label:32} kept after forward {r['kept_MiB']:8.2f} MiB   "
                     f"peak over fwd+bwd {r['peak_MiB']:7.1f} MiB")
    base_label, base = rows[0]
    for label, r in rows[1:]:
        lines.append(f"  {label}: keeps {r['kept_MiB']:.2f} MiB instead of {base['kept_MiB']:.0f} MiB "
                     f"(the inputs, kept by both, are not counted); peak "
                     f"{100 * (1 - r['peak_MiB'] / base['peak_MiB']):.0f}% lower than {base_label}")
    return "\n".join(lines)

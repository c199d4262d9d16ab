"""The lab's suite: KernelBench-style tasks, each a PyTorch reference, an input
generator with awkward shapes and a timing size, and a correct seed kernel.

A task is a thin layer over a :class:`~gpulab.harness.spec.KernelSpec` (the course's own
where one exists, else one of :mod:`gpulab.grading.lab`'s): the spec gives the
reference, the inputs, the correctness cases and tolerances, the bytes and FLOPs; the
task adds the timing case, the eager PyTorch baseline it is compared with, the case the
CPU cost model runs, and the seed template (:mod:`gpulab.lab.seeds`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..harness.spec import Case, KernelSpec, get as get_spec
from ..mlgru import scan_torch
from . import candidate as cand

SEEDS = Path(__file__).resolve().parent / "seeds"


@dataclass(frozen=True)
class Task:
    name: str
    spec_name: str
    kind: str                   # elementwise, reduction, softmax, norm, matmul, scan
    bench: str                  # label of the spec's "bench" case timed on a GPU
    model: Case                 # small case the CPU cost model runs in the interpreter
    model_dtype: torch.dtype = torch.bfloat16
    eager: Callable[[dict], Any] | None = None    # default: the spec's first baseline

    @property
    def spec(self) -> KernelSpec:
        return get_spec(self.spec_name)

    @property
    def summary(self) -> str:
        return self.spec.summary.replace(" (lab task)", "")

    @property
    def seed_path(self) -> Path:
        return SEEDS / f"{self.name}.py"

    @property
    def seed_source(self) -> str:
        return self.seed_path.read_text()

    @property
    def gene_space(self) -> dict:
        return cand.gene_space(self.seed_source)

    def seed(self) -> cand.Candidate:
        """The seed candidate (the template at its default genes)."""
        src = self.seed_source
        return cand.Candidate(task=self.name, source=src, genes=cand.genes_of(src))

    def seed_module(self):
        return importlib.import_module(f"{__package__}.seeds.{self.name}")

    @property
    def bench_case(self) -> Case:
        cases = self.spec.cases.get("bench", [])
        for c in cases:
            if c.label == self.bench:
                return c
        raise KeyError(f"task {self.name}: spec {self.spec_name} has no bench case {self.bench!r}")

    @property
    def bench_dtype(self) -> torch.dtype:
        return (self.spec.bench_dtypes or [torch.bfloat16])[0]

    def eager_fn(self) -> Callable[[dict], Any]:
        if self.eager is not None:
            return self.eager
        if not self.spec.baselines:
            raise ValueError(f"task {self.name}: spec {self.spec_name} has no PyTorch baseline")
        return next(iter(self.spec.baselines.values()))

    def render(self, genes: dict) -> cand.Candidate:
        """A candidate from the seed template with ``genes`` (others at their defaults)."""
        src = cand.render(self.seed_source, genes)
        return cand.Candidate(task=self.name, source=src, genes=cand.genes_of(src), operator="render")


def _mlgru_eager(inp):
    return scan_torch(inp["f"], inp["i"], inp["h0"])


_TASKS = [
    Task("vector_add", "vector_add", "elementwise", "n=2^24", Case("model", dict(n=1 << 14))),
    Task("add_mul", "lab_add_mul", "elementwise", "n=2^24", Case("model", dict(n=1 << 14))),
    Task("silu_mul", "lab_silu_mul", "elementwise", "4096x14336", Case("model", dict(rows=2, cols=14336))),
    Task("bias_gelu", "lab_bias_gelu", "elementwise", "4096x16384", Case("model", dict(rows=4, cols=16384))),
    Task("row_sum", "lab_row_sum", "reduction", "8192x8192", Case("model", dict(rows=4, cols=8192))),
    Task("logsumexp", "lab_logsumexp", "reduction", "8192x8192", Case("model", dict(rows=4, cols=8192))),
    Task("softmax", "softmax", "softmax", "8192x8192", Case("model", dict(rows=4, cols=8192))),
    Task("rmsnorm", "lab_rmsnorm", "norm", "8192x4096", Case("model", dict(rows=4, cols=4096))),
    Task("layernorm", "lab_layernorm", "norm", "8192x4096", Case("model", dict(rows=4, cols=4096))),
    Task("rmsnorm_quant", "rmsnorm_quant", "norm", "8192x8192", Case("model", dict(rows=4, cols=8192))),
    Task("gemv", "lab_gemv", "matmul", "M=1 K=N=8192", Case("model", dict(m=1, k=8192, n=128))),
    Task("matmul_bias_relu", "lab_matmul_bias_relu", "matmul", "4096^3",
         Case("model", dict(m=128, k=256, n=128)), model_dtype=torch.float16),
    Task("cumsum", "lab_cumsum", "scan", "4096x8192", Case("model", dict(rows=4, cols=8192))),
    Task("mlgru_scan", "mlgru_scan_recurrent", "scan", "B16 T8192 D512",
         Case("model", dict(B=2, T=32, D=512)), eager=_mlgru_eager),
]
TASKS: dict[str, Task] = {t.name: t for t in _TASKS}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"no lab task named {name!r}; the tasks are: {', '.join(TASKS)}") from None

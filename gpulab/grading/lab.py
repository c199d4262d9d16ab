"""Grading of the kernel laboratory (notebook 09): the specs of the lab's own tasks and
the checks of the notebook's exercises.

The lab's suite (:mod:`gpulab.lab.tasks`) reuses the course's specs where a kernel
already exists (``vector_add``, ``softmax``, ``rmsnorm_quant``, ``mlgru_scan_recurrent``)
and adds the KernelBench-style tasks below, each a float64 reference, an input
generator with awkward shapes, tolerances, bytes and FLOPs, and the eager PyTorch
baseline. Their ``implementation`` is the task's seed candidate
(:mod:`gpulab.lab.seeds`), so the ordinary checks and the compile check cover the seeds.
"""
from __future__ import annotations

import math
import os
import random
import threading
import warnings

import numpy as np

import torch
import torch.nn.functional as F

from ..harness.checking import CheckFailure, check, scenario_check
from ..harness.spec import Case, KernelSpec, bytes_of, randn
from ..lab import candidate as cand
from ..lab import inprocess
from ..lab.planted import PLANTED
from ..lab.tasks import get_task
from ..lab.seeds import (add_mul, bias_gelu, cumsum, gemv, layernorm, logsumexp, matmul_bias_relu,
                         rmsnorm, row_sum, silu_mul)

RMSNORM_EPS = rmsnorm.EPS
LAYERNORM_EPS = layernorm.EPS
_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
_CPU_DTYPES = [torch.float32, torch.float16]
_GPU_DTYPES = [torch.float32, torch.bfloat16]

# Row-shaped tasks share their shapes: one element, odd rows, ragged tails, many short rows.
_ROWS_CPU = [Case("one element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
             Case("tail", dict(rows=7, cols=1000)), Case("many short rows", dict(rows=65, cols=33))]
_ROWS_GPU = [Case("one element", dict(rows=1, cols=1)), Case("odd row", dict(rows=3, cols=7)),
             Case("tail", dict(rows=37, cols=1000)), Case("wide", dict(rows=129, cols=12345)),
             Case("many short rows", dict(rows=5000, cols=96))]
_FLAT_CPU = [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
             Case("blocks + tail", dict(n=3 * 1024 + 77))]
_FLAT_GPU = [Case("one element", dict(n=1)), Case("tail", dict(n=1000)),
             Case("many blocks + tail", dict(n=(1 << 20) + 3))]


def _rows_elems(p):
    return p["rows"] * p["cols"]


# -- add_mul: (x + y) * z -------------------------------------------------------------------
def _add_mul_inputs(p, dtype, device, gen):
    n = p["n"]
    return {"x": randn((n,), dtype, device, gen), "y": randn((n,), dtype, device, gen, offset=0.5),
            "z": randn((n,), dtype, device, gen, scale=2.0)}


def add_mul_reference(x, y, z):
    return {"out": (x.double() + y.double()) * z.double()}


ADD_MUL = KernelSpec(
    name="lab_add_mul", summary="out = (x + y) * z, elementwise (lab task)",
    args=("x", "y", "z", "out"), make_inputs=_add_mul_inputs, reference=add_mul_reference,
    outputs=lambda inp, dtype: {"out": (inp["x"].shape, dtype)}, implementation=add_mul.launch,
    cases={"cpu": _FLAT_CPU, "gpu": _FLAT_GPU, "bench": [Case("n=2^24", dict(n=1 << 24))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES}, tolerances=_TOL,
    bytes_moved=lambda p, dtype: 4 * p["n"] * bytes_of(dtype), flops=lambda p, dtype: 2 * p["n"],
    baselines={"torch": lambda inp: (inp["x"] + inp["y"]) * inp["z"]}, read_inputs=("x", "y", "z"),
    bench_dtypes=[torch.bfloat16])


# -- silu_mul: SwiGLU's activation ------------------------------------------------------------
def _silu_mul_inputs(p, dtype, device, gen):
    shape = (p["rows"], p["cols"])
    return {"gate": randn(shape, dtype, device, gen, scale=3.0), "up": randn(shape, dtype, device, gen)}


def silu_mul_reference(gate, up):
    g = gate.double()
    return {"out": g * torch.sigmoid(g) * up.double()}


SILU_MUL = KernelSpec(
    name="lab_silu_mul", summary="out = silu(gate) * up, SwiGLU's activation (lab task)",
    args=("gate", "up", "out"), make_inputs=_silu_mul_inputs, reference=silu_mul_reference,
    outputs=lambda inp, dtype: {"out": (inp["gate"].shape, dtype)}, implementation=silu_mul.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("4096x14336", dict(rows=4096, cols=14336))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES}, tolerances=_TOL,
    bytes_moved=lambda p, dtype: 3 * _rows_elems(p) * bytes_of(dtype),
    flops=lambda p, dtype: 6 * _rows_elems(p),
    baselines={"torch": lambda inp: F.silu(inp["gate"]) * inp["up"]}, read_inputs=("gate", "up"),
    bench_dtypes=[torch.bfloat16])


# -- bias_gelu --------------------------------------------------------------------------------
def _bias_gelu_inputs(p, dtype, device, gen):
    return {"x": randn((p["rows"], p["cols"]), dtype, device, gen, scale=2.0),
            "bias": randn((p["cols"],), dtype, device, gen, scale=0.5)}


def bias_gelu_reference(x, bias):
    return {"out": F.gelu(x.double() + bias.double(), approximate="tanh")}


BIAS_GELU = KernelSpec(
    name="lab_bias_gelu", summary="out = gelu_tanh(x + bias), bias broadcast over rows (lab task)",
    args=("x", "bias", "out"), make_inputs=_bias_gelu_inputs, reference=bias_gelu_reference,
    outputs=lambda inp, dtype: {"out": (inp["x"].shape, dtype)}, implementation=bias_gelu.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("4096x16384", dict(rows=4096, cols=16384))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES}, tolerances=_TOL,
    bytes_moved=lambda p, dtype: (2 * _rows_elems(p) + p["cols"]) * bytes_of(dtype),
    flops=lambda p, dtype: 12 * _rows_elems(p),
    baselines={"torch": lambda inp: F.gelu(inp["x"] + inp["bias"], approximate="tanh")},
    read_inputs=("x", "bias"), bench_dtypes=[torch.bfloat16])


# -- row reductions: sum and logsumexp --------------------------------------------------------
def _row_inputs(p, dtype, device, gen):
    return {"x": randn((p["rows"], p["cols"]), dtype, device, gen, offset=0.25)}


def row_sum_reference(x):
    return {"y": x.double().sum(-1)}


# float32 sums of up to 12K terms of size ~1: ~1e-4 absolute from the summation order.
_SUM_TOL = {d: (2e-3, 1e-4) for d in (torch.float32, torch.float16, torch.bfloat16)}

ROW_SUM = KernelSpec(
    name="lab_row_sum", summary="y = x.sum(-1) in float32 (lab task)",
    args=("x", "y"), make_inputs=_row_inputs, reference=row_sum_reference,
    outputs=lambda inp, dtype: {"y": ((inp["x"].shape[0],), torch.float32)}, implementation=row_sum.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("8192x8192", dict(rows=8192, cols=8192))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES}, tolerances=_SUM_TOL,
    bytes_moved=lambda p, dtype: _rows_elems(p) * bytes_of(dtype) + 4 * p["rows"],
    flops=lambda p, dtype: _rows_elems(p),
    baselines={"torch": lambda inp: inp["x"].sum(-1, dtype=torch.float32)}, read_inputs=("x",),
    bench_dtypes=[torch.bfloat16])


def _lse_inputs(p, dtype, device, gen):
    # Large, row-dependent offsets: exp without the max overflows.
    x = randn((p["rows"], p["cols"]), torch.float32, device, gen, scale=3.0)
    x = x + torch.linspace(100, -60, p["rows"], device=device)[:, None]
    return {"x": x.to(dtype)}


def logsumexp_reference(x):
    return {"y": torch.logsumexp(x.double(), dim=-1)}


LOGSUMEXP = KernelSpec(
    name="lab_logsumexp", summary="y = logsumexp(x, -1) in float32, one streaming pass (lab task)",
    args=("x", "y"), make_inputs=_lse_inputs, reference=logsumexp_reference,
    outputs=lambda inp, dtype: {"y": ((inp["x"].shape[0],), torch.float32)}, implementation=logsumexp.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("8192x8192", dict(rows=8192, cols=8192))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES},
    tolerances={d: (2e-5, 2e-6) for d in (torch.float32, torch.float16, torch.bfloat16)},
    bytes_moved=lambda p, dtype: _rows_elems(p) * bytes_of(dtype) + 4 * p["rows"],
    flops=lambda p, dtype: 4 * _rows_elems(p),
    baselines={"torch": lambda inp: torch.logsumexp(inp["x"].float(), dim=-1)}, read_inputs=("x",),
    bench_dtypes=[torch.bfloat16])


# -- norms ------------------------------------------------------------------------------------
def _norm_inputs(p, dtype, device, gen):
    x = randn((p["rows"], p["cols"]), dtype, device, gen, scale=2.0, offset=0.3)
    w = (1.0 + 0.5 * torch.randn(p["cols"], generator=gen, device=device)).to(dtype)
    return {"x": x, "weight": w}


def rmsnorm_reference(x, weight):
    xd = x.double()
    return {"y": xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + RMSNORM_EPS) * weight.double()}


RMSNORM = KernelSpec(
    name="lab_rmsnorm", summary="RMSNorm, y = x / rms(x) * w (lab task)",
    args=("x", "weight", "y"), make_inputs=_norm_inputs, reference=rmsnorm_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)}, implementation=rmsnorm.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("8192x4096", dict(rows=8192, cols=4096))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES}, tolerances=_TOL,
    bytes_moved=lambda p, dtype: (2 * _rows_elems(p) + p["cols"]) * bytes_of(dtype),
    flops=lambda p, dtype: 4 * _rows_elems(p),
    baselines={"torch": lambda inp: F.rms_norm(inp["x"], (inp["x"].shape[-1],), inp["weight"], RMSNORM_EPS)},
    read_inputs=("x", "weight"), bench_dtypes=[torch.bfloat16])


def _layernorm_inputs(p, dtype, device, gen):
    inp = _norm_inputs(p, dtype, device, gen)
    return {**inp, "bias": randn((p["cols"],), dtype, device, gen, scale=0.3)}


def layernorm_reference(x, weight, bias):
    return {"y": F.layer_norm(x.double(), (x.shape[-1],), weight.double(), bias.double(), LAYERNORM_EPS)}


LAYERNORM = KernelSpec(
    name="lab_layernorm", summary="LayerNorm, y = (x - mean) / std * w + b (lab task)",
    args=("x", "weight", "bias", "y"), make_inputs=_layernorm_inputs, reference=layernorm_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)}, implementation=layernorm.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("8192x4096", dict(rows=8192, cols=4096))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES},
    tolerances={torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)},
    bytes_moved=lambda p, dtype: (2 * _rows_elems(p) + 2 * p["cols"]) * bytes_of(dtype),
    flops=lambda p, dtype: 7 * _rows_elems(p),
    baselines={"torch": lambda inp: F.layer_norm(inp["x"], (inp["x"].shape[-1],), inp["weight"], inp["bias"],
                                                 LAYERNORM_EPS)},
    read_inputs=("x", "weight", "bias"), bench_dtypes=[torch.bfloat16])


# -- GEMV and a matmul with a fused epilogue -------------------------------------------------
def _gemv_inputs(p, dtype, device, gen):
    return {"x": randn((p["m"], p["k"]), dtype, device, gen),
            "w": randn((p["n"], p["k"]), dtype, device, gen, scale=1 / math.sqrt(p["k"]))}


def gemv_reference(x, w):
    return {"y": x.double() @ w.double().T}


GEMV = KernelSpec(
    name="lab_gemv", summary="y = x @ w.T for 1-4 rows of x (decode GEMV, lab task)",
    args=("x", "w", "y"), make_inputs=_gemv_inputs, reference=gemv_reference,
    outputs=lambda inp, dtype: {"y": ((inp["x"].shape[0], inp["w"].shape[0]), dtype)},
    implementation=gemv.launch,
    cases={"cpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("odd", dict(m=1, k=100, n=33)),
                   Case("tails", dict(m=3, k=1000, n=70)), Case("K tail", dict(m=2, k=257, n=130))],
           "gpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("tails", dict(m=3, k=1001, n=777)),
                   Case("long K", dict(m=1, k=8191, n=1000)), Case("square", dict(m=4, k=4096, n=4096))],
           "bench": [Case("M=1 K=N=8192", dict(m=1, k=8192, n=8192))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES},
    tolerances={torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)},
    bytes_moved=lambda p, dtype: (p["n"] * p["k"] + p["m"] * (p["k"] + p["n"])) * bytes_of(dtype),
    flops=lambda p, dtype: 2 * p["m"] * p["n"] * p["k"],
    baselines={"torch": lambda inp: F.linear(inp["x"], inp["w"])}, read_inputs=("x", "w"),
    bench_dtypes=[torch.bfloat16])


def _mm_inputs(p, dtype, device, gen):
    return {"a": randn((p["m"], p["k"]), dtype, device, gen),
            "b": randn((p["k"], p["n"]), dtype, device, gen, scale=1 / math.sqrt(p["k"])),
            "bias": randn((p["n"],), dtype, device, gen, scale=0.5)}


def matmul_bias_relu_reference(a, b, bias):
    return {"c": torch.relu(a.double() @ b.double() + bias.double())}


MATMUL_BIAS_RELU = KernelSpec(
    name="lab_matmul_bias_relu", summary="c = relu(a @ b + bias), epilogue fused (lab task)",
    args=("a", "b", "bias", "c"), make_inputs=_mm_inputs, reference=matmul_bias_relu_reference,
    outputs=lambda inp, dtype: {"c": ((inp["a"].shape[0], inp["b"].shape[1]), dtype)},
    implementation=matmul_bias_relu.launch,
    cases={"cpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("odd", dict(m=37, k=45, n=29)),
                   Case("tiles + tails", dict(m=70, k=100, n=65))],
           "gpu": [Case("1x1x1", dict(m=1, k=1, n=1)), Case("odd", dict(m=37, k=45, n=29)),
                   Case("tiles + tails", dict(m=300, k=515, n=260)), Case("square", dict(m=1024, k=1024, n=1024))],
           "bench": [Case("4096^3", dict(m=4096, k=4096, n=4096))]},
    dtypes={"cpu": [torch.float32, torch.float16], "gpu": [torch.float32, torch.bfloat16, torch.float16]},
    tolerances={torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)},
    bytes_moved=lambda p, dtype: (p["m"] * p["k"] + p["k"] * p["n"] + p["m"] * p["n"] + p["n"]) * bytes_of(dtype),
    flops=lambda p, dtype: 2 * p["m"] * p["n"] * p["k"],
    baselines={"torch": lambda inp: torch.relu(inp["a"] @ inp["b"] + inp["bias"])},
    read_inputs=("a", "b", "bias"), bench_dtypes=[torch.bfloat16])


# -- scan -------------------------------------------------------------------------------------
def cumsum_reference(x):
    return {"y": x.double().cumsum(-1)}


CUMSUM = KernelSpec(
    name="lab_cumsum", summary="y = x.cumsum(-1), accumulated in float32 (lab task)",
    args=("x", "y"), make_inputs=_row_inputs, reference=cumsum_reference,
    outputs=lambda inp, dtype: {"y": (inp["x"].shape, dtype)}, implementation=cumsum.launch,
    cases={"cpu": _ROWS_CPU, "gpu": _ROWS_GPU, "bench": [Case("4096x8192", dict(rows=4096, cols=8192))]},
    dtypes={"cpu": _CPU_DTYPES, "gpu": _GPU_DTYPES},
    # Prefix sums grow like sqrt(n): absolute tolerance for float32 summation order,
    # relative for the output's own rounding in 16 bits.
    tolerances={torch.float32: (2e-3, 1e-5), torch.float16: (2e-2, 2e-3), torch.bfloat16: (1e-1, 1e-2)},
    bytes_moved=lambda p, dtype: 2 * _rows_elems(p) * bytes_of(dtype),
    flops=lambda p, dtype: _rows_elems(p),
    baselines={"torch": lambda inp: inp["x"].cumsum(-1)}, read_inputs=("x",),
    bench_dtypes=[torch.bfloat16])


# -- notebook 09's exercises ------------------------------------------------------------------
# The planted kernels a learner's verifier must get right (all run in the learner's
# process, so none of them patches anything there), and what to do about each.
VERIFIER_PLANTS = {
    "correct": "",
    "wrong-scale": "compare every output element with the reference, within the spec's tolerance.",
    "no-max": "use the spec's inputs (spec.inputs / make_inputs: large, row-dependent offsets), not plain "
              "torch.randn: the unsafe softmax only overflows on inputs that are large.",
    "missing-store-mask": "put the outputs inside guard regions (gpulab.harness.checking.Guarded) and check "
                          "them after the call.",
    "cached-output": "run every shape at least twice, with fresh inputs and fresh output buffers each time.",
    "seed-dependent": "draw a fresh random seed for every trial (os.urandom), never a fixed one such as 0.",
    "aliased-output": "read the result from the buffer you allocated (e.g. a new view of the Guarded buffer), "
                      "not from the tensor object you handed to the kernel: it can be re-pointed.",
    "input-modified": "keep a copy of every input and compare it with the input after the call.",
    "async-thread": "poison the outputs before the call and read them as soon as it returns: work that "
                    "finishes later is work a timer never saw.",
    "reads-reference": "compute the reference only after the kernel has returned (it walked up the stack "
                       "and copied a variable named `expected`).",
}


def _contained(launch):
    """The planted out-of-bounds store runs in the learner's own process: let it really
    write past the end of ``y`` only where that memory belongs to ``y``'s own buffer (a
    guard region, where a verifier can see it); otherwise give it a padded scratch
    output, so that it cannot corrupt the process's heap."""
    def contained(x, y):
        slack = y.untyped_storage().nbytes() // y.element_size() - (y.storage_offset() + y.numel())
        if y.is_contiguous() and slack >= 1 << 12:
            return launch(x, y)
        scratch = torch.empty(y.numel() + (1 << 12), dtype=y.dtype, device=y.device)
        launch(x, scratch[:y.numel()].view(y.shape))
        y.copy_(scratch[:y.numel()].view(y.shape))
    return contained


@scenario_check("lab-verifier")
def check_verifier(verify) -> None:
    """Exercise: ``verify(task, launch) -> None | str`` must accept the correct softmax
    kernel (return None) and reject every planted wrong or cheating one (return why)."""
    task = get_task("softmax")
    problems, rejected = [], 0
    for name, advice in VERIFIER_PLANTS.items():
        plant = PLANTED[name]
        launch = inprocess.load(plant.source).launch
        if plant.reason == "out-of-bounds-write":
            launch = _contained(launch)
        threads = set(threading.enumerate())
        # Planted kernels overflow on purpose (no max subtraction...): the interpreter's
        # NumPy warnings must not reach stderr, where nbgrader would fail the cell.
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                answer = verify(task, launch)
            except NotImplementedError:
                raise                         # the exercise is not written yet
            except Exception as e:
                problems.append(f"`{name}` ({plant.what}): your verifier raised {type(e).__name__}: {e}. A "
                                f"verifier reports a bad kernel, it does not crash on one: catch the kernel's errors.")
                continue
            finally:
                # The async plant's thread still launches a kernel after the call returned:
                # let it end here, before anything else launches (Triton's interpreter keeps
                # one grid position for the whole process).
                for t in set(threading.enumerate()) - threads:
                    t.join(timeout=10)
        if name == "correct" and answer is not None:
            problems.append(f"it rejected the correct kernel, saying: {answer}")
        elif name != "correct" and answer is None:
            problems.append(f"it accepted `{name}`, which {plant.what}. To catch it: {advice}")
        elif name != "correct":
            rejected += 1
    if problems:
        raise CheckFailure("lab verifier: " + f"{len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    print(f"✔ lab verifier: accepts the correct kernel and rejects all {rejected} planted ones "
          f"({', '.join(n for n in VERIFIER_PLANTS if n != 'correct')})")


MUTATION_TASKS = ("softmax", "rmsnorm_quant", "matmul_bias_relu")


@scenario_check("lab-mutation")
def check_mutation(mutate, calls: int = 300) -> None:
    """Exercise: ``mutate(genes, space, rng) -> new genes``: a new dict (the parent left
    as it was), with every gene of the space, every value allowed, one or two genes
    changed (at most half of them where there are more than four), every gene changed some of the time; and the
    candidates rendered from its children are correct kernels."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    problems = []
    for name in MUTATION_TASKS:
        task = get_task(name)
        space = task.gene_space
        movable = [k for k, v in space.items() if len(v) > 1]
        changed = set()
        for i in range(calls):
            parent = task.seed().genes if i % 2 == 0 else cand.random_genes(space, rng)
            before = dict(parent)
            try:
                child = mutate(parent, space, rng)
            except NotImplementedError:
                raise                     # the exercise is not written yet
            except Exception as e:
                problems.append(f"{name}: mutate raised {type(e).__name__}: {e} for parent {before}")
                break
            if parent != before:
                problems.append(f"{name}: mutate changed the parent's dict in place; return a new dict "
                                f"(dict(genes) makes a copy)")
                break
            if not isinstance(child, dict):
                problems.append(f"{name}: mutate returned {type(child).__name__}, not a dict of genes")
                break
            bad = cand.invalid_genes(child, space)
            if bad:
                problems.append(f"{name}: child {child} of {before}: {'; '.join(bad)}")
                break
            diff = [k for k in space if child[k] != before[k]]
            if not diff:
                problems.append(f"{name}: the child of {before} is identical to its parent: a mutation must "
                                f"change at least one gene")
                break
            if len(diff) > max(2, len(space) // 2):
                problems.append(f"{name}: the child of {before} differs in {len(diff)} of {len(space)} genes "
                                f"({', '.join(diff)}): a mutation is a small step; change one or two")
                break
            changed.update(diff)
        else:
            never = [k for k in movable if k not in changed]
            if never:
                problems.append(f"{name}: in {calls} calls, gene(s) {', '.join(never)} never changed: "
                                f"every gene must be reachable")
    if not problems:       # the children are kernels: render a few and check them
        task = get_task("softmax")
        space = task.gene_space
        for _ in range(3):
            child = mutate(cand.random_genes(space, rng), space, rng)
            module = inprocess.load(task.render(child).source)
            try:
                check(task.spec, module.launch, cases=task.spec.cases["cpu"][1:3], dtypes=[torch.float32],
                      quiet=True)
            except CheckFailure as e:
                problems.append(f"softmax with genes {child} is not a correct kernel:\n{e}")
                break
    if problems:
        raise CheckFailure("lab mutation: " + "\n  - ".join(problems))
    print(f"✔ lab mutation: {calls} calls on each of {', '.join(MUTATION_TASKS)}: new dicts, allowed values, "
          f"one or two genes changed, every gene reachable; "
          f"rendered children are correct kernels")

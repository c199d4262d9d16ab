"""One spec per kernel: the single description that checks, tests and benchmarks share.

A :class:`KernelSpec` says

* how to call an implementation (``args``: positional names, inputs then outputs),
* how to make fresh random inputs for a case (``make_inputs``),
* what the right answer is (``reference``, computed in float64 or float32),
* which outputs the caller allocates (``outputs``; gpulab poisons them and puts
  guard regions around them) or, if ``outputs`` is None, that the implementation
  returns them,
* tolerances per dtype,
* the cases to run: small ones for the CPU interpreter, larger ones for a GPU,
  and benchmark sizes,
* bytes moved and FLOPs for a case, for roofline figures,
* the PyTorch baselines a benchmark compares against,
* what the check must try beyond fresh random data (all optional, off by default):
  ``strided`` (arguments whose contract takes strides get a run with row-padded,
  differently strided buffers), ``edge_rows`` (zero and constant rows), ``edge_data``
  (any other deliberate data: exact rounding ties, all-zero weights, full block tables),
  ``axes`` (what each output axis means, so a diagnosis can say "heads 2..3" instead
  of "rows 8..15"), and ``learner_kernel`` (whether the exercise asks for a Triton
  kernel of the learner's own; PyTorch-level exercises set it False).
"""
from __future__ import annotations

import copy
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .. import runtime

_REGISTRY: dict[str, "KernelSpec"] = {}


@dataclass(frozen=True)
class Case:
    """A named set of parameters, e.g. ``Case("tail", dict(rows=3, cols=1000))``."""
    label: str
    params: dict

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.label} ({inner})"


@dataclass
class KernelSpec:
    name: str
    summary: str
    args: tuple[str, ...]
    make_inputs: Callable[[dict, torch.dtype, torch.device, torch.Generator], dict]
    reference: Callable[..., dict]
    cases: dict[str, list[Case]]
    dtypes: dict[str, list[torch.dtype]]
    tolerances: dict[torch.dtype, tuple[float, float]]
    outputs: Callable[[dict, torch.dtype], dict[str, tuple[tuple, torch.dtype]]] | None = None
    returns: tuple[str, ...] = ()
    implementation: Callable | None = None
    bytes_moved: Callable[[dict, torch.dtype], float] | None = None
    flops: Callable[[dict, torch.dtype], float] | None = None
    # Which measured compute ceiling bounds ``flops``: bf16 tensor cores, or "int8_ops_per_s"
    # for kernels whose dots run on int8 tensor cores (twice bf16's peak on Hopper)
    compute_ceiling: str = "flops_per_s"
    baselines: dict[str, Callable[[dict], Any]] = field(default_factory=dict)
    # Inputs a check may zero to ask "was this input read at all?"
    read_inputs: tuple[str, ...] = ()
    output_tolerances: dict[str, dict] = field(default_factory=dict)
    # (share, bound): rows (every axis but the last) of an output that may miss the tolerance, by at most
    # ``bound``: that share of a case's rows, and at least one where it has several (none in
    # a one-row case). For kernels that quantize in a chain: one int8 code that float32 rounds
    # the other way moves the next quantization's inputs, and its codes, and so on, down one row.
    row_slack: tuple[float, float] | None = None
    # Consecutive rows of an output that one flip moves together, counted as one row by
    # ``row_slack``: (output name, inputs) -> how many (a rollout's k + 1 steps of a sequence
    # in a layer: a flip at step i moves that layer's state at every later step). None: 1.
    slack_row_group: Callable[[str, dict], int] | None = None
    # For kernels that choose greedily (an argmax) and go on from their choice: where the
    # reference's top two were within the dtype's tolerance of each other and the kernel took
    # the other one, the reference follows the kernel's choice from there, so that what
    # comes after it is still checked. follow_ties(got, expected, inputs, (atol, rtol)) ->
    # expected; it follows a few such rows at most (a kernel that chooses wrong often is wrong).
    follow_ties: Callable[[dict, dict, dict, tuple[float, float]], dict] | None = None
    # Which baselines also run under torch.compile: True (all), False (none: a baseline
    # that is itself a Triton kernel), or the names of those worth compiling (not a
    # Python loop over thousands of steps, which Dynamo unrolls for minutes).
    compile_baselines: bool | tuple[str, ...] = True
    # Spec-specific diagnosis, tried before the generic hints:
    # hint(output_name, got, expected, inputs) -> str | None
    hint: Callable[[str, torch.Tensor, torch.Tensor, dict], str | None] | None = None
    # hint(..., outputs=every output the kernel wrote) too: where one output alone can match
    # a wrong variant by chance (a few argmax tokens) and another tells them apart
    hint_sees_outputs: bool = False
    # Spec-specific diagnosis of stores outside an output, added to the generic message:
    # stray_write_hint(output_name, rows, unwritten, inputs) -> str | None, with ``rows``
    # the indices along the output's first axis that were written outside it (negative:
    # before its start; >= its length: past its end) and ``unwritten`` the number of its
    # own elements never written (0 when the stray stores are extra ones, not shifted).
    stray_write_hint: Callable[[str, list, int, dict], str | None] | None = None
    # Time with CUDA graphs (no Python launch overhead): for kernels of a few µs, such as
    # decode, whose launch cost would otherwise dominate (see gpulab.harness.bench.time_graph_ms).
    graph_timing: bool = False
    bench_dtypes: list | None = None           # default: the GPU's default dtype
    bench_impl: Callable[[dict], Any] | None = None  # default: implementation, outputs preallocated
    # Turns what a learner passes to a check into the launcher convention of ``args`` (e.g. a
    # class with plan() and run(), checked by calling both); None: the learner passes a launcher.
    adapt: Callable[[Any], Callable] | None = None
    notes: str = ""
    # -- what a check tries beyond fresh random data (see the module docstring) ---------
    # Does the exercise ask for a @triton.jit kernel of the learner's own? None: yes when
    # the spec has ``outputs`` (a launcher), no for functions that return their results.
    learner_kernel: bool | None = None
    # Arguments (inputs or outputs, 2-D or more) whose contract takes strides: one extra
    # run gives each of them its own row padding, so a kernel that assumes contiguous
    # rows, or uses one tensor's stride for another, is caught.
    strided: tuple[str, ...] = ()
    # Float inputs whose rows may legally be all zero or constant: an extra run per case
    # sets the first row to 0 and the last row to one repeated value.
    edge_rows: tuple[str, ...] = ()
    # edge_data(inputs, params, dtype, gen) -> inputs: deliberate data for an extra run
    # per case (exact .5 ties, all-zero weights, full block tables...).
    edge_data: Callable[[dict, dict, torch.dtype, torch.Generator], dict] | None = None
    # fresh_case(gen) -> Case: one more run per check on sizes drawn at random (within
    # CPU-friendly bounds), so a block or grid hard-coded to cover the listed cases fails.
    fresh_case: Callable[[torch.Generator], Case] | None = None
    # Names of each output's axes, e.g. {"o": ("batch", "head", "dim")}: diagnoses then
    # locate wrong elements in those terms.
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # NumPy floating-point warnings ("divide", "invalid", "over") that Triton's interpreter
    # raises on this kernel's intended math and a GPU never shows, e.g. log(0) = -inf for
    # an empty attention state, evaluated before tl.where discards it. Silenced while a
    # check calls an implementation in the interpreter, and nowhere else.
    expected_fp_warnings: tuple[str, ...] = ()

    def __post_init__(self):
        old = _REGISTRY.get(self.name)
        if old is not None and old.make_inputs.__module__ != self.make_inputs.__module__:
            raise ValueError(f"two kernel specs are named {self.name!r} "
                             f"({old.make_inputs.__module__} and {self.make_inputs.__module__})")
        _REGISTRY[self.name] = self

    # -- helpers shared by checks, tests and benchmarks --------------------------------
    @property
    def wants_learner_kernel(self) -> bool:
        return self.outputs is not None if self.learner_kernel is None else self.learner_kernel

    def variant(self, **changes) -> "KernelSpec":
        """A copy with some fields changed, not registered (for one-off checks and tests)."""
        twin = copy.copy(self)
        for k, v in changes.items():
            if not hasattr(twin, k):
                raise AttributeError(f"KernelSpec has no field {k!r}")
            setattr(twin, k, v)
        return twin

    def tolerance(self, dtype: torch.dtype, output: str | None = None) -> tuple[float, float]:
        """(atol, rtol) for an output computed from ``dtype`` inputs; exact outputs
        (integer results) get their own entry in ``output_tolerances``."""
        table = self.output_tolerances.get(output, self.tolerances)
        return table.get(dtype, table.get(torch.float32, (1e-5, 1e-5)))

    def inputs(self, case: Case | dict, dtype: torch.dtype, device=None, seed: int = 0) -> dict:
        params = case.params if isinstance(case, Case) else case
        device = torch.device(device or "cpu")
        return self.make_inputs(params, dtype, device, generator(seed, device))

    def expected_warnings(self):
        """Context in which NumPy ignores :attr:`expected_fp_warnings` (interpreter only)."""
        if not self.expected_fp_warnings or not runtime.interpreting():
            return contextlib.nullcontext()
        return np.errstate(**{kind: "ignore" for kind in self.expected_fp_warnings})

    def call(self, fn: Callable, inputs: dict, outputs: dict | None = None):
        """Call ``fn`` positionally in ``args`` order."""
        values = {**inputs, **(outputs or {})}
        return fn(*[values[a] for a in self.args if a in values])

    def roofline_s(self, params: dict, dtype: torch.dtype, ceilings: dict) -> float | None:
        """Lower bound on time from bytes and FLOPs against measured ceilings."""
        if self.bytes_moved is None:
            return None
        t = self.bytes_moved(params, dtype) / ceilings["bytes_per_s"]
        peak = ceilings.get(self.compute_ceiling) or ceilings.get("flops_per_s")   # older saved runs
        if self.flops is not None and peak:
            t = max(t, self.flops(params, dtype) / peak)
        return t


def get(name: str) -> KernelSpec:
    """The spec called ``name`` (``import gpulab`` registers every spec)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel spec named {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def all_specs() -> dict[str, KernelSpec]:
    return dict(_REGISTRY)


def register(spec: KernelSpec) -> None:
    """Make ``spec`` the one registered under its name (the grader uses this to put
    back a spec a notebook replaced)."""
    _REGISTRY[spec.name] = spec


def generator(seed: int, device) -> torch.Generator:
    device = torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# -- input builders: non-uniform random data ----------------------------------------------
def randn(shape, dtype, device, gen, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    """Normal data with a random per-row spread, so rows differ in range (not uniform)."""
    shape = tuple(shape)
    if runtime.COMPILE_ONLY:
        # gpulab compile-check: no kernel runs, only shapes and dtypes reach the compiler;
        # drawing the GPU cases' inputs took most of its time
        return torch.full(shape, 0.5 * scale + offset, device=device).to(dtype)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if len(shape) >= 1 and shape[0] > 0:
        spread = torch.rand((shape[0],) + (1,) * (len(shape) - 1), generator=gen, device=device) * 1.5 + 0.25
        x = x * spread
    return (x * scale + offset).to(dtype)


def bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


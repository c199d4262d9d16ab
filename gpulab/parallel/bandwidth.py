r"""Bus bandwidth of all-reduce implementations, with nccl-tests' conventions.

For a message of S bytes that takes t seconds:

* algorithm bandwidth  algbw = S / t;
* bus bandwidth        busbw = algbw · 2(n-1)/n   for all-reduce
                       (algbw · (n-1)/n for all-gather and reduce-scatter, algbw for
                       broadcast).

A ring all-reduce moves 2(n-1)/n · S bytes over each link, so busbw is the speed the
busiest link actually ran at, comparable with the hardware's link bandwidth whatever
the number of ranks. Two regimes show on a sweep of sizes:

* **latency-bound** (small S): t is nearly constant (launches, synchronisation, one
  message latency per step), so busbw grows in proportion to S;
* **bandwidth-bound** (large S): t grows with S and busbw flattens at the link's speed.

The size where busbw reaches half its peak (Hockney's n½) separates them.

:func:`measure` launches the ranks and sweeps sizes (4 KB .. 1 GB on GPUs); results are
dicts that :func:`save_result` writes as JSON (``gpulab/results/``) and :func:`plot`
draws. Every timing is the slowest rank's, after warm-up: the median of five batches of calls
that together fill a time budget.
"""
from __future__ import annotations

import datetime
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import launch
from .collectives import one_shot_all_reduce, ring_all_reduce

RESULTS = Path(__file__).resolve().parent.parent / "results" / "parallel"
GPU_SIZES = [4096 << k for k in range(19)]        # 4 KB .. 1 GB
CPU_SIZES = [4096 << k for k in range(11)]        # 4 KB .. 4 MB
BUS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def elapsed_s(fn: Callable[[], object], calls: int, cuda: bool) -> float:
    """Seconds for ``calls`` back-to-back calls of ``fn``: CUDA events on a GPU, the
    wall clock on a CPU."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second), as nccl-tests prints it."""
    return nbytes / seconds / 1e9


def busbw_gbps(nbytes: float, seconds: float, world_size: int, op: str = "all_reduce") -> float:
    """Bus bandwidth in GB/s: algbw times the op's factor (2(n-1)/n for all-reduce)."""
    if op not in BUS_FACTORS:
        raise ValueError(f"op must be one of {', '.join(BUS_FACTORS)}, got {op!r}")
    return algbw_gbps(nbytes, seconds) * BUS_FACTORS[op](world_size)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} GB"


# -- timing on the ranks ------------------------------------------------------------------------
def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_per_call(fn: Callable[[], object], budget_s: float = 0.2, max_calls: int = 1000,
                  batches: int = 5) -> float:
    """Seconds per call of a collective ``fn`` (every rank calls this together): two
    warm-up calls, a probe call to size the run, then ``batches`` timed batches filling
    ``budget_s``; each batch's time is the slowest rank's, and the median batch is
    returned (robust to a batch that shared its cores with someone else). GPU work is
    timed with CUDA events."""
    device = _device()
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()

    def run(calls):
        dist.barrier()
        return elapsed_s(fn, calls, cuda)

    probe = _slowest(run(1), device)
    calls = int(max(1, min(max_calls, budget_s / batches / max(probe, 1e-7))))
    per_call = sorted(_slowest(run(calls), device) / calls for _ in range(batches))
    return per_call[len(per_call) // 2]


def local_time_per_call(fn: Callable[[], object], budget_s: float = 0.2, max_calls: int = 1000,
                        batches: int = 5) -> float:
    """Seconds per call of ``fn`` on this rank alone (no collective): CUDA events on a GPU,
    median of ``batches`` batches after warm-up."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(2):
        fn()

    def run(calls):
        return elapsed_s(fn, calls, cuda)

    probe = run(1)
    calls = int(max(1, min(max_calls, budget_s / batches / max(probe, 1e-7))))
    per_call = sorted(run(calls) / calls for _ in range(batches))
    return per_call[len(per_call) // 2]


def sweep_rank(impls: dict, sizes: list[int], dtype: torch.dtype, budget_s: float = 0.2,
               max_bytes: dict | None = None) -> list[dict]:
    """Rank function: time every implementation ``name -> fn(tensor)`` at every size."""
    device = _device()
    n = dist.get_world_size()
    rows = []
    for size in sizes:
        rows += _time_size(impls, size, dtype, device, n, budget_s, max_bytes)
        if device.type == "cuda":
            torch.cuda.empty_cache()        # the buffer of this size is gone: give it back
    return rows


def _time_size(impls, size, dtype, device, n, budget_s, max_bytes) -> list[dict]:
    numel = max(1, size // torch.empty((), dtype=dtype).element_size())
    x = torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * x.element_size()
    rows = []
    for name, fn in impls.items():
        if max_bytes and name in max_bytes and nbytes > max_bytes[name]:
            continue
        t = time_per_call(lambda: fn(x), budget_s)
        rows.append({"impl": name, "bytes": nbytes, "time_us": t * 1e6,
                     "algbw_GBps": algbw_gbps(nbytes, t), "busbw_GBps": busbw_gbps(nbytes, t, n)})
    return rows


def library_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def default_impls(backend: str) -> dict:
    return {backend: library_all_reduce, "ring": ring_all_reduce, "one-shot": one_shot_all_reduce}


# -- runs, results ------------------------------------------------------------------------------
def environment(backend: str, world_size: int) -> dict:
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "backend": backend,
           "world_size": world_size, "multicast_env": dict(launch.MULTICAST_OFF)}
    if backend == "nccl":
        env["device"] = f"{world_size} x {torch.cuda.get_device_name(0)}"
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    else:
        env["device"] = f"CPU, {world_size} gloo processes"
    return env


def measure(world_size: int = 2, backend: str | None = None, sizes: list[int] | None = None,
            dtype: torch.dtype | None = None, impls: dict | None = None, budget_s: float | None = None,
            max_bytes: dict | None = None, label: str = "", timeout_s: float = 600.0,
            start_method: str | None = None) -> dict:
    """Sweep all-reduce implementations over message sizes on ``world_size`` ranks.

    Defaults: NCCL with one process per GPU and bf16 at 4 KB .. 1 GB when there are
    enough GPUs; else gloo CPU processes and float32 at 4 KB .. 4 MB."""
    backend = backend or launch.default_backend(world_size)
    gpu = backend == "nccl"
    sizes = sizes or (GPU_SIZES if gpu else CPU_SIZES)
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    impls = impls or default_impls(backend)
    budget_s = budget_s if budget_s is not None else (0.2 if gpu else 0.05)
    rows = launch.run_ranks(sweep_rank, world_size, impls, sizes, dtype, budget_s, max_bytes,
                            backend=backend, timeout_s=timeout_s, collective_timeout_s=120,
                            start_method=start_method)[0]
    result = {"kind": "all_reduce_busbw", **environment(backend, world_size),
              "dtype": str(dtype).replace("torch.", ""), "library": backend, "rows": rows,
              "label": label or ("measured on GPUs with NCCL" if gpu else
                                 "CPU / gloo: processes on this machine, not GPUs")}
    return result


def save_result(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_result(name: str) -> dict | None:
    """A saved result from gpulab/results/ (``name`` without .json), or None."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- reading a sweep ----------------------------------------------------------------------------
def series(result: dict, impl: str) -> list[dict]:
    return sorted((r for r in result["rows"] if r["impl"] == impl), key=lambda r: r["bytes"])


def regimes(result: dict, impl: str) -> dict:
    """Small-message latency, peak busbw and the half-bandwidth size n½ of one series."""
    s = series(result, impl)
    if not s:
        raise KeyError(f"no rows for {impl!r}; impls: {sorted({r['impl'] for r in result['rows']})}")
    peak = max(r["busbw_GBps"] for r in s)
    half = next((r["bytes"] for r in s if r["busbw_GBps"] >= peak / 2), s[-1]["bytes"])
    return {"impl": impl, "latency_us": s[0]["time_us"], "smallest_bytes": s[0]["bytes"],
            "peak_busbw_GBps": peak, "peak_at_bytes": max(s, key=lambda r: r["busbw_GBps"])["bytes"],
            "half_bandwidth_bytes": half}


def ratio_at(result: dict, impl: str, reference: str, nbytes: int) -> float | None:
    """busbw of ``impl`` / busbw of ``reference`` at the size closest to ``nbytes``."""
    a, b = series(result, impl), series(result, reference)
    if not a or not b:
        return None
    pick = lambda s: min(s, key=lambda r: abs(math.log(r["bytes"] / nbytes)))  # noqa: E731
    ra, rb = pick(a), pick(b)
    return ra["busbw_GBps"] / rb["busbw_GBps"] if ra["bytes"] == rb["bytes"] else None


def table(result: dict, impls: list[str] | None = None) -> str:
    """Time and busbw per size, one column pair per implementation."""
    impls = impls or list(dict.fromkeys(r["impl"] for r in result["rows"]))
    sizes = sorted({r["bytes"] for r in result["rows"]})
    by = {(r["impl"], r["bytes"]): r for r in result["rows"]}
    head = f"{'size':>9} | " + " | ".join(f"{i[:18]:>18} µs  GB/s" for i in impls)
    lines = [head, "-" * len(head)]
    for s in sizes:
        cells = []
        for i in impls:
            r = by.get((i, s))
            cells.append(f"{r['time_us']:>20.1f} {r['busbw_GBps']:>6.2f}" if r else " " * 27)
        lines.append(f"{human_bytes(s):>9} | " + " | ".join(cells))
    return "\n".join(lines)


def plot(result: dict, impls: list[str] | None = None, axes=None, title: str | None = None):
    """Two panels: time per all-reduce and bus bandwidth against message size, the
    latency-bound region (below the library's n½) shaded."""
    import matplotlib.pyplot as plt

    impls = impls or list(dict.fromkeys(r["impl"] for r in result["rows"]))
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax_t, ax_b = axes
    for impl in impls:
        s = series(result, impl)
        xs = [r["bytes"] for r in s]
        ax_t.plot(xs, [r["time_us"] for r in s], marker="o", ms=3, label=impl)
        ax_b.plot(xs, [r["busbw_GBps"] for r in s], marker="o", ms=3, label=impl)
    lib = result.get("library", impls[0])
    if series(result, lib):
        half = regimes(result, lib)["half_bandwidth_bytes"]
        lo = min(r["bytes"] for r in result["rows"])
        for ax in axes:
            ax.axvspan(lo, half, color="0.9", zorder=0)
            ax.axvline(half, color="0.5", ls=":", lw=1)
        ax_b.text(half, ax_b.get_ylim()[1] * 0.95, f"  n½ of {lib}\n  = {human_bytes(half)}", fontsize=8,
                  va="top")
        ax_t.text(lo * 1.2, ax_t.get_ylim()[1] * 0.5, "latency-bound", fontsize=9, color="0.35")
        ax_t.text(half * 2, ax_t.get_ylim()[0] * 2, "bandwidth-bound", fontsize=9, color="0.35")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(alpha=0.3, which="both")
        ticks = [s for s in sorted({r["bytes"] for r in result["rows"]})][::2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_bytes(t).replace(" ", "") for t in ticks], fontsize=7, rotation=45)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per all-reduce (µs)")
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    ax_b.legend(fontsize=8)
    where = f"{result.get('device', '?')}, {result.get('dtype', '')}, {result.get('date', '')}"
    plt.suptitle(title or f"all-reduce on {where}\n{result.get('label', '')}", fontsize=10)
    plt.tight_layout()
    return axes

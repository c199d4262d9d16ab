"""``gpulab profile KERNEL``: what a real profiler says about one benchmark case.

A benchmark says *how fast*; a profiler says *why*. For one of a spec's benchmark
cases this module runs gpulab's implementation once, inside a profiling range, under

* **Nsight Compute** (``ncu``) when it is on PATH: every kernel launched in the range is
  replayed with the SpeedOfLight, Occupancy, WarpStateStats, InstructionStats and
  ComputeWorkloadAnalysis sections, and the raw metrics (``--csv --page raw``) are
  summarised: achieved DRAM bandwidth and its share of the peak, SM and tensor-core
  utilisation, achieved against theoretical occupancy and what limits it, the top
  warp stall reasons, and the instruction mix by pipe;
* **torch.profiler** otherwise: the GPU time of each kernel, and from the spec's bytes
  and FLOPs the achieved bandwidth and FLOP/s (no hardware counters);
* on a CPU (Triton's interpreter: no GPU kernel exists) nothing is run: the report
  saved on an H200 (``gpulab/results/profiles/NAME.json``) is shown, labelled.

``--save`` writes the report there; ``tools/profile-all.sh`` produces them on a GPU.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from .. import runtime
from .bench import RESULTS, default_impl
from .spec import Case, KernelSpec, get

PROFILES = RESULTS / "profiles"
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "InstructionStats",
                "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}

# Raw Nsight Compute metrics -> the summary's fields (the first one present wins).
METRICS = {
    "time_ns": ("gpu__time_duration.sum",),
    "dram_bytes_per_s": ("dram__bytes.sum.per_second",),
    "dram_read_bytes": ("dram__bytes_read.sum",),
    "dram_write_bytes": ("dram__bytes_write.sum",),
    "dram_pct_of_peak": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                         "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    "memory_pct_of_peak": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",),
    "sm_pct_of_peak": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "tensor_pct_of_peak": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                           "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
                           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct",),
    "registers_per_thread": ("launch__registers_per_thread",),
    "shared_bytes_per_block": ("launch__shared_mem_per_block_static",),
    "grid_size": ("launch__grid_size",),
    "block_size": ("launch__block_size",),
}
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE = re.compile(r"sm__inst_executed_pipe_(\w+?)\.avg\.pct_of_peak_sustained_active$")
LIMIT = re.compile(r"launch__occupancy_limit_(\w+)$")


# -- running one case ------------------------------------------------------------------------
def pick_case(spec: KernelSpec, label: str | None) -> Case:
    cases = spec.cases.get("bench") or []
    if not cases:
        raise ValueError(f"{spec.name} has no benchmark cases to profile; "
                         f"`gpulab bench --list` names those that do")
    if label is None:
        return cases[0]
    for c in cases:
        if c.label == label:
            return c
    raise ValueError(f"{spec.name} has no benchmark case {label!r}; its cases: "
                     + ", ".join(repr(c.label) for c in cases))


def pick_dtype(spec: KernelSpec, name: str | None) -> torch.dtype:
    if name is not None:
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r}: use one of bf16, fp16, fp32")
        return DTYPES[name]
    return (spec.bench_dtypes or [runtime.default_dtype()])[0]


def run_once(spec: KernelSpec, case: Case, dtype: torch.dtype, ranged: bool) -> None:
    """Make the case's inputs, warm up (compile, autotune), then run once, inside
    ``cudaProfilerStart/Stop`` when ``ranged`` (Nsight Compute profiles only that)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = spec.make_inputs(case.params, dtype, torch.device("cuda"), gen)
    impl = spec.bench_impl or default_impl(spec, dtype)
    impl(inputs)
    impl(inputs)
    torch.cuda.synchronize()
    if ranged:
        torch.cuda.cudart().cudaProfilerStart()
    impl(inputs)
    torch.cuda.synchronize()
    if ranged:
        torch.cuda.cudart().cudaProfilerStop()


# -- Nsight Compute ---------------------------------------------------------------------------
def ncu_command(name: str, case: Case, dtype: torch.dtype, ncu: str = "ncu") -> list[str]:
    cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--profile-from-start", "off",
           "--target-processes", "all"]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    return cmd + [sys.executable, "-m", "gpulab.harness.profiler", "--child", name,
                  "--case", case.label, "--dtype", str(dtype).replace("torch.", "")]


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of ``ncu --csv --page raw``: one dict per kernel launch, metric -> value (numbers
    where they parse, strings otherwise). The line after the header holds the units."""
    lines = [l for l in text.splitlines() if l.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, units = rows[0], rows[1]
    scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
             "byte/second": 1, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9,
             "Tbyte/second": 1e12, "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
    out = []
    for row in rows[2:]:
        rec = {}
        for key, unit, value in zip(header, units, row):
            v = number(value)       # bytes and bytes/s in base units, times in ns
            rec[key] = (v * scale.get(unit, 1)) if v is not None else value
        out.append(rec)
    return out


def summarise_ncu(rec: dict) -> dict:
    """What a learner should look at, from one kernel's raw metrics."""
    s = {"name": rec.get("Kernel Name") or rec.get("kernel_name") or "?"}
    for field, names in METRICS.items():
        s[field] = next((rec[n] for n in names if isinstance(rec.get(n), float)), None)
    stalls = {m.group(1): rec[k] for k in rec if (m := STALL.search(k)) and isinstance(rec[k], float)}
    total = sum(stalls.values())
    s["top_stalls"] = [(k, round(100 * v / total, 1)) for k, v in
                       sorted(stalls.items(), key=lambda kv: -kv[1])[:4]] if total else []
    pipes = {m.group(1): rec[k] for k in rec if (m := PIPE.search(k)) and isinstance(rec[k], float)}
    s["pipe_utilisation_pct"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:6])
    limits = {m.group(1): rec[k] for k in rec if (m := LIMIT.search(k)) and isinstance(rec[k], float)}
    if limits:
        s["occupancy_limited_by"] = min(limits, key=limits.get)
        s["occupancy_limits_blocks"] = limits
    return s


def profile_ncu(spec: KernelSpec, case: Case, dtype: torch.dtype, ncu: str) -> dict:
    cmd = ncu_command(spec.name, case, dtype, ncu)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])
           + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    records = parse_ncu_csv(done.stdout)
    if done.returncode != 0 or not records:
        raise RuntimeError(f"ncu failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    keep = [k for k in records[0] if any(k in names for names in METRICS.values())
            or STALL.search(k) or PIPE.search(k) or LIMIT.search(k)]
    return {"tool": "Nsight Compute", "command": " ".join(cmd[:cmd.index(sys.executable)]) + " python ...",
            "kernels": [summarise_ncu(r) for r in records],
            "raw": [{k: r.get(k) for k in ["Kernel Name", *keep]} for r in records]}


# -- torch.profiler ---------------------------------------------------------------------------
def kernel_times(prof, reps: int = 1) -> list[dict]:
    """The kernels of a ``torch.profiler`` run that recorded CUDA activity only, by name,
    the longest first: ``time_ns`` and ``calls_per_run`` per run of ``reps``."""
    kernels = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.count:
            kernels.append({"name": evt.key, "time_ns": 1e3 * t / reps, "calls_per_run": evt.count / reps})
    return sorted(kernels, key=lambda k: -k["time_ns"])


def profile_torch(spec: KernelSpec, case: Case, dtype: torch.dtype) -> dict:
    from torch.profiler import ProfilerActivity, profile
    run_once(spec, case, dtype, ranged=False)
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run_once_fast(spec, case, dtype)
    kernels = kernel_times(prof, reps)
    total_s = sum(k["time_ns"] for k in kernels) * 1e-9
    report = {"tool": "torch.profiler", "kernels": kernels[:8],
              "note": "no hardware counters without Nsight Compute: utilisation, occupancy and "
                      "stalls need `ncu` on PATH"}
    if total_s and spec.bytes_moved:
        report["dram_bytes_per_s"] = spec.bytes_moved(case.params, dtype) / total_s
    if total_s and spec.flops:
        report["flops_per_s"] = spec.flops(case.params, dtype) / total_s
    return report


_INPUTS: dict = {}


def run_once_fast(spec: KernelSpec, case: Case, dtype: torch.dtype) -> None:
    key = (spec.name, case.label, dtype)
    if key not in _INPUTS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        _INPUTS[key] = (spec.make_inputs(case.params, dtype, torch.device("cuda"), gen),
                        spec.bench_impl or default_impl(spec, dtype))
    inputs, impl = _INPUTS[key]
    impl(inputs)
    torch.cuda.synchronize()


# -- the report -------------------------------------------------------------------------------
def profile(name: str, case: str | None = None, dtype: str | None = None, tool: str = "auto",
            save: bool = False, out: Path | None = None) -> dict:
    """Profile one benchmark case of spec ``name`` (GPU), or load the saved report (CPU)."""
    spec = get(name)
    if runtime.mode() != "compiled":
        report = load(name)
        if report is None:
            raise FileNotFoundError(f"no GPU here and no saved profile of {name} "
                                    f"(tools/profile-all.sh writes them on a GPU)")
        report["source"] = "saved report: this machine has no GPU to profile"
        return report
    c, dt = pick_case(spec, case), pick_dtype(spec, dtype)
    ncu = shutil.which("ncu")
    if tool == "ncu" and not ncu:
        raise FileNotFoundError("ncu (Nsight Compute) is not on PATH")
    body = profile_ncu(spec, c, dt, ncu) if ncu and tool != "torch" else profile_torch(spec, c, dt)
    report = {"kernel": name, "case": c.label, "params": c.params, "dtype": str(dt).replace("torch.", ""),
              "gpu": runtime.gpu_name(), "date": _dt.date.today().isoformat(),
              "versions": runtime.versions(), "bytes": spec.bytes_moved(c.params, dt) if spec.bytes_moved else None,
              "flops": spec.flops(c.params, dt) if spec.flops else None, **body,
              "source": "measured now"}
    if save or out:
        folder = Path(out) if out else PROFILES
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def load(name: str) -> dict | None:
    path = PROFILES / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def saved() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.0f}%"


def verdict(k: dict) -> str:
    """One sentence on what limits this kernel, from its utilisation."""
    dram, sm = k.get("dram_pct_of_peak"), k.get("sm_pct_of_peak")
    if dram is None or sm is None:
        return ""
    if dram >= 60 and dram >= sm:
        return (f"bandwidth-bound: DRAM at {dram:.0f}% of its peak. Only moving fewer bytes "
                "(fusion, smaller dtypes, reading each byte once) makes it faster.")
    if sm >= 60:
        tensor = k.get("tensor_pct_of_peak")
        extra = (f"; tensor cores busy {tensor:.0f}% of the time" if tensor is not None else "")
        return f"compute-bound: SM throughput at {sm:.0f}% of peak{extra}."
    stall = k.get("top_stalls") or []
    why = f" Warps mostly wait on {stall[0][0].replace('_', ' ')}." if stall else ""
    return (f"latency-bound: neither DRAM ({dram:.0f}%) nor the SMs ({sm:.0f}%) are busy. "
            f"More work in flight (occupancy, more programs, split-K/split-KV) helps.{why}")


def format_report(r: dict, width: int = 88) -> str:
    lines = [f"{r['kernel']} — {r['tool']} on {r.get('gpu')} ({r.get('date')}), case {r.get('case')}, "
             f"{r.get('dtype')}", f"[{r.get('source', '')}]"]
    if r["tool"] == "torch.profiler":
        for k in r["kernels"]:
            lines.append(f"  {k['time_ns'] / 1e3:9.1f} µs  {k['name'][:70]}")
        if r.get("dram_bytes_per_s"):
            lines.append(f"  achieved {r['dram_bytes_per_s'] / 1e12:.2f} TB/s from the spec's bytes")
        if r.get("flops_per_s"):
            lines.append(f"  achieved {r['flops_per_s'] / 1e12:.1f} TFLOP/s from the spec's FLOPs")
        lines.append("  " + r["note"])
        return "\n".join(lines)
    for k in r["kernels"]:
        t = k.get("time_ns")
        lines.append(f"kernel {k['name'][:60]}: " + (f"{t / 1e3:.1f} µs" if t else "")
                     + (f", grid {k['grid_size']:.0f} × block {k['block_size']:.0f}"
                        if k.get("grid_size") and k.get("block_size") else ""))
        bw = k.get("dram_bytes_per_s")
        rw = [f"{x / 1e6:.1f} MB {what}" for x, what in ((k.get("dram_read_bytes"), "read"),
                                                        (k.get("dram_write_bytes"), "written")) if x is not None]
        lines.append(f"  DRAM       {bw / 1e12:.2f} TB/s, " if bw else "  DRAM       ")
        lines[-1] += f"{_pct(k.get('dram_pct_of_peak'))} of peak" + (f" ({', '.join(rw)})" if rw else "")
        lines.append(f"  compute    SM throughput {_pct(k.get('sm_pct_of_peak'))} of peak, tensor cores "
                     f"{_pct(k.get('tensor_pct_of_peak'))}")
        occ = (f"  occupancy  {_pct(k.get('achieved_occupancy_pct'))} achieved of "
               f"{_pct(k.get('theoretical_occupancy_pct'))} theoretical")
        if k.get("occupancy_limited_by"):
            occ += f", limited by {k['occupancy_limited_by'].replace('_', ' ')}"
        if k.get("registers_per_thread"):
            occ += f" ({k['registers_per_thread']:.0f} registers/thread)"
        lines.append(occ)
        if k.get("top_stalls"):
            lines.append("  stalls     " + ", ".join(f"{n.replace('_', ' ')} {p:.0f}%" for n, p in k["top_stalls"]))
        if k.get("pipe_utilisation_pct"):
            lines.append("  pipes      " + ", ".join(f"{n} {v:.0f}%" for n, v in k["pipe_utilisation_pct"].items()))
        v = verdict(k)
        if v:
            lines += textwrap.wrap("  → " + v, width, subsequent_indent="    ")
    # a long line wraps under its label instead of losing its end
    return "\n".join(part for line in lines
                     for part in (textwrap.wrap(line, width, subsequent_indent=" " * 13) if len(line) > width
                                  else [line]))


def show(name: str, **kw) -> dict | None:
    """Notebook helper: profile on a GPU (saved H200 report on a CPU) and print it."""
    try:
        report = profile(name, **kw)
    except FileNotFoundError as e:
        print(e)
        return None
    print(format_report(report))
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab profile", description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", nargs="?", help="spec name (see `gpulab bench --list`)")
    p.add_argument("--case", help="benchmark case label (default: the spec's first)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: the benchmark's)")
    p.add_argument("--tool", choices=("auto", "ncu", "torch"), default="auto")
    p.add_argument("--save", action="store_true", help=f"write {PROFILES}/KERNEL.json")
    p.add_argument("--out", help="write the report JSON into this folder instead")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--list", action="store_true", help="list the saved reports")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:            # inside ncu: run the case once in a profiling range
        spec = get(a.child)
        run_once(spec, pick_case(spec, a.case), pick_dtype(spec, a.dtype), ranged=True)
        return 0
    if a.list or not a.kernel:
        print("saved profiles: " + (", ".join(saved()) or "none"))
        return 0
    try:
        report = profile(a.kernel, case=a.case, dtype=a.dtype, tool=a.tool, save=a.save, out=a.out)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, default=str) if a.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

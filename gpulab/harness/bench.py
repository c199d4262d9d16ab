"""Benchmarks: time a kernel against PyTorch on the GPU, against a measured roofline.

``gpulab bench NAME`` runs the spec's ``bench`` cases with ``triton.testing.do_bench``
(median of repeated runs, L2 flushed between them) for gpulab's implementation, each
PyTorch baseline in eager mode and under ``torch.compile``, and reports time,
GB/s, TFLOP/s, % of the roofline and the ratio to each baseline. The roofline is
``max(bytes / bandwidth, FLOPs / peak)`` with bandwidth and peak *measured* on the
same GPU at the start of the run (a device copy and a bf16 matmul).

Interpreter timings are not performance: in interpreter mode every function here
refuses to time anything, and the notebooks plot the saved GPU results instead
(``gpulab/results/NAME.json``, written by ``--save``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .. import runtime
from ..bitlinear import int8_mm_into
from .spec import Case, KernelSpec, all_specs, get

RESULTS = Path(__file__).resolve().parent.parent / "results"


class InterpreterTiming(RuntimeError):
    pass


def require_gpu(what: str = "timing") -> None:
    if runtime.mode() != "compiled":
        raise InterpreterTiming(
            f"{what} needs a GPU: in {runtime.mode()} mode kernels run as NumPy on the CPU, and "
            "their timings say nothing about GPU performance. Use gpulab.harness.plots.saved(...) to "
            "see figures measured on an H200.")


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds (GPU only), launched from Python each time:
    ``triton.testing.do_bench`` with the L2 cache flushed before every call. A call slower
    than ``SLOW_MS`` (a Python loop over thousands of steps) is timed as the median of 3."""
    require_gpu()
    import triton.testing
    fn()                                   # compile and autotune first
    if _median_of(fn, 1) > SLOW_MS:        # a slow Python-loop baseline: do_bench would take minutes
        return _median_of(fn, 3)
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


SLOW_MS = 250.0


def mean_ms(fn: Callable[[], object], n: int = 50, warmup: int = 1) -> float:
    """Mean GPU time in milliseconds of ``n`` back-to-back calls of ``fn``, between two
    CUDA events (no L2 flush): how graph replays and engine steps run in a server."""
    require_gpu()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _median_of(fn: Callable[[], object], n: int) -> float:
    """Median of n calls timed with CUDA events (for calls long enough that one is enough)."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def host_us_per_call(fn: Callable[[], object], calls: int = 200, batches: int = 5) -> float:
    """Host time (Python and launches) of ``fn()`` in µs: ``calls`` calls unwaited, the
    GPU work queuing up behind; the median over ``batches`` batches, the GPU drained
    between them so that a full launch queue never makes the host wait. Where this
    exceeds the GPU time, a call as timed by :func:`time_ms` is host-bound (on the H200's
    host one batch moved by up to 60% from one call of a tool to the next, 2026-12-02)."""
    require_gpu()
    fn()
    per_batch = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_batch.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(per_batch)[len(per_batch) // 2]


_FLUSH = None


def host_and_wall_us(fn: Callable[[], object], calls: int = 50) -> dict:
    """Whether the host or the GPU sets the pace of ``fn()``: ``calls`` calls queued back to
    back. ``host_us``: the host's time to queue one; ``wall_us``: the time per call until the
    GPU has run them all (equal when the host sets the pace, or when a call waits for the
    GPU); ``allocator``: the caching allocator's device allocations, frees, retries and
    all-stream syncs meanwhile (each cudaMalloc or cudaFree waits for the GPU)."""
    require_gpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = torch.cuda.memory_stats()
    return {"host_us": round(queued / calls * 1e6, 1), "wall_us": round(wall / calls * 1e6, 1),
            "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in
                          ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}}


def cuda_graph_replay(make_run):
    """A benchmark row that replays a CUDA graph: ``make_run(inputs)`` plans and returns a
    function of no arguments; it runs once (compile, autotune), is captured, and every
    call replays the capture. A new capture per input dict."""
    state = {}

    def replay(inp):
        if state.get("key") != id(inp):
            state.clear()
            run = make_run(inp)
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with runtime.cuda_graph_capture(graph):
                run()
            state.update(key=id(inp), graph=graph, run=run)
        state["graph"].replay()
    return replay


def time_graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 9) -> float:
    """Median GPU time of ``fn()`` in milliseconds without Python launch overhead.

    ``calls`` launches are captured in a CUDA graph, each after a write of 256 MB that
    evicts the 60 MB L2 (so weights are read from HBM, as in a model whose layers each
    have their own); a second graph holds the flushes alone, and the difference of the
    two replay times, divided by ``calls``, is the kernel time. Serving engines launch
    decode steps through CUDA graphs for the same reason (FlashInfer's plan/run)."""
    require_gpu()
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()                                   # compile and autotune outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()                           # warm-up on the capture stream
            with runtime.cuda_graph_capture(g, stream=stream):
                for _ in range(calls):
                    _FLUSH.zero_()
                    if with_fn:
                        fn()
        graphs.append(g)
    torch.cuda.synchronize()

    def replay_ms(g):
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]
    return max(0.0, (replay_ms(graphs[0]) - replay_ms(graphs[1])) / calls)


_CEILINGS: dict | None = None


def ceilings() -> dict:
    """Measured bandwidth (device copy, read + write) and bf16 and int8 matmul throughput."""
    global _CEILINGS
    if _CEILINGS is None:
        require_gpu()
        n = 1 << 30  # 1 GiB copied: many times the L2
        a = torch.empty(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        t_copy = time_ms(lambda: b.copy_(a)) * 1e-3
        m = 8192
        x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        t_mm = time_ms(lambda: x @ y, rep=50) * 1e-3
        del a, b, x, y
        _CEILINGS = {"bytes_per_s": 2 * n / t_copy, "flops_per_s": 2 * m ** 3 / t_mm,
                     "how": "device copy of 1 GiB (read+write); bf16 8192^3 matmul"}
        try:    # the int8 ternary matmuls' compute roof (int8 tensor cores)
            x8 = torch.randint(-127, 128, (m, m), device="cuda", dtype=torch.int8)
            # B column-major (a transposed view), the layout cuBLAS's int8 GEMM wants. On the
            # H200 cuBLAS reached 736-894 TOPS (2026-12-03), below gpulab's own int8 GEMM
            # (the prefill path's second half), so the faster of the two is the roof
            t_mm8 = time_ms(lambda: torch._int_mm(x8, x8.t()), rep=50) * 1e-3
            _CEILINGS["int8_ops_per_s_cublas"] = 2 * m ** 3 / t_mm8
            _CEILINGS["how"] += "; int8 8192^3 matmul: the faster of torch._int_mm and gpulab's int8 GEMM"
            scale, out = torch.ones(m, device="cuda"), torch.empty(m, m, device="cuda", dtype=torch.bfloat16)
            t_own = time_ms(lambda: int8_mm_into(x8, scale, x8, scale[:1], out), rep=50) * 1e-3
            _CEILINGS["int8_ops_per_s_gpulab"] = 2 * m ** 3 / t_own
            _CEILINGS["int8_ops_per_s"] = 2 * m ** 3 / min(t_mm8, t_own)
            del x8, out
        except RuntimeError:       # no int8 GEMM in this torch/GPU: bf16's roof stands in
            pass
    return _CEILINGS


def measure(spec: KernelSpec, case: Case, dtype: torch.dtype,
            impls: dict[str, Callable[[dict], object]], compile_baselines: bool = True,
            graph: bool = False) -> list[dict]:
    """Time each implementation (a function of the input dict) on one case."""
    require_gpu()
    inputs = spec.make_inputs(case.params, dtype, torch.device("cuda"), _bench_generator())
    ceil = ceilings()
    roof = spec.roofline_s(case.params, dtype, ceil)
    nbytes = spec.bytes_moved(case.params, dtype) if spec.bytes_moved else None
    nflops = spec.flops(case.params, dtype) if spec.flops else None
    fns = dict(impls)
    for name, base in spec.baselines.items():
        fns[name] = base
        wanted = spec.compile_baselines
        if compile_baselines and (wanted is True or (wanted and name in wanted)):
            compiled = torch.compile(base, dynamic=False)
            fns[f"{name} (compiled)"] = compiled
    rows = []
    for name, fn in fns.items():
        try:
            ms = time_ms(lambda: fn(inputs))
        except Exception as e:  # a baseline that cannot run here is reported, not fatal
            rows.append({"impl": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        row = {"impl": name, "ms_launched": ms}
        if graph:
            try:
                ms = time_graph_ms(lambda: fn(inputs))
                row["timing"] = "CUDA graph, L2 flushed"
            except Exception as e:   # not capturable (a host sync, say): keep the launched time
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                row["timing"] = "launched from Python"
        s = ms * 1e-3
        row["ms"] = ms
        if nbytes:
            row["GB/s"] = nbytes / s / 1e9
        if nflops:
            row["TFLOP/s"] = nflops / s / 1e12
        if roof:
            row["roofline_pct"] = 100 * roof / s
        rows.append(row)
    ours = next((r for r in rows if r["impl"] == "gpulab" and "ms" in r), None)
    for r in rows:
        if ours and "ms" in r:
            r["speedup_vs_this"] = r["ms"] / ours["ms"]   # >1: gpulab is faster than this row
        r.update(case=case.label, params=case.params, dtype=str(dtype).replace("torch.", ""),
                 bytes=nbytes, flops=nflops, roofline_ms=roof * 1e3 if roof else None)
    return rows


def _bench_generator():
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    return g


def run(name: str, cases: list[Case] | None = None, dtypes: list | None = None,
        extra: dict[str, Callable[[dict], object]] | None = None,
        compile_baselines: bool = True) -> dict:
    spec = get(name)
    require_gpu(f"gpulab bench {name}")
    cases = cases or spec.cases["bench"]
    dtypes = dtypes or spec.bench_dtypes or [runtime.default_dtype()]
    rows = []
    for case in cases:
        for dtype in dtypes:
            impl = spec.bench_impl or default_impl(spec, dtype)
            rows += measure(spec, case, dtype, {"gpulab": impl, **(extra or {})}, compile_baselines,
                            graph=spec.graph_timing)
            torch.cuda.empty_cache()
    return {"kernel": name, "date": _dt.date.today().isoformat(), "gpu": runtime.gpu_name(),
            "versions": runtime.versions(), "ceilings": ceilings(), "method":
            "triton.testing.do_bench median (warmup 25 ms, rep 100 ms, L2 flushed); "
            f"calls over {SLOW_MS:.0f} ms: median of 3", "rows": rows}


def default_impl(spec: KernelSpec, dtype: torch.dtype) -> Callable[[dict], object]:
    """Call the package implementation with outputs allocated once, outside the timing.
    Make a new one per case: it keeps the outputs of the inputs it first saw."""
    outputs = {}

    def impl(inputs):
        if spec.outputs is None:
            return spec.call(spec.implementation, inputs)
        if not outputs:
            outputs.update({k: torch.empty(s, dtype=d, device="cuda")
                            for k, (s, d) in spec.outputs(inputs, dtype).items()})
        return spec.call(spec.implementation, inputs, outputs)
    return impl


def save(result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result['kernel']}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


TABLE_WIDTH = 88        # a notebook's output area (and a terminal) without wrapping
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                "int8": "int8", "uint8": "u8"}


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _time(ms: float) -> str:
    """Eight characters: µs below 10 ms, ms above."""
    return f"{ms * 1e3:6.1f}µs" if ms < 10 else f"{ms:6.2f}ms"


def _pct(row: dict, width: int = 0, digits: int = 1) -> str:
    """A row's % of roofline; a dash where the saved result left it out (None: its
    ceiling was not trusted, see the result's ``note``)."""
    pct = row.get("roofline_pct")
    return f"{'—':>{width + 1}}" if pct is None else f"{pct:{width}.{digits}f}%"


def _ratio(x: float) -> str:
    return f"{x:5.2f}" if x < 100 else f"{x:5.0f}"


def table_heading(result: dict) -> str:
    c = result["ceilings"]
    return (f"{result['kernel']} on {result['gpu']} ({result['date']}; torch "
            f"{result['versions']['torch']}, triton {result['versions']['triton']}); measured "
            f"ceilings {c['bytes_per_s'] / 1e12:.2f} TB/s, {c['flops_per_s'] / 1e12:.0f} TFLOP/s (bf16)"
            + (f", {c['int8_ops_per_s'] / 1e12:.0f} TOPS (int8)" if c.get("int8_ops_per_s") else "")
            + (f". {result['note']}" if result.get("note") else ""))


def format_table(result: dict, width: int = TABLE_WIDTH) -> str:
    """The saved or measured rows as text no wider than ``width`` (88) columns.
    ``gpulab is`` > 1 means gpulab's kernel is that many times faster than the row;
    ``g`` after a time marks a CUDA-graph timing."""
    import textwrap
    lines = textwrap.wrap(table_heading(result), width)
    lines.append(f"{'case':18} {'dt':4} {'implementation':26} {'median':>8}   {'GB/s':>5} "
                 f"{'TF/s':>6} {'roof':>4} {'gpulab':>6}")
    for r in result["rows"]:
        impl = r["impl"].replace(" (compiled)", " compiled")
        head = (f"{_fit(r['case'], 18):18} {_SHORT_DTYPE.get(r['dtype'], r['dtype'][:4]):4} "
                f"{_fit(impl, 26):26}")
        if "error" in r:
            lines.append(_fit(f"{head} {r['error']}", width))
            continue
        graph = "g" if r.get("timing", "").startswith("CUDA graph") else " "
        lines.append(
            f"{head} {_time(r['ms'])} {graph} {r.get('GB/s', 0):5.0f} {r.get('TFLOP/s', 0):6.1f} "
            f"{_pct(r, 3, 0)} {_ratio(r.get('speedup_vs_this', float('nan')))}×")
    if any(r.get("timing", "").startswith("CUDA graph") for r in result["rows"]):
        lines.append("g: timed in a CUDA graph; last column: how many times faster gpulab is")
    else:
        lines.append("last column: gpulab is that many times faster than the row's implementation")
    return "\n".join(lines)


def table_html(result: dict) -> str:
    """The same table as HTML, for notebooks (no width limit, full names)."""
    import html
    cells = ["case", "dtype", "implementation", "median", "GB/s", "TFLOP/s", "% of roofline",
             "gpulab is × faster"]
    out = [f"<p><b>{html.escape(table_heading(result))}</b></p>",
           "<table><thead><tr>" + "".join(f"<th>{c}</th>" for c in cells) + "</tr></thead><tbody>"]
    for r in result["rows"]:
        left = [html.escape(str(r[k])) for k in ("case", "dtype", "impl")]
        if "error" in r:
            right = [f'<td colspan="5">{html.escape(r["error"])}</td>']
        else:
            graph = (f" (CUDA graph; as called {r['ms_launched'] * 1e3:.1f} µs)" if r.get("ms_launched")
                     else " (CUDA graph)") if r.get("timing", "").startswith("CUDA graph") else ""
            right = [f"<td>{v}</td>" for v in (
                f"{r['ms'] * 1e3:.1f} µs{graph}", f"{r.get('GB/s', 0):.0f}", f"{r.get('TFLOP/s', 0):.1f}",
                _pct(r), f"{r.get('speedup_vs_this', float('nan')):.2f}")]
        out.append("<tr>" + "".join(f"<td>{v}</td>" for v in left) + "".join(right) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


class BenchTable:
    """A benchmark result as a notebook shows it: an HTML table in JupyterLab, an
    88-column text table everywhere else (nbval, a terminal, a plain viewer)."""

    def __init__(self, result: dict):
        self.result = result

    def __repr__(self) -> str:
        return format_table(self.result)

    def _repr_html_(self) -> str:
        return table_html(self.result)


def markdown(result: dict) -> str:
    """A markdown table of one saved result, for BENCHMARKS.md."""
    v = result["versions"]
    c = result["ceilings"]
    lines = [f"### {result['kernel']}",
             f"{result['gpu']}, {result['date']}, torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}; "
             f"measured ceilings {c['bytes_per_s'] / 1e12:.2f} TB/s, {c['flops_per_s'] / 1e12:.0f} TFLOP/s bf16"
             + (f", {c['int8_ops_per_s'] / 1e12:.0f} TOPS int8." if c.get("int8_ops_per_s") else ".")
             + (f" {result['note']}" if result.get("note") else ""),
             "", "| case | dtype | implementation | median | GB/s | TFLOP/s | % of roofline | gpulab is × faster |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['impl']} | failed: {r['error'][:80]} | | | | |")
            continue
        # a graph timing leads where the spec asks for one; the as-called time beside it
        called = (f" (as called {r['ms_launched'] * 1e3:.1f} µs)"
                  if r.get("timing", "").startswith("CUDA graph") and r.get("ms_launched") else "")
        lines.append(f"| {r['case']} | {r['dtype']} | {r['impl']} | {r['ms'] * 1e3:.1f} µs{called} | "
                     f"{r.get('GB/s', 0):.0f} | {r.get('TFLOP/s', 0):.1f} | {_pct(r)} | "
                     f"{r.get('speedup_vs_this', float('nan')):.2f}"
                     + (" (graph)" if r.get("timing", "").startswith("CUDA graph") else "") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpulab bench", description=__doc__.split("\n\n")[0])
    p.add_argument("kernels", nargs="*", help="spec names (default: all that have bench cases)")
    p.add_argument("--save", action="store_true", help=f"write {RESULTS}/NAME.json")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    p.add_argument("--list", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print saved results as markdown tables")
    a = p.parse_args(argv)
    saved = {path.stem: path for path in sorted(RESULTS.glob("*.json"))}
    if a.markdown:
        missing = [n for n in a.kernels if n not in saved]
        if missing:
            print(f"no saved results for {', '.join(missing)}; saved: {', '.join(saved)}", file=sys.stderr)
            return 2
        for name in a.kernels or saved:
            print(markdown(json.loads(saved[name].read_text())) + "\n")
        return 0
    specs = all_specs()
    if a.list:
        for n, s in sorted(specs.items()):
            print(f"{n:28} {s.summary}")
        return 0
    unknown = [n for n in a.kernels if n not in specs]
    if unknown:
        print(f"no kernel spec named {', '.join(unknown)} (gpulab bench --list names them)", file=sys.stderr)
        return 2
    names = a.kernels or [n for n, s in sorted(specs.items()) if s.cases.get("bench")]
    try:
        require_gpu("gpulab bench")
    except InterpreterTiming as e:       # show what was measured on a GPU instead
        print(f"{e}\nSaved figures follow (as markdown: gpulab bench --markdown NAME).\n", file=sys.stderr)
        for n in (n for n in names if n in saved):
            print(format_table(json.loads(saved[n].read_text())) + "\n")
        unmeasured = [n for n in names if n not in saved]
        if unmeasured:
            print(f"not measured on a GPU yet: {', '.join(unmeasured)}", file=sys.stderr)
        return 2
    for n in names:
        result = run(n, compile_baselines=not a.no_compile)
        print(format_table(result), flush=True)
        if a.save:
            print(f"saved {save(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

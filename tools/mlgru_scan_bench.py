"""The MLGRU forward scan on the H200: the chunked kernel vs the two-phase kernel (issue 13).

    PYTHONPATH=. python3 tools/mlgru_scan_bench.py OUTDIR [--compile] [--quick | --first-only | --t-sweep] [--graph]
                                                         [--train | --train-only | --configs]

Writes OUTDIR/mlgru_scan_bench.json and prints a table. For B16 T8192 D512 and
B4 T32768 D1024, bfloat16 (the spec's inputs: forget gates near 1, h0 given), it times
with ``do_bench`` (median, L2 flushed; autotuning on):

* ``chunked``: :func:`gpulab.mlgru.scan_chunked_into` (today's "auto" at these shapes);
* ``two_phase chunk=C segment=S``: :func:`gpulab.mlgru.scan_two_phase_into` for
  C in 16 .. 1024 and S in (all of T, 512, 1024, 2048), S ≥ 2C (S < T: the three phases
  run on windows of S steps in turn, phase 1 loading with an L2 "evict_last" hint, so
  phase 3 may find f and i in the L2 cache);
* for the fastest two-phase setting: each of its three launches alone, and the whole
  call inside a CUDA graph (``time_graph_ms``: no launch gaps) next to the chunked kernel
  in a graph;
* ``--graph``: every two-phase row in a CUDA graph too (windows cost three launches
  each: the graph shows the GPU's time without the host's);
* ``--t-sweep``: B16 D512 at T = 512 .. 4096 instead, chunks 64-256, no windows: where
  ``mlgru.choose_kernel`` switches from the chunked kernel to the two-phase one;
* ``--train``: forward + backward through autograd for the pairs (chunked, chunked),
  (two-phase, chunked) and (two-phase, two-phase) side by side, then the backward
  launchers alone, the two-phase one for chunks 64-512;
* ``--train-only``: only those rows (first shape), then the step as the benchmark calls it
  and the profiler's table of one step (OUTDIR/mlgru_train.json);
* ``--configs``: only, in a fresh process: the step as benchmarked (twice), the tuner's
  choices for the four two-phase kernels, the host's time to queue a step against the wall
  time, the step from a CUDA graph, and every configuration of each two-phase kernel timed
  alone (OUTDIR/mlgru_configs.json). On 2026-12-03 the step took 425 µs in one process and
  942-1051 µs in fresh ones, its kernels 400-435 µs: this tells host from device;
* ``--compile``: torch.compile of the log-step PyTorch scan (slow to compile; measured
  before at 3262 µs, so off by default).

For every row: µs, GB/s of the 3-pass byte count (read f and i, write h: the roofline's
bytes), % of the measured device-copy bandwidth (``gpulab.harness.bench.ceilings()``),
and the bandwidth of the bytes the kernel really moves (the two-phase kernel reads f
and i twice: 5 passes). Every output is compared with the chunked kernel's (and, on
the first shape, both with the float64 loop). Takes about a minute and a half.

What to do with the result: if a two-phase setting beats ``chunked`` clearly, set
``mlgru.TWO_PHASE_CHUNK`` to its chunk (and a segment default if one helps) and switch
``mlgru.choose_kernel`` to "two_phase" above the T where it starts to win.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402  (first: it fixes Triton's mode before triton.language is imported)
import triton  # noqa: E402
from gpulab import mlgru, runtime  # noqa: E402
from gpulab.harness.bench import ceilings, host_and_wall_us, require_gpu, time_graph_ms, time_ms  # noqa: E402
from gpulab.harness.spec import Case  # noqa: E402

SHAPES = [Case("B16 T8192 D512", dict(B=16, T=8192, D=512)), Case("B4 T32768 D1024", dict(B=4, T=32768, D=1024))]
T_SWEEP = [Case(f"B16 T{t} D512", dict(B=16, T=t, D=512)) for t in (512, 1024, 2048, 4096)]
CHUNKS = (16, 32, 64, 128, 256, 512, 1024)
SEGMENTS = (None, 512, 1024, 2048)
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _row(name, ms, params, ceil, passes, spec, **extra):
    B, T, D = params["B"], params["T"], params["D"]
    roof_bytes = spec.bytes_moved(params, DTYPE)
    real_bytes = passes * B * T * D * DTYPE.itemsize + 2 * B * D * 4
    s = ms * 1e-3
    return {"impl": name, "us": round(ms * 1e3, 2), "GB/s": round(roof_bytes / s / 1e9, 1),
            "pct_of_copy": round(100 * roof_bytes / s / ceil["bytes_per_s"], 1),
            "passes": passes, "achieved_GB/s": round(real_bytes / s / 1e9, 1), **extra}


def _diff(a, b):
    return float((a.float() - b.float()).abs().max())


def _close(got, ref):
    """Within the spec's bf16 tolerance (atol = rtol = 1e-2) of the float64 loop?"""
    return bool(torch.allclose(got.double(), ref, atol=1e-2, rtol=1e-2))


def _phases(f, i, h0, h, h_last, chunk):
    """The three launches of scan_two_phase_into (segment = T) as separate callables."""
    B, T, D = f.shape
    n = triton.cdiv(T, chunk)
    scratch = torch.empty(3, B, n, D, dtype=torch.float32, device=f.device)
    a, bc, carry = scratch[0], scratch[1], scratch[2]
    grid = lambda meta: (triton.cdiv(D, meta["BLOCK_D"]), n, B)  # noqa: E731
    bd = mlgru.CARRY_BLOCK_D

    def p1():
        mlgru.scan_chunk_summary_kernel[grid](f, i, a, bc, B, T, D, 0, T, n, CHUNK=chunk, L2_POLICY=0)

    def p2():
        mlgru.scan_chunk_carry_kernel[(triton.cdiv(D, bd), B)](
            a, bc, carry, h0, h_last, D, n, CHUNKS_BLOCK=min(64, triton.next_power_of_2(n)), BLOCK_D=bd,
            num_warps=4)

    def p3():
        mlgru.scan_chunk_apply_kernel[grid](f, i, carry, h, B, T, D, 0, T, n, CHUNK=chunk, L2_POLICY=0)
    return p1, p2, p3


def train_rows(f, i, h0, p, ceil, spec_train, spec_bwd) -> list[dict]:
    """Forward + backward through autograd (``mlgru_scan`` with a :class:`ScanLaunchers`
    pair, the same fixed dh and dh_last) for three pairs side by side; then the backward
    launchers alone (the spec's 5-pass bytes), the two-phase one for several chunks, each
    output compared with the chunked backward's."""
    rows = []
    fwd = {"chunked": mlgru.scan_chunked_into, "two_phase": mlgru.scan_two_phase_into}
    bwd = {"chunked": mlgru.scan_backward_chunked_into, "two_phase": mlgru.scan_backward_two_phase_into}
    f, i, h0 = (t.detach().requires_grad_() for t in (f, i, h0))
    dh = torch.randn_like(f)
    dh_last = torch.randn_like(h0, dtype=torch.float32)
    for kf, kb in (("chunked", "chunked"), ("two_phase", "chunked"), ("two_phase", "two_phase")):
        pair = mlgru.ScanLaunchers(fwd[kf], bwd[kb])

        def step(pair=pair):
            h, h_last = mlgru.mlgru_scan(f, i, h0, kernel=pair)
            torch.autograd.backward((h, h_last), (dh, dh_last))
        ms = time_ms(step)
        gbs = round(spec_train.bytes_moved(p, DTYPE) / (ms * 1e-3) / 1e9, 1)   # the spec's fwd+bwd bytes
        rows.append({"impl": f"train: fwd {kf} + bwd {kb}", "us": round(ms * 1e3, 2), "GB/s": gbs,
                     "pct_of_copy": round(100 * gbs * 1e9 / ceil["bytes_per_s"], 1), "achieved_GB/s": gbs})
    with torch.no_grad():
        h, _ = mlgru.mlgru_scan(f, i, h0, kernel="chunked")
    outs = [torch.empty_like(f), torch.empty_like(f), torch.empty_like(h0)]
    mlgru.scan_backward_chunked_into(f, h0, h, dh, dh_last, *outs)
    want = [t.clone() for t in outs]
    settings = [("backward chunked", mlgru.scan_backward_chunked_into)] + [
        (f"backward two_phase chunk={c}", lambda *a, c=c: mlgru.scan_backward_two_phase_into(*a, chunk=c))
        for c in (64, 128, 256, 512)]
    for name, run in settings:
        def launch(run=run):
            run(f, h0, h, dh, dh_last, *outs)
        ms = time_ms(launch)
        launch()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, want))
        gbs = round(spec_bwd.bytes_moved(p, DTYPE) / (ms * 1e-3) / 1e9, 1)
        rows.append({"impl": name, "us": round(ms * 1e3, 2), "GB/s": gbs,
                     "pct_of_copy": round(100 * gbs * 1e9 / ceil["bytes_per_s"], 1), "achieved_GB/s": gbs,
                     "max_diff_vs_chunked": diff})
    return rows


def train_only(out: Path, ceil, spec) -> int:
    """--train-only: the train rows, then where a forward + backward as called spends its
    time: the profiler's CUDA kernel times against the step's wall time."""
    case = SHAPES[0]
    p = case.params
    inp = spec.make_inputs(p, DTYPE, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
    rows = train_rows(inp["f"], inp["i"], inp["h0"], p, ceil, gpulab.get_spec("mlgru_scan_train"),
                      gpulab.get_spec("mlgru_scan_backward_chunked"))
    train = gpulab.get_spec("mlgru_scan_train")
    tin = train.make_inputs(p, DTYPE, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
    step = lambda: train.implementation(**tin)  # noqa: E731   (the benchmark's "gpulab" row)
    rows.append({"impl": "mlgru_scan_train as benchmarked", "us": round(time_ms(step) * 1e3, 2)})
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    for r in rows:
        print(f"{r['impl']:44s} {r['us']:9.1f} µs {r.get('pct_of_copy', '')} {r.get('max_diff_vs_chunked', '')}")
    print(table)
    (out / "mlgru_train.json").write_text(json.dumps({"device": runtime.gpu_name(), "versions": runtime.versions(),
                                                      "case": case.label, "rows": rows, "profile": table}, indent=1))
    return 0


def configs_run(out: Path) -> int:
    """--configs: in a fresh process, forward + backward as the benchmark calls it (autotuned
    on its first call), the configuration the tuner chose for each two-phase kernel, then
    every configuration of each of the four two-phase kernels timed alone (chunk 256)."""
    p = SHAPES[0].params
    B, T, D = p["B"], p["T"], p["D"]
    train = gpulab.get_spec("mlgru_scan_train")
    inp = train.make_inputs(p, DTYPE, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
    res = {"device": runtime.gpu_name(), "versions": runtime.versions(),
           "train_us_first": round(time_ms(lambda: train.implementation(**inp)) * 1e3, 2)}
    kernels = {"fwd summary": mlgru.scan_chunk_summary_kernel, "fwd apply": mlgru.scan_chunk_apply_kernel,
               "bwd summary": mlgru.scan_backward_chunk_summary_kernel,
               "bwd apply": mlgru.scan_backward_chunk_apply_kernel}
    res["chosen"] = {name: {str(k): str(v) for k, v in k_.cache.items()} for name, k_ in kernels.items()}
    res["train_us_again"] = round(time_ms(lambda: train.implementation(**inp)) * 1e3, 2)
    # host or device? 50 steps queued without waiting (host time against wall time, and the
    # allocator's device calls meanwhile), then the step replayed from a CUDA graph (the
    # GPU's time alone). On a CPU, with the launches stubbed, the host path of a step took
    # 142 µs: far below the kernels' 400-435 µs.
    paced = host_and_wall_us(lambda: train.implementation(**inp), 50)
    res["host_us_per_step"], res["wall_us_per_step"] = paced["host_us"], paced["wall_us"]
    res["allocator_in_50_steps"] = paced["allocator"]
    try:
        res["train_graph_us"] = round(time_graph_ms(lambda: train.implementation(**inp)) * 1e3, 2)
    except Exception as e:      # autograd inside a capture may not be allowed here: say why
        res["train_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    f, i, h0, dh, dh_last = (inp[k] for k in ("f", "i", "h0", "dh", "dh_last"))
    chunk = mlgru.two_phase_chunk(T)
    n = triton.cdiv(T, chunk)
    a, bc, carry = torch.rand(3, B, n, D, device=DEVICE)
    h, df, di = torch.empty_like(f), torch.empty_like(f), torch.empty_like(f)
    dh0 = torch.empty_like(h0)
    calls = {"fwd summary": lambda fn, g, kw: fn[g](f, i, a, bc, B, T, D, 0, T, n, CHUNK=chunk, L2_POLICY=0, **kw),
             "fwd apply": lambda fn, g, kw: fn[g](f, i, carry, h, B, T, D, 0, T, n, CHUNK=chunk, L2_POLICY=0, **kw),
             "bwd summary": lambda fn, g, kw: fn[g](f, dh, a, bc, B, T, D, n, CHUNK=chunk, **kw),
             "bwd apply": lambda fn, g, kw: fn[g](f, h0, h, dh, carry, df, di, dh0, B, T, D, n, CHUNK=chunk, **kw)}
    res["per_config_us"] = {}
    for name, tuned in kernels.items():
        times = {}
        for cfg in tuned.configs:
            kw = cfg.all_kwargs()
            g = (triton.cdiv(D, kw["BLOCK_D"]), n, B)
            times[str(cfg)] = round(time_ms(lambda: calls[name](tuned.fn, g, kw)) * 1e3, 2)
        res["per_config_us"][name] = times
    print(json.dumps(res, indent=1))
    (out / "mlgru_configs.json").write_text(json.dumps(res, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--compile", action="store_true", help="also torch.compile the log-step PyTorch scan")
    ap.add_argument("--quick", action="store_true", help="first shape only, chunks 128/256/512, no segments")
    ap.add_argument("--t-sweep", action="store_true",
                    help="B16 D512 at T = 512 .. 4096 (where the rule switches kernels), chunks 64/128/256, no segments")
    ap.add_argument("--graph", action="store_true", help="time every two-phase row in a CUDA graph too")
    ap.add_argument("--first-only", action="store_true", help="only the first shape (all chunks and segments)")
    ap.add_argument("--train", action="store_true",
                    help="also forward + backward through autograd with each forward kernel, side by side")
    ap.add_argument("--train-only", action="store_true",
                    help="only --train's rows on the first shape, and the profiler's kernel times of one "
                         "forward + backward as called")
    ap.add_argument("--configs", action="store_true",
                    help="only: forward + backward as benchmarked in a fresh process, the tuner's choices, "
                         "and each two-phase kernel's configurations timed alone")
    args = ap.parse_args()
    require_gpu("the scan benchmark")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ceil = ceilings()
    spec = gpulab.get_spec("mlgru_scan_chunked")
    if args.configs:
        return configs_run(args.out)
    if args.train_only:
        return train_only(args.out, ceil, spec)
    shapes = T_SWEEP if args.t_sweep else SHAPES[:1] if args.quick or args.first_only else SHAPES
    chunks = (64, 128, 256) if args.t_sweep else (128, 256, 512) if args.quick else CHUNKS
    segments = (None,) if args.quick or args.t_sweep else SEGMENTS
    result = {"device": runtime.gpu_name(), "versions": runtime.versions(), "dtype": "bfloat16",
              "ceilings": ceil, "two_phase_chunk_default": mlgru.TWO_PHASE_CHUNK, "shapes": []}
    for case in shapes:
        p = case.params
        B, T, D = p["B"], p["T"], p["D"]
        inp = spec.make_inputs(p, DTYPE, torch.device(DEVICE), torch.Generator(DEVICE).manual_seed(0))
        f, i, h0 = inp["f"], inp["i"], inp["h0"]
        rows, checks = [], {}
        h_ref, hl_ref = torch.empty_like(f), torch.empty(B, D, dtype=torch.float32, device=DEVICE)
        mlgru.scan_chunked_into(f, i, h0, h_ref, hl_ref)
        if case is shapes[0]:
            ref = mlgru.scan_reference(f, i, h0)
            checks["chunked vs float64: max |h diff|, |h_last diff|, within bf16 tolerance"] = (
                _diff(h_ref, ref["h"]), _diff(hl_ref, ref["h_last"]), _close(h_ref, ref["h"]))
        rows.append(_row("chunked", time_ms(lambda: mlgru.scan_chunked_into(f, i, h0, h_ref, hl_ref)),
                         p, ceil, 3, spec))
        h, h_last = torch.empty_like(f), torch.empty_like(hl_ref)
        best = None
        for chunk in chunks:
            for segment in segments:
                if segment is not None and (segment >= T or segment < 2 * chunk) or chunk >= T:
                    continue

                def run(chunk=chunk, segment=segment):
                    mlgru.scan_two_phase_into(f, i, h0, h, h_last, chunk=chunk, segment=segment)
                ms = time_ms(run)
                run()
                torch.cuda.synchronize()
                extra = {"graph_us": round(time_graph_ms(run) * 1e3, 2)} if args.graph else {}
                r = _row(f"two_phase chunk={chunk} segment={segment or T}", ms, p, ceil, 5, spec,
                         chunk=chunk, segment=segment, max_h_diff_vs_chunked=_diff(h, h_ref),
                         max_hlast_diff_vs_chunked=_diff(h_last, hl_ref), **extra)
                rows.append(r)
                if best is None or r["us"] < best["us"]:
                    best = r
        if case is shapes[0]:
            mlgru.scan_two_phase_into(f, i, h0, h, h_last)
            checks["two_phase (default chunk) vs float64: max |h diff|, |h_last diff|, within bf16 tolerance"] = (
                _diff(h, ref["h"]), _diff(h_last, ref["h_last"]), _close(h, ref["h"]))
            del ref
        # The fastest setting: its launches one by one, and in a CUDA graph.
        p1, p2, p3 = _phases(f, i, h0, h, h_last, best["chunk"])
        breakdown = {name: round(time_ms(fn) * 1e3, 2) for name, fn in
                     (("phase 1 (chunk maps)", p1), ("phase 2 (carries)", p2), ("phase 3 (rescan)", p3))}
        p1(), p2(), p3()
        torch.cuda.synchronize()
        checks["phases run one by one vs chunked: max |h diff|"] = _diff(h, h_ref)
        graph = {"chunked": round(time_graph_ms(lambda: mlgru.scan_chunked_into(f, i, h0, h_ref, hl_ref)) * 1e3, 2),
                 best["impl"]: round(time_graph_ms(lambda: mlgru.scan_two_phase_into(
                     f, i, h0, h, h_last, chunk=best["chunk"], segment=best["segment"])) * 1e3, 2)}
        if args.train:
            rows += train_rows(f, i, h0, p, ceil, gpulab.get_spec("mlgru_scan_train"),
                               gpulab.get_spec("mlgru_scan_backward_chunked"))
        if args.compile:
            compiled = torch.compile(mlgru.scan_torch)
            t = time.time()
            compiled(f, i, h0)
            rows.append(_row("torch.compile(log-step scan)", time_ms(lambda: compiled(f, i, h0)), p, ceil, 3, spec,
                             compile_s=round(time.time() - t, 1)))
        roof_us = spec.roofline_s(p, DTYPE, ceil) * 1e6
        result["shapes"].append({"case": case.label, "params": p, "roofline_us": round(roof_us, 2), "rows": rows,
                                 "best_two_phase": best["impl"], "best_phase_breakdown_us": breakdown,
                                 "cuda_graph_us": graph, "checks": checks})
        print(f"\n{case.label} bf16: roofline {roof_us:.1f} µs (copy {ceil['bytes_per_s'] / 1e12:.2f} TB/s)")
        print(f"{'impl':40s} {'µs':>9s} {'GB/s':>8s} {'% copy':>7s} {'real GB/s':>10s} {'graph µs':>9s}")
        for r in rows:
            print(f"{r['impl']:40s} {r['us']:9.1f} {r['GB/s']:8.1f} {r['pct_of_copy']:7.1f} {r['achieved_GB/s']:10.1f}"
                  f" {r.get('graph_us', ''):>9} {r.get('max_diff_vs_chunked', '')}")
        print("best two-phase, launches alone (µs):", breakdown)
        print("in a CUDA graph (µs):", graph)
        print("checks:", checks)
        del inp, f, i, h0, h, h_ref
        torch.cuda.empty_cache()
    result["seconds"] = round(time.time() - started, 1)
    out = args.out / "mlgru_scan_bench.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

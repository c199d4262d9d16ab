"""Where a benchmarked call's host time goes, on the GPU host: for a spec's public function
as ``gpulab bench`` calls it, on one of its benchmark cases.

    PYTHONPATH=$PWD python3 tools/spec_host_profile.py OUTDIR SPEC[:CASE] ... [--steps 50]

(CASE: the index of a benchmark case, 0 by default.)

For each spec:
1. ``host_us`` / ``wall_us``: STEPS calls queued back to back, the host's time to queue them
   and the wall time until the GPU has run them, per call (equal: the host sets the pace, or
   a call waits for the GPU) and the caching allocator's device calls meanwhile
   (``gpulab.harness.bench.host_and_wall_us``), next to the call replayed from a CUDA graph
   (the GPU alone);
2. the CUDA driver and runtime calls in those STEPS calls (``torch.profiler``): a
   synchronising one (cudaStreamSynchronize, cudaMemcpy, cudaDeviceSynchronize...) means
   the call waits for the GPU, and then host time and GPU time add up;
3. ``cProfile`` of STEPS calls: the Python functions with the most time of their own.
Writes OUTDIR/spec_host_profile.json and prints the same.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

import gpulab
from gpulab import runtime
from gpulab.harness import bench


def _bench_call(spec, index: int):
    case = spec.cases["bench"][index]
    dtype = (spec.bench_dtypes or [runtime.default_dtype()])[0]
    inp = spec.make_inputs(case.params, dtype, torch.device("cuda"), torch.Generator("cuda").manual_seed(0))
    impl = spec.bench_impl or bench.default_impl(spec, dtype)
    return case, (lambda: impl(inp))


def profile(spec_name: str, steps: int) -> dict:
    name, _, index = spec_name.partition(":")
    spec = gpulab.get_spec(name)
    case, call = _bench_call(spec, int(index or 0))
    for _ in range(3):                      # compile, tune, warm the allocator
        call()
    res = {"spec": spec_name, "case": str(case.params), **bench.host_and_wall_us(call, steps)}
    try:
        res["graph_us"] = round(bench.time_graph_ms(call) * 1e3, 2)
    except Exception as e:                  # not capturable (a host sync inside, autograd...): say why
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    api = {}
    for ev in prof.key_averages():
        if ev.key.startswith(("cuda", "cu")) and not ev.key.startswith("cutlass"):
            api[ev.key] = {"calls_per_step": round(ev.count / steps, 2),
                           "us_per_step": round(ev.cpu_time_total / steps, 1)}
    res["cuda_api"] = dict(sorted(api.items(), key=lambda kv: -kv[1]["us_per_step"]))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    res["cprofile_top_tottime"] = s.getvalue().splitlines()[:60]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    for name in args.specs:
        spec_name, _, index = name.partition(":")
        try:
            cases = gpulab.get_spec(spec_name).cases.get("bench", [])
        except KeyError:
            print(f"no kernel spec named {spec_name} (gpulab bench --list names them)", file=sys.stderr)
            return 2
        if not (index or "0").isdigit() or int(index or 0) >= len(cases):
            print(f"{spec_name} has {len(cases)} benchmark case(s): CASE must be 0..{len(cases) - 1}, got {index!r}",
                  file=sys.stderr)
            return 2
    if not torch.cuda.is_available() or runtime.mode() != "compiled":
        print("spec_host_profile times calls on a CUDA GPU in compiled mode: run it on the GPU host",
              file=sys.stderr)
        return 2
    out = {"device": runtime.gpu_name(), "versions": runtime.versions(),
           "rows": [profile(name, args.steps) for name in args.specs]}
    Path(args.outdir).mkdir(parents=True, exist_ok=True)
    (Path(args.outdir) / "spec_host_profile.json").write_text(json.dumps(out, indent=1))
    for r in out["rows"]:
        print(f"{r['spec']} {r['case']}: host {r['host_us']} µs, wall {r['wall_us']} µs, "
              f"graph {r.get('graph_us', r.get('graph_error'))}")
        for k, v in list(r["cuda_api"].items())[:12]:
            print(f"   {k:40s} {v['calls_per_step']:6} calls  {v['us_per_step']:8} µs a step")
        print("\n".join(r["cprofile_top_tottime"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

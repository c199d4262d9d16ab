"""The serving engine's H200 measurements (issue 14's targets), for the lead's GPU runs.

    PYTHONPATH=. python3 tools/engine_bench.py OUTDIR [--quick] [--model SPEC] [--no-piecewise] [--no-full-graphs]
                                                  [--kv-split] [--parts 1,2,3,4] [--ttft-order on,off]
                                                  [--ttft-repeats N] [--rehearse]

Writes OUTDIR/engine_bench.json (every number below, with the GPU, versions and
configurations), OUTDIR/engine_throughput.png and OUTDIR/engine_ttft.png.

1. throughput: continuous vs static batching, mixed workload, same KV memory;
2. TTFT with a shared 2K-token system prompt, prefix caching on vs off;
3. one decode step at batch 64: CUDA-graph replay vs eager vs the sum of its kernels'
   device times (torch.profiler);
4. decode tokens/s at batch 1 and 256, the bytes each step reads (2-bit weights + KV)
   and the resulting share of HBM bandwidth (vs the H200's 4.8 TB/s and a measured copy).

The default model is a random-weight ternary transformer of ~0.7 B ternary weights
(timing only: weights do not change the work); ``--model shipped`` times the shipped
checkpoint. ``--quick`` shrinks every workload (a smoke test, minutes less).
``--kv-split`` runs parts 1 and 2 with ``EngineConfig(kv_split=True)`` (split-KV append
attention where a step's tiles leave SMs idle; opt-in). ``--no-piecewise`` runs parts 1 and 2 with ``EngineConfig(piecewise_graphs=False)``: steps
that carry a prompt chunk run eagerly instead of replaying piecewise CUDA graphs (the
engine's default since 2026-12-01). ``--no-full-graphs`` runs them with
``EngineConfig(full_graphs=False)``: small steps with prompt chunks take the piecewise graphs
too, instead of one graph of the whole step (the default since 2026-12-04).
``--ttft-repeats N`` runs part 2's pair N times and reports the pair with the median ratio
(with every pair's figures). ``--rehearse --parts 2`` runs part 2 on a tiny model and
workload in any mode (the interpreter on a CPU): the script's code, not its figures.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402
from gpulab import runtime  # noqa: E402
from gpulab.harness import bench  # noqa: E402
from gpulab.engine.engine import LLM, EngineConfig, frozen_heap  # noqa: E402
from gpulab.engine.model import model_sizes  # noqa: E402
from gpulab.engine.serve_bench import (Workload, build_model, compare, decoding_engine,  # noqa: E402
                                       format_comparison, plot_comparison)

BIG = "random:2048,16,16,4,128,5632,4096"
H200_PEAK_BW = 4.8e12


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        y.copy_(x)
    e1.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (e0.elapsed_time(e1) * 1e-3)


def time_decode_steps(llm: LLM, steps: int) -> float:
    """Seconds per engine step (schedule + plan + graph replay + sampling) when decoding,
    the start-up heap frozen as serving runs (else one full garbage collection of it,
    a tenth of a second or more, lands among the timed steps)."""
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    with frozen_heap():
        t = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / steps


def time_forward(llm: LLM, use_graph: bool, reps: int = 50) -> tuple[float, float]:
    """Device time of one decode forward (graph replay or eager), and the sum of its
    kernels' device times from the profiler (eager run)."""
    runner = llm.runner
    items = [(s, 1) for s in llm.scheduler.running]
    for s, _ in items:                 # runner-only timing: make room without touching tokens
        llm.block_manager.append_slots(s, 1)
    plan = runner.plan(items)
    fn = (lambda: runner.replay(plan)) if use_graph and runner.graphs else (lambda: runner.forward(plan))
    with torch.no_grad():
        step = bench.mean_ms(fn, reps, warmup=5) * 1e-3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.forward(plan)
            torch.cuda.synchronize()
    # only CUDA activity was recorded: every row is a kernel (or a copy/memset) on the device
    kernels = sum(e.self_device_time_total for e in prof.key_averages()) * 1e-6 / 5
    return step, kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--model", default=BIG)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-piecewise", action="store_true",
                    help="steps with prompt chunks run eagerly (EngineConfig(piecewise_graphs=False))")
    ap.add_argument("--kv-split", action="store_true", help="EngineConfig(kv_split=True) in parts 1 and 2")
    ap.add_argument("--no-full-graphs", action="store_true",
                    help="EngineConfig(full_graphs=False) in parts 1 and 2 (small prompt steps piecewise)")
    ap.add_argument("--parts", default="1,2,3,4", help="which of the four parts to run (default: all)")
    ap.add_argument("--ttft-order", default="on,off",
                    help="part 2's runs, prefix caching on and off, in this order (off,on: the slower first)")
    ap.add_argument("--ttft-repeats", type=int, default=1,
                    help="part 2: this many pairs of runs; the JSON keeps them all and reports the median pair")
    ap.add_argument("--rehearse", action="store_true",
                    help="part 2 only, on a tiny model and workload, any mode (the CPU tests run it)")
    a = ap.parse_args(argv)
    parts = {int(p) for p in a.parts.split(",")}
    a.piecewise = not a.no_piecewise
    if a.ttft_repeats < 1:
        ap.error("--ttft-repeats must be at least 1")
    if a.rehearse:
        if parts != {2}:
            ap.error("--rehearse runs part 2 only: add --parts 2")
        a.model = "random:64,1,2,1,32,128,256"
    elif runtime.mode() != "compiled":
        print("engine_bench needs a CUDA GPU (compiled mode); --rehearse --parts 2 runs a tiny part 2 anywhere")
        return 2
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(a.model)
    sizes = model_sizes(model)
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions(), "date": time.strftime("%Y-%m-%d"),
           "model_spec": a.model, "piecewise_graphs": a.piecewise, "full_graphs": not a.no_full_graphs,
           "kv_split": a.kv_split, "parts": sorted(parts),
           "model": asdict(model.cfg), "sizes": sizes}
    print(gpulab.env_report(), "\n", res["model"], sizes, flush=True)

    def save():
        (out / "engine_bench.json").write_text(json.dumps(res, indent=1, default=str))

    if 1 in parts:
        throughput(a, model, res, out)
        save()
    if 2 in parts:
        ttft(a, model, res, out)
        save()
    if 3 in parts:
        decode_step_b64(model, res)
        save()
    if 4 in parts:
        decode_rate(model, sizes, res, save)
    print(f"wrote {out / 'engine_bench.json'}")
    return 0


def throughput(a, model, res, out):
    """Part 1: continuous vs static batching, mixed workload, equal KV memory."""
    q = a.quick
    w = Workload(requests=64 if q else 400, rate=math.inf, prompt_len=(32, 512), output_len=(16, 512),
                 shared=0.0, system_len=0, seed=0)
    cfg = EngineConfig(num_blocks=1024 if q else 4096, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                       piecewise_graphs=a.piecewise, full_graphs=not a.no_full_graphs, kv_split=a.kv_split)
    r = compare(model, cfg, w, static=True)
    print(format_comparison(r), flush=True)
    plot_comparison(r, out / "engine_throughput.png")
    res["throughput"] = {k: r[k] for k in ("workload", "config", "continuous", "static")}
    res["throughput"]["ratio"] = r["continuous"]["throughput_tok_s"] / r["static"]["throughput_tok_s"]


def median_pair(ratios: list[float]) -> int:
    """Index of the run pair whose ratio is the median (the lower middle of an even count)."""
    order = sorted(range(len(ratios)), key=ratios.__getitem__)
    return order[(len(order) - 1) // 2]


def ttft(a, model, res, out):
    """Part 2: TTFT with a shared 2K-token system prompt, prefix caching on / off;
    ``--ttft-repeats`` pairs of runs, each in the order of ``--ttft-order``. The JSON's
    ``on``, ``off`` and ``p50_ratio`` are the pair with the median ratio (its plot too);
    ``pairs`` keeps every pair's p50s and ratio (runs of the same code differ by about 10%
    on the H200: the GPU idles between requests and leaves its idle clock at each)."""
    q = a.quick
    if a.rehearse:
        w = Workload(requests=3, rate=50.0, prompt_len=(4, 8), output_len=(1, 2), shared=1.0, system_len=48, seed=1)
    else:
        w = Workload(requests=32 if q else 128, rate=4.0, prompt_len=(16, 64), output_len=(16, 64),
                     shared=1.0, system_len=2048, seed=1)
    res["ttft"] = {"order": a.ttft_order, "repeats": a.ttft_repeats}
    pairs = []
    for _ in range(a.ttft_repeats):
        pair = {}
        for caching in [c == "on" for c in a.ttft_order.split(",")]:
            cfg = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=128, max_num_batched_tokens=2048,
                               prefix_caching=caching, piecewise_graphs=a.piecewise,
                               full_graphs=not a.no_full_graphs, kv_split=a.kv_split)
            r = compare(model, cfg, w, static=False, progress=not a.rehearse)
            print(format_comparison(r), flush=True)
            pair["on" if caching else "off"] = r
        pairs.append(pair)
    if all("on" in p and "off" in p for p in pairs):
        ratios = [p["off"]["continuous"]["ttft_s_p50"] / p["on"]["continuous"]["ttft_s_p50"] for p in pairs]
        i = median_pair(ratios)
        res["ttft"]["p50_ratio"] = ratios[i]
        res["ttft"]["pairs"] = [{"off_ttft_s_p50": p["off"]["continuous"]["ttft_s_p50"],
                                 "on_ttft_s_p50": p["on"]["continuous"]["ttft_s_p50"], "p50_ratio": x}
                                for p, x in zip(pairs, ratios)]
        print("TTFT p50 ratios, off / on: " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f"; the median pair's: {ratios[i]:.2f}x", flush=True)
    else:                                  # one setting only: its last run
        i = len(pairs) - 1
    for k, r in pairs[i].items():
        res["ttft"][k] = r["continuous"]
    if "on" in pairs[i]:
        plot_comparison(pairs[i]["on"], out / "engine_ttft.png")


def decode_step_b64(model, res):
    """Part 3: one decode step at batch 64, graph vs eager vs the sum of its kernels."""
    llm = decoding_engine(model, 64, 512, cuda_graphs=True)
    g, k = time_forward(llm, True)
    e, _ = time_forward(llm, False)
    res["decode_step_b64"] = {"ctx": 512, "graph_s": g, "eager_s": e, "kernel_sum_s": k,
                              "graph_over_kernels": g / k, "eager_over_kernels": e / k,
                              "engine_step_s": time_decode_steps(llm, 20)}
    print(res["decode_step_b64"], flush=True)


def decode_rate(model, sizes, res, save):
    """Part 4: decode tokens/s at batch 1 and 256, bytes per step, share of HBM bandwidth."""
    bw = copy_bandwidth()
    res["copy_bandwidth_Bps"] = bw
    c = model.cfg
    res["decode_rate"] = {}
    for b in (1, 256):
        ctx = 512
        llm = decoding_engine(model, b, ctx)
        step = time_decode_steps(llm, 20)
        fwd, _ = time_forward(llm, True)
        kv = b * (ctx + 24) * c.n_layers * 2 * c.n_kv_heads * c.head_dim * llm.runner.k_cache.element_size()
        moved = sizes["packed_bytes"] + kv
        res["decode_rate"][f"b{b}"] = {"ctx": ctx, "engine_step_s": step, "forward_s": fwd,
                                       "tokens_per_s": b / step, "weight_bytes": sizes["packed_bytes"],
                                       "kv_bytes": kv, "bytes_per_token": moved / b,
                                       "hbm_share_of_peak": moved / fwd / H200_PEAK_BW,
                                       "hbm_share_of_copy": moved / fwd / bw}
        print(b, res["decode_rate"][f"b{b}"], flush=True)
        del llm
        torch.cuda.empty_cache()
        save()


if __name__ == "__main__":
    sys.exit(main())

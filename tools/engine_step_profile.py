"""Where the time of a step that carries a prompt goes (GPU only; issue 14's TTFT).

    PYTHONPATH=. python3 tools/engine_step_profile.py [--model SPEC] [--reps 8] [--json OUT.json]
                                                      [--no-piecewise] [--no-full-graphs] [--kv-split]
                                                      [--cached-only] [--gap S]
                                                      [--decode-batches 64,128] [--mixed [--trace T.json]]

The engine bench's TTFT workload sends prompts of a shared 2048-token system prompt and a
16-64-token question. With prefix caching a new request's prompt step computes only its
question, yet on the H200 (2026-12-03) that step took 5.4 ms against 1.85 ms for a decode
step. This serves such requests one at a time on the engine bench's model and reports,
for the step that carries the prompt (cached system prompt + 40 new tokens), for the
same prompt with nothing cached, and for a decode step at batch 1:

* the time from the request's arrival to its first token, the engine idle otherwise
  (median of ``--reps`` requests, synchronised before and after);
* from torch.profiler, the device time of its kernels, grouped by name (the top ones),
  and their sum: the step's wall time minus that sum is time the GPU waits for the host;
* the host functions with the most own time (cProfile) over one more such request.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402
from gpulab import runtime  # noqa: E402
from gpulab.engine.engine import LLM, EngineConfig  # noqa: E402
from gpulab.engine.model import BOS, TransformerBlock  # noqa: E402
from gpulab.engine.sequence import SamplingParams  # noqa: E402
from gpulab.engine.serve_bench import build_model, decoding_engine  # noqa: E402
from gpulab.harness.profiler import kernel_times  # noqa: E402

BIG = "random:2048,16,16,4,128,5632,4096"


def timed_step(llm: LLM) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def kernel_table(prof, top: int = 20) -> dict:
    """Device time of the profiled kernels by name (µs), the largest first, and their sum."""
    kernels = kernel_times(prof)
    return {"kernel_sum_us": round(sum(k["time_ns"] for k in kernels) / 1e3, 1),
            "kernels": len(kernels), "launches": int(sum(k["calls_per_run"] for k in kernels)),
            "top": [{"name": k["name"][:90], "us": round(k["time_ns"] / 1e3, 1), "calls": int(k["calls_per_run"])}
                    for k in kernels[:top]]}


def first_token_steps(llm: LLM, request_id: str) -> int:
    """Steps until the request has its first token."""
    seq, steps = llm.groups[request_id][0], 0
    while seq.num_output_tokens == 0:
        llm.step()
        steps += 1
    return steps


def prompt_case(llm: LLM, prompt_of, reps: int, gap: float = 0.0) -> dict:
    """The steps that carry each new request's prompt, up to its first token (one
    request at a time; a prompt longer than the token budget takes two steps), each
    request ``gap`` seconds after the last one finished (the GPU and the host idle)."""
    times, steps = [], 0
    for r in range(reps + 1):
        time.sleep(gap)
        rid = llm.add_request(prompt_of(r), SamplingParams(max_tokens=2, stop_at_eos=False))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = first_token_steps(llm, rid)
        torch.cuda.synchronize()
        if r:                                 # the first one warms the path up
            times.append(time.perf_counter() - t0)
        while llm.has_unfinished():
            llm.step()
    rid = llm.add_request(prompt_of(reps + 1), SamplingParams(max_tokens=2, stop_at_eos=False))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first_token_steps(llm, rid)
        torch.cuda.synchronize()
    while llm.has_unfinished():
        llm.step()
    rid = llm.add_request(prompt_of(reps + 2), SamplingParams(max_tokens=2, stop_at_eos=False))
    host = cProfile.Profile()
    host.runcall(first_token_steps, llm, rid)
    while llm.has_unfinished():
        llm.step()
    stats = pstats.Stats(host)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]     # by own time
    host_top = [{"fn": f"{Path(f).name}:{line}:{fn}", "own_ms": round(v[2] * 1e3, 3), "calls": v[1]}
                for (f, line, fn), v in top]
    return {"host_top": host_top, "first_token_ms_median": round(statistics.median(times) * 1e3, 3), "steps": steps,
            "first_token_ms_all": [round(t * 1e3, 3) for t in times], **kernel_table(prof)}


def decode_case(llm: LLM, reps: int) -> dict:
    llm.add_request([BOS] + [5] * 100, SamplingParams(max_tokens=reps + 8, stop_at_eos=False))
    llm.step()
    llm.step()
    times = [timed_step(llm) for _ in range(reps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    while llm.has_unfinished():
        llm.step()
    return {"step_ms_median": round(statistics.median(times) * 1e3, 3), **kernel_table(prof)}


def batch_decode_case(model, batch: int, ctx: int, reps: int) -> dict:
    """A decode step of ``batch`` requests, each ``ctx`` tokens in (the engine bench's
    decode rows; continuous batching's steps hold about 120 such rows)."""
    llm = decoding_engine(model, batch, ctx, max_tokens=reps + 16)
    for _ in range(2):
        llm.step()
    times = [timed_step(llm) for _ in range(reps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    return {"batch": batch, "ctx": ctx, "step_ms_median": round(statistics.median(times) * 1e3, 3), **kernel_table(prof)}


def mixed_case(model, batch: int, ctx: int, prompts: int, prompt_len: int, reps: int, trace: str | None = None) -> dict:
    """A continuous-batching step: ``batch`` requests decoding (``ctx`` tokens in) and
    ``prompts`` new prompts of ``prompt_len`` tokens in the same step (the engine bench's
    throughput workload spends about half its time in such steps). Median of ``reps``
    such steps, then one profiled."""
    llm = decoding_engine(model, batch, ctx, max_tokens=4 * reps + 32, max_num_seqs=batch + prompts)
    times, prof = [], None
    for r in range(reps + 1):
        for i in range(prompts):
            llm.add_request([BOS] + [(r * 31 + i * 7 + j) % 250 + 3 for j in range(prompt_len - 1)],
                            SamplingParams(max_tokens=1, stop_at_eos=False))
        if r < reps:
            times.append(timed_step(llm))
        else:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.step()
                torch.cuda.synchronize()
        llm.step()                                  # the prompts' requests finish: a decode step
    if trace:                                       # one more such step, host and device, with stacks
        for i in range(prompts):
            llm.add_request([BOS] + [(i * 13 + j) % 250 + 3 for j in range(prompt_len - 1)],
                            SamplingParams(max_tokens=1, stop_at_eos=False))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as tprof:
            llm.step()
            torch.cuda.synchronize()
        tprof.export_chrome_trace(trace)
    return {"batch": batch, "ctx": ctx, "prompts": prompts, "prompt_len": prompt_len,
            "step_ms_median": round(statistics.median(times) * 1e3, 3), **kernel_table(prof, top=30)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=BIG)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-piecewise", action="store_true")
    ap.add_argument("--kv-split", action="store_true", help="EngineConfig(kv_split=True)")
    ap.add_argument("--no-full-graphs", action="store_true",
                    help="EngineConfig(full_graphs=False): small prompt steps take the piecewise graphs")
    ap.add_argument("--gap", type=float, default=0.0,
                    help="seconds idle before each timed prompt (the TTFT workload's requests come "
                         "0.25 s apart on average: do idle clocks slow the step?)")
    ap.add_argument("--cached-only", action="store_true",
                    help="only the prompt after a cached system prompt and the decode step (not the uncached prompt)")
    ap.add_argument("--decode-batches", default="",
                    help="comma-separated batch sizes: profile a decode step of each (context 512) and stop")
    ap.add_argument("--mixed", action="store_true",
                    help="profile a step of 120 decodes (context 512) and 7 new 272-token prompts, and stop")
    ap.add_argument("--trace", default=None, help="with --mixed: a Chrome trace (host and device) of one more such step")
    ap.add_argument("--unfused", action="store_true",
                    help="TransformerBlock.fused_norms = False: the residual add and SiLU·mul as separate "
                         "kernels again (the comparison for gpulab/fused_norms.py)")
    a = ap.parse_args(argv)
    TransformerBlock.fused_norms = not a.unfused
    if runtime.mode() != "compiled":
        print("engine_step_profile needs a CUDA GPU (compiled mode)")
        return 2
    model = build_model(a.model)
    system = [BOS] + [(7 * j) % 250 + 3 for j in range(2047)]
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": runtime.gpu_name(), "versions": runtime.versions(), "model": a.model,
           "piecewise_graphs": not a.no_piecewise, "full_graphs": not a.no_full_graphs, "kv_split": a.kv_split,
           "gap_s": a.gap, "fused_norms": not a.unfused}
    print(gpulab.env_report(), flush=True)
    if a.mixed:
        res["mixed"] = mixed_case(model, 120, 512, 7, 272, a.reps, a.trace)
        print("mixed", json.dumps(res["mixed"], indent=1), flush=True)
    if a.decode_batches:
        for batch in (int(b) for b in a.decode_batches.split(",")):
            res[f"decode_b{batch}"] = batch_decode_case(model, batch, 512, a.reps)
            print(f"decode_b{batch}", json.dumps(res[f"decode_b{batch}"], indent=1), flush=True)
    if a.mixed or a.decode_batches:
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return 0
    for caching in (True,) if a.cached_only else (True, False):
        llm = LLM(model, EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=128,
                                      max_num_batched_tokens=2048, prefix_caching=caching,
                                      piecewise_graphs=not a.no_piecewise, full_graphs=not a.no_full_graphs,
                                      kv_split=a.kv_split))
        llm.generate([system + [9] * 8], SamplingParams(max_tokens=1, stop_at_eos=False))  # fills the cache
        name = "prompt_cached_prefix" if caching else "prompt_no_cache"
        # a 40-token question after the system prompt, a different one each request
        res[name] = prompt_case(llm, lambda r: system + [(r * 11 + j) % 250 + 3 for j in range(40)], a.reps, a.gap)
        print(name, json.dumps(res[name], indent=1), flush=True)
        if caching:
            res["decode_b1"] = decode_case(llm, a.reps)
            print("decode_b1", json.dumps(res["decode_b1"], indent=1), flush=True)
        del llm
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

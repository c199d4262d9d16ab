"""The host's share of one engine decode step: schedule, plan, sampling and bookkeeping
with the model's forward left out (random logits stand in), timed on whatever machine
runs it (a CPU is enough: no kernel runs).

    PYTHONPATH=. python3 tools/engine_host_overhead.py [--batch 64 256] [--ctx 4096] [--profile]

On the H200 an engine step at batch 256 took 20.6 ms while its forward (graph replay) took
4.6 ms (gpulab/results/engine/engine_bench.json): the rest is host work, which this isolates.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import gpulab
from gpulab.engine.engine import LLM
from gpulab.engine.serve_bench import build_model, decoding_engine


def host_step(llm: LLM) -> None:
    """One decode step without the forward: what the host does around it."""
    batch = llm.schedule()
    prefill = batch.prefill_flags
    llm.runner.copy_blocks(list(batch.copies))
    plan = llm.runner.plan(batch.items)
    logits = torch.randn(len(plan.sample_seqs), llm.runner.cfg.vocab_size)
    llm.scheduler.postprocess(batch)
    llm.emit(batch, prefill, llm.sample_tokens(logits, plan.sample_seqs), time.perf_counter(), plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--ctx", type=int, default=4096, help="the model's context (sets the block-table width)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    gpulab.setup()
    model = build_model(f"random:64,1,4,2,16,128,{a.ctx}", device="cpu", dtype=torch.float32)
    for b in a.batch:
        # the PyTorch path, no graphs: the forward is not what this measures
        llm = decoding_engine(model, b, a.prompt, max_tokens=250, cuda_graphs=False, attention="torch", linear="torch")
        for _ in range(3):
            host_step(llm)
        times = []                       # the median step: a shared CPU's stalls and GC left out
        for _ in range(a.steps):
            t = time.perf_counter()
            host_step(llm)
            times.append(time.perf_counter() - t)
        ms, mean = sorted(times)[len(times) // 2] * 1e3, sum(times) / len(times) * 1e3
        print(f"batch {b:4}, context {a.ctx}: host part of a decode step {ms:6.2f} ms median "
              f"({ms / b * 1e3:5.1f} µs per sequence), {mean:6.2f} ms mean")
        if a.profile:
            cProfile.runctx("for _ in range(10): host_step(llm)", globals(), {"host_step": host_step, "llm": llm},
                            "/tmp/engine_host.prof")
            pstats.Stats("/tmp/engine_host.prof").sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

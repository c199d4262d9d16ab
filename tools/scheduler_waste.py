"""What the scheduler alone decides on the engine bench's mixed workload: steps (and
how many carry a prompt chunk, so run eagerly), preemptions and tokens computed (prompts, recomputation after preemption, decodes)
against the tokens the requests need. The forward is stubbed out (every sampled token
is 0; outputs run to their length regardless), so any machine gives the same counts
as the H200 run of tools/engine_bench.py.

    PYTHONPATH=. python3 tools/scheduler_waste.py [--reserve 0 1 2]
"""
from __future__ import annotations

import argparse
import math

import torch

import gpulab
from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.serve_bench import Workload, build_model, make_requests

# tools/engine_bench.py's throughput comparison: workload and pool
WORKLOAD = Workload(requests=400, rate=math.inf, prompt_len=(32, 512), output_len=(16, 512),
                    shared=0.0, system_len=0, seed=0)
POOL = dict(num_blocks=4096, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048)


def count(model, requests, **config) -> dict:
    llm = LLM(model, EngineConfig(**{**POOL, **config, "cuda_graphs": False, "attention": "torch",
                                     "linear": "torch"}))
    computed = 0

    mixed, decode_rows = 0, []

    def run(items, copies=()):                       # the step without its forward
        nonlocal computed, mixed
        plan = llm.runner.plan(items)
        computed += sum(n for _, n in items)
        mixed += any(n > 1 for _, n in items)       # carries a prompt chunk: an eager step
        decode_rows.append(sum(n == 1 for _, n in items))
        return torch.zeros(len(plan.sample_seqs), model.cfg.vocab_size), plan.sample_seqs, plan

    llm.runner.run = run
    for r in requests:
        llm.add_request(r["prompt"], r["params"])
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    # the last output token is sampled, never fed back
    need = sum(len(r["prompt"]) + r["params"].max_tokens - 1 for r in requests)
    return {"steps": steps, "preemptions": llm.summary()["preemptions"], "computed": computed, "needed": need,
            "eager_steps": mixed, "mean_decode_rows": sum(decode_rows) / max(1, len(decode_rows))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reserve", type=int, nargs="+", default=[0, 1, 2])
    a = ap.parse_args(argv)
    gpulab.setup()
    model = build_model("random:32,1,2,1,16,64,1100", device="cpu", dtype=torch.float32)
    requests = make_requests(WORKLOAD, model.cfg.max_seq_len)
    for reserve in a.reserve:
        c = count(model, requests, decode_reserve=reserve)
        print(f"decode_reserve {reserve}: {c['steps']} steps, {c['preemptions']} preemptions, "
              f"{c['computed']} tokens computed for {c['needed']} needed ({c['computed'] / c['needed']:.2f}x); "
              f"{c['eager_steps']} steps carry a prompt chunk (eager: no CUDA graph), "
              f"{c['mean_decode_rows']:.0f} decode rows per step on average")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

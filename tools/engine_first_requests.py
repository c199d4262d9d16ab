"""Tokens/s of the first requests a fresh engine serves, one after another (GPU host).

    PYTHONPATH=. python3 tools/engine_first_requests.py [--no-warm-up]

On the H200 (2026-12-01, before the engine warmed up at start-up) the shipped model
served its first two requests at 42 tok/s and the third at 2460: each new prefill
length met new autotuning keys inside the request. Not garbage collection: a full
collection took 168 ms and none ran. With the start-up warm-up every run should be fast.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

import gpulab
from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.model import load_checkpoint
from gpulab.engine.sequence import SamplingParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args(argv)
    gpulab.setup()
    model = load_checkpoint(device=gpulab.device(), dtype=gpulab.runtime.default_dtype())
    t = time.perf_counter()
    llm = LLM(model, EngineConfig(num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                                  warm_up=not a.no_warm_up))
    print(f"engine start-up {time.perf_counter() - t:.1f} s (warm-up {'off' if a.no_warm_up else 'on'})")
    params = SamplingParams(max_tokens=128, stop_at_eos=False)
    for i in range(a.runs):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t, gen2 = time.perf_counter(), gc.get_stats()[2]["collections"]
        llm.generate(["Shall I compare thee to a summer's day?\n"], params)
        sync()
        print(f"request {i}: {128 / (time.perf_counter() - t):.0f} tok/s, "
              f"full collections during it: {gc.get_stats()[2]['collections'] - gen2}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

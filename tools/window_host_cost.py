"""The host's work per decode token, one step at a time against decode windows (any machine).

    PYTHONPATH=. python3 tools/window_host_cost.py [--batch 1 64] [--k 4 8] [--steps 40] [--json OUT]

``EngineConfig.multi_step = k`` runs k greedy decode steps per host step
(:mod:`gpulab.engine.multi_step`): the host schedules, fills the inputs, reads the tokens
back and retires them once per k tokens. This measures that host work alone: a one-layer
random model serves ``--batch`` greedy requests that never stop, with the runner's forward
replaced by fixed logits (no model compute, here or in a window), and times
:meth:`LLM.step` once the batch decodes. A window's k steps still run their small tensor
ops here (the argmax and the inputs moved on) eagerly; on a GPU they are inside its one
graph replay. Prints the median milliseconds a step and per token-step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulab.engine.engine import LLM, EngineConfig  # noqa: E402
from gpulab.engine.sequence import SamplingParams  # noqa: E402
from gpulab.engine.serve_bench import build_model  # noqa: E402

MODEL = "random:128,1,4,2,32,256,4096"      # host costs do not depend on the model's size


def stubbed_engine(model, batch: int, k: int, max_tokens: int) -> LLM:
    """``batch`` greedy requests decoding, the forward replaced by fixed logits."""
    llm = LLM(model, EngineConfig(num_blocks=batch * (max_tokens // 16 + 4), max_num_seqs=batch,
                                  max_num_batched_tokens=4096, multi_step=k, block_size=16))
    fixed: dict[int, torch.Tensor] = {}

    def forward(plan):
        n = plan.sample_rows.shape[0]
        if n not in fixed:
            fixed[n] = torch.zeros(n, model.cfg.vocab_size, device=llm.runner.device)
            fixed[n][:, ord("a")] = 1.0
        return fixed[n]

    llm.runner.forward = forward
    for _ in range(batch):
        llm.add_request("x" * 20, SamplingParams(max_tokens=max_tokens, stop_at_eos=False))
    while llm.scheduler.waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running):
        llm.step(finished_only=True)
    return llm


def step_ms(llm: LLM, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step(finished_only=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = build_model(MODEL)
    max_tokens = (args.steps + 4) * max(args.k) + 16
    rows = []
    for batch in args.batch:
        one = step_ms(stubbed_engine(model, batch, 1, max_tokens), args.steps)
        rows.append(dict(batch=batch, k=1, step_ms=one, per_token_step_ms=one))
        print(f"batch {batch:>3}: one step at a time {one:.3f} ms a step", flush=True)
        for k in args.k:
            win = step_ms(stubbed_engine(model, batch, k, max_tokens), args.steps)
            rows.append(dict(batch=batch, k=k, step_ms=win, per_token_step_ms=win / k))
            print(f"batch {batch:>3}: windows of {k}: {win:.3f} ms a window, {win / k:.3f} ms a token-step "
                  f"({one / (win / k):.1f}x less host work a token)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=MODEL, steps=args.steps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Steps with prompt chunks: eager vs piecewise CUDA graphs, on the H200 (issue 14).

    PYTHONPATH=. python3 tools/piecewise_bench.py OUTDIR [--model SPEC] [--reps N] [--serve N]

Writes OUTDIR/piecewise_bench.json. Through the real engine's runner (``llm.runner``,
the engine bench's ~0.7 B-weight random model, token budget 2048, so buckets
16 .. 2048), for each step shape:

* ``64 decodes + 512-token chunk`` (T = 576, bucket 1024): the engine bench's typical
  mixed step;
* ``64 decodes + 1984-token chunk`` (T = 2048, the largest bucket);
* ``16 decodes + 48-token chunk`` (T = 64): a small mixed step;

it times a whole step as the engine runs it (plan, forward, and the one device -> host
copy of the sampled tokens) eagerly and with the piecewise graphs, and checks that the
two give the same logits (max |difference|, argmax agreement). Also recorded: start-up
time of the capture, the graphs' memory and the number of graphs. ``--serve N``: also
serve N requests of the engine bench's mixed workload with piecewise graphs on and off
(continuous batching only: throughput and step counts). Takes about a minute.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402
from gpulab import runtime  # noqa: E402
from gpulab.engine.engine import LLM, EngineConfig, frozen_heap  # noqa: E402
from gpulab.engine.sequence import SamplingParams, Sequence  # noqa: E402
from gpulab.engine.serve_bench import Workload, build_model, compare  # noqa: E402

BIG = "random:2048,16,16,4,128,5632,4096"          # tools/engine_bench.py's model
BUDGET = 2048
SHAPES = [(64, 512), (64, BUDGET - 64), (16, 48)]   # (decode rows, prompt-chunk tokens)


def make_step(llm: LLM, num_decode: int, chunk: int, first_id: int):
    """Items of one step: ``num_decode`` sequences with 100..163 tokens of history each
    decoding one token, and a prompt of ``chunk`` tokens after 64 cached ones (so the
    chunk's attention reads history too). Their pages are allocated, their history
    computed (eagerly)."""
    bm, runner = llm.block_manager, llm.runner
    seqs = []
    for i in range(num_decode):
        n = 100 + i
        s = Sequence(first_id + i, f"d{i}", [(3 * i + j) % 250 + 1 for j in range(n)], n, SamplingParams(), 0)
        bm.allocate(s, [], n)
        seqs.append(s)
    with torch.no_grad():
        for at in range(0, len(seqs), 8):           # history in steps within the budget
            part = seqs[at:at + 8]
            runner.forward(runner.plan([(s, s.num_tokens) for s in part]))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(7)
        bm.append_slots(s, 1)
    p = Sequence(first_id + 999, "p", [(5 * j) % 250 + 1 for j in range(64 + chunk)], 64 + chunk,
                 SamplingParams(), 0)
    bm.allocate(p, [], 64)
    with torch.no_grad():
        runner.forward(runner.plan([(p, 64)]))
    p.num_computed_tokens = 64
    bm.append_slots(p, chunk)
    return [(s, 1) for s in seqs] + [(p, chunk)], seqs + [p]


def time_steps(fn, reps: int) -> float:
    """Seconds per step, each ending in the sampled tokens' copy to the host (the step's
    one sync), as the engine runs them."""
    for _ in range(3):
        fn().argmax(-1).cpu()
    torch.cuda.synchronize()
    with frozen_heap():
        t = time.perf_counter()
        for _ in range(reps):
            fn().argmax(-1).cpu()
        return (time.perf_counter() - t) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--model", default=BIG)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--serve", type=int, default=0, help="also serve N mixed-workload requests, piecewise on/off")
    a = ap.parse_args(argv)
    if runtime.mode() != "compiled":
        print("piecewise_bench needs a CUDA GPU (compiled mode)")
        return 2
    out = Path(a.outdir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(a.model)
    res = {"gpu": runtime.gpu_name(), "versions": runtime.versions(), "date": time.strftime("%Y-%m-%d"),
           "model_spec": a.model, "model": asdict(model.cfg), "budget": BUDGET}
    print(gpulab.env_report(), "\n", res["model"], flush=True)

    def save():
        (out / "piecewise_bench.json").write_text(json.dumps(res, indent=1, default=str))

    cfg = EngineConfig(num_blocks=1536, block_size=16, max_num_seqs=64, max_num_batched_tokens=BUDGET,
                       piecewise_graphs=False)
    t = time.perf_counter()
    llm = LLM(model, cfg)                         # warm-up (autotuning) and decode graphs
    res["start_up_without_piecewise_s"] = time.perf_counter() - t
    runner = llm.runner
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    t = time.perf_counter()
    assert runner.capture_piecewise(BUDGET), "piecewise graphs were not captured"
    torch.cuda.synchronize()
    pw = runner.piecewise
    res["capture"] = {"seconds": time.perf_counter() - t, "buckets": pw.buckets,
                      "graphs": sum(len(s) for s in pw.segments.values()),
                      "memory_mb": (torch.cuda.memory_allocated() - mem0) / 2**20,
                      "reserved_mb": torch.cuda.memory_reserved() / 2**20}
    print("capture:", res["capture"], flush=True)
    res["steps"] = []
    for i, (nd, chunk) in enumerate(SHAPES):
        items, seqs = make_step(llm, nd, chunk, first_id=1000 * (i + 1))
        plan = runner.plan(items)
        with torch.no_grad():
            want = runner.forward(plan)
            got = pw.run(plan)
            row = {"decode_rows": nd, "chunk_tokens": chunk, "rows": nd + chunk, "bucket": pw.bucket(nd + chunk),
                   "max_abs_diff": float((got - want).abs().max()),
                   "max_abs_logit": float(want.abs().max()),
                   "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean())}
            # a whole step each: plan + forward + the sampled tokens' copy
            row["eager_ms"] = 1e3 * time_steps(lambda: runner.forward(runner.plan(items)), a.reps)
            row["piecewise_ms"] = 1e3 * time_steps(lambda: pw.run(runner.plan(items)), a.reps)
            row["plan_ms"] = 1e3 * time_steps(lambda: runner.plan(items) and want, a.reps)   # the host's plan alone
        row["speed_up"] = row["eager_ms"] / row["piecewise_ms"]
        print(row, flush=True)
        res["steps"].append(row)
        for s in seqs:
            llm.block_manager.free_sequence(s)
        save()
    if a.serve:
        w = Workload(requests=a.serve, rate=math.inf, prompt_len=(32, 512), output_len=(16, 512),
                     shared=0.0, system_len=0, seed=0)
        res["serve"] = {}
        for on in (False, True):
            c = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=256, max_num_batched_tokens=BUDGET,
                             piecewise_graphs=on)
            r = compare(model, c, w, static=False, progress=False)["continuous"]
            res["serve"]["piecewise" if on else "eager"] = r
            print("serve, piecewise" if on else "serve, eager", {k: r[k] for k in r if "throughput" in k},
                  flush=True)
            save()
    save()
    print("wrote", out / "piecewise_bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

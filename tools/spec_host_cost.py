"""The host's cost of one speculative step, with the graphs' compute left out (any machine).

    PYTHONPATH=. python3 tools/spec_host_cost.py [--batch 1 64] [--steps 40] [--k 4] [--profile] [--json OUT]

On the H200 (2026-12-05) a greedy speculative step at batch 1 took 0.43 ms against 0.27 ms
of draft and verify replays, and 2.02 ms against 0.34 ms at batch 64: the rest is the
host's work (reading the verified tokens, accepting, emitting, scheduling, filling the
next replays' buffers), which the GPU waits for. This measures that work alone: the
shipped target and MLGRU draft serve ``--batch`` greedy requests with drafting ahead
through the graph drafter and the verify graphs as :class:`~gpulab.engine.graph_capture.CapturedStep`
stand-ins (``graphs="emulate"``); after a few real steps every replay returns its outputs
as they are, without computing them, so a step's wall time is its host path: Python, and
the few tensor ops (copies into the graphs' buffers, the results' read-back) it launches.
The tokens then repeat, which changes none of the bookkeeping's work. ``--profile`` adds
the Python functions with the most time of their own (cProfile).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402
from gpulab import runtime  # noqa: E402
from gpulab.engine import graph_capture  # noqa: E402
from gpulab.engine.engine import EngineConfig  # noqa: E402
from gpulab.engine.model import load_checkpoint  # noqa: E402
from gpulab.engine.sequence import SamplingParams  # noqa: E402
from gpulab.engine.speculative import MLGRUDrafter, SpeculativeLLM, load_mlgru_draft  # noqa: E402

PROMPTS = ("The moon", "Tyger Tyger", "Once upon a time", "In the beginning")


@contextlib.contextmanager
def frozen_replays():
    """Every :class:`CapturedStep` that has run once returns its last outputs unchanged."""
    replay = graph_capture.CapturedStep.replay

    def frozen(self):
        return replay(self) if self.out is None else self.out

    graph_capture.CapturedStep.replay = frozen
    try:
        yield
    finally:
        graph_capture.CapturedStep.replay = replay


def speculative_engine(batch: int, k: int, target=None, draft=None) -> SpeculativeLLM:
    """The shipped pair serving ``batch`` greedy requests that never stop, a few steps in."""
    dev = gpulab.device()
    target = target or load_checkpoint(device=dev)
    draft = draft or load_mlgru_draft(device=dev)
    config = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=max(batch, 8), max_num_batched_tokens=2048)
    llm = SpeculativeLLM(target, config, drafter=MLGRUDrafter(draft), k=k, graphs="emulate", draft_ahead=True)
    for i in range(batch):
        llm.add_request(PROMPTS[i % len(PROMPTS)] + " " * (i % 3),
                        SamplingParams(max_tokens=1 << 30, stop_at_eos=False), request_id=f"r{i}")
    for _ in range(6):            # prefill, then decoding with drafts (and drafts ahead)
        llm.step()
    return llm


def host_cost(make_engine, steps: int = 40, repeats: int = 5, profile: bool = False) -> dict:
    """Host µs per step: the median of ``repeats`` runs of ``steps`` steps, each run on a
    fresh engine from ``make_engine()`` with its replays frozen (a request's context, 512
    tokens for the shipped model, holds about a hundred steps)."""
    runs, ahead, text = [], {}, None
    for rep in range(repeats + profile):
        llm = make_engine()
        with frozen_replays():
            for _ in range(5):
                llm.step()
            prof = cProfile.Profile() if rep == repeats else None
            if prof:
                prof.enable()
            t = time.perf_counter()
            for _ in range(steps):
                llm.step()
            dt = time.perf_counter() - t
            if prof:
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                text = text.getvalue()
            else:
                runs.append(1e6 * dt / steps)
        assert all(s.status.name == "RUNNING" for s in llm.scheduler.running) and llm.scheduler.running, \
            "a request stopped while timed: fewer --steps"
        ahead = dict(llm.ahead_counts)
    out = {"host_us_per_step": statistics.median(runs), "runs_us": runs, "drafts_ahead": ahead}
    if text is not None:
        out["profile"] = text
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=40, help="steps per timed run (five runs, each on a fresh engine)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    print(runtime.env_report())
    dev = gpulab.device()
    target, draft = load_checkpoint(device=dev), load_mlgru_draft(device=dev)
    result = {"device": str(dev), "k": a.k, "rows": []}
    for b in a.batch:
        r = host_cost(lambda: speculative_engine(b, a.k, target, draft), a.steps, profile=a.profile)
        print(f"batch {b:>3}, k = {a.k}: {r['host_us_per_step']:.0f} µs of host work a step "
              f"(runs {', '.join(f'{x:.0f}' for x in r['runs_us'])}; drafts ahead {r['drafts_ahead']})")
        if a.profile:
            print(r.pop("profile"))
        result["rows"].append({"batch": b, **r})
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

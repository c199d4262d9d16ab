"""The host's share of one engine decode step, phase by phase: schedule, plan (the step's
index arrays and their copy to the device), forward, sample, postprocess + emit.

    PYTHONPATH=. python3 tools/engine_host_overhead.py [--batch 64 256] [--ctx 4096] [--prompt 128]
                                                      [--finished-only] [--profile] [--json OUT.json]
                                                      [--model SPEC] [--device auto|cpu|cuda]
                                                      [--multi-step K] [--temperature T]

* On a CPU (or with ``--device cpu``) no kernel runs: the forward is left out (fixed
  logits stand in) and the PyTorch paths are used, so every phase is host work.
* ``emit`` builds an output per request per step (what a streaming server gets);
  ``--finished-only`` reports finished requests only, as ``generate`` and serve_bench do.
* On a GPU in compiled mode the engine runs as it serves (Triton kernels, CUDA graphs):
  the phases are timed without extra synchronisation, so ``forward`` is the host's cost
  of launching (replaying) it and ``sample`` includes waiting for the device (its one
  device -> host copy). ``engine_step`` is a whole :meth:`LLM.step`, timed alone.
* ``--multi-step K``: also whole steps of an engine that runs K decode steps per host step
  (``EngineConfig.multi_step``, :mod:`gpulab.engine.multi_step`), per window and per
  token-step: the host's work that windows spread over K tokens (on a CPU the window's K
  forwards are the stand-in logits too; on a GPU its one graph replay).
* ``--temperature T``: sampled requests (seeded; top-k and top-p off) instead of greedy:
  a sampled step also draws each token with its row's Gumbel noise (:mod:`gpulab.engine.sampling`);
  with ``--multi-step`` the windows are of sampled requests too (on a CPU their draws, device
  work on a GPU, are the CPU's as well: that row is not host work alone there).

The default model is a one-layer random model (host costs do not depend on its size);
``--model random:2048,16,16,4,128,5632,4096`` is engine_bench's, to see the forward too.
On the H200 an engine step at batch 256 took 20.6 ms while its forward (graph replay) took
4.6 ms (gpulab/results/engine/engine_bench.json): the rest is host work, which this isolates.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gpulab  # noqa: E402
from gpulab import runtime  # noqa: E402
from gpulab.engine.engine import LLM, EngineConfig, frozen_heap  # noqa: E402
from gpulab.engine.model import BOS  # noqa: E402
from gpulab.engine.sequence import SamplingParams  # noqa: E402
from gpulab.engine.serve_bench import build_model, decoding_engine  # noqa: E402
from gpulab.engine.static import StaticBatchLLM  # noqa: E402

PHASES = ("schedule", "plan", "forward", "sample", "emit")


def host_step(llm: LLM, logits=None, finished_only: bool = False) -> dict[str, float]:
    """One engine step, phase by phase (seconds): what :meth:`LLM.step` does, with the
    forward replaced by ``logits`` rows when given (no kernel runs)."""
    clock = time.perf_counter
    t0 = clock()
    batch = llm.schedule()
    prefill = batch.prefill_flags
    t1 = clock()
    llm.runner.copy_blocks(list(batch.copies))
    plan = llm.runner.plan(batch.items)
    t2 = clock()
    if logits is None:
        with torch.no_grad():
            out = llm.runner.replay(plan) if plan.use_graph else llm.runner.forward(plan)
    else:
        out = logits[:len(plan.sample_seqs)]
    t3 = clock()
    llm.scheduler.postprocess(batch)
    tokens = llm.sample_tokens(out, plan.sample_seqs)
    t4 = clock()
    llm.emit(batch, prefill, tokens, t0, plan, finished_only)
    t5 = clock()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(model, batch: int, prompt: int, steps: int, on_gpu: bool, profile: bool,
            finished_only: bool = False, multi_step: int = 1, temperature: float = 0.0) -> dict:
    if on_gpu:    # as the engine serves: Triton kernels and CUDA graphs; one step at a time, as
        # host_step times it (with overlap a sequence's newest token is a placeholder until
        # the next step lands it, which host_step would feed to the model as a token)
        llm = decoding_engine(model, batch, prompt, max_tokens=250, temperature=temperature, cuda_graphs=True,
                              overlap=False)
        logits = None
    else:         # the PyTorch path, no graphs, no forward: only host work is timed
        llm = decoding_engine(model, batch, prompt, max_tokens=250, temperature=temperature, cuda_graphs=False,
                              attention="torch", linear="torch")
        logits = torch.randn(batch, model.cfg.vocab_size)
    for _ in range(3):
        host_step(llm, logits, finished_only)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    with frozen_heap():                  # as serving runs (serve_bench, gpulab serve)
        rec = [host_step(llm, logits, finished_only) for _ in range(steps)]
        sync()
    totals = [sum(r.values()) for r in rec]
    med = lambda v: statistics.median(v) * 1e3  # noqa: E731   (the median: a shared CPU's stalls and GC left out)
    res = {"batch": batch, "prompt": prompt, "graph": bool(llm.runner.graphs), "temperature": temperature,
           "phases_ms": {p: med([r[p] for r in rec]) for p in PHASES},
           "step_ms": med(totals), "step_mean_ms": statistics.fmean(totals) * 1e3}
    res["host_ms"] = res["step_ms"] - (res["phases_ms"]["forward"] if not on_gpu else 0.0)
    if on_gpu:    # whole engine steps, one at a time (no overlap, as the windows run)
        walls = []
        with frozen_heap():
            for _ in range(steps):
                t = time.perf_counter()
                llm.step(finished_only)
                walls.append(time.perf_counter() - t)
        res["engine_step_ms"] = med(walls)
        res["engine_step_mean_ms"] = statistics.fmean(walls) * 1e3
    if multi_step > 1:
        res.update(window_step_ms(model, batch, prompt, steps, on_gpu, multi_step, logits, finished_only,
                                  temperature))
    if profile:
        prof = cProfile.Profile()
        prof.runctx("for _ in range(10): host_step(llm, logits, finished_only)", globals(),
                    {"host_step": host_step, "llm": llm, "logits": logits, "finished_only": finished_only})
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return res


def window_step_ms(model, batch: int, prompt: int, steps: int, on_gpu: bool, k: int, logits,
                   finished_only: bool, temperature: float = 0.0) -> dict:
    """Whole steps of an engine running ``k`` decode steps per host step (the window's
    forwards the stand-in ``logits`` on a CPU), the median per window and per token-step."""
    opts = {} if on_gpu else dict(cuda_graphs=False, attention="torch", linear="torch")
    llm = decoding_engine(model, batch, prompt, max_tokens=250, temperature=temperature, multi_step=k, **opts)
    if logits is not None:
        llm.runner.forward = lambda plan: logits[:plan.sample_rows.shape[0]]
    llm.step(finished_only)
    walls = []
    with frozen_heap():
        for _ in range(max(3, min(steps, 240 // k - 1))):        # every sequence has 250 tokens of room
            t = time.perf_counter()
            llm.step(finished_only)
            walls.append(time.perf_counter() - t)
    window = statistics.median(walls) * 1e3
    return {"multi_step": k, "window_ms": window, "window_per_token_step_ms": window / k}


def static_step_ms(model, batch: int, prompt: int, steps: int, on_gpu: bool) -> float:
    """Median decode step of the static-batching baseline holding ``batch`` requests (its
    whole step: it shares the runner's plan and the sampler with the engine; on a CPU its
    forward is left out too)."""
    max_len = -(-(prompt + 256) // 16) * 16
    kw = {} if on_gpu else dict(cuda_graphs=False, attention="torch", linear="torch")
    st = StaticBatchLLM(model, EngineConfig(num_blocks=batch * max_len // 16, block_size=16, max_num_seqs=batch,
                                            **kw), max_len=max_len)
    assert st.batch_size == batch
    for i in range(batch):
        st.add_request([BOS] + [(i * 7 + j) % 250 for j in range(prompt - 1)],
                       SamplingParams(max_tokens=250, stop_at_eos=False), arrival_time=0.0)
    st.step()                                     # the batch's prefill
    if not on_gpu:
        logits = torch.randn(batch, model.cfg.vocab_size)
        st.runner.forward = lambda plan: logits[:len(plan.sample_seqs)]
    walls = []
    with frozen_heap():
        for i in range(steps + 3):
            t = time.perf_counter()
            st.step()
            walls.append(time.perf_counter() - t)
    return statistics.median(walls[3:]) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--ctx", type=int, default=4096, help="the model's context (sets the block-table width)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default=None, help="a build_model spec (default: one random layer, d_model 64)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: the GPU when kernels are compiled, else the CPU")
    ap.add_argument("--finished-only", action="store_true",
                    help="report finished requests only, as generate() and serve_bench do (default: an "
                         "output per request per step, as a streaming server gets)")
    ap.add_argument("--static", action="store_true", help="also time the static-batching baseline's decode step")
    ap.add_argument("--multi-step", type=int, default=1,
                    help="also time an engine running this many decode steps per host step (its windows)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampled requests at this temperature (default 0: greedy)")
    ap.add_argument("--profile", action="store_true", help="cProfile 10 steps per batch size")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args(argv)
    gpulab.setup()
    on_gpu = a.device == "cuda" or (a.device == "auto" and runtime.mode() == "compiled")
    if on_gpu and runtime.mode() != "compiled":
        print("--device cuda needs a GPU with compiled kernels")
        return 2
    spec = a.model or f"random:64,1,4,2,16,128,{a.ctx}"
    if on_gpu:
        model = build_model(spec)
    else:
        model = build_model(spec, device="cpu", dtype=torch.float32)
    threads = torch.get_num_threads()
    if not on_gpu:  # one thread: the few CPU ops left (argmax) would wait on busy cores
        torch.set_num_threads(1)
    try:
        return report(a, model, spec, on_gpu)
    finally:
        torch.set_num_threads(threads)


def report(a, model, spec: str, on_gpu: bool) -> int:
    out = {"device": runtime.gpu_name() if on_gpu else "cpu", "cpu": cpu_name(), "python": platform.python_version(),
           "versions": runtime.versions(), "model": spec, "ctx": model.cfg.max_seq_len,
           "finished_only": a.finished_only, "results": []}
    print(f"{'GPU ' + out['device'] if on_gpu else 'CPU only (no forward)'}; host CPU: {out['cpu']}")
    for b in a.batch:
        r = measure(model, b, a.prompt, a.steps, on_gpu, a.profile, a.finished_only, a.multi_step, a.temperature)
        out["results"].append(r)
        ms = r["host_ms"]
        what = "decode step (all phases, forward included)" if on_gpu else "host part of a decode step"
        what += f", sampled at T = {a.temperature:g}" if a.temperature else ""
        print(f"batch {b:4}, context {model.cfg.max_seq_len}: {what} {ms:6.2f} ms median "
              f"({ms / b * 1e3:5.1f} µs per sequence), {r['step_mean_ms']:6.2f} ms mean")
        print("    " + ", ".join(f"{p} {v:.3f}" for p, v in r["phases_ms"].items()) + " ms"
              + (f"; whole engine step without overlap {r['engine_step_ms']:.3f} ms" if on_gpu else ""), flush=True)
        if a.multi_step > 1:
            print(f"    windows of {a.multi_step} steps: {r['window_ms']:.3f} ms a window, "
                  f"{r['window_per_token_step_ms']:.3f} ms a token-step", flush=True)
        if a.static:
            r["static_step_ms"] = static_step_ms(model, b, a.prompt, a.steps, on_gpu)
            print(f"    static batching, same batch: {r['static_step_ms']:.3f} ms per decode step", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

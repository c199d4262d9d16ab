"""Speculative decoding and server overhead on a GPU (issue 15's targets).

usage: python tools/speculative_bench.py OUTDIR [--max-tokens N] [--quick] [--transformer] [--no-server]
                                             [--batches 1,64] [--server-modes thread,switch,process,scaleout]
                                             [--api-servers 4] [--server-rounds 4] [--server-repeats 3]
                                             [--client-processes N] [--eager-k 4] [--profile]
                                             [--server-max-tokens 128,448]
                                             [--multi-step K] [--delay-factors 0,4]

Measures, with the shipped target checkpoint in bf16 and greedy decoding (so every
configuration must produce the target's tokens: issue 15 accepts a difference only where
a near tie of the target's logits flipped, which bf16 rounding in another kernel or GEMM
shape may do: judged on a float32 copy of the target, with a tolerance that is at least
how far bf16 forwards of the target (plain and with rounding-sized noise) move that gap
(:func:`gpulab.engine.model.first_flip`; on 2026-12-03 a gap of 0.41 in float32 on the
H200 flipped in the target alone from one process to the next); each one is printed and counted in the JSON; any other difference is printed,
kept in the JSON's ``wrong_tokens``, leaves that configuration without a row, and fails
the run once the other configurations are measured):

* tokens/s of the target alone (its decode CUDA graphs) and of speculative decoding with
  the shipped MLGRU draft, drafting and verifying in CUDA graphs (``graphs="auto"``), for
  k in 2, 4, 6, 8 (``--ks``; 4 and 8 with ``--quick``) and adaptive k, at batch 1 (the
  prompts one after another) and batch 64 (all at once; the first two k); at batch 1,
  k = 4, three rows for comparison: drafting after reading each step's tokens
  (``draft_ahead=False``), the draft graph stepping the model k + 1 times (no rollout
  kernel), and eager (``graphs="off"``). A configuration that raises gets no row: its
  traceback goes to the JSON's ``errors`` and fails the run, after the others;
* with ``--transformer``: a small ternary transformer draft trained here (eager drafting,
  graph verify);
* unless ``--no-server``: the server's overhead, 64 streaming HTTP clients (aiohttp; since
  2026-12-03 in up to eight processes of their own, half the host's cores), each sending
  four requests of ``--max-tokens`` tokens one after another (a closed loop: until the
  fourth run of 2026-12-03 one request of half that, so the run was mostly its ramp-up
  and tail), against the same closed loop driven in-process; with Python's GIL switch
  interval as it is (5 ms), at 0.5 ms, with the engine in a process of its own, and as
  ``gpulab serve --api-servers N`` runs it (N HTTP processes feeding one engine process;
  ``--server-modes`` picks among ``thread``, ``switch``, ``process``, ``scaleout``, and
  ``profile``: scaleout with cProfile in the engine process and over an in-process run).
  Three timed runs each way (``--server-repeats``), alternating where the server's engine
  is another process; the row compares the best run each way (the medians beside it:
  until the twelfth session (2026-12-05) the best of three in-process runs met one HTTP run).
  Each server row also has the engine's steps and the seconds spent in them, behind HTTP
  and in-process: fewer tokens a step means the clients starve it, longer steps that the
  engine process is the limit;
* with ``--multi-step K``: the target alone once more with K decode steps per host step
  (``EngineConfig.multi_step``, decode-only batches; it joins the baseline), and
  every server row with it, in-process and behind HTTP alike;
* with ``--delay-factors F,...``: each server row once per factor, the engine admitting new
  requests while others run only once the oldest has waited F times the last prompt step
  (``EngineConfig.scheduler_delay_factor``), in-process and behind HTTP alike; a row with
  F > 0 is saved under its mode's key with ``_delay`` and F appended;
* with ``--server-max-tokens N,...``: each server row once per request length (whether
  the HTTP layer's cost is one per request, which longer requests would share: on an H100
  on 2026-12-05 it was not, 448-token requests streamed at 62-63% of in-process against
  55-69% at 128); a row of another length than ``--max-tokens`` is saved with ``_tokens``
  and N appended (before any ``_delay``).

Writes OUTDIR/speculative.json after every stage (copy it to gpulab/results/engine/ to
ship it). On the H200 (2026-12-03) ``--quick`` took about 200 s up to the first server
mode, most of it compiling and warming up.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpulab import block_step, runtime  # noqa: E402
from gpulab.harness import bench  # noqa: E402
from gpulab.engine import speculative as spec  # noqa: E402
from gpulab.engine.engine import LLM, EngineConfig  # noqa: E402
from gpulab.engine.model import NEAR_TIE, TINY, first_flip, load_checkpoint, prepare_for_serving  # noqa: E402
from gpulab.engine.sequence import SamplingParams  # noqa: E402
from gpulab.engine.train import train_model  # noqa: E402

PROMPTS = ["Shall I compare thee to a summer's day?\n", "The sea is calm tonight.\n",
           "Tyger Tyger, burning bright,\n", "I wandered lonely as a cloud\n",
           "Because I could not stop for Death,\n", "Do not go gentle into that good night,\n",
           "Once upon a midnight dreary,\n", "Hope is the thing with feathers\n"]


def timed_generate(llm, waves, params):
    """Serve each wave of prompts to completion, one wave after another: (outputs, tok/s)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [o for wave in waves for o in llm.generate(wave, params)]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return outs, sum(len(o.token_ids) for o in outs) / dt


def engine_config(batch, multi_step=1, delay_factor=0.0, max_len=0):
    """Pages for ``batch`` sequences of ``max_len`` tokens each (24 pages a sequence at
    least): no run is timed with preemptions."""
    return EngineConfig(num_blocks=max(256, batch * max(24, -(-max_len // 16))), block_size=16,
                        max_num_seqs=max(8, batch), max_num_batched_tokens=max(512, batch * 8), multi_step=multi_step,
                        scheduler_delay_factor=delay_factor)


@contextlib.contextmanager
def collector_clock():
    """The garbage collector's passes and seconds while the block runs (a ``gc.callbacks``
    entry, removed after), so that a row says whether collections, not the engine, took
    some of its timed runs' host time (a full pass over this process's heap took about
    0.16 s on the H100 host of 2026-12-05). Building an engine is left out: torch collects
    before every CUDA-graph capture, 40 full passes for the target alone."""
    seen, started = dict(gc_s=0.0, gc_passes=0, gc_full_passes=0), []

    def callback(phase, info):
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            seen["gc_s"] += time.perf_counter() - started.pop()
            seen["gc_passes"] += 1
            seen["gc_full_passes"] += info["generation"] == 2

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def bench_one(llm, waves, params, repeats):
    """The last run's outputs, the best tok/s over ``repeats`` timed runs after a warm-up,
    the Triton kernels compiled during the timed runs (0 in a steady state) and the
    collector's work during them (:func:`collector_clock`)."""
    # warm-up, untimed: every prompt length and batch shape (autotuning, lazy init, graph
    # capture), twice: the timed runs find the prompts in the prefix cache, and those steps
    # have other shapes (on 2026-12-03 the first speculative row at batch 64 took 38 ms
    # steps against 2 ms for the next: compiling while timed was the likely cause)
    for _ in range(2):
        timed_generate(llm, waves, params)
    best, outs = 0.0, None
    gc.collect()                         # the warm-ups' and earlier rows' garbage, not timed
    with runtime.count_compilations() as compiled, collector_clock() as collected:
        for _ in range(repeats):
            if isinstance(llm, spec.SpeculativeLLM):
                llm.stats = spec.SpeculationStats(llm.k)
            llm.metrics.steps.clear()
            outs, tps = timed_generate(llm, waves, params)
            best = max(best, tps)
    return outs, best, len(compiled.names), collected


def replay_ms(replay, n=50) -> float:
    """GPU time of one graph replay (CUDA events, mean of n back to back)."""
    return bench.mean_ms(replay, n)


def graph_times(llm, batch) -> dict:
    """Replay times of the graphs one step of ``batch`` sequences uses: the draft's k
    steps, the verify pass, and the target's plain decode step. Replays reuse the last
    step's buffers (they write stale slots): call it on an engine about to be dropped."""
    out = {}
    if isinstance(llm.proposer, spec.MLGRUGraphDrafter):
        # the k drafting steps: with the rollout kernel the last step replays apart (the
        # drafter's last_steps graph, on a side stream beside the next verify pass)
        out["draft_ms"] = replay_ms(llm.proposer.graph(llm.verify_graphs.bucket(batch), False).replay)
        ahead = [b for b, kind in llm.proposer.graphs if kind == "ahead" and b >= batch]
        if ahead:                           # drafting ahead's replay: its start, then the drafts
            out["draft_ahead_ms"] = replay_ms(llm.proposer.graphs[min(ahead), "ahead"].replay)
    if llm.verify_graphs is not None:
        out["verify_ms"] = replay_ms(llm.verify_graphs.graphs[llm.verify_graphs.bucket(batch)].replay)
    if llm.runner.graphs:
        bucket = next(b for b in sorted(llm.runner.graphs) if b >= batch)
        out["target_decode_ms"] = replay_ms(llm.runner.graphs[bucket][0].replay)
    return out


def near_tie_flips(target, outs, want, label: str) -> list[dict]:
    """Where ``outs`` differ from the target alone's ``want``, request by request: the
    first differing token and the target's logits there (reference forward,
    :func:`gpulab.engine.model.first_flip`, the tests' comparison too). Returns the
    near-tie flips; any other difference fails the benchmark."""
    flips = []
    for i, (o, w) in enumerate(zip(outs, want)):
        flip = first_flip(target, o.prompt_token_ids, o.token_ids, w.token_ids)
        if flip is None:
            continue
        print(f"    {label}, request {i}: {flip.describe()}", flush=True)
        assert flip.near_tie, f"{label} changed the tokens of request {i}: {flip.describe()}"
        flips.append(dict(request=i, **dataclasses.asdict(flip)))
    return flips


def bench_speculation(target, drafts, batch, max_tokens, ks, repeats=2, eager_k=None, wrong=None, errors=None,
                      multi_step=1):
    """Rows for one batch size: the target alone, then each (draft, k, graphs). A
    configuration whose tokens differ from the target alone's (not at a near tie) gets no
    row: its message goes to ``wrong`` (a list), or raises AssertionError without one. One
    that raises gets no row either: its traceback goes to ``errors`` (a list), or it
    propagates without one (on 2026-12-04 a KeyError of one configuration lost the rest)."""
    wrong_given = wrong is not None
    wrong = [] if wrong is None else wrong
    waves = [[p] for p in PROMPTS] if batch == 1 else [(PROMPTS * (batch // len(PROMPTS) + 1))[:batch]]
    params = SamplingParams(max_tokens=max_tokens, stop_at_eos=False)
    # the target alone twice: the engine's default (the host a step ahead, EngineConfig.overlap)
    # and without; with multi_step > 1 a third time, that many decode steps per host step
    # (gpulab.engine.multi_step); the fastest is the baseline (the speculative engine does
    # not overlap)
    rows = []
    for overlap, steps in ((None, 1), (False, 1)) + (((False, multi_step),) if multi_step > 1 else ()):
        t0 = time.perf_counter()
        cfg = dataclasses.replace(engine_config(batch, steps), overlap=overlap)
        what = "" if overlap is None else " without overlap" if steps == 1 else f", {steps} steps a window"
        outs, tps, compiled, collected = bench_one(LLM(target, cfg), waves, params, repeats)
        if overlap is None:
            want = outs
        else:
            near_tie_flips(target, outs, want, f"batch {batch} target alone{what}")
        rows.append(dict(batch=batch, draft="none", k=0, graphs=True, overlap=overlap is None, tokens_per_s=tps,
                         acceptance=float("nan"), tokens_per_pass=1.0, kernels_compiled=compiled,
                         **collected, **({"multi_step": steps} if steps > 1 else {})))
        print(f"batch {batch} target alone{what}: {tps:.0f} tok/s, {rows[-1]['gc_passes']} collections "
              f"({rows[-1]['gc_full_passes']} full) in {rows[-1]['gc_s'] * 1e3:.0f} ms while timed "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    base_tps = max(r["tokens_per_s"] for r in rows)
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base_tps
    # (draft, k, adaptive, graphs, rollout kernel, drafting ahead, the draft's weights int8)
    default_int8 = block_step.INT8_WEIGHTS
    configs = [(name, k, False, "auto", True, True, default_int8) for name in drafts for k in ks]
    configs += [(name, max(ks), True, "auto", True, True, default_int8) for name in drafts]
    if "mlgru" in drafts:   # the draft kernels' other weight dtype (gpulab.block_step.INT8_WEIGHTS)
        configs += [("mlgru", k, False, "auto", True, True, not default_int8) for k in ks[:1]]
    if eager_k:     # the MLGRU graphs drafting after reading each step's tokens, step by step
        configs += [("mlgru", eager_k, False, "auto", True, False, default_int8),
                    ("mlgru", eager_k, False, "auto", False, True, default_int8),
                    ("mlgru", eager_k, False, "off", False, False, default_int8)]   # (no rollout kernel), eagerly
    for name, k, adaptive, graphs, rollout, ahead, int8 in configs:
        t0 = time.perf_counter()
        spec.MLGRUGraphDrafter.use_rollout = rollout
        block_step.INT8_WEIGHTS = int8      # read when the drafter makes its weights and graphs
        try:
            llm = spec.SpeculativeLLM(target, engine_config(batch), drafter=drafts[name](), k=k, adaptive=adaptive,
                                      graphs=graphs, draft_ahead=ahead)
            weight_dtype = block_step.weight_dtype()      # int8 only where the GPU has int8 dots
        finally:
            spec.MLGRUGraphDrafter.use_rollout = True
            block_step.INT8_WEIGHTS = default_int8
        stepped = graphs == "auto" and not rollout
        weights = "" if int8 == default_int8 else " int8 weights" if int8 else " float16 weights"
        variant = ((" stepped draft" if stepped else "") + weights
                   + (" drafting after reading" if graphs == "auto" and not ahead else ""))
        label = f"batch {batch} {name} k={k} graphs={graphs}{variant}"
        try:
            outs, tps, compiled, collected = bench_one(llm, waves, params, repeats if graphs == "auto" else 1)
        except Exception:
            if errors is None:
                raise
            print(f"    ERROR in {label}:\n{traceback.format_exc()}", flush=True)
            errors.append(f"{label}: {traceback.format_exc(limit=-3)}")
            del llm
            torch.cuda.empty_cache()
            continue
        try:
            flips = near_tie_flips(target, outs, want, label)
        except AssertionError as e:       # recorded, the other configurations still measured
            if not wrong_given:
                raise
            print(f"    WRONG TOKENS: {e}", flush=True)
            wrong.append(str(e))
            continue
        steps = llm.metrics.steps
        stats = llm.stats
        rows.append(dict(batch=batch, draft=name, k=k, adaptive=adaptive, graphs=graphs == "auto",
                         rollout=getattr(llm.proposer, "rollout", None) is not None, draft_ahead=ahead,
                         draft_weights=str(weight_dtype).removeprefix("torch."),
                         drafts_ahead=dict(llm.ahead_counts), tokens_per_s=tps, speedup=tps / base_tps,
                         acceptance=stats.acceptance_rate(),
                         tokens_per_pass=stats.mean_tokens_per_pass(),
                         acceptance_by_position=stats.acceptance_by_position(),
                         graph_verify=llm.verify_graphs is not None,
                         graph_draft=isinstance(llm.proposer, spec.MLGRUGraphDrafter),
                         graph_steps=sum(st.graph for st in steps) / max(1, len(steps)),
                         mean_step_ms=1e3 * sum(st.end - st.start for st in steps) / max(1, len(steps)),
                         near_tie_flips=len(flips), flips=flips, kernels_compiled=compiled, **collected))
        if graphs == "auto" and not adaptive:
            rows[-1].update(graph_times(llm, batch))
        print(f"batch {batch} {name} k={'<=' if adaptive else ''}{k} graphs={graphs}{variant}: {tps:.0f} tok/s "
              f"({tps / base_tps:.2f}x), acceptance {stats.acceptance_rate():.0%}, "
              f"{stats.mean_tokens_per_pass():.2f} tok/pass, {rows[-1]['mean_step_ms']:.2f} ms/step, "
              f"{compiled} kernels compiled while timed, {rows[-1]['gc_passes']} collections "
              f"({rows[-1]['gc_full_passes']} full) in {rows[-1]['gc_s'] * 1e3:.0f} ms while timed "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if "verify_ms" in rows[-1]:
            print("    replays: " + ", ".join(f"{key} {rows[-1][key]:.3f}" for key in
                                          ("draft_ms", "draft_ahead_ms", "verify_ms", "target_decode_ms")
                                          if key in rows[-1]), flush=True)
        del llm
        torch.cuda.empty_cache()
    return rows


def stream_clients(url, prompts, max_tokens, rounds, ready, gos, results):
    """Some of the HTTP clients, in a process of their own (a server's clients are not in
    its process, and one process of 64 clients was slower than the server it measured).
    After a warm-up request from every client they wait for ``gos[0]``; then every client
    streams ``rounds`` requests one after another (a closed loop: its next request when the
    last one ends), so that the server is measured in a steady state, not in its first and
    last steps; then the next timed run waits for ``gos[1]``, and so on.
    Puts (run, start, end, events, tokens (from each completion's usage), client CPU
    seconds, every request's seconds to its first event) on ``results`` per timed run,
    wall-clock times comparable across processes.
    aiohttp, not httpx: on a
    2-core CPU, against an engine process of 0.6 ms steps, httpx spent 9.6 ms of CPU per
    streamed request of 128 tokens and aiohttp 1.1 ms, and HTTP throughput doubled (the
    H200 runs of 2026-12-03 used httpx)."""
    import aiohttp

    # as in-process (stop_at_eos=False): max_tokens each; the tokens counted are the usage's
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}

    async def one(session, p):
        events = tokens = 0
        first, t0 = None, time.perf_counter()
        async with session.post(url, json=dict(body, prompt=p)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if b'"usage"' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                    else:
                        events += 1
                        first = first or time.perf_counter() - t0
        return events, tokens, first

    async def loop(session, p):
        counts = [await one(session, p) for _ in range(rounds)]
        return sum(c[0] for c in counts), sum(c[1] for c in counts), [c[2] for c in counts]

    async def run():
        connector = aiohttp.TCPConnector(limit=len(prompts) + 8)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*(one(session, p) for p in prompts))  # warm-up: every client once
            ready.put(True)
            for r, go in enumerate(gos):
                await asyncio.get_running_loop().run_in_executor(None, go.wait)
                t0, cpu0 = time.time(), time.process_time()
                counts = await asyncio.gather(*(loop(session, p) for p in prompts))
                results.put((r, t0, time.time(), sum(c[0] for c in counts), sum(c[1] for c in counts),
                             time.process_time() - cpu0, [t for c in counts for t in c[2]]))

    asyncio.run(run())


def closed_loop(llm, prompts, params, rounds) -> dict:
    """In-process twin of the HTTP clients: client i's next request is added when its last
    one finishes, ``rounds`` each. Tokens/s over the whole run, the steps it took and the
    seconds spent in them, those with prompt tokens apart (as the server's /metrics counts
    them: the same :class:`~gpulab.engine.server.StepTimer`)."""
    from gpulab.engine.server import StepTimer
    left = {i: rounds for i in range(len(prompts))}
    owner = {}

    def add(i):
        left[i] -= 1
        owner[llm.add_request(prompts[i], params)] = i

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(len(prompts)):
        add(i)
    tokens = 0
    ttft = []
    timer = StepTimer()
    prompt_steps = llm.metrics.prompt_steps
    while llm.has_unfinished():
        outputs = timer.step(llm, finished_only=True)
        for out in outputs:
            tokens += len(out.token_ids)
            ttft.append(out.metrics.ttft)
            i = owner.pop(out.request_id)
            if left[i]:
                add(i)
    sync()
    wall = time.perf_counter() - t0
    return dict(tokens_per_s=tokens / wall, wall_s=wall, steps=timer.steps, busy_s=timer.busy,
                prompt_busy_s=timer.prompt_busy, prompt_steps=llm.metrics.prompt_steps - prompt_steps,
                ttft_p50_s=statistics.median(ttft))


def bench_server(target, clients, max_tokens, rounds=4, repeats=3, switch_interval=None, engine_process=False,
                 api_servers=0, profile=None, client_processes=None, multi_step=1, delay_factor=0.0):
    """Streaming through HTTP against in-process serving of the same closed-loop load:
    ``clients`` clients, each ``rounds`` requests of ``max_tokens`` tokens one after another,
    ``repeats`` timed runs each way; the ratio is of the best run each way (and, beside it,
    of the medians). Where the server's engine is another process (idle between runs), the
    in-process runs alternate with the HTTP runs, so that a host that drifts (the same
    in-process run gave 57 to 127 K tok/s between processes on one H200 host) moves both
    sides alike; with the engine in the server's thread (which steps ``llm`` itself) they
    run before the server starts.
    ``switch_interval``: the interpreter's GIL switch interval while the server runs
    (``sys.setswitchinterval``; None leaves Python's 5 ms): the engine's thread and the
    event loop's share the GIL. ``engine_process``: the server's engine steps in a process of
    its own (:class:`gpulab.engine.server.EngineProcess`), built there as ``target`` was (the
    shipped checkpoint in bfloat16), with the same configuration. ``api_servers``: instead,
    ``gpulab serve --api-servers N`` as a user starts it (its own process: N HTTP processes
    and the engine's), with the same engine configuration. ``profile`` (a folder, with
    ``api_servers``): cProfile one more in-process run and the engine process
    (``GPULAB_ENGINE_PROFILE``) over its whole life; the figures are then a profiled run's.
    ``multi_step``: the engine's decode steps per host step, ``delay_factor`` its scheduler's
    admission delay (``EngineConfig.scheduler_delay_factor``), in-process and behind HTTP alike."""
    import multiprocessing

    import uvicorn

    from gpulab.engine.server import create_app

    prompts = (PROMPTS * (clients // len(PROMPTS) + 1))[:clients]
    params = SamplingParams(max_tokens=max_tokens, stop_at_eos=False)
    cfg = engine_config(clients, multi_step, delay_factor, max_len=max(map(len, prompts)) + max_tokens)
    llm = LLM(target, cfg)
    closed_loop(llm, prompts, params, 1)                     # warm-up, untimed
    apart = engine_process or bool(api_servers)              # the server's engine is another process
    in_process = [] if apart else [closed_loop(llm, prompts, params, rounds) for _ in range(repeats)]
    profiles = {}
    if profile:
        import cProfile
        import pstats
        os.makedirs(profile, exist_ok=True)
        prof = cProfile.Profile()
        prof.enable()
        r = closed_loop(llm, prompts, params, rounds)
        prof.disable()
        profiles["in_process"] = per_step_profile(pstats.Stats(prof), r["steps"], "in-process closed loop")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    default_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    server = cli = None
    if api_servers:
        env = dict(os.environ)
        if profile:
            env["GPULAB_ENGINE_PROFILE"] = os.path.join(profile, "engine.prof")
        cli = subprocess.Popen([sys.executable, "-m", "gpulab", "serve", "--port", str(port),
                                "--api-servers", str(api_servers), "--pages", str(cfg.num_blocks),
                                "--max-num-seqs", str(cfg.max_num_seqs),
                                "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                                "--multi-step", str(multi_step), "--scheduler-delay-factor", str(delay_factor)],
                               env=env)
        deadline = time.time() + 600
        while not server_healthy(port):
            assert cli.poll() is None and time.time() < deadline, "gpulab serve --api-servers did not start"
            time.sleep(0.5)
    else:
        if engine_process:
            import functools

            from gpulab.engine.server import build_llm
            app = create_app(make_llm=functools.partial(build_llm, "shipped", dtype="bfloat16",
                                                        **dataclasses.asdict(cfg)))
        else:
            app = create_app(llm)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
    if apart:                                               # the engine process warms up too
        status = httpx_post(f"http://127.0.0.1:{port}/v1/completions", prompts[0], max_tokens)
        assert status == 200, f"the engine process's warm-up request failed ({status})"
    ctx = multiprocessing.get_context("spawn")              # never fork a process that holds CUDA
    n_procs = client_processes or max(1, min(8, (os.cpu_count() or 2) // 2, clients))
    ready, gos, results = ctx.Queue(), [ctx.Event() for _ in range(repeats)], ctx.Queue()
    url = f"http://127.0.0.1:{port}/v1/completions"
    procs = [ctx.Process(target=stream_clients, args=(url, prompts[i::n_procs], max_tokens, rounds, ready, gos,
                                                      results))
             for i in range(n_procs)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=600)
    http = []
    for go in gos:
        if apart:
            in_process.append(closed_loop(llm, prompts, params, rounds))
        before = engine_gauges(port)
        go.set()                                            # every client process starts at once
        http.append(http_run([results.get(timeout=600) for _ in procs], before, engine_gauges(port)))
    for proc in procs:
        proc.join()
    pages_free = llm.idle()
    if apart:                                               # its last step's report may still be on its way
        deadline = time.time() + 10
        while not (pages_free := "gpulab_kv_pages_used 0.0" in httpx_get(f"http://127.0.0.1:{port}/metrics")) \
                and time.time() < deadline:
            time.sleep(0.1)
    if server is not None:
        server.should_exit = True
    else:
        cli.send_signal(signal.SIGINT)                      # as Ctrl-C: the API servers, then the engine
        try:
            cli.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cli.kill()
    sys.setswitchinterval(default_interval)
    if profile and api_servers:
        import pstats
        path = os.path.join(profile, "engine.prof")
        if os.path.exists(path):              # written when the engine process stops
            profiles["engine_process"] = per_step_profile(pstats.Stats(path), int(http[-1]["after_steps"]),
                                                          "engine process (its whole life)")
    return dict(clients=clients, rounds=rounds, repeats=repeats, client_processes=n_procs,
                client=f"aiohttp {aiohttp_version()}", engine_process=apart, multi_step=multi_step,
                scheduler_delay_factor=delay_factor,
                api_servers=api_servers or 1, switch_interval=switch_interval or default_interval,
                max_tokens=max_tokens, all_pages_free=pages_free,
                **compare_runs(in_process, http), **({"profiles": profiles} if profile else {}))


def http_run(got: list[tuple], before: dict, after: dict) -> dict:
    """One timed HTTP run from its client processes' results (run, start, end, events,
    tokens, CPU seconds) and the engine's /metrics counters around it (the first report
    after the run may lag by a step)."""
    t0, t1 = min(g[1] for g in got), max(g[2] for g in got)
    return dict(tokens_per_s=sum(g[4] for g in got) / (t1 - t0), wall_s=t1 - t0, events=sum(g[3] for g in got),
                ttft_p50_s=statistics.median(t for g in got for t in g[6]),
                client_cpu_s=sum(g[5] for g in got), steps=after["steps"] - before["steps"],
                busy_s=after["busy_seconds"] - before["busy_seconds"],
                prompt_busy_s=after["prompt_busy_seconds"] - before["prompt_busy_seconds"],
                prompt_steps=after["prompt_steps"] - before["prompt_steps"], after_steps=after["steps"])


def compare_runs(in_process: list[dict], http: list[dict]) -> dict:
    """The server row's figures: the best run each way (their ratio is the headline), every
    run's tok/s, the ratio of the medians, and where the best runs' time went (steps, the
    seconds inside them, steps with prompt tokens and their seconds: fewer tokens a step
    means the clients starve the engine, longer steps that the engine process is the limit)."""
    e = max(in_process, key=lambda r: r["tokens_per_s"])
    h = max(http, key=lambda r: r["tokens_per_s"])
    median = statistics.median
    return dict(engine_tokens_per_s=e["tokens_per_s"], http_tokens_per_s=h["tokens_per_s"],
                ratio=h["tokens_per_s"] / e["tokens_per_s"],
                ratio_of_medians=median(r["tokens_per_s"] for r in http) / median(r["tokens_per_s"] for r in in_process),
                engine_runs_tokens_per_s=[r["tokens_per_s"] for r in in_process],
                http_runs_tokens_per_s=[r["tokens_per_s"] for r in http],
                engine_steps=e["steps"], engine_busy_s=e["busy_s"], engine_wall_s=e["wall_s"],
                engine_prompt_steps=e["prompt_steps"], engine_prompt_busy_s=e["prompt_busy_s"],
                engine_ttft_p50_s=e["ttft_p50_s"], http_ttft_p50_s=h["ttft_p50_s"],
                http_steps=h["steps"], http_busy_s=h["busy_s"], http_prompt_steps=h["prompt_steps"],
                http_prompt_busy_s=h["prompt_busy_s"],
                http_wall_s=h["wall_s"], events=h["events"], client_cpu_s=h["client_cpu_s"])


def httpx_post(url, prompt, max_tokens) -> int:
    import httpx
    return httpx.post(url, json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=600).status_code


def aiohttp_version() -> str:
    import aiohttp
    return aiohttp.__version__


def server_healthy(port) -> bool:
    import httpx
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def engine_gauges(port) -> dict:
    """The engine's step counters from the server's /metrics."""
    text = httpx_get(f"http://127.0.0.1:{port}/metrics")
    found = {}
    for key, name in (("steps", "gpulab_engine_steps"), ("busy_seconds", "gpulab_engine_busy_seconds"),
                      ("prompt_steps", "gpulab_engine_prompt_steps"),
                      ("prompt_busy_seconds", "gpulab_engine_prompt_busy_seconds")):
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        found[key] = float(line.split()[1])
    return found


def httpx_get(url) -> str:
    import httpx
    return httpx.get(url, timeout=60).text


def host_profile(target, drafter, max_tokens, top=25) -> dict:
    """Where a batch-1 speculative step's host time goes: cProfile over serving the prompts
    one after another (k = 4, graphs), after two untimed runs. Waiting for the GPU shows
    as the time of the device -> host copies (``tolist``, ``cpu``)."""
    import cProfile
    import pstats

    llm = spec.SpeculativeLLM(target, engine_config(1), drafter=drafter(), k=4)
    waves, params = [[p] for p in PROMPTS], SamplingParams(max_tokens=max_tokens, stop_at_eos=False)
    for _ in range(2):
        timed_generate(llm, waves, params)
    llm.metrics.steps.clear()
    prof = cProfile.Profile()
    prof.enable()
    timed_generate(llm, waves, params)
    prof.disable()
    return per_step_profile(pstats.Stats(prof), len(llm.metrics.steps), "host profile, batch 1, k=4", top)


def per_step_profile(stats, steps, what, top=25) -> dict:
    """The ``top`` functions of a cProfile by own time, per engine step; printed too."""
    rows = sorted(((v[2], v[3], v[1], f"{k[0].rsplit('/', 1)[-1]}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),
                  reverse=True)[:top]
    out = dict(steps=steps, top_own=[dict(fn=fn, own_us_per_step=1e6 * own / steps, cum_us_per_step=1e6 * cum / steps,
                                          calls_per_step=n / steps) for own, cum, n, fn in rows])
    print(f"{what}: {steps} steps; own time per step:", flush=True)
    for r in out["top_own"]:
        print(f"    {r['own_us_per_step']:8.1f} us  {r['calls_per_step']:6.1f} calls  {r['fn']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="k in (4, 8) only, one timed run each")
    ap.add_argument("--ks", default=None, help="the k to measure (default 2,4,6,8; 4,8 with --quick)")
    ap.add_argument("--transformer", action="store_true", help="also the transformer draft (trained here)")
    ap.add_argument("--no-server", action="store_true", help="skip the HTTP server's overhead")
    ap.add_argument("--batches", default="1,64", help="batch sizes to measure (1 and/or 64; '' for none)")
    ap.add_argument("--server-modes", default="thread,switch,process,scaleout",
                    help="the server runs to make: engine thread, with a 0.5 ms GIL switch interval, "
                         "engine process, gpulab serve with --api-servers (scaleout), scaleout under cProfile "
                         "(profile)")
    ap.add_argument("--api-servers", type=int, default=4, help="HTTP processes in the scaleout mode")
    ap.add_argument("--client-processes", type=int, default=None,
                    help="processes the 64 HTTP clients run in (default: half the cores, at most 8)")
    ap.add_argument("--server-rounds", type=int, default=4,
                    help="requests each of the 64 server clients sends one after another")
    ap.add_argument("--server-repeats", type=int, default=3,
                    help="timed runs each way, in-process and behind HTTP, per server row (the best of each "
                         "is compared)")
    ap.add_argument("--eager-k", type=int, default=4,
                    help="k of the batch-1 variants drafting after reading, stepped and eager (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="also the host's functions in a batch-1, k=4 speculative run (cProfile)")
    ap.add_argument("--multi-step", type=int, default=1,
                    help="also the target alone with this many decode steps per host step, and the "
                         "server rows with it, in-process and behind HTTP (EngineConfig.multi_step)")
    ap.add_argument("--server-max-tokens", default=None,
                    help="each server row once per request length (tokens a request, comma-separated; default "
                         "--max-tokens); a row of another length than --max-tokens is saved as KEY_tokensN")
    ap.add_argument("--delay-factors", default="0",
                    help="each server row once per admission delay factor (EngineConfig.scheduler_delay_factor), "
                         "in-process and behind HTTP alike; a row with a factor > 0 is saved as KEY_delayF")
    args = ap.parse_args(argv)
    delay_factors = [float(f) for f in args.delay_factors.split(",") if f.strip()] or [0.0]
    server_lengths = [int(n) for n in (args.server_max_tokens or str(args.max_tokens)).split(",") if n.strip()]
    if runtime.mode() != "compiled":
        sys.exit("tools/speculative_bench.py times GPU kernels: run it on a machine with a GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dtype = torch.bfloat16
    target = load_checkpoint(device="cuda", dtype=dtype)
    draft_lm = spec.load_mlgru_draft(device="cuda", dtype=dtype)
    drafts = {"mlgru": lambda: spec.MLGRUDrafter(draft_lm)}
    if args.transformer:
        t0 = time.perf_counter()
        small, _ = train_model(TINY, steps=300 if not args.quick else 50, device="cuda", progress=False)
        small = prepare_for_serving(small, "cuda", dtype)
        print(f"trained the transformer draft in {time.perf_counter() - t0:.0f} s", flush=True)
        drafts["transformer"] = lambda: spec.TransformerDrafter(small)
    ks = tuple(int(k) for k in args.ks.split(",")) if args.ks else (4, 8) if args.quick else (2, 4, 6, 8)
    repeats = 1 if args.quick else 2
    result = dict(date=datetime.date.today().isoformat(), gpu=runtime.gpu_name(), versions=runtime.versions(),
                  max_tokens=args.max_tokens, near_tie_rel_tol=NEAR_TIE[dtype], rows=[], wrong_tokens=[],
                  errors=[])

    def save():   # after every stage: a run cut short keeps what it measured
        result["seconds"] = time.perf_counter() - t_start
        (out / "speculative.json").write_text(json.dumps(result, indent=1))

    batches = {int(b) for b in args.batches.split(",") if b.strip()}
    if 1 in batches:
        result["rows"] += bench_speculation(target, drafts, 1, args.max_tokens, ks, repeats, eager_k=args.eager_k,
                                            wrong=result["wrong_tokens"], errors=result["errors"],
                                            multi_step=args.multi_step)
        save()
    if 64 in batches:
        result["rows"] += bench_speculation(target, drafts, 64, args.max_tokens // 2, ks[:2], 1,
                                            wrong=result["wrong_tokens"], errors=result["errors"],
                                            multi_step=args.multi_step)
        save()
    if args.profile:
        result["host_profile_b1_k4"] = host_profile(target, drafts["mlgru"], args.max_tokens)
        save()
    modes = set() if args.no_server else {m.strip() for m in args.server_modes.split(",") if m.strip()}
    for mode, key, kwargs, what in (
            ("thread", "server", {}, "server"),
            ("switch", "server_switch_interval", dict(switch_interval=0.0005), "server, GIL switch interval 0.5 ms"),
            ("process", "server_engine_process", dict(engine_process=True), "server, engine in its own process"),
            ("scaleout", "server_api_servers", dict(api_servers=args.api_servers),
             f"gpulab serve --api-servers {args.api_servers}"),
            ("profile", "server_profiled", dict(api_servers=args.api_servers, profile=os.path.join(args.out, "prof")),
             f"gpulab serve --api-servers {args.api_servers}, profiled")):
        for length, factor in itertools.product(server_lengths, delay_factors) if mode in modes else ():
            r = result[key + (f"_tokens{length}" if length != args.max_tokens else "")
                       + (f"_delay{factor:g}" if factor else "")] = bench_server(
                target, 64, length, rounds=args.server_rounds, repeats=args.server_repeats,
                client_processes=args.client_processes, multi_step=args.multi_step, delay_factor=factor, **kwargs)
            what_f = (what + (f", requests of {length} tokens" if length != args.max_tokens else "")
                      + (f", delay factor {factor:g}" if factor else ""))
            print(f"{what_f}: {r['ratio']:.0%} of in-process, best run each way ({r['http_tokens_per_s']:.0f} vs "
                  f"{r['engine_tokens_per_s']:.0f} tok/s, {r['events']} events; medians "
                  f"{r['ratio_of_medians']:.0%}; runs " + ", ".join(f"{t / 1e3:.1f}" for t in r['http_runs_tokens_per_s'])
                  + " K behind HTTP, " + ", ".join(f"{t / 1e3:.1f}" for t in r['engine_runs_tokens_per_s'])
                  + f" K in-process); best runs' steps: "
                  f"{r['http_steps']:.0f} in {r['http_wall_s']:.3f} s, {r['http_busy_s']:.3f} s busy, "
                  f"{r['http_prompt_steps']:.0f} with prompt tokens ({r['http_prompt_busy_s']:.3f} s), behind HTTP; "
                  f"{r['engine_steps']} in {r['engine_wall_s']:.3f} s, {r['engine_busy_s']:.3f} s busy, "
                  f"{r['engine_prompt_steps']} with prompt tokens ({r['engine_prompt_busy_s']:.3f} s), in-process",
                  flush=True)
            save()
    print(spec.format_results(result))
    print(f"{time.perf_counter() - t_start:.0f} s in all")
    for message in result["wrong_tokens"] + result["errors"]:
        print(f"FAILED: {message}")
    return 1 if result["wrong_tokens"] or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

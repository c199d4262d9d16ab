"""An OpenAI-compatible HTTP server over the engine (``gpulab serve``).

Endpoints: ``POST /v1/completions`` (streaming by server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus text format). The byte-level model has no chat template, so there is no
``/v1/chat/completions``.

How requests meet the engine. The engine is not thread-safe, so one thread owns it:
:class:`EngineLoop` runs ``add_request``/``abort``/``step`` on that thread only. An HTTP
handler sends it a command through a queue and awaits the answer; every step's outputs
go back to the handler of each request through an asyncio queue. So requests from many
clients join the running batch at the next step, a bad request gets its own 4xx while
the others keep streaming, and a client that disconnects aborts its request, which
frees its pages. :class:`EngineProcess` offers the same to the handlers with the engine
in a process of its own (``create_app(make_llm=...)``, ``gpulab serve --engine-process``),
so that the engine's host work and the event loop's do not take turns on one GIL; with
``gpulab serve --api-servers N`` N HTTP processes (uvicorn's workers, each
``create_app(engine_address=...)``) feed one engine process, when one event loop cannot
keep up with the engine.

>>> from gpulab.engine.server import create_app        # doctest: +SKIP
>>> app = create_app()                                  # the shipped checkpoint
>>> # uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import argparse
import asyncio
import codecs
import collections
import concurrent.futures
import functools
import itertools
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import secrets
import signal
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from .engine import LLM, Completion, EngineConfig, RequestOutput, frozen_heap
from .model import encode_prompt
from .serve_bench import build_model
from .sequence import RequestError, SamplingParams

MODEL_NAME = "gpulab-ternary-poet"


# -- the request body -------------------------------------------------------------------------
class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions API that a byte-level model can honour; any
    other field is an error (so a typo is not silently ignored)."""
    model_config = ConfigDict(extra="forbid")

    model: str = MODEL_NAME
    prompt: str | list[int] | list[str]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # an extension, as in vLLM
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = None
    user: str | None = None
    stream_options: dict | None = None   # {"include_usage": true}: a last chunk with the usage
    ignore_eos: bool = False             # an extension, as in vLLM: generate max_tokens (benchmarks)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _prompt_of(req: CompletionRequest):
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise APIError(400, "send one prompt per request (this server takes a string or a list of "
                                "token ids)", "prompt")
        p = p[0]
    return p


def _sampling_params(req: CompletionRequest) -> SamplingParams:
    if req.logprobs is not None:
        raise APIError(400, "logprobs are not supported by this server: leave the field out", "logprobs")
    if req.echo and req.stream:
        raise APIError(400, "echo is supported only without stream", "echo")
    if req.stream_options is not None:
        if not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        if set(req.stream_options) - {"include_usage"}:
            raise APIError(400, "stream_options takes only include_usage", "stream_options")
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                          max_tokens=req.max_tokens, seed=req.seed, n=req.n, stop_at_eos=not req.ignore_eos)


def _stops(req: CompletionRequest) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop takes up to 4 non-empty strings", "stop")
    return stops


# -- the engine's thread --------------------------------------------------------------------------
@dataclass
class Subscription:
    """Where one request's outputs go, on the server's event loop: the engine's thread
    appends (a whole step's outputs in one call, :func:`deliver`), the request's handler
    takes everything that arrived since it last looked (:meth:`take`)."""
    loop: asyncio.AbstractEventLoop
    items: collections.deque = field(default_factory=collections.deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)      # its last item arrived

    def put(self, item) -> None:
        """From the engine's thread: one item (an abort's None, a failure)."""
        self.loop.call_soon_threadsafe(deliver, [(self, item)])

    async def take(self) -> list:
        """What arrived since the last call (at least one item: waits for it)."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        items = list(self.items)
        self.items.clear()
        return items

    async def gather_for(self, seconds: float) -> None:
        """Let outputs gather for ``seconds``, less if the request ends meanwhile: its last
        event goes out at once (a closed-loop client sends its next request only then)."""
        if not self.ended.is_set():
            try:
                await asyncio.wait_for(self.ended.wait(), seconds)
            except asyncio.TimeoutError:
                pass


def deliver(pairs: list) -> None:
    """On the event loop: (subscription, item) pairs, a step's outputs for many requests
    in one wake-up of the loop (one per output was 64 per step at batch 64)."""
    for sub, item in pairs:
        sub.items.append(item)
        sub.ready.set()
        if item is None or isinstance(item, Exception) or (isinstance(item, RequestOutput) and item.finished):
            sub.ended.set()


def dispatch(subscribers: dict, outputs: list) -> None:
    """From the engine's side: a step's outputs to their requests' subscriptions, one
    wake-up per event loop and step; a finished request's subscription is dropped."""
    by_loop: dict = {}
    for out in outputs:
        sub = subscribers.get(out.request_id)
        if sub is not None:
            by_loop.setdefault(sub.loop, []).append((sub, out))
        if out.finished:
            subscribers.pop(out.request_id, None)
    for loop, pairs in by_loop.items():
        loop.call_soon_threadsafe(deliver, pairs)


class ReportClock:
    """Says whether the engine's next step reports every running request's tokens.

    The engine reports a request's first token and its end at once
    (``step(finished_only=True, first_tokens=True)``), and everything else every
    ``interval`` seconds: the steps in between build no outputs. At batch 64 an output
    per request and step cost the engine's host a sixth of its step (2026-12-03), for
    events that the stream interval holds back anyway: a server reports at half its
    stream interval (:func:`report_interval`)."""

    def __init__(self, interval: float):
        self.interval, self.last = interval, 0.0

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


def report_interval(stream_interval: float) -> float:
    """How often the engine reports running requests for events ``stream_interval`` apart:
    half of it, so an event's tokens are at most that old (0: every step)."""
    return stream_interval / 2


def newest_outputs(items: list) -> list:
    """``items`` less every RequestOutput that the next item supersedes: a request's
    outputs are cumulative (each holds every token so far), so when the engine ran ahead
    of a slow client the newest one says all, in one event instead of one per step."""
    return [item for item, nxt in zip(items, items[1:] + [None])
            if not (isinstance(item, RequestOutput) and isinstance(nxt, RequestOutput) and not item.finished)]


class EngineLoop:
    """Owns the engine: every call to it happens on this object's thread. ``report_every``:
    seconds between reports of running requests' tokens (:class:`ReportClock`)."""

    def __init__(self, llm: LLM, report_every: float = 0.0):
        self.llm = llm
        llm.metrics.keep_last(METRICS_HISTORY)
        self.commands: queue.Queue = queue.Queue()
        self.subscribers: dict[str, Subscription] = {}
        self.ids = itertools.count()
        self.timer = StepTimer()
        self.clock = ReportClock(report_every)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gpulab-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(("wake",))
        self.thread.join(timeout=10)

    # called from the event loop ------------------------------------------------------------
    async def submit(self, prompt, params: SamplingParams) -> tuple[str, Subscription]:
        """Queue a request; raises :class:`RequestError` (for a 400) if the engine refuses it."""
        sub = Subscription(asyncio.get_running_loop())
        done = concurrent.futures.Future()
        self.commands.put(("add", f"cmpl-{next(self.ids)}", prompt, params, sub, done))
        return await asyncio.wrap_future(done), sub

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    # the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping.is_set():
            if not self.llm.has_unfinished():
                self._handle(self.commands.get())        # idle: sleep until a command comes
            while True:                                  # all that arrived joins this step
                try:
                    self._handle(self.commands.get_nowait())
                except queue.Empty:
                    break
            if self.stopping.is_set() or not self.llm.has_unfinished():
                continue
            try:
                outputs = self.timer.step(self.llm, finished_only=not self.clock.due(), first_tokens=True)
            except Exception as e:            # a bug, not a bad request: fail what is running, go on
                traceback.print_exc()
                self._fail_all(f"the engine failed a step: {type(e).__name__}: {e}")
                continue
            dispatch(self.subscribers, outputs)

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "add":
            _, rid, prompt, params, sub, done = command
            try:
                self.llm.add_request(prompt, params, request_id=rid)
            except RequestError as e:
                done.set_exception(e)
                return
            self.subscribers[rid] = sub
            done.set_result(rid)
        elif kind == "abort":
            rid = command[1]
            if rid in self.llm.groups:
                self.llm.abort(rid)
            sub = self.subscribers.pop(rid, None)
            if sub is not None:
                sub.put(None)

    def _fail_all(self, message: str) -> None:
        for rid, sub in list(self.subscribers.items()):
            if rid in self.llm.groups:
                self.llm.abort(rid)
            sub.put(RuntimeError(message))
        self.subscribers.clear()

    # read by /health and /metrics --------------------------------------------------------------
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stats(self) -> dict:
        return engine_stats(self.llm, self.timer)


# A served engine keeps the records of its newest steps and finished requests only (for
# plot_serving_timeline and summaries): kept whole they would grow for as long as it serves.
METRICS_HISTORY = 10_000


class StepTimer:
    """A serving loop's steps and the seconds spent in them (``busy``), those of the steps
    that carried prompt tokens also apart (``prompt_busy``): against wall-clock time they
    say whether the engine or what feeds it is the limit, and what the prompts' steps cost."""

    def __init__(self):
        self.steps, self.busy, self.prompt_busy = 0, 0.0, 0.0

    def step(self, llm: LLM, **kwargs) -> list[RequestOutput]:
        """``llm.step(**kwargs)``, timed (a step that raises is not counted)."""
        prompt_steps, t0 = llm.metrics.prompt_steps, time.perf_counter()
        outputs = llm.step(**kwargs)
        seconds = time.perf_counter() - t0
        self.steps += 1
        self.busy += seconds
        if llm.metrics.prompt_steps != prompt_steps:
            self.prompt_busy += seconds
        return outputs


def engine_stats(llm: LLM, timer: StepTimer) -> dict:
    """The gauges /metrics shows (a snapshot; read from another thread, so approximate).
    ``prompt_steps``: steps that carried prompt tokens (a step with a prompt chunk costs
    more than a decode-only one replayed from its graph); times from ``timer``."""
    bm = llm.block_manager
    return {"pages_used": bm.num_used, "pages_total": llm.config.num_blocks, "running": len(llm.scheduler.running),
            "waiting": len(llm.scheduler.waiting), "steps": timer.steps, "busy_seconds": timer.busy,
            "prompt_busy_seconds": timer.prompt_busy, "prompt_steps": llm.metrics.prompt_steps,
            "hit_rate": bm.hit_rate()}


class EngineProcess:
    """:class:`EngineLoop`'s interface with the engine in a process of its own.

    In one process the engine's thread and the event loop's share Python's global
    interpreter lock: every step's host work (scheduling, planning, launching) waits
    while the loop writes events to 64 clients, and the other way round. Here the engine
    steps in a child process (``make_llm()`` builds it there: a picklable callable, e.g. a
    ``functools.partial``; spawned, never forked, as CUDA requires) and the two talk over
    a pipe: commands down, each step's new tokens up (:func:`step_deltas`), to a thread
    that hands them to the requests' handlers as :class:`EngineLoop` does. vLLM splits
    its engine from its API server the same way.

    One event loop can still fall behind a fast engine: every request costs it a few ms of
    Python (HTTP, validation, streaming). ``listen=(address, authkey)`` makes the engine
    process also accept more API servers there (:meth:`connect`, ``gpulab serve
    --api-servers N``): N processes, each with its own event loop, feed one engine.
    ``report_every`` as for :class:`EngineLoop`."""

    def __init__(self, make_llm=None, start_timeout: float = 600.0, listen: tuple[str, bytes] | None = None,
                 report_every: float = 0.0, _conn=None):
        self.start_timeout = start_timeout
        self.proc = None
        if _conn is None:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=engine_process_main, args=(make_llm, child, listen, report_every),
                                    name="gpulab-engine", daemon=True)
        else:
            self.conn = _conn
        self.tag = secrets.token_hex(3)        # request ids stay unique across API servers
        self.subscribers: dict[str, Subscription] = {}
        self.tokens: dict[str, dict[int, list[int]]] = {}
        self.waiting_add: dict[str, concurrent.futures.Future] = {}
        self.ids = itertools.count()
        self.steps = 0
        self.last_stats: dict = {}
        self.reader = threading.Thread(target=self._read, name="gpulab-engine-reader", daemon=True)
        self.send_lock = threading.Lock()

    @classmethod
    def connect(cls, address: str, authkey: bytes, timeout: float = 60.0) -> "EngineProcess":
        """An API server's link to an engine process started elsewhere with ``listen``."""
        deadline = time.time() + timeout
        while True:
            try:
                conn = multiprocessing.connection.Client(address, authkey=authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.time() > deadline:
                    raise RuntimeError(f"no engine process listens at {address}") from None
                time.sleep(0.1)
            except multiprocessing.AuthenticationError:
                raise RuntimeError(f"the engine process at {address} refused this key") from None
        return cls(_conn=conn, start_timeout=timeout)

    def start(self) -> "EngineProcess":
        if self.proc is not None:
            self.proc.start()
        if not self.conn.poll(self.start_timeout):
            raise RuntimeError(f"the engine process did not start within {self.start_timeout:.0f} s")
        kind, payload = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.last_stats = payload
        self.reader.start()
        return self

    def stop(self) -> None:
        if self.proc is None:                 # an API server: the engine serves the others on
            self._send(("close",))            # its requests are aborted there; "stopped" ends the reader
            self.reader.join(timeout=10)
            self.conn.close()
            return
        self._send(("stop",))
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()

    def _send(self, command) -> None:
        with self.send_lock:
            try:
                self.conn.send(command)
            except (BrokenPipeError, OSError):
                pass                          # the process is gone: /health says so

    async def submit(self, prompt, params: SamplingParams) -> tuple[str, Subscription]:
        sub = Subscription(asyncio.get_running_loop())
        rid = f"cmpl-{self.tag}{next(self.ids)}"
        done = self.waiting_add[rid] = concurrent.futures.Future()
        self.subscribers[rid] = sub            # before the command: its first output may come at once
        self._send(("add", rid, prompt, params))
        try:
            return await asyncio.wrap_future(done), sub
        except RequestError:
            self.subscribers.pop(rid, None)
            raise

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))
        sub = self.subscribers.pop(request_id, None)
        if sub is not None:
            sub.put(None)

    def alive(self) -> bool:
        return (self.proc is None or self.proc.is_alive()) and self.reader.is_alive()

    def stats(self) -> dict:
        return self.last_stats

    def _read(self) -> None:
        """The reader thread: blocks on the pipe (without the GIL), dispatches."""
        while True:
            try:
                kind, *rest = self.conn.recv()
            except (EOFError, OSError):
                self._fail_all("the engine process stopped")
                return
            if kind == "outputs":
                deltas, self.last_stats = rest
                self.steps = self.last_stats["steps"]
                dispatch(self.subscribers, [self._output(*d) for d in deltas])
            elif kind == "stats":
                self.last_stats = rest[0]
            elif kind == "added":
                self.waiting_add.pop(rest[0]).set_result(rest[0])
            elif kind == "rejected":
                self.waiting_add.pop(rest[0]).set_exception(RequestError(rest[1]))
            elif kind == "failed":               # a step failed: what was running is lost
                self._fail_all(rest[0])
            elif kind == "stopped":
                return

    def _output(self, rid, completions, finished, error, metrics) -> RequestOutput:
        """A step's delta as the :class:`RequestOutput` the handlers read: each completion's
        ``token_ids`` is this request's one growing list (outputs are cumulative; no copy
        per step). This thread extends it while a handler reads it, so a reader takes its
        length once and reads up to there (:meth:`_StopWatch.feed`)."""
        held = self.tokens.setdefault(rid, {})
        done = []
        for index, new, reason in completions:
            ids = held.setdefault(index, [])
            ids += new
            done.append(Completion(index, ids, reason))
        if finished:
            self.tokens.pop(rid, None)
        return RequestOutput(rid, [], done, finished, error, metrics)    # prompt ids stay in the engine

    def _fail_all(self, message: str) -> None:
        for sub in list(self.subscribers.values()):
            sub.put(RuntimeError(message))
        self.subscribers.clear()
        self.tokens.clear()
        for fut in list(self.waiting_add.values()):
            fut.set_exception(RuntimeError(message))
        self.waiting_add.clear()


def step_deltas(outputs: list[RequestOutput], sent: dict[str, dict[int, int]]) -> list[tuple]:
    """What an engine process sends of a step: per request (id, [(completion index, its new
    token ids, finish reason)], finished, error, metrics once finished). A step's outputs
    as objects, each with every token so far, took 0.2 ms to pickle at batch 64 and as
    long to unpickle: as much as the step itself. ``sent``: tokens sent so far, per request
    and completion (updated here)."""
    deltas = []
    for out in outputs:
        counts = sent.setdefault(out.request_id, {})
        comps = []
        for c in out.completions:
            n = counts.get(c.index, 0)
            comps.append((c.index, c.token_ids[n:], c.finish_reason))
            counts[c.index] = len(c.token_ids)
        if out.finished:
            sent.pop(out.request_id, None)
        deltas.append((out.request_id, comps, out.finished, out.error, out.metrics if out.finished else None))
    return deltas


def engine_process_main(make_llm, conn, listen: tuple[str, bytes] | None = None, report_every: float = 0.0) -> None:
    """The engine process: build the engine, then step while there is work; between
    steps take every command that arrived, from the parent's pipe and from every API
    server that connected at ``listen`` (blocking only when idle). Each step's tokens go
    to the connection that asked for the request; when an API server goes away its
    requests are aborted (their pages freed) and the engine serves the others on."""
    # Ctrl-C in a terminal reaches every process of the group: the parent stops this one
    # (a "stop" command, or its pipe closing) after its API servers, so it ignores SIGINT
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = make_llm()
        llm.metrics.keep_last(METRICS_HISTORY)
        listener = None if listen is None else multiprocessing.connection.Listener(listen[0], authkey=listen[1])
    except Exception as e:                       # reported to the parent's start()
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    timer, clock = StepTimer(), ReportClock(report_every)
    conns, owner, sent = [conn], {}, {}
    joined: queue.SimpleQueue = queue.SimpleQueue()

    def accept():
        while True:
            try:
                joined.put(listener.accept())
            except (EOFError, multiprocessing.AuthenticationError):
                continue                         # a caller without the key, or gone at once
            except OSError:
                return                           # the listener closed: the engine stops

    if listener is not None:
        threading.Thread(target=accept, name="gpulab-engine-accept", daemon=True).start()
    conn.send(("ready", engine_stats(llm, timer)))

    def drop(c) -> None:
        conns.remove(c)
        for rid in [rid for rid, o in owner.items() if o is c]:
            owner.pop(rid)
            sent.pop(rid, None)
            if rid in llm.groups:
                llm.abort(rid)
        if not llm.has_unfinished():             # the freed pages are news to the others
            for other in conns:
                try:
                    other.send(("stats", engine_stats(llm, timer)))
                except (BrokenPipeError, OSError):
                    pass

    def handle(c, kind, rest) -> str | None:
        if kind == "stop":
            conn.send(("stopped",))
            return "stop"
        if kind == "close":                      # an API server leaves
            drop(c)
            c.send(("stopped",))
            c.close()
            return "closed"
        if kind == "add":
            rid, prompt, params = rest
            try:
                llm.add_request(prompt, params, request_id=rid)
                owner[rid] = c
                c.send(("added", rid))
            except RequestError as e:
                c.send(("rejected", rid, str(e)))
        elif kind == "abort" and rest[0] in llm.groups:
            llm.abort(rest[0])
            owner.pop(rest[0], None)
            sent.pop(rest[0], None)
            if not llm.has_unfinished():     # no step will report the freed pages
                c.send(("stats", engine_stats(llm, timer)))
        return None

    # GPULAB_ENGINE_PROFILE=path: cProfile the serving loop, stats written to path at stop
    # (a debugging aid for where the engine process's time goes; it slows the loop)
    profiler = None
    if os.environ.get("GPULAB_ENGINE_PROFILE"):
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        with frozen_heap():
            while True:
                while not joined.empty():
                    c = joined.get()
                    conns.append(c)
                    c.send(("ready", engine_stats(llm, timer)))
                if llm.has_unfinished():                 # between steps: a poll per link (wait()
                    ready = [c for c in conns if c.poll()]   # builds a selector at every call)
                else:                                    # idle: sleep until a command comes
                    ready = multiprocessing.connection.wait(conns, timeout=0.05)
                for c in ready:
                    try:
                        while c.poll():
                            kind, *rest = c.recv()
                            done = handle(c, kind, rest)
                            if done == "stop":
                                if listener is not None:
                                    listener.close()
                                return
                            if done == "closed":
                                break
                    except (EOFError, OSError):
                        if c is conn:                    # the parent is gone
                            return
                        drop(c)
                if not llm.has_unfinished():
                    continue
                due = clock.due()
                try:
                    outputs = timer.step(llm, finished_only=not due, first_tokens=True)
                except Exception as e:               # a bug, not a bad request: fail what is running, go on
                    traceback.print_exc()
                    for rid in list(llm.groups):
                        llm.abort(rid)
                    for c in conns:
                        try:
                            c.send(("failed", f"the engine failed a step: {type(e).__name__}: {e}"))
                        except (BrokenPipeError, OSError):
                            pass                         # found gone at its next recv
                    owner.clear()
                    sent.clear()
                    continue
                stats = engine_stats(llm, timer)
                by_conn: dict = {}
                for d in step_deltas(outputs, sent):
                    c = owner.pop(d[0], None) if d[2] else owner.get(d[0])
                    if c is not None:
                        by_conn.setdefault(c, []).append(d)
                # every API server's /metrics shows the engine's gauges: all hear of them when
                # the reports are due, and when the engine goes idle (its freed pages)
                idle = not llm.has_unfinished()
                for c in conns:
                    if c in by_conn or due or idle:
                        try:
                            c.send(("outputs", by_conn.get(c, []), stats))
                        except (BrokenPipeError, OSError):
                            pass                         # found gone at its next recv
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.environ["GPULAB_ENGINE_PROFILE"])


def build_llm(model: str = "shipped", dtype: str | None = None, **config) -> LLM:
    """An engine serving ``model`` ("shipped", "tiny" or "random:...", as
    :func:`gpulab.engine.serve_bench.build_model` reads it; ``dtype`` e.g. "bfloat16") with
    these :class:`EngineConfig` fields. ``functools.partial(build_llm, ...)`` is what an
    :class:`EngineProcess` needs: it pickles, and the process builds the engine itself."""
    return LLM(build_model(model, dtype=None if dtype is None else getattr(torch, dtype)), EngineConfig(**config))


# -- metrics ------------------------------------------------------------------------------------------
class ServerMetrics:
    def __init__(self, engine: "EngineLoop | EngineProcess"):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gpulab_requests", "completion requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("gpulab_prompt_tokens", "prompt tokens received", registry=r)
        self.generated_tokens = Counter("gpulab_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("gpulab_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.e2e = Histogram("gpulab_request_latency_seconds", "arrival to last token", registry=r,
                             buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        for key, name, doc in (("pages_used", "kv_pages_used", "KV pages held by requests"),
                               ("pages_total", "kv_pages_total", "KV pages in the pool"),
                               ("running", "requests_running", "requests in the running batch"),
                               ("waiting", "requests_waiting", "requests waiting for pages"),
                               ("steps", "engine_steps", "engine steps run"),
                               ("busy_seconds", "engine_busy_seconds", "seconds the engine spent in steps"),
                               ("prompt_busy_seconds", "engine_prompt_busy_seconds",
                                "seconds the engine spent in steps that carried prompt tokens"),
                               ("prompt_steps", "engine_prompt_steps",
                                "engine steps that carried prompt tokens (the others only decoded)"),
                               ("hit_rate", "prefix_cache_hit_rate", "prompt tokens found in the prefix cache")):
            Gauge(f"gpulab_{name}", doc, registry=r).set_function(lambda key=key: engine.stats()[key])

    def finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.requests.labels("ok").inc()
        if m is not None:
            self.generated_tokens.inc(m.num_output_tokens)
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if m.e2e is not None:
                self.e2e.observe(m.e2e)


# -- the app ------------------------------------------------------------------------------------------
class _StopWatch:
    """Finds the first stop string in a completion's text as it grows. Text that could
    still turn out to be the start of a stop string is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.sent = 0            # characters of text already returned
        self.n_tokens = 0
        self.stopped = False

    def feed(self, token_ids: list[int], final: bool = False) -> str:
        """New text from the completion's token ids so far (specials dropped; a partial
        UTF-8 character waits for its next byte unless ``final``); ends before the first
        stop string, which is not returned."""
        n = len(token_ids)       # read once: an EngineProcess's reader thread extends the list
        new = bytes(t for t in token_ids[self.n_tokens:n] if t < 256)     # meanwhile
        self.n_tokens = n
        start = max(0, len(self.text) - self.hold)
        self.text += self.decoder.decode(new, final=final)
        found = [at for at in (self.text.find(s, start) for s in self.stops) if at >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


# A streamed completion gets an event at most this often (seconds; its first at once): at
# 64 clients the event loop spent its time on one event per token per client and admitted
# new requests slowly (on a 2-core CPU with an engine of 0.6 ms steps that cost nothing,
# 64 requests took 300 ms to admit and the batch averaged 9), while text that waits a few
# ms goes out as one event (outputs are cumulative).
STREAM_INTERVAL = 0.01


def create_app(llm: LLM | None = None, model_name: str = MODEL_NAME,
               stream_interval: float = STREAM_INTERVAL, make_llm=None,
               engine_address: tuple[str, bytes] | None = None) -> FastAPI:
    """The FastAPI app; its engine thread starts with the app and stops with it.
    ``stream_interval``: the least time between two events of a streamed completion
    (0: an event per engine step). ``make_llm``: instead of ``llm``, a picklable callable
    that builds the engine in a process of its own (:class:`EngineProcess`).
    ``engine_address``: instead, (address, authkey) of an engine process that listens
    for API servers (:meth:`EngineProcess.connect`)."""
    if not isinstance(stream_interval, (int, float)) or not 0 <= stream_interval <= 1:
        raise ValueError(f"stream_interval must be between 0 and 1 second, got {stream_interval!r}")
    if (llm is not None) + (make_llm is not None) + (engine_address is not None) > 1:
        raise ValueError("give create_app an engine (llm), a way to build one in its own process (make_llm) "
                         "or the address of an engine process (engine_address), not two of them")
    holder = {}

    @asynccontextmanager
    async def lifespan(app):
        if make_llm is not None:
            engine = await asyncio.get_running_loop().run_in_executor(
                None, EngineProcess(make_llm, report_every=report_interval(stream_interval)).start)
        elif engine_address is not None:
            engine = await asyncio.get_running_loop().run_in_executor(
                None, lambda: EngineProcess.connect(*engine_address).start())
        else:
            engine = EngineLoop(llm if llm is not None else LLM(), report_interval(stream_interval)).start()
        holder["engine"], holder["metrics"] = engine, ServerMetrics(engine)
        app.state.engine = engine
        yield
        engine.stop()

    app = FastAPI(title="gpulab", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        kind = first.get("type", "")
        if kind == "json_invalid":
            msg = "the body is not valid JSON: " + first.get("msg", "")
        elif kind == "extra_forbidden":
            msg = f"unknown field {where!r}: this server accepts " + ", ".join(CompletionRequest.model_fields)
        elif kind == "missing":
            msg = f"{where} is required"
        else:
            msg = f"{where}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(msg, "invalid_request_error", where), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.get("/health")
    async def health():
        engine = holder["engine"]
        alive = engine.alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(holder["metrics"].registry).decode())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "gpulab"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        engine, metrics = holder["engine"], holder["metrics"]
        if req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist: this server serves {model_name!r}",
                           "model", code="model_not_found")
        prompt, params, stops = _prompt_of(req), _sampling_params(req), _stops(req)
        try:
            rid, sub = await engine.submit(prompt, params)
        except RequestError as e:
            metrics.requests.labels("rejected").inc()
            raise APIError(400, str(e), "prompt" if "prompt" in str(e) else None) from None
        n_prompt = len(prompt) if isinstance(prompt, list) else len(encode_prompt(prompt))
        metrics.prompt_tokens.inc(n_prompt)
        created = int(time.time())
        watches = [_StopWatch(stops) for _ in range(req.n)]

        def usage() -> dict:
            n_out = sum(w.n_tokens for w in watches)
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

        def chunk(index: int, text: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": reason}]}

        async def outputs():
            """The request's outputs until it finishes; aborts it on a stop string."""
            finished: dict[int, str] = {}
            last = None
            while True:
                if req.stream and last is not None and (wait := last + stream_interval - time.perf_counter()) > 0:
                    await sub.gather_for(wait)         # what arrives meanwhile goes out as one event
                items = await sub.take()
                last = time.perf_counter()
                for out in newest_outputs(items):
                    if out is None:
                        return
                    if isinstance(out, Exception):
                        raise out
                    for c in out.completions:
                        w = watches[c.index]
                        if c.index in finished:
                            continue
                        text = w.feed(c.token_ids, final=c.finish_reason is not None)
                        reason = "stop" if w.stopped else {"eos": "stop", "length": "length"}.get(c.finish_reason)
                        if reason:
                            finished[c.index] = reason
                        yield c.index, text, reason
                    if out.finished:
                        metrics.finished(out)
                        return
                    if len(finished) == req.n:          # every completion hit a stop string
                        engine.abort(rid)
                        return

        if req.stream:
            async def events():
                done = False
                try:
                    async for index, text, reason in outputs():
                        if text or reason:
                            yield f"data: {json.dumps(chunk(index, text, reason))}\n\n"
                    done = True
                    if (req.stream_options or {}).get("include_usage"):    # as OpenAI: no choices
                        yield f"data: {json.dumps(dict(chunk(0, '', None), choices=[], usage=usage()))}\n\n"
                    yield "data: [DONE]\n\n"
                except RuntimeError as e:
                    done = True
                    yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
                finally:
                    if not done:              # the client went away: free its pages
                        engine.abort(rid)
                        metrics.requests.labels("disconnected").inc()
            return StreamingResponse(events(), media_type="text/event-stream")

        texts, reasons = [""] * req.n, [None] * req.n
        try:
            async for index, text, reason in outputs():
                texts[index] += text
                reasons[index] = reason or reasons[index]
        except RuntimeError as e:
            raise APIError(500, str(e), type_="server_error") from None
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        echo = prompt if req.echo and isinstance(prompt, str) else ""
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": echo + t, "index": i, "logprobs": None, "finish_reason": r}
                            for i, (t, r) in enumerate(zip(texts, reasons))],
                "usage": usage()}

    return app


def plot_serving_timeline(llm: LLM):
    """What the engine did while it served: sequences per step and KV pages in use over
    time, and the distribution of time to first token and end-to-end latency."""
    import matplotlib.pyplot as plt

    steps = llm.metrics.steps
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
    if steps:
        t0 = steps[0].start
        x = [s.start - t0 for s in steps]
        a1.step(x, [s.num_seqs for s in steps], where="post", label="sequences in the batch")
        a1.step(x, [s.waiting for s in steps], where="post", label="waiting")
        a1.set_xlabel("time (s)")
        a1.set_ylabel("requests")
        a1.legend(fontsize=8, loc="upper left")
        pages = a1.twinx()
        pages.plot(x, [s.pages_used for s in steps], color="k", lw=1)
        pages.set_ylabel(f"KV pages in use (of {llm.config.num_blocks})")
    reqs = [m for m in llm.metrics.requests.values() if m.e2e is not None]
    for key, label in (("ttft", "time to first token"), ("e2e", "end-to-end latency")):
        v = sorted(getattr(m, key) * 1e3 for m in reqs if getattr(m, key) is not None)
        if v:
            a2.plot(v, [(i + 1) / len(v) for i in range(len(v))], marker=".", label=label)
    a2.set_xlabel("ms")
    a2.set_ylabel("share of requests")
    a2.legend(fontsize=8)
    fig.tight_layout()
    plt.show()


ENGINE_ADDRESS_ENV = "GPULAB_ENGINE_ADDRESS"     # how `gpulab serve --api-servers N` tells its API servers


def api_server_app() -> FastAPI:
    """One API server of ``gpulab serve --api-servers N`` (uvicorn's factory, in each of its
    worker processes): the app, linked to the engine process whose address, key and
    stream interval the parent put in the environment."""
    if ENGINE_ADDRESS_ENV not in os.environ:
        raise RuntimeError(f"api_server_app is the app of `gpulab serve --api-servers N`'s workers: that command "
                           f"starts the engine process and sets {ENGINE_ADDRESS_ENV} for them")
    address, key, interval = os.environ[ENGINE_ADDRESS_ENV].split(",")
    logging.getLogger("uvicorn.error").addFilter(quiet_lifespan_cancel)
    return create_app(engine_address=(address, bytes.fromhex(key)), stream_interval=float(interval))


def quiet_lifespan_cancel(record: logging.LogRecord) -> bool:
    """A log filter for uvicorn's workers. Ctrl-C in a terminal reaches every worker as
    well as their supervisor; a worker shuts down cleanly, re-raises the signal, and its
    finished lifespan task is cancelled, which uvicorn logs as an error with two
    tracebacks (a known uvicorn race, Kludex/uvicorn#2367). Nothing failed: that record
    is dropped, every other one kept."""
    return not (record.exc_info and record.exc_info[0] is asyncio.CancelledError)


def main(argv=None) -> int:
    """``gpulab serve [--host H] [--port P] [--pages N] [--max-num-seqs B] [--stream-interval S]
    [--engine-process] [--api-servers N] [--multi-step K] [--scheduler-delay-factor F]``."""
    ap = argparse.ArgumentParser(prog="gpulab serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--pages", type=int, default=None, help="KV pages in the pool (default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests in one step, the running batch (default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the token budget of one step (default: the engine's)")
    ap.add_argument("--stream-interval", type=float, default=STREAM_INTERVAL,
                    help=f"least seconds between two events of a streamed completion (default {STREAM_INTERVAL})")
    ap.add_argument("--engine-process", action="store_true",
                    help="step the engine in a process of its own (no GIL shared with the HTTP side)")
    ap.add_argument("--api-servers", type=int, default=1,
                    help="HTTP processes feeding one engine process (more than 1 implies --engine-process): "
                         "one event loop handles a few hundred requests a second")
    ap.add_argument("--multi-step", type=int, default=1,
                    help="decode steps per host step for decode-only batches (default 1: one; "
                         "see gpulab.engine.multi_step)")
    ap.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                    help="while requests run, admit new ones once the oldest has waited this many times "
                         "the last step with prompts (default 0: at once): clients that arrive one by one "
                         "are admitted together, at some cost in time to first token (see gpulab.engine.scheduler)")
    args = ap.parse_args(argv)
    if not 0 <= args.stream_interval <= 1:
        ap.error("--stream-interval must be between 0 and 1 second")
    if args.api_servers < 1:
        ap.error("--api-servers must be at least 1")
    if args.multi_step < 1:
        ap.error("--multi-step must be at least 1 (1: one decode step per host step)")
    if not 0 <= args.scheduler_delay_factor < float("inf"):
        ap.error("--scheduler-delay-factor must be a number >= 0 (0: admit at once)")
    config = {key: v for key, v in (("num_blocks", args.pages), ("max_num_seqs", args.max_num_seqs),
                                    ("max_num_batched_tokens", args.max_num_batched_tokens),
                                    ("multi_step", args.multi_step if args.multi_step != 1 else None),
                                    ("scheduler_delay_factor", args.scheduler_delay_factor)) if v}
    try:
        EngineConfig(**config)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    url = f"http://{args.host}:{args.port}/v1"
    if args.api_servers > 1:
        import shutil
        import tempfile
        folder = tempfile.mkdtemp(prefix="gpulab-engine-")       # only this user may connect
        address = os.path.join(folder, "socket")
        key = secrets.token_bytes(16)
        engine = EngineProcess(functools.partial(build_llm, "shipped", **config), listen=(address, key),
                               report_every=report_interval(args.stream_interval)).start()
        os.environ[ENGINE_ADDRESS_ENV] = f"{address},{key.hex()},{args.stream_interval}"
        print(f"serving {MODEL_NAME} on {url}: {args.api_servers} API servers, one engine process (Ctrl-C stops)")
        try:
            uvicorn.run(f"{__name__}:api_server_app", factory=True, workers=args.api_servers,
                        host=args.host, port=args.port, log_level="warning")
        finally:
            engine.stop()
            shutil.rmtree(folder, ignore_errors=True)
        return 0
    if args.engine_process:
        app = create_app(make_llm=functools.partial(build_llm, "shipped", **config),
                         stream_interval=args.stream_interval)
    else:
        app = create_app(LLM(**config), stream_interval=args.stream_interval)
    print(f"serving {MODEL_NAME} on {url} (Ctrl-C stops)")
    with frozen_heap():    # the start-up heap stays out of every garbage collection while serving
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

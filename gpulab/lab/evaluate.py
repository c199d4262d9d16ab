"""The evaluator: is a candidate kernel correct, and how fast is it? Without being fooled.

Everything a generated kernel claims rests on the evaluator, and evaluators have been
gamed (a widely reported automatically generated "speed-up" read the result the
reference had left in memory). So each candidate runs in **its own process**
(:mod:`gpulab.lab.worker`), with a wall-time and a memory limit: a candidate that hangs,
crashes or eats memory is a failed candidate, never a hung evaluator (what the limits
cover: :class:`Evaluator`). This process
makes the inputs, keeps its own copy, and computes the reference only after the
candidate's process has reported; the candidate never sees it.

Correctness uses gpulab's checks on every correctness case of the task's spec, in every
dtype, each case twice with fresh seeds: inputs inside NaN guard regions, outputs
poisoned and guarded, inputs verified unchanged, outputs compared with the float64
reference. Then the defences, each naming the cheat it caught (:data:`REASONS`):

* a result computed for earlier inputs (``cached-output``): each trial has fresh
  inputs and fresh output buffers; a wrong output equal to an earlier trial's answer
  is named as such;
* answers hard-coded for one seed's inputs (``seed-dependent``): fresh seeds, and a
  wrong output equal to the answer for seed 0, 1 or 42 is named;
* output re-pointed at other memory (``aliased-output``) or written into the inputs
  (``input-modified``); stores outside the output (``out-of-bounds-write``);
* work left running after the call returns (``async-launch``): threads still alive, and
  on a GPU a wall-clock run with a device-wide synchronise far slower than the events
  (twice over: the worker times both again before reporting such a gap);
  timed calls that do not reproduce the untimed result (``timing-mismatch``);
* reading the evaluator's frames or objects (``reads-evaluator-memory``), replacing
  functions of torch, triton or gpulab (``monkeypatch``), network, subprocesses,
  signals or file writes outside the scratch space (``forbidden-call``).

Speed: on a GPU, the candidate is timed on the task's timing case; the eager PyTorch
function and its ``torch.compile`` version are timed the same way on the same inputs
in a process of their own. :func:`fast_p` is KernelBench's metric over a suite: the
fraction of tasks whose candidate is correct *and* at least p times faster. On a CPU,
the fitness is the stated cost model of :mod:`gpulab.lab.costmodel`.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..harness.checking import Guarded, diagnose
from ..harness.spec import Case, generator
from . import candidate as cand
from . import costmodel, worker
from .compile_candidate import compile_in_subprocess
from .tasks import Task, get_task

REASONS = {
    "correct": "correct on every case",
    "wrong-output": "an output is wrong",
    "cached-output": "returns a result computed for earlier inputs instead of computing from its own",
    "seed-dependent": "returns answers that fit one fixed seed's inputs, not the inputs it was given",
    "aliased-output": "re-points its output tensor at other memory instead of writing into it",
    "input-modified": "writes into its inputs (an in-place or aliased result)",
    "out-of-bounds-write": "writes outside its output",
    "async-launch": "leaves work running after it returns, so a timer stops before the work ends",
    "timing-mismatch": "does different work when timed than when checked",
    "reads-evaluator-memory": "inspects the evaluator's frames or objects (where a reference result could be)",
    "monkeypatch": "replaces functions of torch, triton or gpulab inside its process",
    "forbidden-call": "uses the network, subprocesses, signals or writes files outside its scratch space",
    "import-error": "does not import",
    "compile-error": "does not compile for a GPU (though the interpreter may run it)",
    "raised": "raises an exception when called",
    "timeout": "does not finish within the time limit (a hang)",
    "crash": "kills its own process (a crash)",
    "memory": "uses more memory than allowed",
    "unfinished": "was stopped unjudged: the caller's time ran out (not the candidate's fault)",
}
CHEATS = ("cached-output", "seed-dependent", "aliased-output", "async-launch", "timing-mismatch",
          "reads-evaluator-memory", "monkeypatch", "forbidden-call")
FIXED_SEEDS = (0, 1, 42)


@dataclass
class Verdict:
    """What the evaluator concluded about one candidate."""
    task: str
    candidate: str                      # the candidate's id
    status: str                         # correct | rejected | error | timeout | crash | memory | unfinished
    reason: str                         # a key of REASONS
    message: str
    trials: int = 0
    max_error: float = 0.0
    time_ms: float | None = None        # GPU: median time on the timing case
    eager_ms: float | None = None
    compiled_ms: float | None = None
    cost_ms: float | None = None        # CPU: the cost model's time
    cost: dict = field(default_factory=dict)
    wall_s: float = 0.0                 # the evaluation's wall time, shared among those run at once
    startup_s: float = 0.0              # waiting for its process to start (no candidate code yet)
    run_s: float = 0.0                  # its run, as counted against the time limit

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    @property
    def cheat(self) -> bool:
        return self.reason in CHEATS

    @property
    def fitness_ms(self) -> float:
        """Lower is better: measured time on a GPU, else the cost model; inf if rejected."""
        if not self.correct:
            return float("inf")
        if self.time_ms is not None:
            return self.time_ms
        return self.cost_ms if self.cost_ms is not None else float("inf")

    def speedup(self, against: str = "eager") -> float | None:
        base = self.eager_ms if against == "eager" else self.compiled_ms
        if base is None or self.time_ms is None or not self.correct:
            return None
        return base / self.time_ms

    def summary(self) -> str:
        head = "✔ correct" if self.correct else f"✘ {self.status}: {self.reason}"
        parts = [f"{self.task} {self.candidate}: {head}"]
        if self.time_ms is not None:
            parts.append(f"{self.time_ms * 1e3:.1f} µs")
            for b in ("eager", "compiled"):
                s = self.speedup(b)
                if s is not None:
                    parts.append(f"{s:.2f}× vs {b}")
        if self.cost_ms is not None and self.correct:
            parts.append(f"model {self.cost_ms * 1e3:.1f} µs")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return self.summary() + ("" if self.correct else "\n" + self.message)


class EvaluatorError(RuntimeError):
    pass


# -- processes -----------------------------------------------------------------------------
CHECK_S = 0.02        # how often the evaluator checks its workers' messages and limits
EXIT_GRACE_S = 5.0    # a process that closed its pipe has this long to exit (else: killed, a crash)


class _Worker:
    def __init__(self, process, conn):
        self.process = process
        self.conn = conn
        self.ready = False
        self.rss_ready = 0.0

    def check_ready(self) -> bool:
        """Has the process said it is ready? (Never waits.) A process that died starting,
        or said something else, is killed: EvaluatorError."""
        if self.ready:
            return True
        if not self.conn.poll(0):
            if self.alive():
                return False
            msg = None
        else:
            try:
                msg = self.conn.recv_bytes()
            except (EOFError, OSError):
                msg = None
        if msg != b"ready":
            self.kill()
            raise EvaluatorError("a worker process died or misbehaved while starting")
        self.ready = True
        self.rss_ready = worker.rss_mb(self.process.pid)
        return True

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL the process group, without waiting for it to exit (a CUDA process can
        take seconds to tear down, and the evaluator has other workers to watch):
        multiprocessing reaps it when the next process starts, or at exit."""
        if self.process.pid is not None:
            worker.kill_group(self.process.pid)
        self.conn.close()


class WorkerPool:
    """One process per job, the next ones started ahead of time. On a CPU the processes
    are forked from a server that has already imported torch and gpulab
    (``forkserver``), so a worker starts in milliseconds; with a GPU they are spawned
    fresh (CUDA cannot be used in a forked process), import and initialise CUDA in the
    background while earlier candidates run."""

    def __init__(self, memory_mb: float):
        self.memory_mb = memory_mb
        method = "spawn" if runtime.mode() == "compiled" else "forkserver"
        self.ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            self.ctx.set_forkserver_preload([worker.__name__])
        self.spares: list[_Worker] = []

    def _start(self) -> _Worker:
        parent, child = self.ctx.Pipe()
        # Not a daemon: torch.compile (the baselines) starts compile workers of its own.
        # Every worker is killed when its job ends, and the spares by close().
        p = self.ctx.Process(target=worker.worker_main, args=(child, self.memory_mb), daemon=False,
                             name="gpulab-lab-worker")
        # A worker needs nothing from the caller's __main__; without this, multiprocessing
        # would re-run a calling script that lacks an `if __name__ == "__main__"` guard.
        main = sys.modules["__main__"]
        saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
        try:
            main.__spec__ = None
            main.__dict__.pop("__file__", None)
            p.start()
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
        child.close()
        return _Worker(p, parent)

    def get(self) -> _Worker:
        while self.spares:
            w = self.spares.pop(0)
            if w.alive():
                return w
            w.kill()
        return self._start()

    def prestart(self, n: int = 1) -> None:
        """Keep ``n`` workers starting up (or ready) for the next jobs."""
        self.spares = [w for w in self.spares if w.alive()]
        while len(self.spares) < n:
            self.spares.append(self._start())

    def close(self) -> None:
        # kill every spare first, then wait: a CUDA process takes seconds to tear down,
        # and waiting for each in turn kept lab-bench 16 s and more past its last line
        for w in self.spares:
            w.kill()
        deadline = time.monotonic() + 5
        for w in self.spares:
            w.process.join(max(0.0, deadline - time.monotonic()))
        self.spares = []


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


# -- the evaluator ----------------------------------------------------------------------------
class Evaluator:
    """Evaluates candidates for the lab's tasks, each in a fresh process.

    ``cases``/``dtypes`` narrow the correctness cases (tests and demos; the default is
    every case of the spec for this machine, in every dtype); ``repeats`` is how many
    fresh seeds each case gets (its first dtype). ``time`` (default: on a GPU) times the
    candidate and ``cost_model`` (default: on a CPU) runs the cost model. ``parallel``
    candidates are evaluated at once by :meth:`evaluate_many` (default: up to 4 on a GPU
    host, their timing never overlapping; 1 on a CPU). ``timing_cases`` replaces a task's
    timing case ({task: Case}) and ``timing_reps`` fixes the number of timed calls. On a
    CPU, ``compile_targets`` (e.g. ``(75, 80, 90)``) also compiles each correct candidate
    for those GPUs (:mod:`gpulab.lab.compile_candidate`; ``compile_cases``: only the
    first N GPU cases).

    Limits. ``timeout_s`` (default 180 s on a GPU, 60 s on a CPU) is the wall clock a
    candidate's run may take: from its job reaching its process (CUDA already
    initialised there) to its report, importing the candidate, compiling its kernels,
    every trial and the timing included; only time spent queued for the GPU while
    another candidate is timed is not counted (that one is bounded by its own limit).
    Starting a process (spawning it, importing torch, Triton and gpulab, initialising
    CUDA) runs no candidate code, is done ahead of time while earlier candidates run,
    and has a bound of its own, ``startup_s`` (default 300 s), past which
    :class:`EvaluatorError` says the machine is overloaded. So a candidate's evaluation
    ends within ``startup_s + timeout_s`` (plus, when several are timed at once, their
    turns on the GPU) and the evaluator's own work: making inputs, judging. Each
    verdict records its ``startup_s`` and ``run_s``. ``memory_mb`` is the memory a
    candidate may add on the host and, on a GPU, also the most it may allocate there
    (besides its share of the device among the parallel workers, ``gpu_memory_fraction``).
    """

    def __init__(self, *, timeout_s: float | None = None, memory_mb: float | None = None,
                 cases: dict | list | None = None, dtypes: list | None = None, repeats: int = 2,
                 time: bool | None = None, cost_model: bool | None = None, baselines: bool = True,
                 workdir: str | Path | None = None, seed: int | None = None, entry: str = "launch",
                 verify_timing_outputs: bool = True, gpu_memory_fraction: float | None = None,
                 parallel: int | None = None, timing_cases: dict | None = None, timing_reps: int | None = None,
                 compile_targets: tuple | None = None, compile_cases: int | None = None,
                 startup_s: float | None = None):
        gpu = runtime.mode() == "compiled"
        # Several candidates at once on a GPU host (compiling is the slow part, and it runs
        # on the CPU); one at a time on a CPU, where the interpreter needs every core.
        self.parallel = max(1, parallel or (min(4, max(1, (os.cpu_count() or 1) // 4)) if gpu else 1))
        gpu_memory_fraction = gpu_memory_fraction or 0.8 / self.parallel
        self.timeout_s = timeout_s or (180.0 if gpu else 60.0)
        self.startup_s = startup_s or 300.0
        self.memory_mb = memory_mb or (16384.0 if gpu else 2048.0)
        self.cases = cases
        self.dtypes = dtypes
        self.repeats = max(1, repeats)
        self.time = gpu if time is None else time
        if self.time and not gpu:
            raise EvaluatorError("timing needs a GPU: on a CPU use the cost model (cost_model=True)")
        self.cost_model = (not gpu) if cost_model is None else cost_model
        if self.cost_model and runtime.mode() != "interpreter":
            raise EvaluatorError("the cost model measures kernels in Triton's interpreter: on a GPU, time them")
        self.with_baselines = baselines
        self.device = "cuda" if gpu else "cpu"
        self.own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gpulab-lab-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.entry = entry
        self.verify_timing_outputs = verify_timing_outputs
        self.gpu_memory_fraction = gpu_memory_fraction
        self.rng_seed = seed
        self.timing_cases = timing_cases or {}
        self.compile_targets = tuple(compile_targets or ())
        self.compile_cases = compile_cases
        self.timing_reps = timing_reps
        self._seed_counter = 0
        self.pool = WorkerPool(self.memory_mb)
        self._timing: dict = {}
        self._baselines: dict = {}
        self._timing_ref: dict = {}
        atexit.register(self.close)

    # -- plumbing
    def close(self) -> None:
        self.pool.close()
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fresh_seed(self) -> int:
        if self.rng_seed is None:
            while True:
                s = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
                if s not in FIXED_SEEDS:
                    return s
        while True:
            self._seed_counter += 1
            s = (self.rng_seed * 7919 + self._seed_counter * 104729) & 0x7FFFFFFF
            if s not in FIXED_SEEDS:
                return s

    def _allowed_dirs(self) -> list[str]:
        dirs = [str(self.workdir), tempfile.gettempdir(), "/dev/shm",
                os.environ.get("TRITON_CACHE_DIR", ""), os.path.expanduser("~/.triton"),
                os.path.expanduser("~/.cache")]
        return [d for d in dirs if d]

    # -- trials
    def plan(self, task: Task) -> list[dict]:
        """The correctness trials: every case x dtype once, each case ``repeats`` times
        in all (fresh seeds), inputs made here."""
        spec = task.spec
        where = "gpu" if runtime.mode() == "compiled" else "cpu"
        cases = self.cases.get(task.name) if isinstance(self.cases, dict) else self.cases
        cases = cases if cases is not None else spec.cases[where]
        cases = [c if isinstance(c, Case) else Case(str(c), dict(c)) for c in cases]
        dtypes = self.dtypes or [d for d in spec.dtypes[where] if runtime.supports(d)]
        plan = []
        for case in cases:
            for j, dtype in enumerate(dtypes):
                plan.append(self._trial(spec, case, dtype))
        for _ in range(self.repeats - 1):
            for case in cases:
                plan.append(self._trial(spec, case, dtypes[0]))
        return plan

    def _trial(self, spec, case, dtype) -> dict:
        seed = self._fresh_seed()
        inputs = spec.make_inputs(case.params, dtype, torch.device("cpu"), generator(seed, "cpu"))
        return {"label": case.label, "params": case.params, "dtype": str(dtype).replace("torch.", ""),
                "seed": seed, "inputs": inputs}

    def _timing_job(self, task: Task) -> dict:
        if task.name not in self._timing:
            seed = self._fresh_seed()
            case, dtype = self.timing_cases.get(task.name, task.bench_case), task.bench_dtype
            inputs = task.spec.make_inputs(case.params, dtype, torch.device("cpu"), generator(seed, "cpu"))
            path = self.workdir / f"timing_{task.name}_{seed}.pt"
            torch.save(inputs, path)
            self._timing[task.name] = {"inputs_path": str(path), "params": case.params,
                                       "dtype": str(dtype).replace("torch.", ""), "seed": seed,
                                       "reps": self.timing_reps}
        return self._timing[task.name]

    # -- running
    def _run(self, job: dict, timeout: float) -> tuple[str, object, dict]:
        return self._run_many([job], timeout)[0]

    def _run_many(self, jobs: list[dict], timeout: float,
                  stop_after_s: float | None = None) -> list[tuple[str, object, dict]]:
        """Run jobs in up to ``parallel`` worker processes at once: [(outcome, info, times)].

        A job is handed to its worker once that process is ready (start-up, bounded by
        ``startup_s``); from then on the worker has ``timeout`` seconds of wall clock, not
        counting time spent waiting for the GPU grant, and is killed when it reports, dies,
        outlives that or grows past the memory limit. Nothing here waits on one worker:
        every worker's messages and limits are checked every :data:`CHECK_S`. Timing on
        the GPU is granted to one worker at a time: its measurements are never overlapped
        by another candidate's timing. After ``stop_after_s`` seconds the jobs not yet
        finished end as "unfinished"."""
        t_call = _now()
        pending = list(range(len(jobs)))
        running: dict[int, dict] = {}
        results: list = [None] * len(jobs)
        queue: list[int] = []
        holder = None

        def counted(i, r, now) -> float:      # the time that counts against the limit
            if r["start"] is None:            # stopped before its worker took the job
                return 0.0
            asked = r["gpu_asked"]
            return now - r["start"] - r["gpu_wait"] - (now - asked if asked is not None and holder != i else 0.0)

        def finish(i, outcome, info):
            nonlocal holder
            r = running.pop(i)
            results[i] = (outcome, info, {"startup_s": r["startup_s"], "run_s": counted(i, r, _now()),
                                          "gpu_wait_s": r["gpu_wait"]})
            r["worker"].kill()
            if holder == i:
                holder = None
            if i in queue:
                queue.remove(i)

        try:
            while pending or running:
                if stop_after_s is not None and _now() - t_call > stop_after_s:
                    for i in list(running):
                        finish(i, "unfinished", _now() - t_call)
                    for i in pending:
                        results[i] = ("unfinished", _now() - t_call, {"startup_s": 0.0, "run_s": 0.0,
                                                                     "gpu_wait_s": 0.0})
                    pending = []
                    break
                while pending and len(running) < self.parallel:
                    i = pending.pop(0)
                    asked = _now()          # before get(): the first forkserver start waits for its imports
                    running[i] = {"worker": self.pool.get(), "asked": asked, "replaced": False, "start": None,
                                  "startup_s": 0.0, "gpu_wait": 0.0, "gpu_asked": None, "eof": None}
                self.pool.prestart(self.parallel)   # the next candidates' processes start meanwhile
                busy = False
                for i, r in list(running.items()):
                    w = r["worker"]
                    now = _now()
                    if r["start"] is None:
                        busy |= self._hand_over(r, jobs[i])
                        continue
                    if r["eof"] is None and w.conn.poll(0):
                        busy = True
                        try:
                            msg = w.conn.recv_bytes()
                        except (EOFError, OSError):
                            msg = None
                        if msg == b"done":
                            finish(i, "done", None)
                        elif msg == worker.ASK_GPU:
                            r["gpu_asked"] = now
                            queue.append(i)
                        elif msg == worker.GPU_DONE:
                            if holder == i:
                                holder = None
                        elif msg is None:     # the pipe closed: the process is dying
                            r["eof"] = now
                        else:
                            finish(i, "crash", None)
                        continue
                    if not w.alive():
                        finish(i, "crash", w.process.exitcode)
                        continue
                    if r["eof"] is not None:
                        if now - r["eof"] > EXIT_GRACE_S:     # closed its pipe, yet lives on
                            finish(i, "crash", None)
                        continue
                    if counted(i, r, now) > timeout:
                        finish(i, "timeout", timeout)
                        continue
                    rss = worker.rss_mb(w.process.pid)
                    if rss - w.rss_ready > self.memory_mb:
                        finish(i, "memory", rss - w.rss_ready)
                if holder is None and queue:
                    holder = queue.pop(0)
                    r = running[holder]
                    r["gpu_wait"] += _now() - r["gpu_asked"]
                    r["gpu_asked"] = None
                    r["worker"].conn.send_bytes(worker.GRANT_GPU)
                    busy = True
                if not busy:
                    time.sleep(CHECK_S)
        finally:
            for r in running.values():       # an EvaluatorError (or Ctrl-C): leave no worker behind
                r["worker"].kill()
        return results

    def _hand_over(self, r: dict, job: dict) -> bool:
        """Give ``job`` to the slot's worker once that process is ready. Its start-up
        (spawning it, importing torch, Triton and gpulab, initialising CUDA) runs no
        candidate code and is bounded on its own, by ``startup_s``; a worker that dies
        starting is replaced once."""
        w = r["worker"]
        try:
            ready = w.check_ready()
        except EvaluatorError:
            if r["replaced"]:
                raise
            r["worker"], r["replaced"] = self.pool.get(), True
            return True
        if ready:
            r["start"] = _now()
            r["startup_s"] = r["start"] - r["asked"]
            w.conn.send(job)
            return True
        if _now() - r["asked"] > self.startup_s:
            raise EvaluatorError(f"a worker process did not start within {self.startup_s:.0f} s (spawning it, "
                                 f"importing torch, Triton and gpulab): is the machine overloaded?")
        return False

    def _prepare(self, task: Task, c: cand.Candidate, timed: bool, modelled: bool) -> tuple[dict, list]:
        path = cand.write(c, self.workdir / "candidates")
        trials = self.plan(task)
        result_path = self.workdir / f"result_{c.id}_{os.getpid()}_{self._fresh_seed()}.pt"
        job = {"kind": "candidate", "task": task.name, "candidate_path": str(path), "entry": self.entry,
               "device": self.device, "result_path": str(result_path), "allowed_dirs": self._allowed_dirs(),
               "cost_model": modelled, "gpu_memory_fraction": self.gpu_memory_fraction,
               "gpu_memory_mb": self.memory_mb,
               "trials": trials, "timing": self._timing_job(task) if timed else None}
        return job, trials

    def evaluate(self, task: Task | str, candidate: cand.Candidate | str | Path, *,
                 time: bool | None = None, cost_model: bool | None = None) -> Verdict:
        """Evaluate one candidate (a Candidate, its source text, or a file path)."""
        return self.evaluate_many(task, [candidate], time=time, cost_model=cost_model)[0]

    def evaluate_many(self, task: Task | str, candidates: list, *, time: bool | None = None,
                      cost_model: bool | None = None, stop_after_s: float | None = None) -> list[Verdict]:
        """Evaluate several candidates of one task, ``parallel`` processes at a time."""
        return self.evaluate_pairs([(task, c) for c in candidates], time=time, cost_model=cost_model,
                                   stop_after_s=stop_after_s)

    def evaluate_pairs(self, pairs: list, *, time: bool | None = None,
                       cost_model: bool | None = None, stop_after_s: float | None = None) -> list[Verdict]:
        """Evaluate (task, candidate) pairs, ``parallel`` processes at a time.

        ``stop_after_s``: the caller's own limit (a search's budget). Candidates not
        judged by then are stopped and get the verdict ``unfinished``, which says nothing
        about them: a search leaves them out instead of counting them as hangs."""
        pairs = [(get_task(t) if isinstance(t, str) else t, c) for t, c in pairs]
        pairs = [(t, _as_candidate(t, c)) for t, c in pairs]
        timed = self.time if time is None else time
        modelled = self.cost_model if cost_model is None else cost_model
        if timed and self.with_baselines:     # before the candidates: the slow part (torch.compile)
            self.prefetch_baselines(list({t.name: t for t, _ in pairs}.values()))
        prepared = [self._prepare(t, c, timed, modelled) for t, c in pairs]
        t0 = _now()
        outcomes = self._run_many([job for job, _ in prepared], self.timeout_s, stop_after_s)
        wall = (_now() - t0) / max(1, len(pairs)) * min(len(pairs), self.parallel)
        verdicts = []
        for (task, c), (job, trials), (outcome, info, times) in zip(pairs, prepared, outcomes):
            verdict = self._verdict(task, c, job, trials, outcome, info)
            verdict.startup_s, verdict.run_s = times["startup_s"], times["run_s"]
            Path(job["result_path"]).unlink(missing_ok=True)
            if verdict.correct and self.compile_targets and runtime.mode() == "interpreter":
                verdict = self._compiled(task, c, job, verdict)
            verdict.wall_s = wall
            if verdict.correct and timed and self.with_baselines:
                base = self.baselines(task)
                verdict.eager_ms, verdict.compiled_ms = base.get("eager"), base.get("compiled")
            verdicts.append(verdict)
        return verdicts

    def _compiled(self, task, c, job, verdict: Verdict) -> Verdict:
        got = compile_in_subprocess(task.name, job["candidate_path"], self.compile_targets, self.compile_cases,
                                    timeout_s=max(600.0, self.timeout_s))
        if got["ok"]:
            verdict.cost = {**verdict.cost, "compiled_for": list(self.compile_targets), "compilations": got["compiled"]}
            return verdict
        return _reject(task, c, "compile-error",
                       f"the candidate is correct in Triton's interpreter but does not compile for "
                       f"{', '.join(f'sm_{a}' for a in self.compile_targets)}:\n  " + "\n  ".join(got["failures"][:3]),
                       trials=verdict.trials, max_error=verdict.max_error)

    def _verdict(self, task, c, job, trials, outcome, info) -> Verdict:
        if outcome == "unfinished":
            return Verdict(task.name, c.id, "unfinished", "unfinished",
                           f"unfinished: stopped after {info:.0f} s, when the caller's time ran out, "
                           f"before it could be judged.")
        if outcome == "timeout":
            return Verdict(task.name, c.id, "timeout", "timeout",
                           f"timeout: the candidate did not finish within {info:.0f} s, so its process "
                           f"was killed (an endless loop in the launcher or the kernel?).")
        if outcome == "memory":
            return Verdict(task.name, c.id, "memory", "memory",
                           f"memory: the candidate's process grew by {info:.0f} MiB (limit "
                           f"{self.memory_mb:.0f} MiB), so it was killed.")
        if outcome == "crash":
            how = (f"was killed by {_signal_name(info)}" if isinstance(info, int) and info < 0
                   else f"exited with status {info}" if isinstance(info, int)
                   else "stopped answering the evaluator")
            return Verdict(task.name, c.id, "crash", "crash",
                           f"crash: the candidate's process {how} before reporting (a segfault, an "
                           f"illegal memory access, os._exit...). The evaluator itself is unharmed.")
        try:
            report = torch.load(job["result_path"], weights_only=True)
        except Exception as e:
            report = {"error": {"stage": "result", "type": type(e).__name__,
                                "message": f"the result file is unreadable: {e}", "traceback": ""}}
        return judge(task, c, trials, report, self)

    def baselines(self, task: Task | str) -> dict:
        """Eager and torch.compile times (ms) of the task's PyTorch function, GPU only."""
        task = get_task(task) if isinstance(task, str) else task
        return self.prefetch_baselines([task])[task.name]

    def prefetch_baselines(self, tasks: list) -> dict:
        """Time the baselines of several tasks in one process (torch.compile's start-up
        cost is paid once); results are cached per task."""
        tasks = [get_task(t) if isinstance(t, str) else t for t in tasks]
        todo = [t for t in tasks if t.name not in self._baselines]
        if todo:
            if runtime.mode() != "compiled":
                raise EvaluatorError("baselines are timed on a GPU")
            result_path = self.workdir / f"baselines_{os.getpid()}_{self._fresh_seed()}.pt"
            job = {"kind": "baselines", "tasks": [t.name for t in todo], "device": self.device,
                   "result_path": str(result_path), "timings": {t.name: self._timing_job(t) for t in todo}}
            outcome, info, _ = self._run(job, max(600.0, 120.0 * len(todo)))
            got = torch.load(result_path, weights_only=True)["baselines"] if outcome == "done" else {}
            for t in todo:
                self._baselines[t.name] = got.get(t.name, {"error": f"{outcome} ({info})"})
            result_path.unlink(missing_ok=True)
        return {t.name: self._baselines[t.name] for t in tasks}

    def timing_reference(self, task: Task) -> dict:
        """The float64 reference on the timing inputs, made once per task; for outputs of
        more than 2^20 elements, an evenly spaced sample of them: {name: (indices, values)}."""
        if task.name not in self._timing_ref:
            inputs = torch.load(self._timing[task.name]["inputs_path"], weights_only=True)
            ref = {}
            for k, exp in task.spec.reference(**inputs).items():
                flat = exp.reshape(-1)
                idx = sample_indices(flat.numel())
                ref[k] = (idx, flat.clone() if idx is None else flat[idx].clone())
            self._timing_ref[task.name] = ref
        return self._timing_ref[task.name]


SAMPLE = 1 << 20


def sample_indices(n: int, k: int = SAMPLE) -> torch.Tensor | None:
    """``k`` evenly spaced indices into ``n`` elements, the first and the last included
    (None when ``n <= k``: take them all). Integer arithmetic: ``torch.linspace`` counts
    in floats, and float32 rounds n - 1 = 2^26 - 1 up to 2^26, one past the end."""
    if n <= k:
        return None
    if k < 2:
        raise ValueError(f"a sample of {n} elements needs at least 2 indices, not {k}")
    return torch.arange(k, dtype=torch.int64) * (n - 1) // (k - 1)


def _now() -> float:
    return time.monotonic()


def _as_candidate(task: Task, candidate) -> cand.Candidate:
    if isinstance(candidate, cand.Candidate):
        return candidate
    if isinstance(candidate, Path) or (isinstance(candidate, str) and "\n" not in candidate
                                       and candidate.endswith(".py")):
        src = Path(candidate).read_text()
    else:
        src = str(candidate)
    return cand.Candidate(task=task.name, source=src, genes=cand.genes_of(src), operator="given",
                          proposer="given")


# -- judging (in this process; the reference is computed here, after the candidate ran) -------
def _close(got: torch.Tensor, exp: torch.Tensor, atol: float, rtol: float) -> bool:
    if tuple(got.shape) != tuple(exp.shape):
        return False
    return bool(torch.isclose(got.double(), exp.double(), atol=atol, rtol=rtol).all())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def _reject(task, c, reason, message, **kw) -> Verdict:
    status = "error" if reason in ("import-error", "raised", "compile-error") else "rejected"
    return Verdict(task.name, c.id, status, reason, f"{reason}: {message}", **kw)


def _event_verdict(task, c, events) -> Verdict:
    names = sorted({e[0] for e in events})
    seen = []
    for e, d in events:
        text = f"{e} ({d[:80]})" if d else e
        if text not in seen:
            seen.append(text)
    detail = "; ".join(seen[:4])
    reads = {"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
             "object.__getattr__", "sys.settrace", "sys.setprofile"}
    if set(names) & reads:
        return _reject(task, c, "reads-evaluator-memory",
                       f"the candidate's own code called {detail}: walking the caller's frames or the "
                       f"garbage collector's objects is how a kernel finds data it was not given, such "
                       f"as a reference result. Here the reference lives in another process, but the "
                       f"attempt alone rejects the candidate.")
    return _reject(task, c, "forbidden-call",
                   f"the candidate tried {detail}, which the evaluator refuses: a kernel has no "
                   f"business with the network, other processes or files outside its scratch space.")


def _unpack(buf, shape, dtype, like=None):
    """Check the shipped buffer's layout and rebuild a Guarded view around it."""
    g = Guarded.wrap(shape, dtype, "cpu", like=like)
    if not isinstance(buf, torch.Tensor) or buf.dtype != g.buf.dtype or buf.numel() != g.buf.numel():
        return None
    g.buf.copy_(buf.reshape(-1))
    return g


def judge(task: Task, c: cand.Candidate, trials: list[dict], report: dict, ev: Evaluator) -> Verdict:
    spec = task.spec
    if not isinstance(report, dict):
        return _reject(task, c, "raised", "the candidate's process returned no report")
    if report.get("events"):
        return _event_verdict(task, c, report["events"])
    if report.get("patched"):
        names = ", ".join(report["patched"][:6])
        return _reject(task, c, "monkeypatch",
                       f"the candidate replaced {names} in its process. Patching the functions an "
                       f"evaluator relies on (comparisons, synchronisation, timers, gpulab's checks) "
                       f"is a way to fake a result; here the verdict is reached in another process, "
                       f"but the attempt alone rejects the candidate.")
    err = report.get("error")
    if err and err.get("stage") == "import":
        return _reject(task, c, "import-error", f"importing the candidate raised {err['type']}: "
                       f"{err['message']}\n{err.get('traceback', '')[-1500:]}")
    done = report.get("trials", [])
    answers: list[tuple[int, str, torch.Tensor]] = []     # (trial, output, expected) seen so far
    worst = 0.0
    for i, t in enumerate(done):
        trial = trials[i]
        where = (f"case {trial['label']} ({', '.join(f'{k}={v}' for k, v in trial['params'].items())}), "
                 f"{trial['dtype']}, seed {trial['seed']} (trial {i + 1})")
        if t.get("repointed"):
            return _reject(task, c, "aliased-output",
                           f"after the call, output(s) {', '.join(t['repointed'])} no longer point at the "
                           f"buffer the evaluator passed ({where}): the candidate swapped the tensor's "
                           f"storage (out.set_, out.data = ...) instead of writing into it, so whoever "
                           f"reads the caller's buffer sees nothing or someone else's data.",
                           trials=i + 1)
        if t.get("threads"):
            return _reject(task, c, "async-launch",
                           f"{t['threads']} thread(s) the candidate started were still running after "
                           f"it returned and the device was synchronised ({where}): the work finishes "
                           f"later (a lazy or asynchronous launch), so a timer that stops when the call "
                           f"returns measures nothing, and a check may read the outputs too early.",
                           trials=i + 1)
        dtype = getattr(torch, trial["dtype"])
        inputs = trial["inputs"]
        outs = spec.outputs(inputs, dtype)
        problems = []
        got = {}
        for k, (shape, odt) in outs.items():
            g = _unpack(t["outputs"].get(k), shape, odt)
            if g is None:
                return _reject(task, c, "raised", f"the report of {where} has a malformed output `{k}`",
                               trials=i + 1)
            before, after = g.guard_damage()
            if before or after:
                problems.append(f"wrote {after} element(s) past the end and {before} before the start of "
                                f"output `{k}` ({where}): a store is missing its mask, or the mask lets "
                                f"through offsets ≥ the length.")
            got[k] = g.inner
        modified = []
        for k, v in inputs.items():
            if not isinstance(v, torch.Tensor):
                continue
            g = _unpack(t["inputs"].get(k), v.shape, v.dtype, like=v)
            if g is None:
                return _reject(task, c, "raised", f"the report of {where} has a malformed input `{k}`",
                               trials=i + 1)
            before, after = g.guard_damage()
            if before or after:
                problems.append(f"wrote {before + after} element(s) just outside input `{k}` ({where}).")
            if not _same_bits(g.inner, v):
                modified.append(k)
        if problems:
            return _reject(task, c, "out-of-bounds-write", "\n  ".join(problems), trials=i + 1)
        if modified:
            return _reject(task, c, "input-modified",
                           f"input(s) {', '.join(modified)} changed during the call ({where}): a kernel "
                           f"must leave its inputs alone; computing in place and aliasing the result is "
                           f"how an evaluator that computes the reference afterwards gets fooled.",
                           trials=i + 1)
        expected = spec.reference(**inputs)          # only now: the candidate has finished
        for k, exp in expected.items():
            atol, rtol = spec.tolerance(dtype, k)
            msg, error = diagnose(k, got[k], exp, atol, rtol)
            if msg:
                named = _name_wrong_answer(task, trial, k, got[k], dtype, answers, atol, rtol)
                if named:         # the generic hint would mislead: the cause is known
                    msg = "\n".join(line for line in msg.splitlines() if "Hint:" not in line)
                    return _reject(task, c, named[0], f"{named[1]}\n  ({where})\n{msg}", trials=i + 1)
                return _reject(task, c, "wrong-output", f"output `{k}` is wrong for {where}.\n{msg}",
                               trials=i + 1)
            worst = max(worst, error)
            answers.append((i, k, exp))
    if err and err.get("type") in ("CompilationError", "CompileTimeAssertionFailure", "UnsupportedLanguageConstruct"):
        return _reject(task, c, "compile-error", f"Triton could not compile the candidate: {err['message'][:1500]}",
                       trials=len(done), max_error=worst)
    if err and "illegal memory access" in err.get("message", ""):
        return _reject(task, c, "out-of-bounds-write",
                       f"the kernel accessed memory outside its buffers, beyond the guard regions (CUDA: "
                       f"{err['message'][:300]})", trials=len(done), max_error=worst)
    if err and _out_of_memory(err):
        gpu = ", and as much at most on the GPU, within its share" if ev.device == "cuda" else ""
        return Verdict(task.name, c.id, "memory", "memory",
                       f"memory: the candidate ran out of the memory it is allowed ({ev.memory_mb:.0f} MiB "
                       f"on the host{gpu}): {err['type']}: {err['message'][:300]}", trials=len(done))
    if err:
        where = f"trial {err.get('trial', len(done)) + 1}" if err.get("stage") == "trial" else err.get("stage")
        return _reject(task, c, "raised", f"the candidate raised {err['type']} in {where}: {err['message']}\n"
                       f"{err.get('traceback', '')[-1500:]}", trials=len(done), max_error=worst)
    if len(done) < len(trials):
        return _reject(task, c, "raised", f"only {len(done)} of {len(trials)} trials ran", trials=len(done))
    v = Verdict(task.name, c.id, "correct", "correct",
                f"correct on {len(done)} trials (every case and dtype, fresh seeds, guards and inputs "
                f"intact); largest error {worst:.2e}", trials=len(done), max_error=worst)
    if "cost" in report:
        est = costmodel.estimate(task, report["cost"])
        v.cost_ms, v.cost = est["ms"], est
    if report.get("timing"):
        return _judge_timing(task, c, v, report["timing"], ev)
    return v


def _out_of_memory(err: dict) -> bool:
    text = f"{err.get('type')} {err.get('message')}"
    return err.get("type") in ("MemoryError", "OutOfMemoryError") or "can't allocate memory" in text \
        or "out of memory" in text.lower()


def _name_wrong_answer(task, trial, out_name, got, dtype, answers, atol, rtol):
    """Is this wrong output the right answer to *other* inputs?"""
    for j, k, exp in reversed(answers):
        if k == out_name and _close(got, exp, atol, rtol):
            return ("cached-output", f"output `{k}` is exactly the answer of trial {j + 1} (other inputs, "
                    f"fresh buffers): the candidate returned a result it had computed before instead of "
                    f"computing from the inputs it was given.")
    spec = task.spec
    for s in FIXED_SEEDS:
        inputs = spec.make_inputs(trial["params"], dtype, torch.device("cpu"), generator(s, "cpu"))
        exp = spec.reference(**inputs)[out_name]
        if _close(got, exp, atol, rtol):
            return ("seed-dependent", f"output `{out_name}` is the answer for the inputs of seed {s}, not "
                    f"for the inputs given: the candidate depends on one fixed seed's values (answers "
                    f"baked in, or inputs recognised), which only fresh random inputs expose.")
    return None


def _judge_timing(task, c, v: Verdict, timing: dict, ev: Evaluator) -> Verdict:
    ms, wall = timing["ms"], timing["wall_ms"]
    if wall > worker.ASYNC_WALL_RATIO * ms + worker.ASYNC_WALL_SLACK_MS:
        return _reject(task, c, "async-launch",
                       f"with a device-wide synchronise after the calls it takes {wall * 1e3:.1f} µs per "
                       f"call, but only {ms * 1e3:.1f} µs between the CUDA events around each call: its "
                       f"work runs outside the timed stream (another stream, or launched later).")
    if timing.get("timed_outputs_differ"):
        return _reject(task, c, "timing-mismatch",
                       f"the outputs of its timed calls differ from those of an untimed call on the same "
                       f"inputs ({', '.join(timing['timed_outputs_differ'])}): it skips or changes work when "
                       f"called repeatedly, so its time is not the time of the kernel that was checked.")
    if ev.verify_timing_outputs:
        spec = task.spec
        dtype = getattr(torch, timing_dtype(task))
        for k, (idx, exp) in ev.timing_reference(task).items():
            got = timing["first_outputs"][k].reshape(-1)
            if got.numel() != (exp.numel() if idx is None else int(idx[-1]) + 1):
                return _reject(task, c, "wrong-output", f"output `{k}` has the wrong size at the timing size")
            got = got if idx is None else got[idx]
            atol, rtol = spec.tolerance(dtype, k)
            msg, _ = diagnose(k, got, exp, atol, rtol)
            if msg:
                sample = "" if idx is None else f" (an evenly spaced sample of {exp.numel()} elements, flattened)"
                return _reject(task, c, "wrong-output",
                               f"output `{k}` is wrong at the timing size{sample}.\n{msg}")
    v.time_ms = ms
    v.cost = {**v.cost, "wall_ms": wall, "min_ms": timing["min_ms"], "reps": timing["reps"]}
    return v


def timing_dtype(task: Task) -> str:
    return str(task.bench_dtype).replace("torch.", "")


def fast_p(verdicts: list[Verdict], p: float, against: str = "eager") -> float:
    """KernelBench's fast_p: the fraction of tasks whose candidate is correct and at least
    ``p`` times faster than the baseline (``fast_0`` = the fraction correct)."""
    if not verdicts:
        return 0.0
    hits = 0
    for v in verdicts:
        if not v.correct:
            continue
        if p <= 0:
            hits += 1
            continue
        s = v.speedup(against)
        if s is not None and s >= p:
            hits += 1
    return hits / len(verdicts)

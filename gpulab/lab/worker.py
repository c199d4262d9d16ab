"""The candidate's side of the evaluator: what runs inside the process a candidate gets.

The evaluator (:mod:`gpulab.lab.evaluate`) starts one process per candidate and sends it
one job. This module, running there, only *runs* the candidate and *records* what it
did; every verdict is reached in the evaluator's process, which never imports the
candidate:

1. before the candidate's module is imported: an audit hook (``sys.addaudithook``, which
   cannot be removed) records reads of other frames and of the garbage collector's
   object lists, refuses network connections, subprocesses, signals to other processes
   and file writes outside the scratch directories; the identity of the functions a
   cheat would patch (``torch.allclose``, ``torch.cuda.synchronize``, gpulab's checks,
   this module...) is noted;
2. each trial's inputs (made by the evaluator) are copied into the middle of guarded
   buffers, the outputs are poisoned and guarded (:class:`gpulab.harness.checking.Guarded`),
   the candidate's ``launch`` is called, the device synchronised (every stream), and the
   *whole* buffers, guards included, are sent back with what else was seen: output
   tensors re-pointed at other memory, threads left running;
3. on a CPU, the cost model's measurements (:mod:`gpulab.lab.costmodel`): bytes loaded and
   stored by the interpreter on the task's model case, and the launch geometry of a dry
   run at the timing size;
4. on a GPU, timing: CUDA events around each call with the L2 flushed and the outputs
   re-poisoned between calls, alternating between two input sets; wall-clock batches
   with a device-wide synchronise (the fastest counts) to catch work finishing outside
   the timed stream; the outputs of the timed calls compared with those of an untimed call.

Before it says it is ready, a process on a GPU initialises CUDA and Triton's launcher:
that is start-up, done ahead of time, not part of the candidate's time limit.

Results go to a file the evaluator reads with ``torch.load(weights_only=True)``: a
candidate can write anything there, but not run code in the evaluator.
"""
from __future__ import annotations

import builtins
import importlib.util
import os
import resource
import signal
import sys
import time
import traceback
import warnings
import _thread

import torch
import triton
import triton.language as tl

import gpulab  # noqa: F401  (decides the Triton mode before any candidate is imported)
from .. import runtime
from ..harness import checking, spec as spec_module
from ..harness.checking import Guarded
from . import costmodel
from .tasks import get_task

# -- what a cheat would patch: identities noted before any candidate runs --------------------
_WATCHED_MODULES = {
    "torch": torch, "torch.Tensor": torch.Tensor, "torch.cuda": torch.cuda, "torch.testing": torch.testing,
    "time": time, "builtins": builtins, "triton": triton,
    "gpulab.harness.checking": checking, "gpulab.harness.spec": spec_module, "gpulab.runtime": runtime,
    "gpulab.lab.costmodel": costmodel,
}


def _public_callables(obj) -> dict:
    out = {}
    for k, v in list(vars(obj).items()):
        if not k.startswith("__") and callable(v):
            out[k] = id(v)
    return out


def fingerprint() -> dict:
    """id() of every public function of the watched modules (and of this module)."""
    fp = {name: _public_callables(m) for name, m in _WATCHED_MODULES.items()}
    fp[__name__] = _public_callables(sys.modules[__name__])
    return fp


def patched(before: dict, after: dict) -> list[str]:
    """Watched names whose object changed or vanished (new names are not counted:
    libraries add attributes lazily)."""
    out = []
    for mod, names in before.items():
        now = after.get(mod, {})
        out += [f"{mod}.{k}" for k, v in names.items() if now.get(k) != v]
    return out


_FINGERPRINT = fingerprint()      # taken when the worker module is imported (forkserver preload)


def _warm_meta() -> None:
    """The cost model's dry run uses ``meta`` tensors, whose first use imports torch's
    meta kernels (seconds): pay that once, in the server the workers are forked from."""
    g = torch.Generator()
    x = torch.randn((4, 4), generator=g, device="meta") * torch.rand((4, 1), generator=g, device="meta")
    x[1] = 0
    (torch.sigmoid(x) + torch.linspace(0, 1, 4, device="meta")).to(torch.bfloat16).abs().sum(-1)


if runtime.interpreting():
    _warm_meta()


@triton.jit
def _warm_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _warm_gpu() -> None:
    """Initialise CUDA and Triton's launcher before the job arrives: seconds (many more
    on a loaded host) that are start-up, not the candidate's run."""
    x = torch.zeros(1, device="cuda")
    _warm_kernel[(1,)](x)
    torch.cuda.synchronize()


# -- the audit hook ---------------------------------------------------------------------------
_READS = {"sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
_TAMPER = {"sys.settrace", "sys.setprofile"}
_STDLIB = os.path.dirname(os.__file__) + os.sep
_BLOCKED = {"socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system",
            "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn"}


class _Audit:
    def __init__(self):
        self.candidate_file = None
        self.allowed_dirs: tuple = ()
        self.events: list = []
        self.busy = False

    def _from_candidate(self) -> bool:
        """Is the code that triggered the event the candidate's own? Walking up from the
        trigger, standard-library frames (inspect.currentframe, subprocess.run, socket,
        open...) are skipped; the first other frame decides. So the candidate calling
        subprocess.run counts, Triton calling ptxas while compiling the candidate's
        kernel does not."""
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name == self.candidate_file:
                return True
            stdlib = name.startswith(_STDLIB) and "-packages" not in name[len(_STDLIB):]
            if not (stdlib or name.startswith("<")):
                return False
            f = f.f_back
        return False

    def _write_allowed(self, path) -> bool:
        try:
            p = os.path.realpath(os.fsdecode(path))
        except Exception:
            return True          # file descriptors and the like
        return p == os.devnull or any(p.startswith(d) for d in self.allowed_dirs)

    def __call__(self, event, args):
        if self.candidate_file is None or self.busy:
            return
        if event not in _READS and event not in _TAMPER and event not in _BLOCKED and \
                event not in ("open", "os.kill", "os.killpg", "os.remove", "os.rename", "os.rmdir",
                              "shutil.rmtree", "object.__getattr__"):
            return
        self.busy = True
        try:
            if not self._from_candidate():     # libraries (Triton compiling, torch) do as they must
                return
            if event in _READS or event in _TAMPER:
                self.events.append([event, ""])
                return
            if event == "object.__getattr__":
                if args[1] in ("tb_frame", "f_back", "gi_frame", "cr_frame", "f_locals"):
                    self.events.append([event, str(args[1])])
                return
            if event in ("os.kill", "os.killpg"):
                if args[0] not in (os.getpid(), 0):
                    self.events.append([event, f"pid {args[0]}"])
                    raise PermissionError(f"gpulab lab: a candidate may not signal other processes ({event})")
                return
            if event == "open":
                path, mode, flags = args
                writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                         (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND))
                if writes and path is not None and not self._write_allowed(path):
                    self.events.append([event, f"write to {path}"])
                    raise PermissionError(f"gpulab lab: a candidate may not write to {path}")
                return
            if event in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree"):
                if not self._write_allowed(args[0]):
                    self.events.append([event, str(args[0])])
                    raise PermissionError(f"gpulab lab: a candidate may not change {args[0]}")
                return
            if event in _BLOCKED:
                self.events.append([event, str(args[0])[:80] if args else ""])
                raise PermissionError(f"gpulab lab: {event} is not allowed in a candidate")
        finally:
            self.busy = False


_AUDIT = _Audit()
_hook_installed = False


def install_audit(candidate_file: str, allowed_dirs) -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_AUDIT)
        _hook_installed = True
    _AUDIT.allowed_dirs = tuple(os.path.realpath(d) + os.sep for d in allowed_dirs if d)
    _AUDIT.candidate_file = candidate_file


# -- the process --------------------------------------------------------------------------------
def rss_mb(pid="self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# The evaluator grants the GPU for timing to one worker at a time.
ASK_GPU, GRANT_GPU, GPU_DONE = b"gpu?", b"gpu!", b"gpu-done"
_CONN = None


class _ExclusiveGPU:
    """Held while timing: ask the evaluator, wait for its grant, release when done."""

    def __enter__(self):
        if _CONN is not None:
            _CONN.send_bytes(ASK_GPU)
            if _CONN.recv_bytes() != GRANT_GPU:
                raise RuntimeError("the evaluator did not grant the GPU")

    def __exit__(self, *exc):
        if _CONN is not None:
            _CONN.send_bytes(GPU_DONE)


def worker_main(conn, memory_mb: float) -> None:
    """Entry point of a candidate's process: get ready, run one job, exit."""
    try:
        os.setsid()                       # its own process group: killed as a whole
    except OSError:
        pass
    try:                                  # a crashing candidate writes no core file
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError):
        pass
    if runtime.mode() != "compiled":
        torch.set_num_threads(1)
        if memory_mb:                     # allocations beyond the limit fail at once
            limit = _vm_size() + int(memory_mb * 2 ** 20)
            try:
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            except (ValueError, OSError):
                pass
    warnings.simplefilter("ignore")       # a candidate's overflows are judged, not printed
    if runtime.mode() == "compiled":
        _warm_gpu()
    conn.send_bytes(b"ready")
    job = conn.recv()                     # the evaluator's job (a trusted pickle)
    global _CONN
    _CONN = conn
    try:
        report = run_job(job)
    except BaseException as e:            # the candidate called sys.exit, say
        report = {"error": _error("worker", e)}
    torch.save(report, job["result_path"])
    conn.send_bytes(b"done")
    conn.close()
    os._exit(0)                           # skip atexit handlers a candidate may have added


def _error(stage: str, e: BaseException) -> dict:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"stage": stage, "type": type(e).__name__, "message": str(e)[:2000],
            "traceback": "".join(tb)[-4000:]}


def load_candidate(path: str):
    name = f"gpulab_lab_candidate_{os.path.basename(path)[:-3]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()          # the whole device: every stream


def run_job(job: dict) -> dict:
    if job["kind"] == "baselines":
        return run_baselines(job)
    report: dict = {"trials": [], "events": _AUDIT.events, "patched": []}
    device = torch.device(job["device"])
    if device.type == "cuda":
        total_mb = torch.cuda.get_device_properties(device).total_memory / 2 ** 20
        torch.cuda.set_per_process_memory_fraction(
            gpu_share(total_mb, job.get("gpu_memory_fraction"), job.get("gpu_memory_mb")))
    task = get_task(job["task"])
    spec = task.spec
    install_audit(job["candidate_path"], job["allowed_dirs"])
    try:
        module = load_candidate(job["candidate_path"])
        launch = getattr(module, job["entry"])
    except BaseException as e:
        report["error"] = _error("import", e)
        report["patched"] = patched(_FINGERPRINT, fingerprint())
        return report
    report["patched"] = patched(_FINGERPRINT, fingerprint())
    if report["patched"]:
        return report
    for trial in job["trials"]:
        try:
            report["trials"].append(run_trial(spec, launch, trial, device))
        except BaseException as e:
            report["error"] = _error("trial", e)
            report["error"]["trial"] = len(report["trials"])
            break
        if report["trials"][-1]["threads"]:
            break
    report["patched"] = patched(_FINGERPRINT, fingerprint())
    if "error" in report or report["patched"] or any(t["threads"] or t["repointed"] for t in report["trials"]):
        return report
    try:
        if job.get("cost_model"):
            report["cost"] = costmodel.measure(task, launch)
        if job.get("timing"):
            with _ExclusiveGPU():
                report["timing"] = time_candidate(spec, launch, job["timing"], device)
    except BaseException as e:
        report["error"] = _error("cost model" if job.get("cost_model") else "timing", e)
    report["patched"] = patched(_FINGERPRINT, fingerprint())
    return report


def gpu_share(total_mb: float, fraction: float | None, limit_mb: float | None) -> float:
    """The fraction of the GPU's memory a candidate may allocate: its share of the device
    among the evaluator's parallel workers, and never more than the evaluator's memory
    limit, so that a memory hog is caught on a 141 GB GPU with one worker as on a 16 GB one."""
    share = fraction or 1.0
    if limit_mb:
        share = min(share, limit_mb / total_mb)
    return share


def run_trial(spec, launch, trial: dict, device) -> dict:
    """One call of the candidate on the evaluator's inputs, in guarded buffers."""
    inputs = trial["inputs"]
    dtype = getattr(torch, trial["dtype"])
    guarded_in, call = {}, {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            guarded_in[k] = Guarded.wrap(v.shape, v.dtype, device, like=v.to(device))
            call[k] = guarded_in[k].inner
        else:
            call[k] = v
    outs = spec.outputs(inputs, dtype)
    guarded_out = {k: Guarded.wrap(shape, odt, device) for k, (shape, odt) in outs.items()}
    views = {k: g.inner for k, g in guarded_out.items()}
    where = {k: (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for k, t in views.items()}
    threads_before = _thread._count()
    spec.call(launch, call, views)
    _sync()
    left_running = _thread._count() - threads_before
    repointed = [k for k, t in views.items() if (t.data_ptr(), tuple(t.shape), tuple(t.stride())) != where[k]]
    return {"outputs": {k: g.buf.cpu() for k, g in guarded_out.items()},
            "inputs": {k: g.buf.cpu() for k, g in guarded_in.items()},
            "threads": int(max(0, left_running)), "repointed": repointed}


# -- timing ---------------------------------------------------------------------------------------
# On a GPU: CUDA events around each call. The same loop runs on a CPU with a wall clock
# (only so that the tests exercise it: interpreter timings mean nothing).
_FLUSH_BYTES = 256 << 20      # more than the L2 of any GPU gpulab runs on
WALL_BATCHES = 5
# the evaluator's async-launch test: wall > ratio x the events' median + slack (ms)
ASYNC_WALL_RATIO, ASYNC_WALL_SLACK_MS = 2.0, 0.1


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-128 if t.dtype == torch.int8 else -1)


def _device_sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()          # the whole device: every stream


class _CPUEvent:
    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _event(device):
    return torch.cuda.Event(enable_timing=True) if torch.device(device).type == "cuda" else _CPUEvent()


def _event_times(call, sets, reps: int, poison: bool, device) -> list[float]:
    """Per-call times (ms): the L2 flushed and (candidates) the outputs poisoned before
    each call, outside the timed region; input sets alternate."""
    cuda = torch.device(device).type == "cuda"
    flush = torch.empty(_FLUSH_BYTES if cuda else 1, dtype=torch.int8, device=device)
    starts = [_event(device) for _ in range(reps)]
    ends = [_event(device) for _ in range(reps)]
    for r in range(reps):
        s = sets[r % len(sets)]
        if poison:
            for t in s["outputs"].values():
                _poison(t)
        flush.zero_()
        starts[r].record()
        call(s)
        ends[r].record()
    _device_sync(device)
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def _reps_for(call, sets, device) -> int:
    """About 0.3 s of timed calls, between 10 and 200."""
    _device_sync(device)
    t = time.perf_counter()
    for s in sets:
        call(s)
    _device_sync(device)
    per = (time.perf_counter() - t) / len(sets)
    return int(min(200, max(10, 0.3 / max(per, 1e-6))))


def timing_sets(spec, timing: dict, device) -> list[dict]:
    """Two input sets for timing: the evaluator's (from its file) and a second, made
    here, so a candidate that skips calls it has seen before is caught."""
    first = torch.load(timing["inputs_path"], weights_only=True)
    params, dtype = timing["params"], getattr(torch, timing["dtype"])
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(timing["seed"] + 1)
    second = spec.make_inputs(params, dtype, device, gen)
    sets = []
    for inputs in (first, second):
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        outputs = {k: torch.empty(s, dtype=d, device=device) for k, (s, d) in spec.outputs(inputs, dtype).items()}
        sets.append({"inputs": inputs, "outputs": outputs})
    return sets


def time_candidate(spec, launch, timing: dict, device) -> dict:
    sets = timing_sets(spec, timing, device)

    def call(s):
        spec.call(launch, s["inputs"], s["outputs"])
    for s in sets:                    # untimed first calls: compile, and the outputs to compare with
        for t in s["outputs"].values():
            _poison(t)                # torch.empty: on a GPU, whatever the memory held before
        call(s)
    _device_sync(device)
    first = [{k: t.clone() for k, t in s["outputs"].items()} for s in sets]
    reps = timing.get("reps") or _reps_for(call, sets, device)
    times = _event_times(call, sets, reps, poison=True, device=device)
    # The last timed call on each set must reproduce the untimed result.
    differs = []
    for i, s in enumerate(sets):
        for k, t in s["outputs"].items():
            a, b = t.double(), first[i][k].double()
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True):
                differs.append(f"{k} (input set {i})")
    times.sort()
    ms, wall_ms = times[len(times) // 2], _wall_ms(call, sets, reps, device)
    if wall_ms > ASYNC_WALL_RATIO * ms + ASYNC_WALL_SLACK_MS:
        # the evaluator would call this an async launch: time both again, back to back, so
        # that a machine that got busy between the two measurements is not taken for one
        # (a kernel that leaves its work running is as slow on the wall clock again)
        times = sorted(_event_times(call, sets, reps, poison=True, device=device))
        ms, wall_ms = times[len(times) // 2], _wall_ms(call, sets, reps, device)
    return {"ms": ms, "min_ms": times[0], "reps": reps, "wall_ms": wall_ms,
            "timed_outputs_differ": differs, "first_outputs": {k: t.cpu() for k, t in first[0].items()}}


def _wall_ms(call, sets, reps: int, device) -> float:
    """Milliseconds a call on the wall clock with a device-wide synchronise: work left on
    another stream, or finished later by a thread, shows up here and not between the
    events. In batches, the fastest one counts: such work slows every batch, while another
    process taking its turn on the GPU or the CPU (the events' median ignores that) slows
    only some."""
    n = max(4, reps // 10)
    walls = []
    for _ in range(WALL_BATCHES):
        _device_sync(device)
        t0 = time.perf_counter()
        for r in range(n):
            call(sets[r % len(sets)])
        _device_sync(device)
        walls.append((time.perf_counter() - t0) * 1e3 / n)
    return min(walls)


def run_baselines(job: dict) -> dict:
    """Time each task's eager PyTorch function and its torch.compile'd version on the
    evaluator's timing inputs (in a process without any candidate in it)."""
    device = torch.device(job["device"])
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # compile in this process
    result = {}
    for name in job["tasks"]:
        task = get_task(name)
        sets = timing_sets(task.spec, job["timings"][name], device)
        eager = task.eager_fn()
        out = {}
        for kind, fn in (("eager", eager), ("compiled", torch.compile(eager, dynamic=False))):
            try:
                def call(s, fn=fn):
                    fn(s["inputs"])
                for s in sets:
                    call(s)               # torch.compile compiles here, outside the GPU grant
                _device_sync(device)
                with _ExclusiveGPU():
                    times = sorted(_event_times(call, sets, _reps_for(call, sets, device), poison=False,
                                                device=device))
                out[kind] = times[len(times) // 2]
            except Exception as e:
                out[kind + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result[name] = out
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"baselines": result}


def kill_group(pid: int) -> None:
    """SIGKILL a worker and everything it started (its own process group)."""
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError, OSError):
            pass

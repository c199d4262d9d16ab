"""Run one function on N ranks, from a notebook cell or a test, and get every rank's result.

    results = run_ranks(fn, 3, x)        # fn(x) runs on ranks 0, 1, 2; a list of 3 results

Inside ``fn`` the default process group is ready: ``torch.distributed.get_rank()``,
``get_world_size()``, ``all_reduce``, ``isend``/``irecv`` all work.

* ``backend="gloo"`` (the default without a GPU per rank): N processes on this machine,
  joined by gloo over the loopback interface. Processes are *forked* (Linux): a function
  defined in a notebook cell runs as it is, nothing is re-imported, and a rank starts in
  ~50 ms. A forked child cannot use CUDA once this process has: gloo ranks that run GPU
  kernels need ``start_method="spawn"``.
* ``backend="nccl"`` (the default with a GPU per rank): one process per GPU,
  rank r on ``cuda:r``, *spawned* (a process that has used CUDA cannot be forked).
  ``fn`` and its arguments are pickled with ``cloudpickle``, so functions defined in a
  notebook travel by value (without cloudpickle: only functions importable by name).


The ranks meet through a :class:`torch.distributed.FileStore` in a fresh temporary
folder (no ports to pick or collide). Results travel back pickled; CUDA tensors are
moved to the CPU first.

Nothing hangs: every collective has the process group's timeout
(``collective_timeout_s``), the whole run has ``timeout_s``, and the launcher stops every
process it started before returning. A rank's exception is raised again in the caller,
as the same exception type, with a note giving the rank and that rank's traceback; a
rank that dies without a word (killed, segfault) is reported with its exit signal.

Every process started here, and the caller, keep NVLink multicast off
(:data:`MULTICAST_OFF`, set with ``setdefault`` so an explicit choice wins); GPU ranks
also get ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (a timed-out collective tears the rank
down instead of leaving it stuck).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import runtime

try:        # optional: only needed to spawn (GPU) a function defined in a notebook
    import cloudpickle
except ImportError:  # pragma: no cover - depends on the environment
    cloudpickle = None

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
GPU_RANK_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
CPU_RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}     # one machine: gloo talks over loopback


def keep_multicast_off() -> None:
    """Set :data:`MULTICAST_OFF` in this process (``setdefault``), so children inherit it."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)


keep_multicast_off()


class RankError(RuntimeError):
    """A rank failed and its own exception could not be re-raised (it did not pickle),
    or it died without reporting (killed, crashed)."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class RanksTimedOut(TimeoutError):
    """The run went past ``timeout_s``: the ranks still running were stopped."""


@dataclass
class RankOutcome:
    """What one rank did: returned ``value`` (ok), raised ``error``, or died (exitcode)."""
    rank: int
    ok: bool = False
    value: Any = None
    error: BaseException | None = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    seconds: float | None = None      # from the start of the run to the rank's report
    stopped: bool = False             # still running when the launcher stopped it

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: returned"
        if self.stopped:
            return f"rank {self.rank}: stopped by the launcher"
        if self.error_type:
            return f"rank {self.rank}: raised {self.error_type}: {self.message}"
        return f"rank {self.rank}: {exit_description(self.exitcode)}"


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} without reporting"
    return f"exited with code {exitcode} without reporting"


def kernel_start_method() -> str:
    """How to start gloo ranks that run gpulab's kernels: spawned where those are GPU
    kernels (a forked child cannot use CUDA), else forked (fast)."""
    fork = "fork" in mp.get_all_start_methods()
    return "spawn" if runtime.mode() == "compiled" or not fork else "fork"


def default_backend(world_size: int = 1) -> str:
    """``nccl`` when there is a CUDA GPU for each of ``world_size`` ranks, else ``gloo``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if dist.is_nccl_available() and gpus >= world_size else "gloo"


# -- the abandoned-group flag: set when a collective failed or timed out ---------------------
_GROUP_STATE = {"abandoned": False}


def abandon_process_group() -> None:
    """Mark this rank's process group as unusable (a peer is dead or a collective timed
    out): the rank then exits without the final barrier and without tearing the group
    down, both of which would wait on the missing peer."""
    _GROUP_STATE["abandoned"] = True


def process_group_abandoned() -> bool:
    return _GROUP_STATE["abandoned"]


# -- the rank side -------------------------------------------------------------------------
def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _exception_bytes(e: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
        return data
    except Exception:
        return None


def _rank_main(rank, world_size, backend, store_path, payload, by_value, results,
               collective_timeout_s, threads, started):
    """Entry point of every rank: join the group, run the function, report, exit."""
    status = 1
    try:
        if faulthandler.is_enabled():   # a forked rank inherits the caller's; its dump would
            faulthandler.disable()      # repeat the caller's stack, not say what went wrong
        keep_multicast_off()
        for k, v in (GPU_RANK_ENV if backend == "nccl" else CPU_RANK_ENV).items():
            os.environ.setdefault(k, v)
        _GROUP_STATE["abandoned"] = False
        if threads:
            torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        init = dict(backend=backend, init_method=f"file://{store_path}", rank=rank,
                    world_size=world_size, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            init["device_id"] = torch.device("cuda", rank)
        fn, args, kwargs = ((cloudpickle if by_value else pickle).loads(payload)
                            if isinstance(payload, bytes) else payload)
        try:
            dist.init_process_group(**init)
            value = fn(*args, **kwargs)
            if backend == "nccl" and not process_group_abandoned():
                torch.cuda.synchronize()    # (not behind a collective stuck on a dead peer)
            message = ("ok", rank, pickle.dumps(_to_cpu(value)), time.time() - started)
            status = 0
        except BaseException as e:  # report everything, KeyboardInterrupt included
            message = ("error", rank, type(e).__name__, str(e), traceback.format_exc(),
                       _exception_bytes(e), time.time() - started)
        results.put(message)
        if status == 0 and dist.is_initialized() and not process_group_abandoned():
            dist.barrier()                  # nobody leaves while a peer may still need it
            dist.destroy_process_group()
    except BaseException:   # the report itself failed (e.g. a result that does not pickle)
        try:
            results.put(("error", rank, "RankError", "the rank failed outside the function",
                         traceback.format_exc(), None, time.time() - started))
        except Exception:
            pass
        status = 1
    finally:
        try:
            results.close()
            results.join_thread()       # flush the report before the hard exit below
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # A hard exit: no interpreter teardown, which could wait on a dead peer.
            os._exit(status)


# -- the caller side -----------------------------------------------------------------------
def _payload(fn: Callable, args: tuple, kwargs: dict, start_method: str):
    """What the child receives: the objects themselves (fork), or (fn, args, kwargs)
    pickled — by value with cloudpickle where available, so functions defined in a
    notebook travel too."""
    if start_method == "fork":
        return (fn, args, kwargs), False
    if cloudpickle is not None:
        return cloudpickle.dumps((fn, args, kwargs)), True
    for f in (fn, *args, *kwargs.values()):
        if callable(f) and (getattr(f, "__module__", None) == "__main__"
                            or "<locals>" in getattr(f, "__qualname__", "")):
            raise TypeError(f"{getattr(f, '__name__', f)!r} is defined in a notebook or inside another "
                            f"function, so spawned (GPU) ranks cannot import it: move it into a module, "
                            f"or `pip install cloudpickle`")
    return pickle.dumps((fn, args, kwargs)), False


def _stop(processes, grace_s: float = 2.0) -> set[int]:
    """Terminate, then kill, the processes started here that are still alive; return
    the indices of those that were."""
    alive = {i for i, p in enumerate(processes) if p.is_alive()}
    for p in processes:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)
    return alive


def run_ranks_outcomes(fn: Callable, world_size: int, *args, backend: str | None = None,
                       timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
                       start_method: str | None = None, threads: int | None = 1,
                       fail_fast: bool = True, **kwargs) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ranks 0..world_size-1 and return what each did,
    without raising for a rank's failure (fault demos need the whole picture).

    ``fail_fast``: stop the others half a second after one rank fails (they would only
    wait for it; the half second collects reports that tell the cause from its echoes);
    with ``False`` every rank gets until ``timeout_s`` to report its own view.
    Raises :class:`RanksTimedOut` only if ranks are still running at ``timeout_s`` with
    no failure to explain it."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout_s <= 0 or collective_timeout_s <= 0:
        raise ValueError("timeout_s and collective_timeout_s must be > 0")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU processes) or 'nccl' (one process per GPU), "
                         f"got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise ValueError(f"NCCL runs one process per GPU: {world_size} ranks need {world_size} GPUs, "
                             f"this machine has {gpus}; use backend='gloo' for CPU processes")
    if start_method is None:
        fork_ok = backend == "gloo" and "fork" in mp.get_all_start_methods()
        start_method = "fork" if fork_ok else "spawn"
    keep_multicast_off()
    ctx = mp.get_context(start_method)
    payload, by_value = _payload(fn, args, kwargs, start_method)
    folder = tempfile.mkdtemp(prefix="gpulab-ranks-")
    store_path = os.path.join(folder, "store")
    results = ctx.Queue()
    started = time.time()
    processes = [ctx.Process(target=_rank_main, name=f"gpulab-rank-{r}", daemon=True,
                             args=(r, world_size, backend, store_path, payload, by_value, results,
                                   collective_timeout_s, threads, started))
                 for r in range(world_size)]
    outcomes: dict[int, RankOutcome] = {}
    stopped: set[int] = set()
    dead_since: dict[int, float] = {}
    try:
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if fail_fast and any(not o.ok for o in outcomes.values()):
                # one rank failed: the others' reports of the same moment still help tell the
                # cause from its echoes (a peer's "connection closed"); collect them briefly
                deadline = min(deadline, time.monotonic() + 0.5)
                fail_fast = False
            try:
                msg = results.get(timeout=min(0.05, left))
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(processes):
                    if r in outcomes or p.exitcode is None:
                        continue
                    # dead: give its report (if any) a moment to come through the queue
                    if now - dead_since.setdefault(r, now) > 0.5:
                        outcomes[r] = RankOutcome(r, exitcode=p.exitcode, seconds=time.time() - started)
                continue
            outcomes[msg[1]] = _outcome(msg)
        # Let ranks that reported finish their exit (final barrier), then stop the rest.
        if len(outcomes) == world_size and all(o.ok for o in outcomes.values()):
            end = time.monotonic() + min(10.0, collective_timeout_s)
            for p in processes:
                p.join(max(0.0, end - time.monotonic()))
    finally:
        stopped = _stop(processes)
        for r, p in enumerate(processes):
            if r in outcomes and outcomes[r].exitcode is None:
                outcomes[r].exitcode = p.exitcode
        results.close()
        shutil.rmtree(folder, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing and all(o.ok for o in outcomes.values()):
        raise RanksTimedOut(
            f"rank(s) {missing} of {world_size} were still running after {timeout_s:g} s and were "
            f"stopped: most likely stuck in a collective or a receive that not every rank joined "
            f"(each collective has a {collective_timeout_s:g} s timeout of its own)")
    return [outcomes.get(r, RankOutcome(r, exitcode=processes[r].exitcode, stopped=r in stopped))
            for r in range(world_size)]


def _outcome(msg) -> RankOutcome:
    if msg[0] == "ok":
        _, rank, data, seconds = msg
        return RankOutcome(rank, ok=True, value=pickle.loads(data), seconds=seconds)
    _, rank, etype, text, tb, data, seconds = msg
    error = None
    if data is not None:
        try:
            error = pickle.loads(data)
        except Exception:
            error = None
    return RankOutcome(rank, error=error, error_type=etype, message=text, traceback=tb, seconds=seconds)


def _is_lost_peer(message: str) -> bool:
    m = message.lower()
    return "connection closed by peer" in m or "connection reset by peer" in m or "broken pipe" in m


def raise_first_failure(outcomes: list[RankOutcome], world_size: int | None = None) -> None:
    """Raise the failure that explains a run: the first rank (in report order) that raised,
    as its own exception type with a note naming the rank and giving its traceback; but a
    rank that died without reporting (killed, aborted) when the others only saw its
    connection drop."""
    n = world_size or len(outcomes)
    failed = [o for o in outcomes if not o.ok and not o.stopped]
    if not failed:
        return
    # A rank whose peer vanished reports "connection closed": an echo of the failure that
    # made the peer exit. The cause is a rank that raised something else, else one that died.
    raised = sorted((o for o in failed if o.error_type),
                    key=lambda o: (_is_lost_peer(o.message), o.seconds or 0.0))
    died = [o for o in failed if not o.error_type]
    if died and all(_is_lost_peer(o.message) for o in raised):
        raised = []     # the others only saw the dead rank's connection drop: it is the cause
    first = raised[0] if raised else died[0]
    others = "; ".join(o.describe() for o in failed[:6] if o is not first)
    if raised:
        o = raised[0]
        note = (f"gpulab: raised on rank {o.rank} of {n}"
                + (f" (also: {others})" if others else "") + f". Rank {o.rank}'s traceback:\n"
                + o.traceback.rstrip())
        e = o.error
        if e is not None:
            try:
                e.failed_rank = o.rank
            except Exception:
                pass
            if hasattr(e, "add_note"):
                e.add_note(note)
            else:       # Python 3.10: keep the type, carry the note along
                e.__notes__ = [*getattr(e, "__notes__", []), note]
            raise e
        raise RankError(f"rank {o.rank} of {n} raised {o.error_type}: {o.message}\n{note}", o.rank)
    o = first
    raise RankError(f"rank {o.rank} of {n} {exit_description(o.exitcode)}"
                    + (f" ({others})" if others else ""), o.rank, o.exitcode)


def run_ranks(fn: Callable, world_size: int, *args, backend: str | None = None,
              timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
              start_method: str | None = None, threads: int | None = 1, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return ``[result of rank 0, ...]``.

    A rank's exception is raised here (same type, with its rank and traceback in a note);
    a rank killed without reporting raises :class:`RankError`; a run still going after
    ``timeout_s`` raises :class:`RanksTimedOut`. Every started process is stopped before
    this returns or raises.

    >>> def rank_and_sum():
    ...     t = torch.ones(3) * (dist.get_rank() + 1)
    ...     dist.all_reduce(t)
    ...     return dist.get_rank(), t
    >>> run_ranks(rank_and_sum, 2)      # [(0, tensor([3., 3., 3.])), (1, tensor([3., 3., 3.]))]
    """
    outcomes = run_ranks_outcomes(fn, world_size, *args, backend=backend, timeout_s=timeout_s,
                                  collective_timeout_s=collective_timeout_s, start_method=start_method,
                                  threads=threads, fail_fast=True, **kwargs)
    raise_first_failure(outcomes, world_size)
    return [o.value for o in outcomes]

"""Faults: turn a dead or stalled rank into an error instead of a hang.

A collective waits for every rank. If one is dead (killed, crashed) or stalled (stuck in
a long computation, a deadlock, a full disk), the others wait — by default for the
process group's timeout (10 minutes for NCCL), often forever in practice when the wait
is a GPU kernel spinning on a flag. Two layers of defence:

* the process group's own timeout (``init_process_group(timeout=...)``; :func:`run_ranks`
  sets it from ``collective_timeout_s``): gloo raises when an operation exceeds it, and
  NCCL's watchdog thread aborts the communicator and, with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (set in every GPU rank), tears the process down;
* a deadline per call, :func:`all_reduce_within`: the collective is started
  asynchronously and the host polls its completion until the deadline, then raises
  :class:`CollectiveError` naming the rank, the operation and the time waited. The
  rank's process group is then marked abandoned (:func:`launch.abandon_process_group`):
  it is not used again, and the rank exits without waiting on the missing peer.

gloo notices a *dead* peer at once (its TCP connection closes); a *stalled* peer, and
on NCCL a dead one too, is only noticed by the deadline.
"""
from __future__ import annotations

import os
import re
import signal
import time

import torch
import torch.distributed as dist

from . import launch


class CollectiveError(RuntimeError):
    """A collective did not complete: ``reason`` is ``"timeout"`` (no answer before the
    deadline) or ``"peer lost"`` (the backend saw a peer's connection close)."""

    def __init__(self, message: str, reason: str, waited_s: float):
        super().__init__(message)
        self.reason = reason
        self.waited_s = waited_s


def all_reduce_within(tensor: torch.Tensor, timeout_s: float, op=dist.ReduceOp.SUM, group=None,
                      poll_s: float = 1e-3) -> torch.Tensor:
    """``dist.all_reduce(tensor)`` that raises :class:`CollectiveError` if it has not
    completed after ``timeout_s`` seconds (or if the backend reports a lost peer).

    It blocks the host until the collective is done: for fault detection, not for hot
    paths (where the process group timeout and NCCL's watchdog are the guard)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    rank, n = dist.get_rank(), dist.get_world_size(group)
    what = f"all_reduce of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} values"
    start = time.monotonic()
    try:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        while not work.is_completed():
            if time.monotonic() - start > timeout_s:
                launch.abandon_process_group()
                raise CollectiveError(
                    f"rank {rank} of {n}: {what} did not complete within {timeout_s:g} s: "
                    f"another rank is dead or stalled (it never joined the collective). "
                    f"This process group is abandoned; restart the ranks.", "timeout",
                    time.monotonic() - start)
            time.sleep(poll_s)
        work.wait()
    except CollectiveError:
        raise
    except Exception as e:      # gloo: "Connection closed by peer", "Timed out ..."
        launch.abandon_process_group()
        waited = time.monotonic() - start
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        text = re.sub(r"^\[[^\]]*\]\s*", "", text)      # gloo's "[.../pair.cc:545] " prefix
        reason = "timeout" if "timed out" in text.lower() else "peer lost"
        raise CollectiveError(f"rank {rank} of {n}: {what} failed after {waited:.3g} s: another rank "
                              f"is gone ({text[:200]}). This process group is abandoned; restart the "
                              f"ranks.", reason, waited) from e
    return tensor


def _victim_and_survivors(victim: int, mode: str, timeout_s: float, device_tensor: bool):
    """Rank function of :func:`dead_rank_demo`."""
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if device_tensor else torch.device("cpu")
    t = torch.ones(1024, device=dev)
    dist.all_reduce(t)              # everyone is up and the communicator works
    if device_tensor:
        torch.cuda.synchronize()
    dist.barrier()
    if rank == victim:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        launch.abandon_process_group()      # stall: sleep past the others' deadline
        time.sleep(1.5 * timeout_s + 0.5)
        return {"rank": rank, "role": "stalled"}
    start = time.monotonic()
    try:
        all_reduce_within(t, timeout_s)
    except CollectiveError as e:
        return {"rank": rank, "role": "survivor", "detected": True, "reason": e.reason,
                "detect_s": time.monotonic() - start, "message": str(e)}
    return {"rank": rank, "role": "survivor", "detected": False, "detect_s": time.monotonic() - start}


def dead_rank_demo(world_size: int = 2, victim: int = 1, mode: str = "kill", timeout_s: float = 2.0,
                   backend: str | None = None) -> dict:
    """Kill (SIGKILL) or stall rank ``victim`` just before an all-reduce; the other ranks
    call :func:`all_reduce_within` with ``timeout_s``. Returns what each survivor saw and
    how long detection took (``detect_s``), and how the victim ended. A survivor that the
    backend itself tears down (NCCL's watchdog) counts as detected, timed by when the
    launcher saw it end."""
    if mode not in ("kill", "stall"):
        raise ValueError(f"mode must be 'kill' or 'stall', got {mode!r}")
    if not 0 <= victim < world_size or world_size < 2:
        raise ValueError(f"need world_size >= 2 and 0 <= victim < world_size, got {world_size}, {victim}")
    backend = backend or launch.default_backend(world_size)
    start = time.monotonic()
    outcomes = launch.run_ranks_outcomes(
        _victim_and_survivors, world_size, victim, mode, timeout_s, backend == "nccl", backend=backend,
        timeout_s=4 * timeout_s + 60, collective_timeout_s=timeout_s + 30, fail_fast=False)
    v = outcomes[victim]
    seen = []
    for o in outcomes:
        if o.rank == victim:
            continue
        if o.ok:
            seen.append(o.value)
        elif o.error_type:                  # a survivor failed some other way: a real bug
            launch.raise_first_failure([o], world_size)
        else:
            # Torn down before its deadline: NCCL's watchdog saw the peer's error and, with
            # TORCH_NCCL_ASYNC_ERROR_HANDLING=1, ended the process. Detected too, by the backend.
            after = None if o.seconds is None or v.seconds is None else max(0.0, o.seconds - v.seconds)
            seen.append({"rank": o.rank, "role": "survivor", "detected": True, "detect_s": after,
                         "reason": "torn down by the backend", "message": f"rank {o.rank}: {o.describe()}"})
    times = [s["detect_s"] for s in seen if s.get("detect_s") is not None]
    return {"world_size": world_size, "backend": backend, "victim": victim, "mode": mode,
            "timeout_s": timeout_s, "detected": all(s["detected"] for s in seen),
            "detect_s": max(times) if times else None, "reasons": sorted({s.get("reason", "") for s in seen}),
            "messages": [s.get("message", "") for s in seen],
            "victim_end": v.describe() if not v.ok else "returned after stalling",
            "wall_s": time.monotonic() - start}

"""Collectives and tensor parallelism (notebook 10), on ``torch.distributed``.

* :mod:`.launch`: run a function on N ranks from a notebook or a test (gloo CPU
  processes, or NCCL with one process per GPU), with timeouts and rank-tagged errors;
* :mod:`.collectives`: ring all-reduce (reduce-scatter + all-gather) and one-shot
  all-reduce written on point-to-point ``isend``/``irecv``;
* :mod:`.bandwidth`: algorithm and bus bandwidth (nccl-tests conventions), sweeps, plots;
* :mod:`.tensor_parallel`: column- and row-parallel ternary BitLinear layers whose
  TP=2 output is bit-identical to TP=1 (the reduction is on int32 partial sums);
* :mod:`.tensor_parallel_model`: the serving engine's model at TP=n (heads split,
  rank-local KV caches), served by the unchanged engine with TP=1's tokens;
* :mod:`.faults`: collectives with a deadline that turn a dead or stalled rank into
  an error.
"""
from .launch import (MULTICAST_OFF, RankError, RankOutcome, RanksTimedOut, default_backend,  # noqa: F401
                     keep_multicast_off, run_ranks, run_ranks_outcomes)

__all__ = ["MULTICAST_OFF", "RankError", "RankOutcome", "RanksTimedOut", "default_backend", "keep_multicast_off",
           "run_ranks", "run_ranks_outcomes"]

r"""Whole-step CUDA graphs for small steps that carry prompt chunks.

Piecewise graphs (:mod:`.piecewise`) leave attention out of their graphs, because how a
step's rows split into requests changes from step to step. For a big step that costs
nothing: its GPU work hides the host's launches. For a small one it is most of the
step. A request whose 2K-token system prompt is cached brings a prompt step of some 40
new tokens: about a millisecond of GPU work, while the host launches L attention
kernels and L + 1 segment graphs from Python, one after the other (on the H200,
2026-12-03, such a step took 3.7 ms back to back, a decode step 1.9 ms).

Padded to a bucket, a small step's *shapes* do not change; only the data does. So the
whole forward can be captured, attention included, once the step is written as data:

* every row is an **append** row (:mod:`.batch_attention`): a decode is a request with
  one new token. A step of at most ``max_requests`` requests is described by static
  tensors: ``qo_indptr`` [R + 1] (the unused requests own no rows), the kv lengths [R]
  and the block tables [R, context pages];
* the append kernel's **work list** is built inside the graph, on the device, from that
  ``qo_indptr`` (:func:`gpulab.prefill.append_schedule_device`), sized for the worst
  layout of the bucket (⌈T / tile⌉ + R items); the surplus items find nothing to do;
* each tile's history is **split** in a fixed number of parts (at most 16, each of at
  least 4·BLOCK_N positions of the longest context), merged after the kernel: parts past
  a request's history find nothing to do, and 40 new tokens over 2K cached ones keep
  tens of SMs busy instead of eight.

A step of at most ``max_tokens`` rows (128) from at most ``max_requests`` requests (16)
then replays one graph for the smallest bucket that holds it (16, 32, 64, 128 rows), and
the host's cost of the step is the plan and one replay (the cached-prompt step above:
2.34 ms back to back on the H200, 2026-12-04). Bigger steps take the piecewise graphs.
Padded rows are as in :mod:`.piecewise`: stale but valid tokens, K and V written to the
scratch page, no request owns them, their outputs are ignored.

Without CUDA graphs (``cuda=False``) every replay calls the captured function: the same
static buffers and layout, run eagerly, checkable on a CPU.
"""
from __future__ import annotations

import bisect
import functools

import numpy as np
import torch

from .. import runtime
from ..prefill import append_tile_config
from .batch_attention import plan_append_attention
from .graph_capture import CapturedStep
from .piecewise import token_buckets

MAX_TOKENS = 128         # the largest step a whole graph runs; bigger ones take the piecewise graphs
MAX_REQUESTS = 16        # requests (decodes and prompt chunks) in such a step
MAX_SPLITS = 16          # parts of each attention tile's history


def full_input_fields(bucket: int, max_requests: int, max_blocks: int, table_rows: int | None = None) -> list:
    """A whole-step graph's static inputs, (name, NumPy dtype, shape) per field: the rows
    (input ids, positions, slots, fed tokens), the sampled rows, then per request its kv
    length, qo_indptr and block table. The table comes last, so a step of n requests sends
    only its first n rows."""
    rows = max_requests if table_rows is None else table_rows
    return [("rows", np.int64, (4, bucket)), ("sample", np.int64, (bucket,)), ("lens", np.int32, (max_requests,)),
            ("indptr", np.int32, (max_requests + 1,)), ("table", np.int32, (rows, max_blocks))]


class FullStepGraphs:
    """One CUDA graph of the whole forward per token bucket, for small steps with prompt
    chunks (see the module's docstring).

    ``runner``: the :class:`~.runner.ModelRunner` whose model, KV cache and kernels the
    graphs run. ``max_tokens`` and ``max_requests``: the largest step they take.
    ``cuda``: capture real graphs (compiled mode on a GPU); else each replay calls the
    forward on the same static buffers (tests on a CPU).

    The runner's :meth:`~.runner.ModelRunner.plan` writes a step that fits straight into
    its bucket's static inputs (one copy) and :meth:`replay` runs it.
    """

    def __init__(self, runner, max_tokens: int = MAX_TOKENS, max_requests: int = MAX_REQUESTS,
                 cuda: bool = True):
        from .runner import StepPlan, field_layout, tensor_fields     # the runner imports this module
        self.runner, self.cuda, self.max_requests = runner, cuda, max_requests
        self.buckets = token_buckets(max_tokens)
        c = runner.cfg
        block_n = append_tile_config(runner.dtype, c.head_dim, c.n_heads // c.n_kv_heads)["BLOCK_N"]
        self.capacity = runner.max_blocks * runner.block_size        # the longest history a table holds
        self.num_splits = max(1, min(MAX_SPLITS, self.capacity // (4 * block_n)))
        self.inputs: dict[int, torch.Tensor] = {}     # bucket -> its static input bytes
        self.views: dict[int, dict] = {}              # bucket -> typed views of them
        self.plans: dict[int, StepPlan] = {}          # bucket -> the plan its graph reads
        self.steps: dict[int, CapturedStep] = {}
        pool = None
        for t in reversed(self.buckets):              # largest first, one memory pool
            layout = field_layout(full_input_fields(t, max_requests, runner.max_blocks))
            buf = torch.zeros(layout[-1][2], dtype=torch.uint8, device=runner.device)
            v = tensor_fields(buf, layout)
            v["rows"][2].fill_(runner.scratch_slot)   # until a step writes them: padded rows
            self.inputs[t], self.views[t] = buf, v
            self.plans[t] = StepPlan(v["rows"][0], v["rows"][1], v["rows"][2], 0, v["table"][:0], v["lens"][:0],
                                     None, v["indptr"], v["table"], v["lens"], v["sample"], [])
            step = CapturedStep(functools.partial(self.forward, t), cuda, pool)
            pool = step.pool or pool
            self.steps[t] = step

    def forward(self, t: int) -> torch.Tensor:
        """The captured function of bucket ``t``: the append kernel's work list and split
        from the static qo_indptr (on the device), then the runner's forward. Returns the
        logits [t, vocab] of the static sampled rows."""
        r, c = self.runner, self.runner.cfg
        plan = self.plans[t]
        if r.attention == "triton" and runtime.mode() == "compiled":
            plan.append_work = plan_append_attention(
                plan.append_indptr, t, r.dtype, c.n_heads, c.n_kv_heads, c.head_dim,
                capacity=self.capacity, num_splits=self.num_splits)
        return r.forward(plan)

    def bucket(self, num_rows: int, num_requests: int) -> int:
        """The bucket a step of that many rows and requests replays in, or 0: too big."""
        if not 0 < num_rows <= self.buckets[-1] or num_requests > self.max_requests:
            return 0
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def replay(self, plan) -> torch.Tensor:
        """Logits [S, vocab] (float32) of the plan's sampled rows: its inputs are in place
        already (the plan's one copy). No host sync."""
        out = self.steps[plan.full_bucket].replay()
        return out[:plan.sample_rows.shape[0]]

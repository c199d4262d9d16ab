r"""Whole-step CUDA graphs for steps that carry prompt chunks.

Piecewise graphs (:mod:`.piecewise`) leave attention out of their graphs, because how a
step's rows split into requests changes from step to step. For a big step that costs
nothing: its GPU work hides the host's launches. For a small one it is most of the
step. A request whose 2K-token system prompt is cached brings a prompt step of some 40
new tokens: about a millisecond of GPU work, while the host launches L attention
kernels and L + 1 segment graphs from Python, one after the other (on the H200,
2026-12-03, such a step took 3.7 ms back to back, a decode step 1.9 ms).

Padded to a bucket, a step's *shapes* do not change; only the data does. So the
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

A step of at most 128 rows (:data:`SMALL_TOKENS`) from at most ``max_requests`` requests
(16) then replays one graph for the smallest bucket that holds it (16, 32, 64, 128 rows),
and the host's cost of the step is the plan and one replay (the cached-prompt step above:
2.34 ms back to back on the H200, 2026-12-04).

Big steps too: continuous batching's typical step carries ~120 decodes and a few prompt
chunks, some 2000 rows. Through the piecewise graphs the host took longer over such a
step than the GPU (on the H200, 2026-12-04: 8.4-8.8 ms a step for 5.7-6.6 ms of kernels;
the host's L attention launches, L + 1 replays and the attention plan's small kernels).
Buckets above 128 rows (256, 512, ... up to ``max_tokens``, at most :data:`MAX_TOKENS`)
hold as many requests as the engine runs (``max_num_seqs``) and split no history: their
rows fill the GPU, and a split's workspace and merge would grow with them. Steps bigger
still take the piecewise graphs.
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

MAX_TOKENS = 2048        # the largest step a whole graph runs; bigger ones take the piecewise graphs
SMALL_TOKENS = 128       # buckets up to this many rows: few requests, each tile's history split
MAX_REQUESTS = 16        # requests (decodes and prompt chunks) in a small step
MAX_SPLITS = 16          # parts of each attention tile's history (small steps)


def full_input_fields(bucket: int, max_requests: int, max_blocks: int, table_rows: int | None = None) -> list:
    """A whole-step graph's static inputs, (name, NumPy dtype, shape) per field: the rows
    (input ids, positions, slots, fed tokens), the sampled rows, then per request its kv
    length, qo_indptr and block table. The table comes last, so a step of n requests sends
    only its first n rows."""
    rows = max_requests if table_rows is None else table_rows
    return [("rows", np.int64, (4, bucket)), ("sample", np.int64, (bucket,)), ("lens", np.int32, (max_requests,)),
            ("indptr", np.int32, (max_requests + 1,)), ("dec_lens", np.int32, (max_requests,)),
            ("app_indptr", np.int32, (max_requests + 1,)), ("table", np.int32, (rows, max_blocks))]


class FullStepGraphs:
    """One CUDA graph of the whole forward per token bucket, for steps with prompt chunks
    (see the module's docstring).

    ``runner``: the :class:`~.runner.ModelRunner` whose model, KV cache and kernels the
    graphs run. ``max_tokens``: the largest step they take; ``max_requests``: the most
    requests in a step of at most :data:`SMALL_TOKENS` rows (a bigger bucket holds the
    runner's ``max_num_seqs``: ``requests[bucket]``).
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
        self.num_splits = max(1, min(MAX_SPLITS, self.capacity // (4 * block_n)))     # small buckets
        big = max(max_requests, runner.max_num_seqs)
        self.requests = {t: max_requests if t <= SMALL_TOKENS else big for t in self.buckets}
        self.inputs: dict[int, torch.Tensor] = {}     # bucket -> its static input bytes
        self.views: dict[int, dict] = {}              # bucket -> typed views of them
        self.plans: dict[int, StepPlan] = {}          # bucket -> the plan its graph reads
        self.steps: dict[int, CapturedStep] = {}
        pool = None
        for t in reversed(self.buckets):              # largest first, one memory pool
            layout = field_layout(full_input_fields(t, self.requests[t], runner.max_blocks))
            buf = torch.zeros(layout[-1][2], dtype=torch.uint8, device=runner.device)
            v = tensor_fields(buf, layout)
            v["rows"][2].fill_(runner.scratch_slot)   # until a step writes them: padded rows
            self.inputs[t], self.views[t] = buf, v
            self.plans[t] = StepPlan(v["rows"][0], v["rows"][1], v["rows"][2], 0, v["table"][:0], v["lens"][:0],
                                     None, v["indptr"], v["table"], v["lens"], v["sample"], [])
            if self.splits_decodes(t):
                self.plans[t].full_decode_lens, self.plans[t].full_append_indptr = v["dec_lens"], v["app_indptr"]
            step = CapturedStep(functools.partial(self.forward, t), cuda, pool)
            pool = step.pool or pool
            self.steps[t] = step

    def forward(self, t: int) -> torch.Tensor:
        """The captured function of bucket ``t``: the append kernel's work list and split
        from the static qo_indptr (on the device), then the runner's forward. Returns the
        logits [t, vocab] of the static sampled rows. A big bucket's history is split only
        where its worst-case work list leaves SMs idle (:func:`gpulab.prefill.plan_kv_split`)."""
        r, c = self.runner, self.runner.cfg
        plan = self.plans[t]
        if r.attention == "triton" and runtime.mode() == "compiled":
            indptr = plan.append_indptr if plan.full_append_indptr is None else plan.full_append_indptr
            plan.append_work = plan_append_attention(
                indptr, t, r.dtype, c.n_heads, c.n_kv_heads, c.head_dim,
                capacity=self.capacity, num_splits=self.num_splits if t <= SMALL_TOKENS else None)
        return r.forward(plan)

    def splits_decodes(self, t: int) -> bool:
        """Whether bucket ``t``'s graph runs its one-token requests through the paged decode
        kernel (rows 0 .. R-1, the requests' decode lengths, 0 for the others) and only the
        prompt chunks through the append kernel: big buckets on gpulab's attention kernels.
        In the append kernel a one-token request takes a whole tile of BLOCK_M // group
        query tokens (32 in bf16 on the H200), so ~120 decode rows of a mixed step cost it
        1928 µs over 16 layers, against 719 µs in the decode kernel (2026-12-04, fifth run)."""
        return t > SMALL_TOKENS and self.runner.attention == "triton"

    def bucket(self, num_rows: int, num_requests: int) -> int:
        """The smallest bucket that holds a step of that many rows and requests, or 0: too big."""
        if not 0 < num_rows <= self.buckets[-1]:
            return 0
        return next((t for t in self.buckets[bisect.bisect_left(self.buckets, num_rows):]
                     if num_requests <= self.requests[t]), 0)

    def replay(self, plan) -> torch.Tensor:
        """Logits [S, vocab] (float32) of the plan's sampled rows: its inputs are in place
        already (the plan's one copy). No host sync."""
        out = self.steps[plan.full_bucket].replay()
        return out[:plan.sample_rows.shape[0]]

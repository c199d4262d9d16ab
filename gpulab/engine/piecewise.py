r"""Piecewise CUDA graphs: steps that carry prompt chunks, replayed between attention calls.

A decode-only step has one shape per batch size, so the runner captures the whole step
in one CUDA graph per batch bucket (:mod:`.runner`). A step that mixes decodes with
prompt chunks does not: its attention depends on how the rows split into requests and
how long each history is. But *only* its attention does. Everything else the model
does works row by row (embedding, RMSNorm, per-token quantization, projections, RoPE,
MLP) and depends only on the number of token rows T. So (as vLLM V1 does) the model is
cut at its attention calls and the pieces between them are captured, per token-count
bucket, as graphs ("segments"):

    segment 0        embedding, RoPE tables, layer 0 before attention  -> x, q, k, v
    segment i        layer i-1 after attention, layer i before it      -> x, q, k, v
    segment L        layer L-1 after attention, final norm             -> h

Each segment also writes its layer's K and V into the paged cache (at static slots:
a write is one more launch, and the host, not the GPU, is what a step of a few dozen
rows waits for). A step of T real rows runs in the smallest bucket ≥ T (powers of two
from 16 up to the engine's token budget): replay segment 0, run layer 0's attention
eagerly on the real rows (the runner's :meth:`~.runner.ModelRunner.attend`: decode and
append attention), copy its output into the static buffer segment 1 reads, replay
segment 1, and so on; the logits of the sampled rows are computed from the last
segment's output.

Padded rows (T .. bucket) are harmless: their tokens and positions are whatever the
static buffers held (valid ids), every piece of a segment treats rows independently,
their K and V go to the cache's scratch page (the slot the decode graphs' padded rows
write), and attention only ever sees the real rows, so nothing attends to them; their
outputs are ignored.

Buffers: a segment's inputs are static tensors (the token ids and positions, the
attention output) or the previous segment's outputs (which a graph rewrites in place
at every replay). All buckets share one graph memory pool, captured largest first.
Without CUDA graphs (``cuda=False``) :class:`~.graph_capture.CapturedStep` calls each
segment instead of replaying it: the same buffers and order, checkable on a CPU.
"""
from __future__ import annotations

import bisect
import functools

import torch

from .graph_capture import CapturedStep


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts a step is padded to: 16, 32, 64, ... below ``max_tokens``, then
    ``max_tokens`` itself (the engine's token budget: no step has more rows)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes, t = [], smallest
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]


class PiecewiseGraphs:
    """The model's work between attention calls, captured per token-count bucket.

    ``runner``: the :class:`~.runner.ModelRunner` whose model, KV cache and attention
    the steps use. ``max_tokens``: the largest step (the engine's token budget).
    ``cuda``: capture real CUDA graphs (compiled mode on a GPU); otherwise every replay
    calls its segment (an emulation with the same buffers, for tests on a CPU).

    >>> pw = PiecewiseGraphs(runner, max_tokens=256, cuda=False)   # doctest: +SKIP
    >>> logits = pw.run(runner.plan(items))                        # doctest: +SKIP
    """

    def __init__(self, runner, max_tokens: int, cuda: bool):
        self.runner, self.model, self.cuda = runner, runner.model, cuda
        self.reference = runner.linear == "torch"
        cfg, dev = runner.cfg, runner.device
        self.buckets = token_buckets(max_tokens)
        t_max = self.buckets[-1]
        # static inputs, shared by every bucket (bucket t reads their first t rows)
        self.token_ids = torch.zeros(t_max, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t_max, dtype=torch.long, device=dev)
        self.slots = torch.full((t_max,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.attn_out = torch.zeros(t_max, cfg.n_heads, cfg.head_dim, dtype=runner.dtype, device=dev)
        # per bucket: the latest x and RoPE tables, which the next segment reads
        self.carry: dict[int, dict[str, torch.Tensor]] = {t: {} for t in self.buckets}
        self.segments: dict[int, list[CapturedStep]] = {}
        pool = None
        for t in reversed(self.buckets):                 # largest first, one memory pool
            segments = []
            for i in range(cfg.n_layers + 1):
                step = CapturedStep(functools.partial(self.segment, t, i), cuda, pool)
                pool = step.pool or pool
                if step.out is not None and i < cfg.n_layers:    # a graph: its outputs are static
                    self.keep(t, step.out)
                segments.append(step)
            self.segments[t] = segments

    def keep(self, t: int, out) -> None:
        x, cos, sin = out[:3]
        self.carry[t].update(x=x, cos=cos, sin=sin)

    def segment(self, t: int, i: int):
        """The captured function of segment ``i`` of bucket ``t``: layer i-1's work after
        attention (none for i = 0: the embedding instead), then layer i's before it.
        Returns (x, cos, sin, q, k, v), or the final-norm hidden states h for i = L."""
        m, blocks, ref = self.model, self.model.blocks, self.reference
        if i == 0:
            x, x_quantized = m.embed(self.token_ids[:t]), None
            pos = self.positions[:t]
            cos, sin = m.rope_cos[pos], m.rope_sin[pos]
        else:
            c = self.carry[t]
            x, x_quantized = blocks[i - 1].post_attention_to(c["x"], self.attn_out[:t], m.next_qkv(i - 1), ref)
            cos, sin = c["cos"], c["sin"]
        if i == len(blocks):
            return m.norm(x)
        q, k, v = blocks[i].pre_attention(x, cos, sin, ref, self.runner.kv_destination(self.slots[:t])(i),
                                          x_quantized)
        return x, cos, sin, q, k, v

    # -- a step -------------------------------------------------------------------------------
    def bucket(self, num_rows: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def fits(self, plan) -> bool:
        return 0 < plan.input_ids.shape[0] <= self.buckets[-1]

    def run(self, plan) -> torch.Tensor:
        """Logits [S, vocab] (float32) of the plan's sample rows, as
        :meth:`~.runner.ModelRunner.forward` computes them. No host sync."""
        n = plan.input_ids.shape[0]
        t = self.bucket(n)
        self.token_ids[:n].copy_(plan.input_ids)
        self.positions[:n].copy_(plan.positions)
        self.slots[:n].copy_(plan.slot_mapping)
        if n < t:
            self.slots[n:t].fill_(self.runner.scratch_slot)   # a longer step's slots are not scratch
        segments = self.segments[t]
        attend, out = self.runner.attend, self.attn_out[:n]
        for layer, step in enumerate(segments[:-1]):
            produced = step.replay()
            self.keep(t, produced)            # a graph's outputs: the same tensors every time
            q, k, v = produced[3:]
            attend(plan, layer, q[:n], k[:n], v[:n], out=out)
        h = segments[-1].replay()
        return self.model.logits(h[plan.sample_rows])

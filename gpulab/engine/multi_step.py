r"""Several decode steps per host step (``EngineConfig.multi_step = k``).

A decode step of the engine's ternary model at batch 64 is about 0.1 ms of GPU work in
its CUDA graph, and 0.5-0.6 ms of the host's: scheduling, the plan, the replay, reading
the tokens back and retiring them (H200, 2026-12-05). The GPU waits for the host, and a
server that adds its own work to that loop (building outputs, talking to its HTTP
processes) loses throughput one for one.

A *window* runs k decode steps of a decode-only batch in one replay: the host schedules
once, reserves the pages for k more tokens per sequence, fills one set of inputs, and
replays one graph that does, k times over,

    logits = model(ids, positions, slots[j])        # slot j of each sequence's next k
    ids    = argmax(logits)                         # the next step's input, on the device
    positions += 1;  lengths += 1

then reads the k × B tokens back in one copy. Its host work is paid once per k tokens.
What it costs: a request that arrives meanwhile waits for the window (k steps) before its
prompt is scheduled, and a sequence that stops inside a window (EOS, ``max_tokens``) has
computed up to k − 1 tokens for nothing, which the engine drops (its pages are freed
when it finishes; a page it filled inside that window is not added to the prefix cache,
since its pages are freed before the window's tokens are registered).

A sampled request's token is drawn inside the window as one step draws it (the noise is a
hash of the token's stream key, computed on the device: :mod:`.sampling`), step j's key
its key at the window's start plus j, so the seeded text is the same too; greedy and
sampled rows share a window, and a window whose requests filter (top-k, top-p) runs a
graph of its own. A step with prompt tokens, a request about to fork (``n > 1``), a
sequence within k tokens of the context, or a pool without room for k more tokens per
sequence runs one ordinary step instead. Tokens are the same as one step at a time: each
step of the window is the decode step's forward on the same rows.
Without CUDA graphs (a CPU, ``cuda=False``) every replay calls the same function, so the
window's bookkeeping is testable anywhere (:class:`~.graph_capture.CapturedStep`).
"""
from __future__ import annotations

import bisect
import functools

import numpy as np
import torch

from ..paged import raise_recorded_faults
from .graph_capture import CapturedStep, StagedBuffers
from .runner import ModelRunner, StepPlan, bucket_sizes, fill_tables
from .sampling import KEY_MASK, draw, filters, token_seed
from .sequence import Sequence


class DecodeWindows:
    """One captured window of ``k`` greedy decode steps per batch-size bucket (see the
    module's docstring). ``cuda``: CUDA graphs (captured now, after the runner's
    warm-up); else each replay runs the window eagerly."""

    def __init__(self, runner: ModelRunner, k: int, max_num_seqs: int, cuda: bool):
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise ValueError(f"a decode window runs k >= 2 steps, got {k!r}")
        self.runner, self.k = runner, k
        dev, b_max = runner.device, max_num_seqs
        long = dict(dtype=torch.long, device=dev)
        # the table comes last: a window of n sequences sends n of its rows, and the span
        # before it (ids, positions, lengths, slots) whole, padding included: the window
        # moves its padded rows' positions on, and the next send puts them back to zero
        # sampling: each row's temperature, stream key at its next token, greedy flag, top-k and
        # top-p, in the dtypes sample_on_device's tensors have (the same draws, bit for bit)
        real = torch.get_default_dtype()
        self.buf = StagedBuffers(ids=torch.zeros(b_max, **long), pos=torch.zeros(b_max, **long),
                                 lens=torch.zeros(b_max, dtype=torch.int32, device=dev),
                                 slots=torch.full((k, b_max), runner.scratch_slot, **long),
                                 temp=torch.ones(b_max, dtype=real, device=dev), keys=torch.zeros(b_max, **long),
                                 greedy=torch.ones(b_max, dtype=torch.bool, device=dev),
                                 top_k=torch.zeros(b_max, **long), top_p=torch.ones(b_max, dtype=real, device=dev),
                                 table=torch.zeros((b_max, runner.max_blocks), dtype=torch.int32, device=dev))
        self.rows = torch.arange(b_max, device=dev)
        self.buckets = bucket_sizes(b_max)
        self.cuda = cuda
        self.graphs: dict[tuple[int, str], CapturedStep] = {}
        self.pool = None
        for b in reversed(self.buckets):           # largest first, sharing one memory pool
            self.graph(b, "greedy")
        self.plan = StepPlan(self.buf["ids"], self.buf["pos"], self.buf["slots"][0], 0, self.buf["table"],
                             self.buf["lens"], None, runner.no_indptr, runner.no_table, runner.no_lens,
                             self.rows, [], use_graph=cuda)     # what the engine's step record reads

    def graph(self, b: int, kind: str) -> CapturedStep:
        """The window of bucket ``b``: "greedy" (captured at start-up), "sampled" or
        "filtered" (top-k/top-p; both captured at their first use)."""
        if (b, kind) not in self.graphs:
            # a capture runs the window (warm-ups, then the capture itself): from inputs that
            # write only the scratch slot and read no page, not the last window's
            for name, value in (("ids", 0), ("pos", 0), ("lens", 0), ("slots", self.runner.scratch_slot)):
                self.buf.set(name, torch.full_like(self.buf[name], value))
            self.graphs[b, kind] = CapturedStep(functools.partial(self.window, b, kind), self.cuda, self.pool)
            self.pool = self.graphs[b, kind].pool or self.pool
        return self.graphs[b, kind]

    def window(self, b: int, kind: str = "greedy") -> torch.Tensor:
        """The captured function: k decode steps of bucket ``b``'s rows, tokens [k, b]; a
        sampled window draws as :func:`~.sampling.sample_on_device` does, step j's noise
        from each row's stream key + j (its token j further on)."""
        run, buf = self.runner, self.buf
        ids, pos, lens, table = buf["ids"][:b], buf["pos"][:b], buf["lens"][:b], buf["table"][:b]
        live = (lens > 0).to(lens.dtype)          # padded rows keep length 0: they read no page
        top = (buf["top_k"][:b], buf["top_p"][:b]) if kind == "filtered" else None
        tokens = []
        for j in range(self.k):
            plan = StepPlan(ids, pos, buf["slots"][j, :b], b, table, lens, None, run.no_indptr, run.no_table,
                            run.no_lens, self.rows[:b], [])
            logits = run.forward(plan)
            if kind == "greedy":
                tok = logits.argmax(-1)
            else:
                tok = draw(logits, buf["temp"][:b], (buf["keys"][:b] + j) & KEY_MASK, buf["greedy"][:b], top)
            tokens.append(tok)
            if j + 1 < self.k:                    # the next step's inputs, without the host
                ids.copy_(tok)
                pos.add_(1)
                lens.add_(live)
        return torch.stack(tokens)

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def run(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's next k tokens. Its pages must hold positions up to
        ``num_computed_tokens + k - 1``, and its last token must be its one uncomputed
        token (a decode)."""
        n, k, bs = len(seqs), self.k, self.runner.block_size
        params = [s.params for s in seqs]
        kind = "greedy" if not any(x.temperature for x in params) else "filtered" if filters(params) else "sampled"
        b = self.bucket(n)
        graph = self.graph(b, kind)               # before the inputs are filled: a capture runs it
        a = self.buf.np
        p = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        for name in ("ids", "pos", "lens"):
            a[name].fill(0)
        a["ids"][:n] = [s.token_ids[-1] for s in seqs]
        a["pos"][:n] = p
        a["lens"][:n] = p + 1
        table = a["table"][:n]
        fill_tables(table, [s.block_table for s in seqs])
        at = p[None, :] + np.arange(k)[:, None]                     # [k, n]: positions written
        slots = a["slots"]
        slots.fill(self.runner.scratch_slot)
        slots[:, :n] = table[np.arange(n)[None, :], at // bs] * bs + at % bs
        if kind != "greedy":                      # padded rows: greedy, temperature 1
            a["temp"].fill(1)
            a["greedy"].fill(True)
            a["temp"][:n] = [x.temperature if x.temperature > 0 else 1.0 for x in params]
            a["greedy"][:n] = [x.greedy for x in params]
            a["keys"][:n] = [token_seed(s.seed, s.index, s.num_output_tokens) for s in seqs]
            a["top_k"][:n] = [x.top_k for x in params]
            a["top_p"][:n] = [float(x.top_p) for x in params]
        b_max = self.buckets[-1]
        self.buf.send(ids=b_max, pos=b_max, lens=b_max, slots=k, temp=b_max, keys=b_max, greedy=b_max,
                      top_k=b_max, top_p=b_max, table=n)
        tokens = graph.replay()[:, :n].t().tolist()                 # the window's one read-back
        raise_recorded_faults(self.runner.device)
        return tokens

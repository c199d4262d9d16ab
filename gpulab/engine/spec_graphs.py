r"""CUDA graphs for speculative decoding: one replay drafts k tokens, one replay verifies them.

Run eagerly, a speculative step launches hundreds of small kernels from Python (k draft
steps, then the target's layers over k+1 rows per sequence), and on a host that is slow
at Python the launches, not the GPU, set the pace. As for the runner's decode steps
(:mod:`.runner`), both halves have fixed shapes once the batch is padded to a bucket, so
each is captured once per bucket and replayed from static buffers.

**Verify** (:class:`VerifyGraphs`). B decoding sequences with up to k drafts each are
B · (k+1) rows; sequence b owns rows b(k+1) .. b(k+1)+k. The graph runs the target over
them through the append attention kernel (its work list is built on the device from
``qo_indptr``, no host sync) and leaves logits and argmax of every row in its outputs.
Rows a sequence does not use (fewer drafts than k, or a bucket larger than the batch)
are padding: their K and V go to the runner's scratch page, and they form requests of
their own with no history (kv_len 0: they attend to nothing). So the attention sees 2B
requests, 2b = sequence b's rows, 2b+1 its padding, and only indptr and lengths change
from step to step.

**Draft** (:class:`MLGRUGraphDrafter`). The MatMul-free LM's state is one vector per
layer and sequence. A pool holds k+1 states per sequence slot: ``hist[i]``, the state
after the sequence's tokens up to ``done`` and its first i drafts. A replay gathers each
sequence's start state from the pool, consumes its last committed token, then drafts k
tokens one after the other on the device (argmax, or a Gumbel-max draw whose noise the
host computes from the same seeded streams as the eager drafter), and writes the k+1
states back. When the target has accepted a drafts, the next start state is
``hist[a]``: rewinding picks a row, it recomputes nothing. A sequence not in the pool
(new, or after steps without drafts) catches up eagerly over its missing tokens once.
Compiled, a greedy replay is one kernel (:func:`gpulab.block_step.draft_rollout`: every
step of every layer, the head and the argmax in one launch instead of about eight
launches a draft token).

**Drafting ahead** (:meth:`MLGRUGraphDrafter.launch_ahead`). For greedy sequences the
next step's start needs nothing the host must decide: the accepted count a is the
number of leading drafts equal to the target's argmax, the next first token is the
argmax after them, the start state is ``hist[a]``. So right after the verify replay
one more replay computes them and drafts the next step, before the host has read a
single token; the host then reads and reports this step while the GPU drafts the next
one, instead of leaving the GPU idle meanwhile.

CUDA graphs are captured in compiled mode on a GPU only. Elsewhere
:class:`~.graph_capture.CapturedStep` calls the function at every replay: the same buffers
and bookkeeping, testable on a CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..block_step import draft_rollout_into
from ..paged import fault_flag
from ..prefill import append_schedule_device, append_tile_config, launch_append_attention
from .batch_attention import append_attention_reference
from .graph_capture import CapturedStep, StagedBuffers, tokens_from_device
from .runner import ModelRunner, bucket_sizes
from .sampling import filter_top_k_top_p
from .sequence import Sequence, Status

BYTES = 256          # the MLGRU draft's vocabulary: token ids >= 256 (BOS, EOS) are not bytes


@dataclass
class GraphStepPlan:
    """What the engine records of a step that replayed a speculative graph."""
    use_graph: bool = True
    prefix: tuple | None = None


# -- verify ------------------------------------------------------------------------------------
class VerifyGraphs:
    """The target's pass over B sequences × (k+1) rows, one graph per batch bucket."""

    def __init__(self, runner: ModelRunner, k: int, max_num_seqs: int, cuda: bool):
        self.runner, self.k = runner, k
        dev, b_max, k1 = runner.device, max_num_seqs, k + 1
        i32 = dict(dtype=torch.int32, device=dev)
        self.buf = StagedBuffers(
            ids=torch.zeros(b_max * k1, dtype=torch.long, device=dev),
            pos=torch.zeros(b_max * k1, dtype=torch.long, device=dev),
            slots=torch.full((b_max * k1,), runner.scratch_slot, dtype=torch.long, device=dev),
            indptr=torch.zeros(2 * b_max + 1, **i32),                 # all requests empty
            table=torch.zeros((2 * b_max, runner.max_blocks), **i32),
            lens=torch.zeros(2 * b_max, **i32),
            draft_at=torch.full((b_max * k1,), -1, dtype=torch.long, device=dev))
        # drafts handed over on the device (:class:`PendingDrafts`): row r's token is
        # drafts[draft_at[r]] where draft_at[r] >= 0, else ids[r] (from the host)
        self.drafts = torch.zeros(b_max * k, dtype=torch.long, device=dev)
        self.graphs: dict[int, CapturedStep] = {}
        pool = None
        for b in reversed(bucket_sizes(b_max)):       # largest first, sharing one memory pool
            self.graphs[b] = CapturedStep(functools.partial(self.forward, b), cuda, pool)
            pool = self.graphs[b].pool

    def fits(self, items: list[tuple[Sequence, int]], drafted) -> bool:
        """A batch the graphs can run: only decoding sequences, each with its last
        committed token plus its drafts (``drafted``) or that token alone."""
        k1 = self.k + 1
        return 0 < len(items) <= max(self.graphs) and all(
            s.num_output_tokens > 0 and s.num_computed_tokens + n == s.num_tokens
            and (n == 1 or (s in drafted and n <= k1)) for s, n in items)

    def forward(self, b: int):
        """The captured function: (logits [b(k+1), V] float32, their argmax)."""
        run, buf, rows = self.runner, self.buf, b * (self.k + 1)
        slots = buf["slots"][:rows]
        indptr, table, lens = buf["indptr"][:2 * b + 1], buf["table"][:2 * b], buf["lens"][:2 * b]
        if run.attention == "triton":
            # tiles sized for k+1 new tokens (not a prefill's 128 rows); the work list once for all layers
            group = run.cfg.n_heads // run.cfg.n_kv_heads
            tiles = append_tile_config(run.dtype, run.cfg.head_dim, group, max_new=self.k + 1)
            work = append_schedule_device(indptr, rows, tiles["BLOCK_M"] // group)

        def attend(layer, q, k, v):            # this step's K, V stored by the model (kv_cache)
            kc, vc = run.k_cache[layer], run.v_cache[layer]
            if run.attention == "torch":
                return append_attention_reference(q, kc, vc, indptr, table, lens)
            o = torch.empty_like(q)
            launch_append_attention(q, kc, vc, indptr, table, lens, *work, o, None, fault_flag(q.device),
                                    True, None, tiles)
            return o

        ids = tokens_from_device(buf["ids"][:rows], buf["draft_at"][:rows], self.drafts)
        h = run.model.hidden_states(ids, buf["pos"][:rows], attend, reference=run.linear == "torch",
                                    kv_cache=run.kv_destination(slots))
        logits = run.model.logits(h)
        return logits, logits.argmax(-1)

    def bucket(self, n: int) -> int:
        return next(b for b in sorted(self.graphs) if b >= n)

    def run(self, items: list[tuple[Sequence, int]], pending: PendingDrafts | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the buffers for ``items`` (sequence i's rows start at i·(k+1)) and replay:
        (logits [B(k+1), V], argmax [B(k+1)]) on the device, no host sync. The drafts of
        the sequences in ``pending`` come from its device tensor (their ``token_ids``
        hold placeholders until it is resolved)."""
        b, k1, bs = self.bucket(len(items)), self.k + 1, self.runner.block_size
        h = self.buf.np
        rows = b * k1
        h["ids"][:rows], h["pos"][:rows], h["slots"][:rows] = 0, 0, self.runner.scratch_slot
        h["draft_at"][:rows] = -1
        h["table"][:2 * b], h["lens"][:2 * b] = 0, 0
        # the rows gathered in Python lists, then one NumPy write per field: NumPy calls per
        # sequence took this fill 0.49 ms at batch 64 (0.17 ms now, on a 2-core CPU), and
        # all-NumPy index arithmetic made a whole step 0.09 ms slower at batch 1
        # (tools/spec_host_cost.py)
        used = np.zeros(b, dtype=np.int32)
        at, ids, pos, slots, draft_rows, draft_at = [], [], [], [], [], []
        for i, (seq, n) in enumerate(items):
            start, r, table = seq.num_computed_tokens, i * k1, seq.block_table
            at += range(r, r + n)
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += [table[q // bs] * bs + q % bs for q in range(start, start + n)]
            h["table"][2 * i, :len(table)] = table
            used[i] = n
            j = -1 if pending is None else pending.column.get(seq, -1)
            if j >= 0 and n > 1:         # rows r+1.. are its drafts 0..n-2, read on the device
                draft_rows += range(r + 1, r + n)
                draft_at += range(j * self.k, j * self.k + n - 1)
        h["ids"][at], h["pos"][at], h["slots"][at] = ids, pos, slots
        h["draft_at"][draft_rows] = draft_at
        h["lens"][0:2 * len(items):2] = [seq.num_computed_tokens + n for seq, n in items]
        first = np.arange(b, dtype=np.int32) * k1
        h["indptr"][0] = 0
        h["indptr"][1:2 * b + 1:2] = first + used          # end of sequence b's rows
        h["indptr"][2:2 * b + 1:2] = first + k1            # end of its padding
        self.buf.send(ids=rows, pos=rows, slots=rows, indptr=2 * b + 1, table=2 * b, lens=2 * b, draft_at=rows)
        if pending is not None:
            flat = pending.flat()
            self.drafts[:flat.numel()].copy_(flat)
        return self.graphs[b].replay()


# -- draft -------------------------------------------------------------------------------------
class PendingDrafts:
    """One draft replay's tokens, still on the device: ``tokens`` [k, b], column j for
    ``seqs[j]`` (the graph's output buffer: read before the next replay of that graph).
    ``ks[j]``: how many of them sequence j proposes. :meth:`resolve` reads them (once)."""

    def __init__(self, drafter: "MLGRUGraphDrafter", seqs: list[Sequence], done: list[int | None], ks: list[int],
                 tokens: torch.Tensor, q: torch.Tensor | None):
        self.drafter, self.seqs, self.done, self.ks, self.tokens, self.q = drafter, seqs, done, ks, tokens, q
        self.column = {seq: j for j, seq in enumerate(seqs)}
        self.ids: list[list[int]] | None = None
        self._flat: torch.Tensor | None = None

    def flat(self) -> torch.Tensor:
        """The tokens as the host reads them back: [len(seqs) · k], sequence by sequence. A
        copy, made at the first call: ``tokens`` is a graph's output, which its next replay
        rewrites (drafting ahead replays it before the host reads these; for one sequence
        a flattened view would share its memory)."""
        if self._flat is None:
            self._flat = self.tokens[:, :len(self.seqs)].t().clone(memory_format=torch.contiguous_format).view(-1)
        return self._flat

    def probabilities(self) -> list[torch.Tensor | None]:
        """Per sequence, its drafts' q [ks[j], V] (on the device), None when greedy."""
        return [None if seq.params.greedy else self.q[:n, j] for j, (seq, n) in enumerate(zip(self.seqs, self.ks))]

    def resolve(self, flat: list[int] | None = None) -> list[tuple[list[int], torch.Tensor | None]]:
        """(tokens, q or None if greedy) per sequence: from ``flat`` (:meth:`flat` already
        copied to the host with other results) or read back now. Records each sequence's
        drafts in the drafter: its pool rows now hold the states after them (not for a
        sequence whose ``done`` is None, or that the drafter has forgotten meanwhile)."""
        if self.ids is None:
            flat = self.flat().tolist() if flat is None else flat
            k = self.drafter.k
            self.ids = [flat[j * k:(j + 1) * k] for j in range(len(self.seqs))]
            for seq, done, row in zip(self.seqs, self.done, self.ids):
                if done is not None and seq.seq_id in self.drafter.slots:
                    self.drafter.record[seq.seq_id] = (done, row)
        return [(row[:n], q) for row, n, q in zip(self.ids, self.ks, self.probabilities())]


def last_byte(tokens: list[int]) -> int | None:
    """Index of the last byte token (not BOS/EOS) in ``tokens``, None if there is none."""
    return next((m for m in range(len(tokens) - 1, -1, -1) if tokens[m] < BYTES), None)


class MLGRUGraphDrafter:
    """:class:`~gpulab.engine.speculative.MLGRUDrafter`'s proposals from one graph replay
    per step (the same ``propose``/``forget`` interface).

    ``noise(starts, count, vocab)``: the Gumbel noise [len(starts), count, vocab] (float32)
    of sampled sequences' drafts, ``starts`` their (sequence, first position), from the
    eager drafter's seeded streams (:func:`~gpulab.engine.speculative.draft_noise`). ``fused``:
    each block's step as one kernel (the eager drafter's choice). ``ahead``: capture the
    graphs of :meth:`launch_ahead` now too (otherwise at their first use)."""

    use_rollout = True        # False: greedy graphs step the model k + 1 times (for comparisons)

    def __init__(self, model, vocab_size: int, k: int, max_num_seqs: int, noise, cuda: bool, fused: bool = False,
                 ahead: bool = False):
        self.model, self.vocab_size, self.k, self.noise, self.fused = model, vocab_size, k, noise, fused
        if fused:                                 # made now, never inside a capture
            for block in model.blocks:
                block.step_weights()
        self.device = dev = model.embed.weight.device
        self.max_batch = max_num_seqs
        n_slots = 2 * max_num_seqs                # live sequences <= max_num_seqs: spare slots
        self.scratch = n_slots                    # padded rows read and write this slot
        k1 = k + 1
        # pool[layer] row s·(k+1) + i: slot s's state hist[i] (float32, as the step returns it)
        self.pool = torch.zeros((len(model.blocks), (n_slots + 1) * k1, model.d_model), device=dev)
        # greedy graphs: all k drafts in one kernel (gpulab.block_step.draft_rollout) where it applies
        self.rollout = model.rollout_weights() if fused and self.use_rollout else None
        self.free = list(range(n_slots))
        self.slots: dict[int, int] = {}                           # seq_id -> slot
        self.record: dict[int, tuple[int, list[int]]] = {}        # seq_id -> (done, its k drafts)
        self.buf = StagedBuffers(
            src=torch.full((max_num_seqs,), self.scratch * k1, dtype=torch.long, device=dev),
            first=torch.zeros(max_num_seqs, dtype=torch.long, device=dev),
            dst=self.scratch * k1 + torch.arange(max_num_seqs * k1, device=dev) % k1,
            # launch_ahead, per sequence: its first verify row, drafts verified, pool row
            # of its hist[0], column in the verified drafts (before the large fields below)
            ahead=torch.zeros((max_num_seqs, 4), dtype=torch.long, device=dev),
            greedy=torch.ones(max_num_seqs, dtype=torch.bool, device=dev),
            temp=torch.ones(max_num_seqs, device=dev),
            top_k=torch.zeros(max_num_seqs, dtype=torch.long, device=dev),
            top_p=torch.ones(max_num_seqs, device=dev),
            noise=torch.zeros((max_num_seqs, k, vocab_size), device=dev))
        self.specials = torch.full((max_num_seqs, vocab_size - BYTES), -torch.inf, device=dev)
        self.offsets = torch.arange(k, device=dev)
        # launch_ahead's inputs where its graphs find them: the verify argmax, the drafts verified
        self.best_in = torch.zeros(max_num_seqs * k1, dtype=torch.long, device=dev)
        self.drafts_in = torch.zeros((k, max_num_seqs), dtype=torch.long, device=dev)
        self.cuda = cuda
        self.graphs: dict[tuple[int, bool | str], CapturedStep] = {}
        # with the rollout kernel, a greedy graph's last step runs apart (launch_last), on
        # a side stream beside the next verify pass; the drafter's next launch waits for it
        self.last_steps: dict[tuple[int, bool | str], CapturedStep] = {}
        self.side = torch.cuda.Stream(device=dev) if cuda else None
        self.last_done = None
        self.mempool = None
        for b in reversed(bucket_sizes(max_num_seqs)):   # greedy graphs now, sampled ones when first needed
            self.graph(b, sampled=False)
            if ahead:                                    # (a capture waits for the GPU: not while serving)
                self.graph(b, "ahead")

    def graph(self, b: int, sampled: bool | str) -> CapturedStep:
        """The replay for ``b`` sequences: greedy (``sampled`` False), sampled (True), or
        greedy starting where the verify pass left each sequence ("ahead")."""
        if (b, sampled) not in self.graphs:
            k1 = self.k + 1       # capture from neutral buffers: warm-ups touch only the scratch slot
            self.buf.set("src", torch.full_like(self.buf["src"], self.scratch * k1))
            self.buf.set("dst", self.scratch * k1 + torch.arange(self.buf["dst"].numel(), device=self.device) % k1)
            self.buf.set("ahead", self.neutral_ahead(self.buf["ahead"].shape[0]))
            fn = functools.partial(self.forward_ahead, b) if sampled == "ahead" else \
                functools.partial(self.forward, b, sampled)
            self.graphs[b, sampled] = CapturedStep(fn, self.cuda, self.mempool)
            self.mempool = self.graphs[b, sampled].pool or self.mempool
            if self.rollout is not None and sampled is not True:
                last = functools.partial(self.forward_last, b, sampled)
                self.last_steps[b, sampled] = CapturedStep(last, self.cuda, self.mempool)
                self.mempool = self.last_steps[b, sampled].pool or self.mempool
        return self.graphs[b, sampled]

    def neutral_ahead(self, n: int) -> torch.Tensor:
        """``n`` rows of launch_ahead's table that start nothing but the scratch slot."""
        rows = torch.zeros((n, 4), dtype=torch.long, device=self.device)
        rows[:, 2] = self.scratch * (self.k + 1)
        return rows

    def forward_ahead(self, b: int):
        """The captured function of :meth:`launch_ahead`: each of the ``b`` rows' start (first
        token, pool row) from the verify pass's argmax, then :meth:`forward` (greedy). With
        the rollout kernel both happen in its one launch (its ``ahead`` start); otherwise
        in PyTorch ops (about fifteen small kernels) before the stepped draft."""
        info = self.buf["ahead"][:b]
        if self.rollout is not None:
            k = self.k
            drafts = torch.empty((k, b), dtype=torch.long, device=self.device)
            draft_rollout_into(self.buf["first"][:b], self.buf["src"][:b], self.buf["dst"][:b * (k + 1)],
                               self.pool, self.pool, self.rollout, k, drafts,
                               ahead=(info, self.drafts_in, self.best_in, BYTES), part="drafts")
            return drafts, None
        drafts = self.drafts_in.index_select(1, info[:, 3]).t()                           # [b, k]
        match = (drafts == self.best_in[info[:, :1] + self.offsets]) & (self.offsets < info[:, 1:2])
        accepted = match.cumprod(1).sum(1)
        first = self.best_in[info[:, 0] + accepted]
        # a special token (EOS) is no draft input: the engine forgets that sequence on landing
        self.buf["first"][:b] = torch.where(first < BYTES, first, 0)
        self.buf["src"][:b] = info[:, 2] + accepted
        return self.forward(b, sampled=False)

    def forward(self, b: int, sampled: bool):
        """The captured function: k draft tokens [k, b] (and q [k, b, V] when sampled)."""
        buf, k = self.buf, self.k
        if self.rollout is not None and not sampled:
            drafts = torch.empty((k, b), dtype=torch.long, device=self.device)
            draft_rollout_into(buf["first"][:b], buf["src"][:b], buf["dst"][:b * (k + 1)], self.pool, self.pool,
                               self.rollout, k, drafts, part="drafts")
            return drafts, None
        states = [pool.index_select(0, buf["src"][:b]) for pool in self.pool]
        token = buf["first"][:b]
        hist, drafts, qs = [], [], []
        for i in range(k + 1):
            out, states = self.model.step(token, states, self.fused)
            hist.append(states)
            if i == k:                     # the last step only leaves hist[k] (all k accepted)
                break
            token = out.argmax(-1)               # a byte: the specials' widened logits are -inf
            if sampled:
                logits = torch.cat([out.float(), self.specials[:b]], dim=-1)
                scaled = filter_top_k_top_p(logits / buf["temp"][:b, None], buf["top_k"][:b], buf["top_p"][:b])
                q = torch.softmax(scaled, dim=-1)
                drawn = (q.log() + buf["noise"][:b, i]).argmax(-1)
                token = torch.where(buf["greedy"][:b], token, drawn)
                qs.append(q)
            drafts.append(token)
        dst = buf["dst"][:b * (k + 1)]
        for layer, pool in enumerate(self.pool):
            pool.index_copy_(0, dst, torch.stack([h[layer] for h in hist], dim=1).flatten(0, 1))
        return torch.stack(drafts), (torch.stack(qs) if sampled else None)

    def forward_last(self, b: int, kind: bool | str):
        """The captured function of graph (b, kind)'s last step: each row's states after its
        last draft (hist[k], wanted only if the verify pass accepts all k), from the drafts
        and states that graph's replay left."""
        k, buf = self.k, self.buf
        drafts = self.graphs[b, kind].out[0]
        draft_rollout_into(buf["first"][:b], buf["src"][:b], buf["dst"][:b * (k + 1)], self.pool, self.pool,
                           self.rollout, k, drafts, part="last")

    def launch_last(self, b: int, kind: bool | str) -> None:
        """The last step of graph (b, kind), just replayed: on the side stream (it then runs
        beside what the engine launches next: the verify pass), else at once."""
        last = self.last_steps.get((b, kind))
        if last is None:
            return
        if self.side is None:
            last.replay()
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            last.replay()
        self.last_done = self.side.record_event()

    def wait_last(self) -> None:
        """The current stream waits for the last step launched apart (before the pool, the
        staged inputs or a graph's drafts change under it)."""
        if self.last_done is not None:
            torch.cuda.current_stream().wait_event(self.last_done)
            self.last_done = None

    # -- the Drafter interface --------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(seqs)
        go = [i for i, s in enumerate(seqs) if ks[i] > 0 and last_byte(s.token_ids) is not None]
        busy = {seqs[i].seq_id for i in go}
        for at in range(0, len(go), self.max_batch):
            part = go[at:at + self.max_batch]
            for i, (tokens, q) in zip(part, self.launch([seqs[i] for i in part], busy).resolve()):
                out[i] = (tokens[:ks[i]], None if q is None else q[:ks[i]])
        return out

    def propose_on_device(self, seqs: list[Sequence], ks: list[int]) -> "PendingDrafts | None":
        """:meth:`propose` without reading the drafts back: one replay for every sequence
        that can draft (None if none can; at most ``max_num_seqs`` sequences). The engine
        hands the drafts to the verify graph on the device and reads them back with the
        verification's own copy, so a step waits for the GPU once, not twice."""
        go = [(s, k) for s, k in zip(seqs, ks) if k > 0 and last_byte(s.token_ids) is not None]
        if not go:
            return None
        if len(go) > self.max_batch:
            raise ValueError(f"{len(go)} sequences to draft, more than the graphs' {self.max_batch}")
        pending = self.launch([s for s, _ in go], {s.seq_id for s, _ in go})
        pending.ks = [k for _, k in go]
        return pending

    def launch(self, seqs: list[Sequence], busy: set) -> "PendingDrafts":
        """One replay for ``seqs`` (at most the largest bucket): k drafts each, left on the
        device (q [k, V] per sampled sequence stays there for good)."""
        k, k1 = self.k, self.k + 1
        self.wait_last()
        b = next(s for s in bucket_sizes(self.max_batch) if s >= len(seqs))
        sampled = any(not s.params.greedy for s in seqs)
        starts = self.starts(seqs, busy)
        firsts = [s.token_ids[last_byte(s.token_ids)] for s in seqs]
        graph = self.graph(b, sampled)
        h = self.buf.np
        h["src"][:b], h["first"][:b], h["greedy"][:b] = self.scratch * k1, 0, 1
        h["dst"][:b * k1] = self.scratch * k1 + np.arange(b * k1) % k1
        for j, (seq, (slot, row), first) in enumerate(zip(seqs, starts, firsts)):
            h["src"][j], h["first"][j] = row, first
            h["dst"][j * k1:(j + 1) * k1] = slot * k1 + np.arange(k1)
            if not seq.params.greedy:
                h["greedy"][j], h["temp"][j] = 0, seq.params.temperature
                h["top_k"][j], h["top_p"][j] = seq.params.top_k, float(seq.params.top_p)
        if sampled:               # every sampled row's k draws' noise in one call
            rows = [j for j, seq in enumerate(seqs) if not seq.params.greedy]
            h["noise"][rows] = self.noise([(seqs[j], seqs[j].num_tokens) for j in rows], k, self.vocab_size).numpy()
        counts = dict(src=b, first=b, dst=b * k1, greedy=b)
        if sampled:
            counts.update(temp=b, top_k=b, top_p=b, noise=b)
        self.buf.send(**counts)
        drafts, q = graph.replay()
        self.launch_last(b, sampled)
        return PendingDrafts(self, seqs, [s.num_tokens for s in seqs], [k] * len(seqs), drafts, q)

    def launch_ahead(self, verified: PendingDrafts, items: list[tuple[Sequence, int]], n_drafts: dict,
                     best: torch.Tensor) -> "PendingDrafts | None":
        """The next step's greedy drafts, launched before the host reads this step's tokens.

        ``verified``: the drafts the verify graph just checked (greedy); ``items``: the
        verify batch (sequence i's rows start at i·(k+1)); ``n_drafts``: per sequence of
        ``verified`` that was verified, how many of its drafts; ``best``: the target's
        argmax of every row (the verify graph's output). On the device, per sequence:
        accepted a = leading drafts equal to the argmax, next first token = the argmax
        after them, start state = ``hist[a]`` (the replay then rewrites the slot's rows).
        The result's ``done`` is filled in once the engine has the tokens
        (:meth:`land_ahead`). One replay (:meth:`forward_ahead`), no host sync."""
        k, k1 = self.k, self.k + 1
        go = [(i, seq) for i, (seq, _) in enumerate(items) if seq in n_drafts and seq.seq_id in self.slots]
        if not go:
            return None
        self.wait_last()
        verified.flat()                        # this step's drafts, copied before the replay below
        m = len(go)
        b = next(s for s in bucket_sizes(self.max_batch) if s >= m)
        graph = self.graph(b, "ahead")         # (captured from neutral buffers the first time)
        h = self.buf.np
        h["dst"][:b * k1] = self.scratch * k1 + np.arange(b * k1) % k1
        h["ahead"][:b] = (0, 0, self.scratch * k1, 0)
        dst, rows = [], []              # gathered, then written at once (as VerifyGraphs.run)
        for i, seq in go:
            row = self.slots[seq.seq_id] * k1
            dst += range(row, row + k1)
            rows.append((i * k1, n_drafts[seq], row, verified.column[seq]))
        h["dst"][:m * k1], h["ahead"][:m] = dst, rows
        self.buf.send(dst=b * k1, ahead=b)
        self.best_in[:best.numel()].copy_(best)
        self.drafts_in[:, :verified.tokens.shape[1]].copy_(verified.tokens)
        tokens, _ = graph.replay()
        self.launch_last(b, "ahead")
        return PendingDrafts(self, [seq for _, seq in go], [None] * m, [k] * m, tokens, None)

    def land_ahead(self, ahead: PendingDrafts) -> None:
        """The engine has the tokens of the step ``ahead`` was launched in: a running
        sequence whose last token is a byte started where it now ends (``done``, its
        length); any other is forgotten (it catches up when it drafts again)."""
        for j, seq in enumerate(ahead.seqs):
            if seq.status is Status.RUNNING and seq.token_ids and seq.token_ids[-1] < BYTES:
                ahead.done[j] = seq.num_tokens
            else:
                self.forget(seq.seq_id)

    def starts(self, seqs: list[Sequence], busy: set) -> list[tuple[int, int]]:
        """Per sequence, (slot, pool row of the state after its tokens before its last byte).
        (Specials are no input to the draft: the graph consumes the last byte next, and
        the tokens after it are specials, so the state is then the one after all tokens.)

        ``record`` says the slot holds hist[i] = state after tokens[:done] + drafts[:i]:
        if the sequence's tokens since ``done`` begin with the drafts up to the needed
        length, that row is it. Otherwise the longest matching row (a new sequence: the
        zero state) catches up eagerly and lands in hist[0]: all such sequences in one
        right-padded pass of the draft model, not one pass each (at batch 64 every new
        request needs one)."""
        k1 = self.k + 1
        out, behind = [], []          # behind: (slot, pool row to start from or None, tokens)
        for seq in seqs:
            slot = self.slots.get(seq.seq_id)
            if slot is None:
                slot = self.new_slot(seq.seq_id, busy)
            need = last_byte(seq.token_ids)
            done, drafts = self.record.get(seq.seq_id, (need + 1, []))
            i = 0
            if done <= need:
                while i < min(need - done, len(drafts)) and seq.token_ids[done + i] == drafts[i]:
                    i += 1
                if done + i == need:
                    out.append((slot, slot * k1 + i))
                    continue
                base, frm = slot * k1 + i, done + i
            else:                                        # no usable state: from the start
                base, frm = None, 0
            behind.append((slot, base, [t for t in seq.token_ids[frm:need] if t < BYTES]))
            self.record[seq.seq_id] = (need, [])
            out.append((slot, slot * k1))
        if behind:
            self.catch_up(behind)
        return out

    @torch.no_grad()
    def catch_up(self, behind: list[tuple[int, int | None, list[int]]]) -> None:
        """Write hist[0] of each slot: the state after ``tokens`` from pool row ``base``
        (None: the zero state), every sequence in one pass of the draft model."""
        k1 = self.k + 1
        h0 = [torch.stack([pool[base] if base is not None else torch.zeros_like(pool[0])
                           for _, base, _ in behind]) for pool in self.pool]
        n = [len(tokens) for _, _, tokens in behind]
        moving = [j for j in range(len(behind)) if n[j]]
        states = [h.clone() for h in h0]                   # no new byte: the base state
        if moving:
            width = max(n)
            ids = torch.zeros((len(moving), width), dtype=torch.long)
            for r, j in enumerate(moving):
                ids[r, :n[j]] = torch.tensor(behind[j][2])
            lengths = torch.tensor([n[j] for j in moving], device=self.device)
            rows = torch.tensor(moving, device=self.device)
            _, new = self.model(ids.to(self.device), [h[rows] for h in h0], lengths=lengths)
            for layer, h in enumerate(new):
                states[layer][rows] = h.to(states[layer].dtype)
        dst = torch.tensor([slot * k1 for slot, _, _ in behind], device=self.device)
        for pool, h in zip(self.pool, states):
            pool[dst] = h

    def new_slot(self, seq_id: int, busy: set) -> int:
        if not self.free:                 # evict a sequence not drafting now (it catches up later)
            self.forget(next(s for s in self.slots if s not in busy))
        self.slots[seq_id] = slot = self.free.pop()
        return slot

    def forget(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)
        self.record.pop(seq_id, None)

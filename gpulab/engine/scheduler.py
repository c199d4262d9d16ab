"""Iteration-level scheduling (continuous batching): every step decides afresh which
sequences run and how many of their tokens.

One step has a *token budget* (``max_num_batched_tokens``) and a cap on sequences
(``max_num_seqs``). :meth:`Scheduler.schedule`:

1. **Running sequences first**, oldest first. A decoding sequence needs 1 token; one
   still in its prompt needs the rest of it, cut to what the budget has left (*chunked
   prefill*: a long prompt is spread over several steps, mixed with other requests'
   decodes, so it never stalls them for long). If the KV pool cannot hold the new
   tokens, the newest running sequence is *preempted*: its pages are released and it
   goes back to the front of the waiting queue, to be recomputed later. The oldest
   requests keep their place: first come, first served.
2. **Then waiting sequences**, in arrival order, while budget, sequence slots and pages
   remain. Admission looks the prompt up in the prefix cache first: cached pages are
   reused and only the rest is computed. The queue is not skipped: if its head does not
   fit, later requests wait too (no starvation of long prompts).

   With ``delay_factor`` > 0 (vLLM's ``scheduler_delay_factor``), new requests are not
   admitted while others run until the oldest has waited ``delay_factor`` times the last
   step that admitted prompts took. Requests that arrive one by one (clients of a server)
   are then admitted together, in one step with prompt tokens instead of one each, and the
   decode-only steps between can run as windows (:mod:`.multi_step`); each waits a little
   longer for its first token.

The result, a :class:`ScheduledBatch`, says for each chosen sequence how many tokens
to run, plus the page copies (copy-on-write) to do first. After the step,
:meth:`Scheduler.postprocess` appends the sampled tokens and retires finished sequences.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens to run)
    copies: list[tuple[int, int]] = field(default_factory=list)       # pages to copy first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def prefill_flags(self) -> list[bool]:
        """Per item: does it compute prompt tokens (before postprocess counts them)?"""
        return [s.num_computed_tokens < s.num_prompt_tokens or n > 1 for s, n in self.items]

    def __len__(self):
        return len(self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, chunked_prefill: bool = True,
                 max_model_len: int | None = None, decode_reserve: int = 0, delay_factor: float = 0.0,
                 clock=time.perf_counter):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        if not chunked_prefill and max_model_len and max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill a whole prompt must fit one step: "
                             f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_model_len ({max_model_len})")
        self.bm = block_manager
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        # pages left free per running sequence when admitting a new one, so the running
        # ones can grow a while before anyone is preempted (and recomputed)
        self.decode_reserve = decode_reserve
        if not 0 <= delay_factor < float("inf"):
            raise ValueError(f"delay_factor must be a number >= 0 (0: admit at once), got {delay_factor!r}")
        # admission delay: the clock of the requests' arrival_time, when the last step that
        # admitted prompts was scheduled, and how long it took (until the next schedule)
        self.delay_factor, self.clock = delay_factor, clock
        self.now = 0.0
        self.prompt_step_at: float | None = None
        self.prompt_step_s = 0.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s pages and requeue it first; it will recompute its tokens."""
        self.bm.free_sequence(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def admitting(self) -> bool:
        """May this step admit waiting requests? Always, unless ``delay_factor`` holds them
        back: then only when nothing runs, or the oldest has waited ``delay_factor`` times
        the last prompt step's time."""
        if not self.delay_factor:
            return True
        self.now = now = self.clock()
        if self.prompt_step_at is not None:      # the step before admitted prompts: its time
            self.prompt_step_s, self.prompt_step_at = now - self.prompt_step_at, None
        if not self.running or not self.waiting:
            return True
        oldest = min(s.arrival_time for s in self.waiting)   # a preempted one is older than the rest
        return now - oldest >= self.delay_factor * self.prompt_step_s

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        admit = self.admitting()                 # before this step's running sequences are counted
        # 1. running sequences, oldest first; preempt the newest when pages run out
        bm, running, items = self.bm, self.running, batch.items
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)     # seq.num_uncomputed
            if n == 0:          # its last token is still being sampled (the engine's overlap): skip
                i += 1
                continue
            while not bm.can_append(seq, n):
                victim = running.pop()
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                copies = bm.append_slots(seq, n)
                if copies:
                    batch.copies += copies
                items.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        # 2. waiting sequences in arrival order (not in a step that had to preempt)
        while admit and self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            todo = seq.num_tokens - len(hits) * self.bm.block_size
            if todo > budget and not self.chunked_prefill:
                break
            n = min(todo, budget)
            if not self.bm.can_allocate(seq, hits, seq.num_tokens - todo + n,
                                        keep_free=self.decode_reserve * len(self.running)):
                break
            self.waiting.popleft()
            self.bm.allocate(seq, hits, seq.num_tokens - todo + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
            if self.delay_factor:
                self.prompt_step_at = self.now
        return batch

    def postprocess(self, batch: ScheduledBatch, commit: bool = True) -> None:
        """After the step ran: count the computed tokens and register full pages
        (``commit=False``: count only; :meth:`commit` registers them once their tokens
        are known on the host)."""
        for seq, n in batch.items:
            seq.num_computed_tokens += n
        if commit:
            self.commit(batch)

    def commit(self, batch: ScheduledBatch) -> None:
        """Register the batch's running sequences' full, computed pages in the prefix cache."""
        commit, bs = self.bm.commit_full_blocks, self.bm.block_size
        for seq, _ in batch.items:
            if seq.status is Status.RUNNING and seq.num_computed_tokens // bs != seq.num_registered_blocks:
                commit(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq``: release its pages (their hashes stay cached) and drop it."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.bm.free_sequence(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

"""The step loop: schedule, run, sample, retire. Everything else is in its own file.

>>> llm = LLM()                                     # the shipped checkpoint
>>> out = llm.generate(["Shall I compare thee"], SamplingParams(max_tokens=40))
>>> print(out[0].text)

or request by request (what a server does)::

    rid = llm.add_request("Tyger Tyger", SamplingParams(temperature=0.8, seed=1))
    while llm.has_unfinished():
        for update in llm.step():      # requests that got a token (or finished) this step
            ...

One :meth:`LLM.step`:

1. the scheduler picks sequences and token counts within the budget (and preempts);
2. the runner copies shared pages that are about to be written, plans the step once and
   runs the model's layers over the paged cache;
3. sequences whose prompt is now fully computed get a token from the sampler (the n
   completions of a request fork here, sharing the prompt's pages);
4. finished sequences release their pages: full pages stay in the prefix cache.

On a GPU the host runs one step ahead (:meth:`LLM.step_overlapped`, ``EngineConfig.overlap``):
it schedules, plans and launches the next step before it reads the tokens of the one the
GPU is running, so its own work no longer leaves the GPU idle between steps. With
``EngineConfig.multi_step = k`` a decode-only batch instead runs k steps in one replay
per host step (:mod:`.multi_step`).

Bad requests (empty prompt, prompt longer than the context, invalid sampling
parameters, more pages than the pool has) are refused by ``add_request`` with a
:class:`RequestError` saying what to change; ``generate`` reports that error on the
request's own output and serves the others.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .. import runtime
from ..paged import fault_flag, raise_recorded_faults
from .block_manager import BlockManager
from .metrics import EngineMetrics, RequestMetrics, StepRecord
from .model import EOS, TernaryTransformer, decode_tokens, load_checkpoint
from .multi_step import DecodeWindows
from .runner import ModelRunner, StepPlan
from .sampling import sample, sample_on_device
from .scheduler import ScheduledBatch, Scheduler
from .sequence import RequestError, SamplingParams, Sequence, Status, draw_seed, validate_request


PLACEHOLDER = -1      # a token the host has not read yet (EngineConfig.overlap, speculative drafts);
                      # an embedding lookup of one fails loudly


def drop_placeholders(seq: Sequence) -> None:
    """Remove a sequence's trailing placeholders (it stopped, or was aborted, meanwhile)."""
    while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
        seq.token_ids.pop()


@dataclass
class InFlight:
    """A launched step whose sampled tokens are still on their way to the host, with the
    device's fault flag as it stood after the step (:func:`gpulab.paged.fault_flag`: a
    kernel that met a bad page or length records it there; the runner's plans do not read
    the layout back, which would wait for the step before)."""
    batch: ScheduledBatch
    prefill: list[bool]
    plan: StepPlan
    seqs: list[Sequence]                  # the sampled sequences, one token each
    host: torch.Tensor                    # their tokens, landing here (pinned on a GPU)
    ready: object                         # a CUDA event recorded after the copies (None on a CPU)
    t0: float
    index: dict = field(default_factory=dict)    # sequence -> its token's index (the next feed)
    at: dict = field(default_factory=dict)       # sequence -> where its token goes in token_ids
    faults: torch.Tensor | None = None           # the fault flag's copy (a GPU's; None on a CPU)

    @classmethod
    def launch(cls, batch, prefill, plan, seqs, tokens: torch.Tensor, t0: float) -> "InFlight":
        """Start the device -> host copies of ``tokens`` and of the fault flag now, in
        stream order after the step."""
        faults = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            faults = torch.empty(2, dtype=torch.int32, pin_memory=True)
            faults.copy_(fault_flag(tokens.device), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = tokens.clone(), None
        return cls(batch, prefill, plan, seqs, host, ready, t0, {s: i for i, s in enumerate(seqs)}, faults=faults)

    def tokens(self) -> list[int]:
        """The step's tokens (waits for this step's copies only, not the steps after it);
        raises :class:`gpulab.paged.LayoutFault` if a kernel recorded a fault by then."""
        if self.ready is not None:
            self.ready.synchronize()
            if self.faults[0]:
                raise_recorded_faults(self.plan.input_ids.device)
        else:
            raise_recorded_faults(self.host.device)
        return self.host.tolist()


@dataclass
class EngineConfig:
    num_blocks: int = 256               # KV pages in the pool
    block_size: int = 16                # tokens per page
    max_num_seqs: int = 32              # sequences per step (and the largest CUDA graph)
    max_num_batched_tokens: int = 256   # the token budget of one step
    chunked_prefill: bool = True
    prefix_caching: bool = True
    decode_reserve: int = 1             # pages kept free per running sequence when admitting:
                                        # fewer preemptions (each one recomputes a sequence)
    cascade: bool = False               # shared-prefix decode batches through cascade attention
    cuda_graphs: bool = True            # compiled mode only
    piecewise_graphs: bool = True       # with cuda_graphs: steps with prompt chunks replay graphs
                                        # between their attention calls (see .piecewise); on the
                                        # H200 1.76x static batching's throughput, 1.28x without
    full_graphs: bool = True            # with cuda_graphs: steps with prompt chunks (up to 128
                                        # rows of 16 requests, or 2048 rows of any) replay one
                                        # graph of the whole forward, attention included (see
                                        # .full_graphs); bigger steps take the piecewise graphs
    warm_up: bool = True                # compiled mode only: compile and autotune every step
                                        # shape at start-up, not in the first requests
    linear: str = "auto"                # "triton" (gpulab's BitLinear kernels) or "torch";
    attention: str = "auto"             # auto: triton when compiled (GPU), torch on the CPU
    kv_split: bool | int = False        # steps with prompt chunks split each attention tile's
                                        # history when SMs would idle (True), or in that many
                                        # parts (an int); opt-in: see gpulab.prefill.KVSplit
    overlap: bool | None = None         # schedule step N+1 while step N runs on the GPU (see
                                        # LLM.step); None: on a GPU, with the package's own
                                        # scheduler and block manager and no decode hook
    multi_step: int = 1                 # decode-only batches run this many steps per
                                        # host step (see .multi_step; without overlap); 1: off
    scheduler_delay_factor: float = 0.0  # while requests run, admit new ones once the oldest
                                        # has waited this many times the last prompt step (see
                                        # .scheduler); 0: at once


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    finish_reason: str | None

    @property
    def text(self) -> str:
        return decode_tokens(self.token_ids)


@dataclass
class RequestOutput:
    """What one step (or ``generate``) reports for a request. ``prompt_token_ids`` is one
    list shared by all of the request's outputs (read it, do not modify it);
    each completion's ``token_ids`` is a copy of the tokens generated so far."""
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    metrics: RequestMetrics | None = None

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []


class LLM:
    def __init__(self, model: TernaryTransformer | None = None, config: EngineConfig | None = None,
                 decode_hook=None, block_manager_cls=BlockManager, scheduler_cls=Scheduler, **overrides):
        """``decode_hook(q, k_cache, v_cache, block_table, seq_lens) -> o`` replaces the
        paged-decode kernel; ``block_manager_cls`` and ``scheduler_cls`` swap in other
        implementations of those parts (notebook 07 plugs in the learner's)."""
        if config is not None and overrides:
            raise TypeError("pass either config or keyword overrides, not both")
        self.config = config = config or EngineConfig(**overrides)
        if model is None:
            model = load_checkpoint(device=runtime.device(), dtype=runtime.default_dtype())
        self.model = model
        self.max_model_len = model.cfg.max_seq_len
        self.block_manager = block_manager_cls(config.num_blocks, config.block_size, config.prefix_caching)
        if config.scheduler_delay_factor and scheduler_cls.schedule is not Scheduler.schedule:
            raise ValueError("scheduler_delay_factor is the package's Scheduler.schedule's policy: "
                             f"{scheduler_cls.__name__} schedules on its own (leave the factor at 0)")
        self.scheduler = scheduler_cls(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                       config.chunked_prefill, self.max_model_len, config.decode_reserve,
                                       **({"delay_factor": config.scheduler_delay_factor}
                                          if config.scheduler_delay_factor else {}))
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, config.max_num_seqs,
                                  config.linear, config.attention, config.cuda_graphs, config.cascade, decode_hook,
                                  kv_split=config.kv_split)
        if config.warm_up and runtime.mode() == "compiled" and self.runner.device.type == "cuda":
            self.runner.warm_up(config.max_num_batched_tokens)
        if config.piecewise_graphs:          # after the warm-up: no autotuning inside a capture
            self.runner.capture_piecewise(config.max_num_batched_tokens)
        if config.full_graphs:
            self.runner.capture_full(config.max_num_batched_tokens)
        self.metrics = EngineMetrics(config.num_blocks)
        self.groups: dict[str, list[Sequence]] = {}     # request id -> its sequences
        self.pending_forks: set[str] = set()            # requests with n > 1 not forked yet
        self.prompt_ids: dict[str, list[int]] = {}      # request id -> its prompt, shared by its outputs
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        own = scheduler_cls is Scheduler and block_manager_cls is BlockManager and decode_hook is None
        k = config.multi_step
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"multi_step (decode steps per host step) must be an int >= 1, got {k!r}")
        if k > 1 and (config.overlap or not own):
            raise ValueError("multi_step > 1 runs without overlap (overlap=False or None) and needs the "
                             "package's Scheduler and BlockManager and no decode hook")
        self.overlap = (own and k == 1 and self.runner.device.type == "cuda" and runtime.mode() == "compiled"
                        if config.overlap is None else bool(config.overlap))
        if self.overlap and not own:
            raise ValueError("overlap=True needs the package's Scheduler and BlockManager and no decode hook "
                             "(they must tolerate tokens that are still on the device)")
        # captured after the warm-up and the other graphs, as they are (no autotuning inside)
        self.windows = None if k == 1 else DecodeWindows(self.runner, k, config.max_num_seqs,
                                                         self.runner.graphs_possible)
        self.in_flight: InFlight | None = None          # the step whose tokens the host has not read

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a RequestError saying what is wrong."""
        ids = validate_request(prompt, params, self.model.cfg.vocab_size, self.max_model_len)
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = self.block_manager.blocks_for(total)
        if need > self.config.num_blocks:
            raise RequestError(f"the request needs up to {total} tokens of KV cache = {need} pages of "
                               f"{self.config.block_size}, but the pool has only {self.config.num_blocks} "
                               f"pages: lower max_tokens or the prompt length, or give the engine more pages")
        return ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises :class:`RequestError` for a bad one
        (nothing is allocated then)."""
        params = SamplingParams() if params is None else params
        ids = self.validate_request(prompt, params)
        request_id = str(next(self._req_ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        now = time.perf_counter() if arrival_time is None else arrival_time
        seq = Sequence(next(self._seq_ids), request_id, list(ids), len(ids), params,
                       draw_seed() if params.seed is None else params.seed, arrival_time=now)
        self.groups[request_id] = [seq]
        if params.n > 1:
            self.pending_forks.add(request_id)
        self.metrics.requests[request_id] = RequestMetrics(request_id, now, len(ids))
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        for seq in self.groups.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
            drop_placeholders(seq)
        self.pending_forks.discard(request_id)
        self._maybe_close(request_id, time.perf_counter())
        step = self.in_flight
        if step is not None and all(seq.finished for seq in step.seqs):
            # nothing of it is left to report: land it now (its record goes into the
            # metrics), so that an engine whose last request was aborted is idle at once
            self.in_flight = None
            self.land(step, finished_only=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    # -- the step ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False, first_tokens: bool = False) -> list[RequestOutput]:
        """One iteration of continuous batching; returns the requests that got tokens
        (``finished_only``: only those that finished, as offline serving needs: no
        output is built for the others; ``first_tokens`` too: and those that got their
        first token, as a server needs, to answer at once)."""
        if self.overlap:
            return self.step_overlapped(finished_only, first_tokens)
        t0 = time.perf_counter()
        batch = self.schedule()
        if not batch.items:
            return []
        if self.windows is not None and self.window_fits(batch):
            return self.step_window(batch, t0, finished_only, first_tokens)
        prefill = batch.prefill_flags          # before the step counts the tokens as computed
        logits, seqs, plan = self.runner.run(batch.items, batch.copies)
        self.scheduler.postprocess(batch)
        return self.emit(batch, prefill, self.sample_tokens(logits, seqs), t0, plan, finished_only,
                         first_tokens=first_tokens)

    def step_overlapped(self, finished_only: bool = False, first_tokens: bool = False) -> list[RequestOutput]:
        """:meth:`step` with the host one step ahead of the GPU. This step is scheduled,
        planned and launched before the host reads the previous step's tokens: a decoding
        sequence's newest token is a :data:`PLACEHOLDER` in its ``token_ids`` and its
        input row takes the token on the device (``feed``). Then the previous step's
        tokens are read (waiting for that step only), put in place, and reported. So the
        host's work for a step (scheduling, planning, launching, reporting) happens while
        the GPU runs the step before, instead of between the two.

        A sequence that will stop at that token anyway (max_tokens, the context) gets no
        placeholder and is not scheduled meanwhile; one that stops at EOS is found a step
        late: the row computed after it is dropped. Full pages join the prefix cache only
        once their tokens are known."""
        t0 = time.perf_counter()
        prev, self.in_flight = self.in_flight, None
        batch = self.schedule()
        if batch.items:
            prefill = batch.prefill_flags
            feed = None if prev is None else prev.index
            logits, seqs, plan = self.runner.run(batch.items, batch.copies, feed=feed)
            # counted before a request with n > 1 forks: its completions start where the
            # prompt ends (forked before, they would compute the prompt again)
            self.scheduler.postprocess(batch, commit=False)
            seqs, rows = self._fork_completions(seqs)
            tokens = sample_on_device(logits if rows is None else logits[rows], seqs)
            self.runner.keep_tokens(tokens)
            self.in_flight = step = InFlight.launch(batch, prefill, plan, seqs, tokens, t0)
            max_len, at = self.max_model_len, step.at
            for seq in seqs:
                ids = seq.token_ids
                at[seq] = len(ids)
                # a token that may be followed by another gets its placeholder now; the
                # last one (max_tokens, context) does not: nothing runs until it lands
                if len(ids) + 1 - seq.num_prompt_tokens < seq.params.max_tokens and len(ids) + 1 < max_len:
                    ids.append(PLACEHOLDER)
        outputs = [] if prev is None else self.land(prev, finished_only, first_tokens)
        if self.in_flight is not None:
            self.scheduler.commit(self.in_flight.batch)
        return outputs

    def window_fits(self, batch: ScheduledBatch) -> bool:
        """Can this step run as a window of ``multi_step`` decode steps (:mod:`.multi_step`)?
        Only decodes of sequences that will not fork, k tokens from the context's end,
        with pages for k more tokens each."""
        k, bm = self.config.multi_step, self.block_manager
        if batch.preempted or self.pending_forks:
            return False
        need = 0
        for seq, n in batch.items:
            if n != 1 or seq.num_output_tokens == 0 or seq.num_tokens + k > self.max_model_len:
                return False
            need += max(0, bm.blocks_for(seq.num_computed_tokens + k) - len(seq.block_table))
        return need <= bm.num_free

    def step_window(self, batch: ScheduledBatch, t0: float, finished_only: bool = False,
                    first_tokens: bool = False) -> list[RequestOutput]:
        """k decode steps of ``batch`` in one replay; each sequence gets k tokens, cut
        where it stops (:meth:`emit`)."""
        k = self.config.multi_step
        seqs = [seq for seq, _ in batch.items]
        for seq in seqs:                       # the schedule made room for one token: now for k
            self.block_manager.append_slots(seq, k)
        self.runner.copy_blocks(batch.copies)
        tokens = self.windows.run(seqs)
        for seq in seqs:
            seq.num_computed_tokens += k
        outputs = self.emit(batch, [False] * len(seqs), dict(zip(seqs, tokens)), t0, self.windows.plan,
                            finished_only, first_tokens=first_tokens, tokens_per_decode=k)
        self.scheduler.commit(batch)           # once the window's tokens are in token_ids
        return outputs

    def land(self, step: "InFlight", finished_only: bool, first_tokens: bool = False) -> list[RequestOutput]:
        """Read a launched step's tokens (waits for that step) into their sequences'
        placeholders, then retire and report as :meth:`emit` does."""
        new_tokens = {seq: [token] for seq, token in zip(step.seqs, step.tokens())
                      if not seq.finished}        # else aborted, or stopped at the token before
        return self.emit(step.batch, step.prefill, new_tokens, step.t0, step.plan, finished_only, step.at,
                         first_tokens)

    def schedule(self):
        """The scheduler's batch for this step (see :mod:`.scheduler`)."""
        batch = self.scheduler.schedule()
        if not batch.items and self.scheduler.has_work() and not self.scheduler.running \
                and not batch.preempted:
            raise RuntimeError("the scheduler admitted nothing although the engine is idle: "
                               "a waiting request can never fit (this is a bug: add_request checks it)")
        return batch

    def sample_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, list[int]]:
        """One new token for each sequence whose row of ``logits`` is ready to sample."""
        seqs, rows = self._fork_completions(seqs)
        tokens = sample(logits[rows] if rows is not None else logits, seqs)
        raise_recorded_faults(logits.device)     # after sample's copy: the step is done
        return {seq: [tok] for seq, tok in zip(seqs, tokens)}

    def emit(self, batch, prefill: list[bool], new_tokens: dict[Sequence, list[int]], t0: float,
             plan, finished_only: bool = False, at: dict[Sequence, int] | None = None,
             first_tokens: bool = False, tokens_per_decode: int = 1) -> list[RequestOutput]:
        """Append each sequence's new tokens (a speculative step may bring several),
        retire those that hit EOS, max_tokens or the context, record the step
        (``prefill``: which of the batch's items were prompt chunks). Returns an output
        per request that got tokens, or with ``finished_only`` per request that finished
        (a request's metrics are brought up to date when it reports), and with
        ``first_tokens`` also per request whose first token came now. ``at``: where each
        sequence's one new token goes instead (its placeholder, :meth:`step_overlapped`);
        a sequence that stops there loses what follows (the next step's placeholder).
        ``tokens_per_decode``: tokens each decode item ran (a window of several steps)."""
        items = batch.items
        if True in prefill:
            n_prefill = sum(n for (_, n), p in zip(items, prefill) if p)
            n_decode = batch.num_tokens - n_prefill
        else:                                  # a decode-only step: one token per item (k in a window)
            n_prefill, n_decode = 0, len(items) * tokens_per_decode
        now = time.perf_counter()
        max_len = self.max_model_len
        touched, finished, first = {}, {}, []
        for seq, tokens in new_tokens.items():
            if seq.first_token_time is None:
                seq.first_token_time = now
                first.append(seq.request_id)
            ids, params = seq.token_ids, seq.params
            for tok in tokens:
                if at is None:
                    ids.append(tok)
                    n = len(ids)
                else:                          # tokens is [tok]: into its placeholder, or appended
                    n = at[seq] + 1
                    if n > len(ids):
                        ids.append(tok)
                    else:
                        ids[n - 1] = tok
                if ((tok == EOS and params.stop_at_eos) or n - seq.num_prompt_tokens >= params.max_tokens
                        or n >= max_len):
                    del ids[n:]
                    self.scheduler.finish(seq, "eos" if tok == EOS and params.stop_at_eos else "length")
                    finished[seq.request_id] = None
                    break
            touched[seq.request_id] = None
        if finished_only:
            touched = [rid for rid in finished if all(s.finished for s in self.groups[rid])]
            if first_tokens:
                touched += [rid for rid in dict.fromkeys(first) if rid not in touched]
        bm = self.block_manager
        graph = plan.use_graph or bool(plan.full_bucket)        # a decode graph or a whole-step one
        self.metrics.record(StepRecord(
            t0, now, len(items), n_prefill, n_decode, bm.num_used, bm.num_cached_free, len(self.scheduler.waiting),
            len(batch.preempted), graph, plan.prefix is not None, [s.seq_id for s, _ in items],
            [tokens_per_decode] * len(items) if not n_prefill else [n for _, n in items], prefill,
            [s.seq_id for s in batch.preempted]))
        return [self._maybe_close(rid, now) for rid in touched]

    def _fork_completions(self, seqs: list[Sequence]):
        """A request with n > 1 forks when its prompt is done: the other n - 1 completions
        share its pages and sample their first token from the same logits."""
        if not self.pending_forks or all(s.params.n == 1 or s.num_output_tokens > 0 or s.index > 0 for s in seqs):
            return seqs, None
        out, rows = [], []
        for r, seq in enumerate(seqs):
            out.append(seq)
            rows.append(r)
            if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                self.pending_forks.discard(seq.request_id)
                for i in range(1, seq.params.n):
                    child = Sequence(next(self._seq_ids), seq.request_id, list(seq.token_ids),
                                     seq.num_prompt_tokens, seq.params, seq.seed, index=i,
                                     arrival_time=seq.arrival_time, status=Status.RUNNING)
                    self.block_manager.fork(seq, child)
                    self.scheduler.running.append(child)
                    self.groups[seq.request_id].append(child)
                    out.append(child)
                    rows.append(r)
        return out, torch.tensor(rows, device=self.runner.device)

    def _maybe_close(self, request_id: str, now: float) -> RequestOutput:
        group = self.groups[request_id]
        m = self.metrics.requests[request_id]
        if len(group) == 1:                    # n = 1 (most requests): no sums over the group
            s = group[0]
            done = s.status is Status.FINISHED
            m.first_token = s.first_token_time
            known = len(s.token_ids) - (s.token_ids[-1] == PLACEHOLDER)    # not the token in flight
            m.num_output_tokens = known - s.num_prompt_tokens
            m.num_preemptions = s.num_preemptions
            completions = [Completion(s.index, s.token_ids[s.num_prompt_tokens:known], s.finish_reason)]
        else:
            done = all(s.finished for s in group)
            m.first_token = min((s.first_token_time for s in group if s.first_token_time is not None),
                                default=None)
            outputs = [s.output_ids[:-1] if s.token_ids[-1] == PLACEHOLDER else s.output_ids for s in group]
            m.num_output_tokens = sum(map(len, outputs))
            m.num_preemptions = sum(s.num_preemptions for s in group)
            completions = [Completion(s.index, out, s.finish_reason) for s, out in zip(group, outputs)]
        first = group[0]
        m.num_cached_tokens = first.num_cached_tokens
        if done and m.finish is None:
            m.finish = now
            self.metrics.request_finished(request_id)
        prompt = self.prompt_ids.get(request_id)
        if prompt is None:                     # copied once per request, not once per step
            prompt = self.prompt_ids[request_id] = first.token_ids[:first.num_prompt_tokens]
        out = RequestOutput(request_id, prompt, completions, done, metrics=m)
        if done:
            del self.groups[request_id]
            del self.prompt_ids[request_id]
        return out

    # -- offline use ------------------------------------------------------------------------
    def generate(self, prompts, params=None, progress: bool = False) -> list[RequestOutput]:
        """Serve a list of prompts to completion; one output per prompt, in order. A bad
        request's output carries its ``error`` and no tokens; the others are served."""
        return generate_all(self, prompts, params, progress)

    # -- views ------------------------------------------------------------------------------
    def summary(self) -> dict:
        return self.metrics.summary(self.block_manager.hit_rate())

    def idle(self) -> bool:
        """No requests and every page free (cached pages count as free)."""
        return not self.has_unfinished() and self.block_manager.num_free == self.config.num_blocks


@contextlib.contextmanager
def frozen_heap():
    """Serve with the objects that exist now (model, PyTorch, Triton, the engine) frozen
    out of the garbage collector (``gc.freeze``, as vLLM does after start-up): a full
    collection during serving then walks only what serving allocated, instead of
    stalling one step for a tenth of a second or more.

    Blocks nest: the outermost one unfreezes when it exits, and only if the heap held no
    frozen objects when it entered. ``gc`` can only thaw everything at once, so when
    someone else (the host program, a library) had frozen objects first, they stay
    frozen, with ours, for that owner's ``gc.unfreeze``: unfreezing here would undo a
    freeze that is not ours."""
    if FREEZE["depth"] == 0:
        FREEZE["found"] = gc.get_freeze_count()
    FREEZE["depth"] += 1
    gc.freeze()
    try:
        yield
    finally:
        FREEZE["depth"] -= 1
        if FREEZE["depth"] == 0 and FREEZE["found"] == 0:
            gc.unfreeze()


# nested frozen_heap() blocks open now, and the freeze count the outermost one found
FREEZE = {"depth": 0, "found": 0}


def generate_all(engine, prompts, params=None, progress: bool = False) -> list[RequestOutput]:
    """Offline serving with any engine that has add_request/step/has_unfinished."""
    if isinstance(prompts, str):
        prompts = [prompts]
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
    order, results = [], {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        try:
            order.append(engine.add_request(p, sp))
        except RequestError as e:
            key = f"rejected-{i}"
            results[key] = RequestOutput(key, [], finished=True, error=str(e))
            order.append(key)
    bar = tqdm(total=len(order) - len(results), desc="requests", mininterval=0.5) if progress else None
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            if out.finished:
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return [results[k] for k in order]

"""The baseline: static batching with contiguous per-request KV caches (the usual
``generate`` loop), on the same model, kernels and KV memory as the engine.

* Each request reserves one contiguous KV region of ``max_len`` tokens (the longest
  prompt plus the largest ``max_tokens`` it may see), whether it uses it or not. With
  the engine's KV memory that allows ``batch_size = kv_tokens // max_len`` requests at
  once, often far fewer than paging allows.
* A batch is formed when the previous one is done: up to ``batch_size`` requests
  that have arrived. All prompts are prefilled in one step, then every row decodes
  until the *last* request of the batch finishes: rows that finished early keep
  computing (their tokens are thrown away), and requests that arrive meanwhile wait
  for the whole batch.

A contiguous region is a page of ``max_len`` tokens: the same runner and attention
kernels serve it, with block tables of one page per request.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

from .. import runtime
from .engine import Completion, EngineConfig, RequestOutput, generate_all
from .metrics import EngineMetrics, RequestMetrics, StepRecord
from .model import EOS, TernaryTransformer
from .runner import ModelRunner
from .sampling import sample
from .sequence import RequestError, SamplingParams, Sequence, Status, draw_seed, validate_request


class StaticBatchLLM:
    def __init__(self, model: TernaryTransformer, config: EngineConfig | None = None, max_len: int | None = None):
        config = config or EngineConfig()
        self.model, self.config = model, config
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        kv_tokens = config.num_blocks * config.block_size
        self.batch_size = kv_tokens // self.max_len
        if self.batch_size < 1:
            raise ValueError(f"the KV memory ({kv_tokens} tokens) cannot hold one request of max_len {self.max_len}")
        self.runner = ModelRunner(model, self.batch_size, self.max_len, self.batch_size, config.linear,
                                  config.attention, config.cuda_graphs, cascade=False)
        if config.warm_up and runtime.mode() == "compiled" and self.runner.device.type == "cuda":
            self.runner.warm_up(self.max_len)      # as the engine does: no autotuning inside the timing
        self.metrics = EngineMetrics(self.batch_size)
        self.waiting: deque[Sequence] = deque()
        self.batch: list[Sequence] = []
        self.batch_done = 0                         # sequences of the batch that finished
        self.done_len: dict[int, int] = {}          # seq id -> its length when it finished
        self._ids = itertools.count()

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        params = SamplingParams() if params is None else params
        ids = validate_request(prompt, params, self.model.cfg.vocab_size, self.max_len)
        if params.n != 1:
            raise RequestError("the static baseline serves n=1 only")
        if len(ids) + params.max_tokens > self.max_len:
            raise RequestError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                               f"static batch's reserved length {self.max_len}")
        i = next(self._ids)
        rid = str(i) if request_id is None else str(request_id)
        now = time.perf_counter() if arrival_time is None else arrival_time
        seq = Sequence(i, rid, list(ids), len(ids), params, draw_seed() if params.seed is None else params.seed,
                       arrival_time=now)
        self.waiting.append(seq)
        self.metrics.requests[rid] = RequestMetrics(rid, now, len(ids))
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    def step(self, finished_only: bool = True) -> list[RequestOutput]:
        """One step of the batch; reports finished requests only (``finished_only`` is
        accepted for :func:`generate_all`'s sake)."""
        t0 = time.perf_counter()
        decode = bool(self.batch)
        if not decode:                           # a new batch: prefill every prompt at once
            now = time.perf_counter()
            while self.waiting and len(self.batch) < self.batch_size and self.waiting[0].arrival_time <= now:
                seq = self.waiting.popleft()
                seq.block_table, seq.status = [len(self.batch)], Status.RUNNING
                self.batch.append(seq)
            if not self.batch:
                return []
            items = [(s, s.num_tokens) for s in self.batch]
        else:                                    # every row decodes, finished or not
            items = [(s, 1) for s in self.batch if s.num_tokens < self.max_len]
        logits, seqs, plan = self.runner.run(items)
        for s, n in items:
            s.num_computed_tokens += n
        tokens = sample(logits, seqs)
        now = time.perf_counter()
        outputs = []
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            if seq.seq_id in self.done_len:
                continue                         # a finished row: wasted work
            if seq.first_token_time is None:
                seq.first_token_time = now
            if (seq.params.stop_at_eos and tok == EOS) or seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish_reason = "eos" if tok == EOS and seq.params.stop_at_eos else "length"
                self.done_len[seq.seq_id] = seq.num_tokens
                self.batch_done += 1
                outputs.append(self._finish(seq, now))
        if decode:                               # one token per row
            n_prefill, n_decode, flags = 0, len(items), [False] * len(items)
        else:
            n_prefill, n_decode = sum(n for _, n in items if n > 1), sum(n for _, n in items if n == 1)
            flags = [n > 1 for _, n in items]
        self.metrics.record(StepRecord(t0, now, len(items), n_prefill, n_decode, len(self.batch), 0,
                                       len(self.waiting), 0, plan.use_graph, False,
                                       [s.seq_id for s, _ in items], [n for _, n in items], flags))
        if self.batch_done == len(self.batch) or not items:
            self.batch, self.batch_done = [], 0
        return outputs

    def _finish(self, seq: Sequence, now: float) -> RequestOutput:
        m = self.metrics.requests[seq.request_id]
        m.first_token, m.finish, m.num_output_tokens = seq.first_token_time, now, seq.num_output_tokens
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens],
                             [Completion(0, seq.output_ids, seq.finish_reason)], True, metrics=m)

    def generate(self, prompts, params=None, progress: bool = False) -> list[RequestOutput]:
        return generate_all(self, prompts, params, progress)

    def summary(self) -> dict:
        return self.metrics.summary(None)

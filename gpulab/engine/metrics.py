"""What a serving run measures.

Per request: **TTFT** (time to first token: arrival -> first generated token, which
includes queueing and the whole prefill; also split into the wait until the step that
gave the first token began and that step's time), **TPOT** (time per output token after the
first: (finish - first token) / (outputs - 1)), **end-to-end latency** (arrival ->
finish). Per run: **throughput** (generated tokens per second of wall time), requests
per second, KV **pages in use** per step, the **prefix-cache hit rate** (prompt tokens
found in the cache / prompt tokens looked up) and preemptions. Every step is also
recorded (what ran, how many pages), for the timeline plots of ``gpulab serve-bench``,
and the steps' times are summarised with and without prompt tokens.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import asdict, dataclass, field, fields


@dataclass
class RequestMetrics:
    request_id: str
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_output_tokens - 1)


@dataclass
class StepRecord:
    """One engine step. What ran is kept as three flat lists of ints (a few objects per
    step: thousands of tuples kept per step would make every full garbage collection
    of a long run slower); :attr:`scheduled` pairs them up when read."""
    start: float
    end: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    pages_used: int
    pages_cached: int
    waiting: int
    preempted: int
    graph: bool
    cascade: bool = False
    seq_ids: list[int] = field(default_factory=list, repr=False)      # per scheduled sequence
    tokens: list[int] = field(default_factory=list, repr=False)       # ... the tokens it ran
    prefill: list[bool] = field(default_factory=list, repr=False)     # ... a prompt chunk?
    preempted_ids: list[int] = field(default_factory=list)

    @property
    def scheduled(self) -> list[tuple[int, int, bool]]:
        """(seq id, tokens, prefill?) per scheduled sequence."""
        return list(zip(self.seq_ids, self.tokens, self.prefill))

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr} | {"scheduled": self.scheduled}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class EngineMetrics:
    """Every request's and every step's record, for summaries and plots of a run; or, after
    :meth:`keep_last`, only the newest (a server runs for days)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.requests: dict[str, RequestMetrics] = {}
        self.steps: list[StepRecord] = []
        self.history: int | None = None            # None: keep everything
        self._finished: collections.deque[str] = collections.deque()
        self.prompt_steps = 0                       # steps that carried prompt tokens, ever

    def record(self, step: StepRecord) -> None:
        """Keep a step's record (and count it if it carried prompt tokens)."""
        self.steps.append(step)
        if step.prefill_tokens:
            self.prompt_steps += 1

    def keep_last(self, n: int) -> None:
        """From now on keep the newest ``n`` steps and ``n`` finished requests (requests
        still running are always kept). A server calls this: kept whole, the records grow
        by one per step and one per request for as long as it serves."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"keep_last needs a number of records >= 1, got {n!r}")
        self.history = n
        self.steps = collections.deque(self.steps, maxlen=n)
        self._finished = collections.deque(rid for rid, r in self.requests.items() if r.finish is not None)
        self._trim()

    def request_finished(self, request_id: str) -> None:
        """The engine's note that a request finished: with a history kept, the oldest
        finished request's record goes once there are more than it keeps."""
        if self.history is not None:
            self._finished.append(request_id)
            self._trim()

    def _trim(self) -> None:
        while len(self._finished) > self.history:
            self.requests.pop(self._finished.popleft(), None)

    def summary(self, hit_rate: float | None = None) -> dict:
        done = [r for r in self.requests.values() if r.finish is not None]
        out_tokens = sum(r.num_output_tokens for r in done)
        t0 = min((r.arrival for r in self.requests.values()), default=0.0)
        t1 = max((r.finish for r in done), default=t0)
        wall = max(t1 - t0, 1e-9)

        def stats(name, vals):
            return {f"{name}_p50": percentile(vals, 50), f"{name}_p90": percentile(vals, 90),
                    f"{name}_mean": statistics.fmean(vals) if vals else None}
        s = {"requests": len(done), "output_tokens": out_tokens, "wall_s": wall,
             "throughput_tok_s": out_tokens / wall, "requests_per_s": len(done) / wall,
             "steps": len(self.steps),
             "pages_used_mean": statistics.fmean([r.pages_used for r in self.steps]) if self.steps else 0.0,
             "pages_used_max": max((r.pages_used for r in self.steps), default=0), "pages_total": self.num_pages,
             "preemptions": sum(r.preempted for r in self.steps),
             "prefix_hit_rate": hit_rate,
             "graph_steps": sum(r.graph for r in self.steps),
             "cascade_steps": sum(r.cascade for r in self.steps)}
        s.update(stats("ttft_s", [r.ttft for r in done if r.ttft is not None]))
        # TTFT in two parts: the wait until the step that gave the first token began
        # (queueing, the step already running), and that step's own time
        start_of = {st.end: st.start for st in self.steps}   # emit() stamps both with one clock reading
        firsts = [(r, start_of[r.first_token]) for r in done if r.first_token in start_of]
        s.update(stats("ttft_wait_s", [max(0.0, begin - r.arrival) for r, begin in firsts]))
        s.update(stats("ttft_step_s", [r.first_token - max(begin, r.arrival) for r, begin in firsts]))
        s.update(stats("tpot_s", [r.tpot for r in done if r.tpot is not None]))
        s.update(stats("e2e_s", [r.e2e for r in done]))
        # how long steps take, with and without prompt tokens
        s.update(stats("step_prompt_s", [st.end - st.start for st in self.steps if st.prefill_tokens]))
        s.update(stats("step_decode_s", [st.end - st.start for st in self.steps if not st.prefill_tokens]))
        return s

    def to_json(self) -> dict:
        return {"requests": [asdict(r) | {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
                             for r in self.requests.values()],
                "steps": [s.to_json() for s in self.steps]}


def format_summary(s: dict, title: str = "") -> str:
    """A small table of a run's summary (times in ms)."""
    ms = lambda v: "-" if v is None else f"{v * 1e3:9.1f}"  # noqa: E731
    lines = [title] if title else []
    lines += [f"requests {s['requests']}, output tokens {s['output_tokens']}, {s['steps']} steps, "
              f"wall {s['wall_s']:.2f} s, throughput {s['throughput_tok_s']:.1f} tok/s",
              f"{'':12}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}"]
    for k, label in (("ttft_s", "TTFT"), ("ttft_wait_s", " its wait"), ("ttft_step_s", " its step"),
                     ("tpot_s", "TPOT"), ("e2e_s", "latency"), ("step_prompt_s", "step, prompt"),
                     ("step_decode_s", "step, decode")):
        if k in ("ttft_s", "tpot_s", "e2e_s") or s.get(k + "_p50") is not None:     # the others where measured
            lines.append(f"{label:12}{ms(s.get(k + '_p50'))} {ms(s.get(k + '_p90'))} {ms(s.get(k + '_mean'))}")
    hr = s.get("prefix_hit_rate")
    lines.append(f"pages used: mean {s['pages_used_mean']:.1f}, max {s['pages_used_max']} of {s['pages_total']}; "
                 f"preemptions {s['preemptions']}; prefix-cache hit rate "
                 f"{'-' if hr is None else f'{100 * hr:.0f}%'}")
    if s.get("kernels_compiled"):
        lines.append(f"kernels compiled while serving: {s['kernels_compiled']} "
                     f"({', '.join(s.get('kernels_compiled_names', []))}): not yet steady state")
    return "\n".join(lines)

"""Several decode steps per host step (EngineConfig.multi_step, gpulab.engine.multi_step):
the same tokens as one step at a time, pages and prefix cache kept right when a sequence
stops inside a window, and the steps a window cannot take run one at a time."""
import pytest
import torch

import gpulab
from gpulab import runtime
from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.model import EOS, TINY, encode_prompt, reference_generate
from gpulab.engine.multi_step import DecodeWindows
from gpulab.engine.sequence import SamplingParams
from gpulab.engine.speculative import MLGRUDrafter, SpeculativeLLM
from gpulab.model import MatMulFreeLM
from helpers import (PROMPTS, assert_same_text_stopping_at_eos, assert_tokens_match, force_eos, load_tool,
                     tiny_transformer)

MAX_TOKENS = [23, 17, 5, 30, 12, 9]      # most not multiples of k: sequences stop inside windows


@pytest.fixture(scope="module")
def model():
    return tiny_transformer()   # float32 everywhere


@pytest.fixture(scope="module")
def expected(model):
    return [reference_generate(model, encode_prompt(p), n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def count_windows(llm: LLM) -> list:
    """Record the number of sequences of every window the engine runs."""
    seen, run = [], llm.windows.run
    llm.windows.run = lambda seqs: seen.append(len(seqs)) or run(seqs)
    return seen


@pytest.mark.parametrize("cfg", [
    dict(multi_step=4),
    dict(multi_step=2, max_num_batched_tokens=7, block_size=4),        # chunked prompts between windows
    dict(multi_step=5, num_blocks=24, block_size=4, max_num_batched_tokens=16),   # a tight pool: preemption
    dict(multi_step=3, prefix_caching=False, max_num_seqs=2),
], ids=["k4", "k2-chunked", "k5-tight-pool", "k3-two-seqs"])
def test_windows_give_the_reference_tokens_under_any_schedule(model, expected, cfg):
    llm = LLM(model, EngineConfig(**cfg))
    windows = count_windows(llm)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    assert_tokens_match(model, PROMPTS, [o.token_ids for o in outs], expected)
    assert windows, "no window ran"
    assert llm.idle(), "pages or requests left over after serving"
    k = cfg["multi_step"]
    window_steps = [r for r in llm.metrics.steps if r.tokens and set(r.tokens) == {k} and not r.prefill_tokens]
    assert len(window_steps) == len(windows), "each window is one step record, k tokens per sequence"
    assert all(r.decode_tokens == k * r.num_seqs for r in window_steps)
    if "num_blocks" in cfg:
        assert llm.summary()["preemptions"] > 0, "the tight pool did not preempt"


def test_windows_on_gpulabs_paged_decode_kernel(model, expected):
    """The window's steps through the Triton decode kernel (as on a GPU, where the window
    is one CUDA graph; here the interpreter): the reference's tokens."""
    llm = LLM(model, EngineConfig(multi_step=3, attention="triton", block_size=8))
    windows = count_windows(llm)
    outs = llm.generate(PROMPTS[4:6], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[4:6]])
    assert_tokens_match(model, PROMPTS[4:6], [o.token_ids for o in outs], expected[4:6])
    assert windows and llm.idle()


def test_a_sequence_that_stops_inside_a_window_keeps_only_its_tokens(model, monkeypatch):
    """EOS as request "1"'s fifth token, in the middle of a window: it stops there, what
    the window computed after it is dropped, its pages are freed, and the other requests'
    tokens are the one-step engine's."""
    force_eos(monkeypatch, "1", 4)         # one step at a time
    real_run = DecodeWindows.run

    def run_with_eos(self, seqs):
        tokens = real_run(self, seqs)
        for s, row in zip(seqs, tokens):
            if s.request_id == "1" and s.num_output_tokens <= 4 < s.num_output_tokens + len(row):
                row[4 - s.num_output_tokens] = EOS
        return tokens

    monkeypatch.setattr(DecodeWindows, "run", run_with_eos)
    assert_same_text_stopping_at_eos(model, [EngineConfig(multi_step=k, block_size=4) for k in (1, 3)],
                                     max_tokens=20, stop_len=5)


def test_pages_a_window_filled_are_cached_with_their_own_tokens(model):
    """A later prompt that continues a finished request's text finds the pages that
    windows filled in the prefix cache, and its tokens are still the reference's."""
    llm = LLM(model, EngineConfig(multi_step=4, block_size=4))
    windows = count_windows(llm)
    first = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=30))[0]
    assert windows
    follow = encode_prompt(PROMPTS[1]) + first.token_ids[:25]
    again = llm.generate([follow], SamplingParams(max_tokens=10))[0]
    assert again.metrics.num_cached_tokens >= len(follow) // 4 * 4 - 4 > len(encode_prompt(PROMPTS[1]))
    assert again.token_ids == reference_generate(model, follow, 10)
    assert llm.idle()


@pytest.mark.parametrize("top, pool", [(dict(), {}), (dict(top_k=20), {}), (dict(top_p=0.9), {}),
                                       (dict(), dict(num_blocks=20, max_num_batched_tokens=16))],
                         ids=["plain", "top-k", "top-p", "tight-pool"])
def test_sampled_requests_run_windows_and_keep_their_text(model, top, pool):
    """Sampled requests (with greedy ones beside them, and completions of n = 2 once they
    have forked) run windows, and each seeded text is the one-step engine's: step j of a
    window draws with the noise of the request's token j further on; also where a tight
    pool preempts and recomputes."""
    params = [SamplingParams(max_tokens=14, temperature=0.9, seed=3, **top), SamplingParams(max_tokens=25),
              SamplingParams(max_tokens=11, temperature=1.2, seed=5, **top),
              SamplingParams(max_tokens=9, temperature=0.7, n=2, seed=8, **top)]
    runs = []
    for k in (1, 4):
        llm = LLM(model, EngineConfig(multi_step=k, block_size=4, **pool))
        if k > 1:
            kinds = []
            graph = llm.windows.graph
            llm.windows.graph = lambda b, kind: kinds.append(kind) or graph(b, kind)
        outs = llm.generate(PROMPTS[:4], params)
        runs.append([[c.token_ids for c in o.completions] for o in outs])
        assert llm.idle()
        if pool and k > 1:
            assert llm.summary()["preemptions"] > 0, "the tight pool did not preempt"
    assert runs[0] == runs[1]
    assert ("filtered" if top else "sampled") in kinds, kinds
    assert len(set(map(tuple, runs[0][3]))) == 2, "n = 2: two different completions"


def test_a_window_draws_what_single_steps_draw_on_the_same_logits():
    """draw(), as a window runs it with each row's key + j, gives sample_on_device's
    tokens for those rows at their token j further on (greedy, plain and filtered rows)."""
    from types import SimpleNamespace
    from gpulab.engine.sampling import KEY_MASK, draw, sample_on_device, token_seed
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    params = [SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(), SamplingParams(temperature=1.3,
              seed=2 ** 70 - 3), SamplingParams(temperature=0.5, top_p=0.8, seed=-4), SamplingParams(temperature=2.0)]
    seqs = [SimpleNamespace(params=x, seed=x.seed if x.seed is not None else 11, index=i % 2, num_output_tokens=7)
            for i, x in enumerate(params)]
    keys = torch.tensor([token_seed(s.seed, s.index, s.num_output_tokens) for s in seqs])
    for j in range(4):
        for s in seqs:
            s.num_output_tokens = 7 + j
        want = sample_on_device(logits, seqs)
        got = draw(logits, torch.tensor([x.temperature or 1.0 for x in params]), (keys + j) & KEY_MASK,
                   torch.tensor([x.greedy for x in params]),
                   (torch.tensor([x.top_k for x in params]), torch.tensor([float(x.top_p) for x in params])))
        assert torch.equal(got, want), j


def test_windows_stop_short_of_the_context_end(model):
    prompt = encode_prompt("x" * (TINY.max_seq_len - 14))
    want = reference_generate(model, prompt, 50, stop_at_eos=False)
    llm = LLM(model, EngineConfig(multi_step=4, block_size=16, max_num_batched_tokens=100))
    windows = count_windows(llm)
    out = llm.generate([prompt], SamplingParams(max_tokens=50, stop_at_eos=False))[0]
    assert out.token_ids == want and len(prompt) + len(want) == TINY.max_seq_len
    assert out.completions[0].finish_reason == "length" and windows and llm.idle()


def test_a_server_step_reports_first_tokens_at_once_and_windows_in_between(model, expected):
    """As the server steps the engine (``finished_only``, ``first_tokens``): the first
    token comes with its prompt's step, the rest in windows, everything by the end."""
    llm = LLM(model, EngineConfig(multi_step=4, block_size=4))
    windows = count_windows(llm)
    rid = llm.add_request(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS[3]))
    first = llm.step(finished_only=True, first_tokens=True)
    assert [o.request_id for o in first] == [rid] and first[0].token_ids == expected[3][:1]
    last = []
    while llm.has_unfinished():
        last = llm.step(finished_only=True, first_tokens=True) or last
    assert last[0].finished and last[0].token_ids == expected[3]
    assert len(windows) == -(-(MAX_TOKENS[3] - 1) // 4) and llm.idle()


@pytest.mark.parametrize("factor", [0.0, 3.0])
def test_a_delay_factor_admits_a_servers_arrivals_together_between_windows(model, expected, factor):
    """Requests that arrive one by one while others decode (a server's clients):
    with ``scheduler_delay_factor`` they are admitted in one step with prompt tokens, the
    running sequences decode in windows meanwhile, and every request gets the reference's
    tokens. The engine's clock is a step counter here (each schedule: one second)."""
    llm = LLM(model, EngineConfig(multi_step=4, block_size=4, scheduler_delay_factor=factor))
    now = [0.0]
    llm.scheduler.clock = lambda: now[0]
    order = [3, 0, 1, 2]
    rids = {}
    outs = {}
    for t in range(200):
        if t < len(order):                      # one arrival per step
            i = order[t]
            rids[llm.add_request(PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS[i]), arrival_time=now[0])] = i
        elif not llm.has_unfinished():
            break
        for o in llm.step(finished_only=True, first_tokens=True):
            outs[rids[o.request_id]] = o.token_ids
        now[0] += 1.0
    assert_tokens_match(model, [PROMPTS[i] for i in order], [outs[i] for i in order],
                        [expected[i] for i in order])
    prompt_steps = [r for r in llm.metrics.steps if r.prefill_tokens]
    # without a delay: one step with prompt tokens per arrival; with one, the three that
    # arrive while request 3 runs wait (3 steps of 1 s) and are admitted together
    assert len(prompt_steps) == (4 if factor == 0 else 2)
    assert llm.idle()


def test_a_delay_factor_is_the_packages_schedulers_policy(model):
    from gpulab.engine.scheduler import Scheduler

    class Mine(Scheduler):
        def schedule(self):
            return super().schedule()

    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        LLM(model, EngineConfig(scheduler_delay_factor=2.0), scheduler_cls=Mine)
    with pytest.raises(ValueError, match="delay_factor"):
        LLM(model, EngineConfig(scheduler_delay_factor=-1.0))


def test_the_benchmarks_table_names_window_rows(model):
    from gpulab.engine.speculative import format_results
    row = dict(batch=64, draft="none", k=0, graphs=True, overlap=False, tokens_per_s=1.0, acceptance=float("nan"),
               tokens_per_pass=1.0, speedup=1.0)
    server = dict(clients=64, http_tokens_per_s=1.0, engine_tokens_per_s=2.0, ratio=0.5, api_servers=4,
                  multi_step=8)
    text = format_results(dict(gpu="GPU", date="today", versions={}, max_tokens=8,
                               rows=[row, dict(row, multi_step=8)], server_api_servers=server))
    assert "none (8 steps)" in text and "8 decode steps a host step" in text


def test_the_benchmark_times_the_target_alone_with_windows_too(model, monkeypatch):
    """tools/speculative_bench.py --multi-step k: a third target-alone row, its engine
    built with k steps a window, in the baseline like the other two."""
    from types import SimpleNamespace
    bench = load_tool("speculative_bench")
    outs = [SimpleNamespace(prompt_token_ids=[1], token_ids=[2, 3])]
    built = []

    def bench_one(llm, waves, params, repeats):
        built.append((llm.config.multi_step, llm.overlap))
        return outs, 100.0 * llm.config.multi_step, 0, dict(gc_s=0.0, gc_passes=0, gc_full_passes=0)

    monkeypatch.setattr(bench, "bench_one", bench_one)
    monkeypatch.setattr(bench, "engine_config",
                        lambda batch, multi_step=1: EngineConfig(block_size=4, multi_step=multi_step))
    rows = bench.bench_speculation(model, {}, 1, 4, (), repeats=1, wrong=[], errors=[], multi_step=4)
    # the engine's default first: overlap where the kernels are compiled on a GPU
    overlap = runtime.mode() == "compiled" and next(model.parameters()).is_cuda
    assert built == [(1, overlap), (1, False), (4, False)]
    assert [r.get("multi_step", 1) for r in rows] == [1, 1, 4]
    assert [r["speedup"] for r in rows] == [0.25, 0.25, 1.0]


def test_the_benchmarks_collector_clock_counts_passes_inside_its_block_only():
    """tools/speculative_bench.py's rows say how much of their timed runs the garbage
    collector took: passes inside the block are counted, its callback is gone after."""
    import gc
    bench = load_tool("speculative_bench")
    before = len(gc.callbacks)
    with bench.collector_clock() as seen:
        gc.collect()
        gc.collect(0)
    assert seen["gc_passes"] == 2 and seen["gc_full_passes"] == 1 and seen["gc_s"] > 0
    assert len(gc.callbacks) == before
    gc.collect()
    assert seen["gc_passes"] == 2


def test_the_host_overhead_tool_times_windows_too(tmp_path, capsys):
    """tools/engine_host_overhead.py --multi-step k: whole window steps beside the one-step
    phases, per window and per token-step."""
    import json
    tool = load_tool("engine_host_overhead")
    assert tool.main(["--batch", "2", "--ctx", "256", "--prompt", "20", "--steps", "3", "--device", "cpu",
                      "--multi-step", "3", "--json", str(tmp_path / "h.json")]) == 0
    r = json.loads((tmp_path / "h.json").read_text())["results"][0]
    assert r["multi_step"] == 3 and r["window_ms"] > 0
    assert r["window_per_token_step_ms"] == pytest.approx(r["window_ms"] / 3)
    assert "windows of 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_multi_step_must_be_a_whole_number_of_steps(model, bad):
    with pytest.raises(ValueError, match="multi_step"):
        LLM(model, EngineConfig(multi_step=bad))


def test_multi_step_runs_without_overlap_and_not_under_speculation(model):
    with pytest.raises(ValueError, match="without overlap"):
        LLM(model, EngineConfig(multi_step=2, overlap=True))
    assert LLM(model, EngineConfig(multi_step=2)).overlap is False
    with pytest.raises(ValueError, match="multi_step must be 1"):
        SpeculativeLLM(model, EngineConfig(multi_step=2), drafter=MLGRUDrafter(_tiny_draft()), k=2)


def _tiny_draft():
    torch.manual_seed(0)
    return MatMulFreeLM(d_model=32, n_layers=1, scan="torch").pack().to(gpulab.device())

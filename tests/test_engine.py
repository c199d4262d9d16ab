"""The serving engine against the reference decoder: same tokens under every schedule."""
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

import gpulab

from gpulab.engine.block_manager import BlockManager
from gpulab.engine.engine import LLM, PLACEHOLDER, EngineConfig
from gpulab.engine.metrics import EngineMetrics, RequestMetrics, StepRecord
from gpulab.engine.model import (TINY, encode_prompt, reference_generate,
                                 attention_with_history)
from gpulab.engine.runner import ModelRunner
from gpulab.engine.sampling import filter_top_k_top_p
from gpulab.engine.scheduler import Scheduler
from gpulab.engine.sequence import RequestError, SamplingParams, Sequence
from gpulab.engine.static import StaticBatchLLM
from helpers import (PROMPTS, SYSTEM, assert_same_text_stopping_at_eos, assert_tokens_match, force_eos,
                     tiny_transformer)

MAX_TOKENS = [9, 6, 5, 8, 7, 6]


@pytest.fixture(scope="module")
def model():
    return tiny_transformer()   # float32 everywhere


@pytest.fixture(scope="module")
def expected(model):
    return [reference_generate(model, encode_prompt(p), n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def serve(model, prompts=PROMPTS, max_tokens=MAX_TOKENS, **cfg):
    llm = LLM(model, EngineConfig(**cfg))
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert llm.idle(), "pages or requests left over after serving"
    return llm, outs


def test_runner_logits_match_teacher_forcing_under_chunked_prefill(model):
    """Every chunk's last-row logits equal the reference forward's at that position."""
    tokens = encode_prompt("Tyger Tyger, burning bright, in the forests")
    with torch.no_grad():
        dev = model.embed.weight.device
        h = model.hidden_states(torch.tensor(tokens, device=dev), torch.arange(len(tokens), device=dev),
                                lambda layer, q, k, v: attention_with_history(q, k, v), reference=True)
        want = model.logits(h)
    for attention in ("torch", "triton"):
        bm = BlockManager(16, 4)
        # no graphs: this checks the eager step's decode plan (graph replay has its own tests)
        runner = ModelRunner(model, 16, 4, attention=attention, linear="torch", cuda_graphs=False)
        s = Sequence(0, "r", tokens, len(tokens), SamplingParams(), 0)
        bm.allocate(s, [], 0)
        for n in (5, 1, 7, 3, 1, len(tokens) - 17):
            bm.append_slots(s, n)
            s.token_ids = tokens[:s.num_computed_tokens + n]     # the chunk ends the "prompt" so it is sampled
            logits, _, plan = runner.run([(s, n)])
            # one-token steps on the Triton path run the decode planned once for all layers
            assert plan.decode_planned == (n == 1 and attention == "triton")
            s.num_computed_tokens += n
            torch.testing.assert_close(logits[0], want[s.num_computed_tokens - 1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [
    dict(max_num_batched_tokens=512),                                   # whole prompts, big batches
    dict(max_num_batched_tokens=7, block_size=4),                       # chunked prefill mixed with decode
    dict(max_num_batched_tokens=64, max_num_seqs=2, block_size=8),      # few sequences per step
    dict(num_blocks=20, block_size=4, max_num_batched_tokens=16),       # preemption by recompute
    dict(prefix_caching=False, block_size=4),
    dict(chunked_prefill=False, max_num_batched_tokens=256),
    dict(cuda_graphs=False),                                            # (graphs exist only when compiled)
], ids=["whole", "chunked", "two-seqs", "preempt", "no-prefix-cache", "no-chunking", "no-graphs"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_greedy_matches_reference_under_any_schedule(model, expected, cfg, overlap):
    llm, outs = serve(model, overlap=overlap, **cfg)
    assert llm.overlap == overlap
    assert_tokens_match(model, PROMPTS, [o.token_ids for o in outs], expected)
    if "num_blocks" in cfg:
        assert llm.summary()["preemptions"] > 0, "the preemption case did not preempt"


def test_triton_attention_and_cascade_match_reference(model, expected):
    for cascade in (False, True):
        llm, outs = serve(model, PROMPTS[3:5], MAX_TOKENS[3:5], attention="triton", block_size=8,
                          cascade=cascade, max_num_batched_tokens=40)
        assert_tokens_match(model, PROMPTS[3:5], [o.token_ids for o in outs], expected[3:5])
        assert (llm.summary()["cascade_steps"] > 0) == cascade


def test_triton_bitlinear_kernels_in_the_engine(model, expected):
    """The whole model on gpulab's kernels (slow in the interpreter: a short run)."""
    llm, outs = serve(model, PROMPTS[:2], [3, 3], attention="triton", linear="triton")
    assert_tokens_match(model, PROMPTS[:2], [o.token_ids for o in outs], [e[:3] for e in expected[:2]])


def test_prefix_cache_hits_and_still_matches(model, expected):
    llm = LLM(model, EngineConfig(block_size=4, max_num_batched_tokens=64))
    first = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=MAX_TOKENS[3]))
    second = llm.generate([PROMPTS[4], PROMPTS[3]], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[4:2:-1]])
    assert first[0].token_ids == expected[3]
    assert [o.token_ids for o in second] == [expected[4], expected[3]]
    prompt_len = len(encode_prompt(SYSTEM))
    assert second[0].metrics.num_cached_tokens >= prompt_len // 4 * 4 - 4 > 0
    assert 0 < llm.block_manager.hit_rate() < 1
    assert llm.idle()


def test_n_completions_share_pages_with_copy_on_write(model, expected):
    llm = LLM(model, EngineConfig(block_size=4))
    greedy = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, n=3))[0]
    assert [c.token_ids for c in greedy.completions] == [expected[1]] * 3
    sampled = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, n=3, temperature=1.5, seed=7))[0]
    texts = [c.token_ids for c in sampled.completions]
    assert len(set(map(tuple, texts))) > 1, "the n completions should differ when sampling"
    again = LLM(model, EngineConfig(block_size=16, max_num_batched_tokens=3)).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=6, n=3, temperature=1.5, seed=7))[0]
    assert [c.token_ids for c in again.completions] == texts
    assert llm.idle()


def test_seeded_sampling_is_the_same_under_any_schedule(model):
    params = [SamplingParams(max_tokens=8, temperature=t, top_k=k, top_p=p, seed=s)
              for t, k, p, s in ((1.0, 0, 1.0, 1), (0.7, 20, 1.0, 2), (1.3, 0, 0.9, 3), (0.9, 5, 0.8, 4),
                                 (1.0, 0, 1.0, 5), (0, 0, 1.0, None))]
    runs = []
    for cfg in (dict(), dict(max_num_batched_tokens=5, block_size=4), dict(num_blocks=20, block_size=4)):
        outs = LLM(model, EngineConfig(**cfg)).generate(PROMPTS, params)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1] == runs[2]
    other = LLM(model).generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=99))
    assert other[0].token_ids != runs[0][0]


def test_bad_requests_get_their_own_error_and_the_rest_are_served(model, expected):
    llm = LLM(model, EngineConfig(num_blocks=12, block_size=4))
    bad = [("", SamplingParams(), "prompt is empty"),
           ([], SamplingParams(), "prompt is empty"),
           ("x" * TINY.max_seq_len, SamplingParams(), "context is 256"),
           ([1, 300], SamplingParams(), "token 300 is outside the vocabulary"),
           ([5, 7, -1, 400], SamplingParams(), "token -1 is outside the vocabulary"),
           ([1, True], SamplingParams(), "prompt must be a str or a list of token ids"),
           ([1, 2.0], SamplingParams(), "prompt must be a str or a list of token ids"),
           ("hi", SamplingParams(temperature=-1), "temperature"),
           ("hi", SamplingParams(top_p=0), "top_p"),
           ("hi", SamplingParams(top_k=1000), "top_k"),
           ("hi", SamplingParams(max_tokens=0), "max_tokens"),
           ("hi", SamplingParams(n=0), "n \\(completions"),
           ("hi", SamplingParams(max_tokens=60), "pool has only 12 pages"),
           (12, SamplingParams(), "prompt must be a str")]
    prompts = [PROMPTS[1]] + [b[0] for b in bad] + [PROMPTS[0]]
    params = [SamplingParams(max_tokens=6)] + [b[1] for b in bad] + [SamplingParams(max_tokens=9)]
    outs = llm.generate(prompts, params)
    assert outs[0].token_ids == expected[1] and outs[-1].token_ids == expected[0]
    for out, (_, _, msg) in zip(outs[1:-1], bad):
        assert out.error and out.finished and not out.token_ids
        assert re.search(msg, out.error), out.error
    assert llm.idle()
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.add_request("")
    assert llm.idle()


def test_generation_stops_at_the_context_length(model):
    prompt = encode_prompt("x" * (TINY.max_seq_len - 6))
    want = reference_generate(model, prompt, 50, stop_at_eos=False)
    out = LLM(model, EngineConfig(block_size=16, max_num_batched_tokens=100)).generate(
        [prompt], SamplingParams(max_tokens=50, stop_at_eos=False))[0]
    assert out.token_ids == want and len(prompt) + len(want) == TINY.max_seq_len
    assert out.completions[0].finish_reason == "length"


# -- the host one step ahead (EngineConfig.overlap) -----------------------------------------------
def test_overlap_leaves_the_newest_token_on_the_device_until_the_next_step(model, expected):
    """After a step returns, its tokens are still placeholders (the host has not waited
    for them); the next step launches its own work first, then reads them."""
    llm = LLM(model, EngineConfig(overlap=True, block_size=4))
    fed = []
    real_feed = llm.runner.feed_tokens
    llm.runner.feed_tokens = lambda plan: fed.append(plan.feed_all) or real_feed(plan)
    llm.add_request(PROMPTS[1], SamplingParams(max_tokens=6))
    seq = llm.scheduler.waiting[0]
    assert llm.step() == [] and seq.token_ids[-1] == PLACEHOLDER      # prompt done, first token in flight
    outs = llm.step()
    assert outs[0].token_ids == expected[1][:1] and seq.token_ids[-1] == PLACEHOLDER
    while llm.has_unfinished():
        outs = llm.step() or outs
    assert outs[0].token_ids == expected[1] and PLACEHOLDER not in seq.token_ids and llm.idle()
    assert fed == [True] * 5, "each decode step feeds every row with one gather"


def test_overlap_sampling_and_n_completions_equal_the_plain_step(model):
    params = [SamplingParams(max_tokens=7, temperature=t, top_k=k, top_p=p, seed=s, n=n)
              for t, k, p, s, n in ((1.0, 0, 1.0, 1, 1), (0.7, 20, 1.0, 2, 3), (1.3, 0, 0.9, 3, 1),
                                    (0, 0, 1.0, None, 2), (0.9, 5, 0.8, 4, 1), (1.0, 0, 1.0, 5, 1))]
    runs = []
    for overlap in (False, True):
        llm = LLM(model, EngineConfig(overlap=overlap, max_num_batched_tokens=9, block_size=4))
        runs.append([[c.token_ids for c in o.completions] for o in llm.generate(PROMPTS, params)])
        assert llm.idle()
    assert runs[0] == runs[1]


def test_overlap_finds_eos_a_step_late_and_drops_the_row_after_it(model, monkeypatch):
    """EOS is seen only when the step after it is already launched: that step's token for
    the sequence is dropped, its pages are freed, the text is the plain step's."""
    force_eos(monkeypatch, "1", 2)         # request "1"'s third token is EOS
    assert_same_text_stopping_at_eos(model, [EngineConfig(overlap=o, block_size=4) for o in (False, True)],
                                     max_tokens=8, stop_len=3)


def test_overlap_abort_in_flight_frees_pages_and_reports_no_placeholder(model):
    llm = LLM(model, EngineConfig(overlap=True, block_size=4))
    rid = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=20))
    other = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=5))
    for _ in range(3):
        llm.step()
    seq = llm.groups[rid][0]
    llm.abort(rid)
    assert PLACEHOLDER not in seq.token_ids and seq.finish_reason == "abort"
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs if o.finished] == [other] and llm.idle()


def test_overlap_needs_the_packages_own_parts(model):
    with pytest.raises(ValueError, match="overlap=True needs"):
        LLM(model, EngineConfig(overlap=True), scheduler_cls=type("S", (Scheduler,), {}))
    assert not LLM(model, EngineConfig()).overlap or gpulab.mode() == "compiled"


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_pages(model, overlap):
    """Also with the host a step ahead (the GPU's default): the step in flight holds only
    the aborted request, so nothing is left to wait for."""
    llm = LLM(model, EngineConfig(block_size=4, overlap=overlap))
    rid = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=20))
    llm.step()
    assert llm.block_manager.num_used > 0
    n_steps = len(llm.metrics.steps)
    llm.abort(rid)
    assert llm.idle() and llm.in_flight is None
    assert len(llm.metrics.steps) == n_steps + overlap      # the landed step is recorded


def test_static_batching_baseline_matches_reference(model, expected):
    static = StaticBatchLLM(model, EngineConfig(num_blocks=16, block_size=16), max_len=80)
    outs = static.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    assert static.batch_size == 3
    assert [o.token_ids for o in outs] == expected
    # the waste: finished rows keep decoding until the batch's longest request is done
    s = static.summary()
    assert sum(r.decode_tokens for r in static.metrics.steps) > sum(MAX_TOKENS) - len(PROMPTS)
    assert s["requests"] == len(PROMPTS)


def test_top_k_top_p_filter():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    out = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1e-3]))
    keep = torch.isfinite(out)
    assert keep.tolist() == [[True, False, True, False], [True, False, False, False], [False, False, False, True]]
    torch.testing.assert_close(out[keep], logits[keep])


def test_train_and_serve_bench_commands(tmp_path):
    from gpulab.engine import serve_bench, train
    from gpulab.engine.model import load_checkpoint
    ckpt = tmp_path / "tiny.pt"
    assert train.main(["--config", "tiny", "--steps", "3", "--seq-len", "32", "--out", str(ckpt)]) == 0
    model = load_checkpoint(ckpt)
    assert model.packed and model.cfg == TINY
    out = tmp_path / "bench.json"
    assert serve_bench.main(["--model", "tiny", "--requests", "6", "--prompt-len", "4:12", "--output-len", "2:6",
                             "--system-len", "16", "--num-blocks", "24", "--quiet", "--json", str(out),
                             "--plot", str(tmp_path / "bench.png")]) == 0
    r = json.loads(out.read_text())
    assert r["continuous"]["requests"] == r["static"]["requests"] == 6
    # what Triton compiled while serving, with the specialisation that was new (none in the interpreter)
    assert min(r["continuous"]["kernels_compiled"], 32) == len(r["continuous"]["kernels_compiled_details"])
    assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_timeline_records_every_step(model, overlap):
    from gpulab.engine import timeline
    llm = LLM(model, EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=16, overlap=overlap))
    frames = timeline.record(llm, PROMPTS[:4], SamplingParams(max_tokens=5))
    assert len(frames) == len(llm.metrics.steps) and llm.idle()
    assert llm.overlap == overlap                # the engine's own setting again afterwards
    assert all(len(f.pages) == 20 for f in frames) and any(f.preempted for f in frames)
    timeline.draw(frames, len(frames) // 2)
    view = timeline.explore(frames)              # the notebook's view: a step slider over the figure
    before = view.png
    view.controls["step"].value = 0
    assert view.redraws == 1 and view.png != before


def test_host_overhead_tool_times_a_decode_step_without_the_forward(capsys, tmp_path):
    """tools/engine_host_overhead.py (the host's share of an engine step, phase by phase,
    and the static baseline's step) runs on a CPU."""
    import runpy
    tool = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "engine_host_overhead.py"))
    threads = torch.get_num_threads()
    assert tool["main"](["--batch", "4", "--ctx", "512", "--prompt", "40", "--steps", "3", "--static",
                         "--device", "cpu", "--json", str(tmp_path / "host.json")]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out
    assert "batch    4, context 512: host part of a decode step" in out and "µs per sequence" in out
    assert "schedule" in out and "emit" in out and "static batching, same batch" in out
    r = json.loads((tmp_path / "host.json").read_text())["results"][0]
    assert r["batch"] == 4 and set(r["phases_ms"]) == {"schedule", "plan", "forward", "sample", "emit"}


def test_step_block_tables_are_as_wide_as_the_longest_sequence(model):
    """A table as wide as the context would cost the host more than the step's kernels:
    the plan's tables hold the step's longest table, zero-padded, and nothing is lost."""
    bm = BlockManager(64, 4)
    runner = ModelRunner(model, 64, 4, attention="torch", linear="torch", cuda_graphs=False)
    seqs = []
    for i, n in enumerate((3, 9, 14)):
        s = Sequence(i, str(i), list(range(1, n + 1)), n, SamplingParams(), 0)
        bm.allocate(s, [], n)
        seqs.append(s)
    plan = runner.plan([(s, s.num_tokens) for s in seqs])
    widths = [len(s.block_table) for s in seqs]
    assert runner.max_blocks > max(widths) and tuple(plan.append_table.shape) == (3, max(widths))
    for row, s in zip(plan.append_table.tolist(), seqs):
        assert row == s.block_table + [0] * (max(widths) - len(s.block_table))


def test_a_graph_steps_inputs_are_one_copy_into_its_buckets_buffer(model):
    """A decode step that a CUDA graph would run is written, padded rows and all, into the
    bucket's static input buffer by the plan's one copy (replay copies nothing): its views
    hold the same step as the eager plan, and the forward over them gives the same logits.
    (Checked on any device: the buffers and the plan need no graph.)"""
    bs = 4
    bm = BlockManager(64, bs)
    runner = ModelRunner(model, 64, bs, max_num_seqs=8, attention="torch", linear="torch", cuda_graphs=False)
    seqs = []
    for i, n in enumerate((3, 9, 14, 6, 1)):
        s = Sequence(i, str(i), list(range(1, n + 1)), n, SamplingParams(), 0)
        bm.allocate(s, [], n)
        seqs.append(s)
    runner.run([(s, s.num_tokens) for s in seqs])               # the prompts' K, V
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(7)
        bm.append_slots(s, 1)
    items = [(s, 1) for s in seqs]
    eager = runner.plan(items)
    want = runner.forward(eager)
    runner.allocate_graph_inputs()
    runner.graphs = {b: None for b in runner.graph_inputs}        # stand-ins: plan() only asks which exist
    plan = runner.plan(items)
    assert plan.use_graph and plan.graph_bucket == 8 and plan.sample_all
    for name in ("input_ids", "positions", "slot_mapping", "decode_lens"):
        assert torch.equal(getattr(plan, name), getattr(eager, name)), name
    w = eager.decode_table.shape[1]
    assert torch.equal(plan.decode_table[:, :w], eager.decode_table) and not plan.decode_table[:, w:].any()
    v = runner.graph_views[8]
    assert (v["slots"][5:] == runner.scratch_slot).all() and not v["lens"][5:].any()
    torch.testing.assert_close(runner.forward(plan), want, rtol=0, atol=0)
    # a 1-token prompt chunk in a decode step is not sampled: the rows come from the buffer
    s = Sequence(9, "9", [1, 2, 3, 4, 5, 6], 6, SamplingParams(), 0)
    bm.allocate(s, [], 4)
    runner.run([(s, 4)])
    s.num_computed_tokens = 4
    bm.append_slots(s, 1)
    plan = runner.plan(items[:2] + [(s, 1)])
    assert plan.use_graph and not plan.sample_all and plan.sample_rows.tolist() == [0, 1]


def test_frozen_heap_keeps_the_start_up_heap_out_of_collections_and_nests():
    """Counts relative to what the test finds: an earlier freeze in the same process (on
    the H200, 375 objects frozen before this test ran in its pytest worker) is not ours
    to undo."""
    import gc
    from gpulab.engine.engine import frozen_heap
    before = gc.get_freeze_count()
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > before
        with frozen_heap():
            pass
        assert gc.get_freeze_count() >= frozen       # the inner block left the outer's freeze alone
    if before:                                       # someone else's freeze: left to its owner
        assert gc.get_freeze_count() >= before
        return
    assert gc.get_freeze_count() == 0                # ours alone: all thawed
    # a freeze made before the block (the host program's) survives the block's exit
    gc.freeze()
    try:
        foreign = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() >= foreign > 0
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("budget, block_size, num_blocks", [(48, 4, 48), (2, 4, 8), (40, 8, 5)])
def test_warm_up_plants_no_layout_fault(model, monkeypatch, budget, block_size, num_blocks):
    """Every step of the warm-up has a valid layout: each length within its block table's
    capacity, each page used a page of the pool (the checks validate=True runs), for the
    decode rows and the append rows alike; gpulab's decode kernel (interpreted here) and
    the eager decode plan, which reports recorded faults, run as on the GPU, and nothing
    is recorded. For the speculative tests' engine (48 tokens, pages of 4), a budget below
    a page, and a pool smaller than the budget."""
    from gpulab import paged, prefill
    runner = ModelRunner(model, num_blocks, block_size, max_num_seqs=8, attention="triton", linear="torch")
    plans, forward = [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda plan: plans.append(plan) or forward(plan))
    runner.warm_up(budget)
    pages = runner.k_cache.shape[1]
    mixed = any(p.num_decode and p.append_lens.numel() for p in plans)
    assert mixed == (budget > 2), "the mixed step: a decode row beside a prompt chunk (two 1-token rows below 3)"
    for plan in plans:
        paged.require_paged_layout(plan.decode_table, plan.decode_lens, block_size, pages)
        if plan.append_lens.numel():
            prefill.require_append_layout(plan.append_indptr, plan.append_table, plan.append_lens, pages,
                                          block_size, plan.input_ids.shape[0] - plan.num_decode)
    paged.raise_recorded_faults(runner.device)             # raises LayoutFault if a kernel met one


@pytest.mark.parametrize("overlap", [False, True])
def test_a_mixed_steps_plan_reads_no_layout_back_and_faults_still_surface(model, monkeypatch, overlap):
    """A step with decode rows beside a prompt chunk plans its decode rows without reading
    the layout back (on a GPU that waits for the step before: the H200 lost ~2 ms a mixed
    step to it, 2026-12-04); a fault a kernel records still stops the engine, at the
    step's tokens (the overlapped step: at the copy of the flag beside them)."""
    from gpulab import paged
    checks = []
    monkeypatch.setattr(paged, "require_paged_layout", lambda *a: checks.append("layout"))
    # full_graphs off: on a GPU a step this small would replay a whole-step graph instead
    llm = LLM(model, EngineConfig(overlap=overlap, block_size=4, attention="triton", max_num_batched_tokens=64,
                                  full_graphs=False))
    llm.add_request(PROMPTS[1], SamplingParams(max_tokens=8))
    for _ in range(3):
        llm.step()
    planned = []
    wrapper_plan = llm.runner.decode_wrapper.plan
    monkeypatch.setattr(llm.runner.decode_wrapper, "plan", lambda *a, **k: planned.append(k) or wrapper_plan(*a, **k))
    llm.add_request(PROMPTS[2], SamplingParams(max_tokens=3))
    llm.step()                                      # the decode row and the new prompt: a mixed step
    assert planned and planned[-1]["check_layout"] is False
    assert not checks, "the mixed step read its decode layout back"
    paged.fault_flag(llm.runner.device)[0:1].fill_(paged.FAULT_PAGE)    # as a kernel records one
    with pytest.raises(paged.LayoutFault, match="not a page of the cache"):
        for _ in range(3):
            llm.step()
    assert int(paged.fault_flag(llm.runner.device)[0]) == 0, "reported once, then cleared"


def _append_alignment(plan, runner) -> tuple:
    """What the append kernel is specialised on that can change from step to step: whether
    each of its index arrays, and q and o (after the decode rows), start 16-byte aligned.
    (On a CPU the plan's arrays are views of its host buffer, laid out as on the GPU.)"""
    if not plan.append_lens.numel():
        return ()
    c = runner.cfg
    q_offset = plan.num_decode * c.n_heads * c.head_dim * runner.k_cache.element_size()
    return tuple(t.data_ptr() % 16 == 0 for t in (plan.append_indptr, plan.append_table, plan.append_lens)) \
        + (q_offset % 16 == 0,)


def test_warm_up_meets_every_alignment_of_the_append_kernels_arrays(model, monkeypatch):
    """Steps with decode rows beside prompt chunks start the append rows' block table and
    lengths at addresses Triton sees as 16-byte aligned or not (it compiles once per
    class): the warm-up must meet each class a served step can, or the first request to
    meet another compiles the kernel while serving (one step of a second on the H200)."""
    import random
    bs = 4
    runner = ModelRunner(model, 64, bs, max_num_seqs=8, attention="torch", linear="torch", cuda_graphs=False)
    seen = set()
    monkeypatch.setattr(runner, "forward", lambda plan: seen.add(_append_alignment(plan, runner)))
    runner.warm_up(40)
    warm, seen = set(seen), set()

    def item(total, new):
        seq = Sequence(-1, "t", [0] * total, total, SamplingParams(max_tokens=1), 0,
                       num_computed_tokens=total - new, block_table=list(range(-(-total // bs))))
        return seq, new
    rng = random.Random(0)
    for _ in range(400):            # as the scheduler builds steps: decode rows first, then chunks
        decode = [item(rng.randint(1, 60), 1) for _ in range(rng.randint(0, 6))]
        total = rng.randint(3, 60)
        chunk = item(total, rng.randint(2, min(total, 36)))
        seen.add(_append_alignment(runner.plan(decode + [chunk]), runner))
    assert seen <= warm, f"served steps met alignments {seen - warm} that the warm-up never ran"


def test_warm_up_meets_both_row_classes_of_the_norm_tuner(model, monkeypatch):
    """rmsnorm_quant's tuner keys on whether a launch's rows fill its row blocks (EVEN:
    a power of two does, an odd count does not): the warm-up runs both at its largest
    size, or a served prefill of an odd number of rows autotunes while serving (the static
    baseline did, three configurations, on the H200 on 2026-12-04)."""
    runner = ModelRunner(model, 64, 4, max_num_seqs=8, attention="torch", linear="torch", cuda_graphs=False)
    rows = []
    monkeypatch.setattr(runner, "forward", lambda plan: rows.append(plan.input_ids.shape[0]))
    runner.warm_up(40)
    assert 40 in rows and any(n % 2 and n > 20 for n in rows), rows


def test_warm_up_runs_every_prefill_size_and_changes_no_output(model, expected):
    """The start-up warm-up (compiled mode: so that autotuning happens before the first
    request) runs prefills of 1, 2, 4, ... tokens and a mixed step; afterwards the engine
    serves exactly what it serves without it, and every page is free."""
    llm = LLM(model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=40))
    assert llm.runner.warm_up(40) == [1, 2, 4, 8, 16, 32, 40]
    assert llm.idle()
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    assert_tokens_match(model, PROMPTS, [o.token_ids for o in outs], expected)
    assert llm.idle()


def test_ttft_splits_into_the_wait_and_the_step_that_gave_the_first_token():
    m = EngineMetrics(8)
    m.steps = [StepRecord(1.0, 1.5, 1, 4, 0, 1, 0, 0, 0, False),       # a prompt step
               StepRecord(1.5, 1.6, 1, 0, 1, 1, 0, 0, 0, True),        # decode steps
               StepRecord(1.6, 2.0, 2, 3, 1, 2, 0, 0, 0, False)]
    m.requests = {"a": RequestMetrics("a", 0.75, 4, first_token=1.5, finish=1.6, num_output_tokens=2),
                  "b": RequestMetrics("b", 1.55, 3, first_token=2.0, finish=2.0, num_output_tokens=1)}
    s = m.summary()
    assert s["ttft_wait_s_mean"] == pytest.approx((0.25 + 0.05) / 2)      # a waited for its step, b for 1.6
    assert s["ttft_step_s_mean"] == pytest.approx((0.5 + 0.4) / 2)
    assert s["ttft_s_mean"] == pytest.approx(s["ttft_wait_s_mean"] + s["ttft_step_s_mean"])
    assert s["step_prompt_s_p50"] == pytest.approx(0.45) and s["step_decode_s_p50"] == pytest.approx(0.1)


@pytest.mark.parametrize("overlap", [False, True])
def test_finished_only_steps_can_report_first_tokens(model, overlap):
    """A server steps with finished_only=True between its reports, and first_tokens=True so
    that a request's first token is not held back until the next report: each request is
    reported when its first token comes (one token, not finished) and when it ends, and
    in no other step; with n = 2 the request's first report holds both completions."""
    llm = LLM(model, EngineConfig(overlap=overlap, block_size=4, max_num_batched_tokens=8))
    short = llm.add_request("a", SamplingParams(max_tokens=5))
    long = llm.add_request("Tyger Tyger, burning bright", SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=3))
    reports = []
    while llm.has_unfinished():
        reports += [(o.request_id, [len(c.token_ids) for c in o.completions], o.finished)
                    for o in llm.step(finished_only=True, first_tokens=True)]
    assert reports.count((short, [1], False)) == 1 and reports[-1][0] == long
    assert [r for r in reports if r[0] == short] == [(short, [1], False), (short, [5], True)]
    assert [r for r in reports if r[0] == long] == [(long, [1, 1], False), (long, [3, 3], True)]
    assert llm.idle()
    # without first_tokens: the ends only
    llm.add_request("a", SamplingParams(max_tokens=5))
    ends = [o for _ in range(20) for o in llm.step(finished_only=True)]
    assert [o.finished for o in ends] == [True]


@pytest.mark.parametrize("overlap", [False, True])
def test_kept_metrics_stay_bounded_and_keep_what_is_running(model, overlap):
    """A served engine keeps its newest records only (``EngineMetrics.keep_last``): the
    oldest finished requests go, running ones stay, steps are a sliding window, and the
    summary still works; asking to keep none is an error."""
    llm = LLM(model, EngineConfig(linear="torch", attention="torch", overlap=overlap))
    running = llm.add_request("a request still running", SamplingParams(max_tokens=200))
    llm.step()
    llm.metrics.keep_last(3)
    ids = [llm.add_request(f"prompt {i}", SamplingParams(max_tokens=2)) for i in range(8)]
    while any(m.finish is None for rid, m in llm.metrics.requests.items() if rid != running):
        llm.step()
    finished = [rid for rid, m in llm.metrics.requests.items() if m.finish is not None]
    assert finished == ids[-3:]                      # the three newest, in order
    assert running in llm.metrics.requests           # still running: kept
    assert len(llm.metrics.steps) <= 3
    assert llm.metrics.summary()["requests"] == 3
    llm.abort(running)
    assert llm.idle()
    with pytest.raises(ValueError, match="keep_last needs a number of records >= 1"):
        llm.metrics.keep_last(0)


def test_engine_bench_rehearses_repeated_ttft_pairs(tmp_path):
    """tools/engine_bench.py --rehearse --parts 2 --ttft-repeats 2: the GPU script's TTFT
    part on a tiny model; the JSON keeps every pair and reports the median one."""
    path = Path(__file__).resolve().parent.parent / "tools" / "engine_bench.py"
    spec = importlib.util.spec_from_file_location("engine_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.median_pair([3.0, 1.0, 2.0]) == 2 and bench.median_pair([4.0, 1.0]) == 1
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path), "--rehearse"])                    # all four parts: refused
    assert bench.main([str(tmp_path), "--rehearse", "--parts", "2", "--ttft-repeats", "2",
                       "--ttft-order", "off,on"]) == 0
    t = json.loads((tmp_path / "engine_bench.json").read_text())["ttft"]
    assert len(t["pairs"]) == 2 and t["p50_ratio"] in [p["p50_ratio"] for p in t["pairs"]]
    assert t["on"]["prefix_hit_rate"] > 0 and not t["off"]["prefix_hit_rate"]
    assert (tmp_path / "engine_ttft.png").exists()

"""Piecewise CUDA graphs (gpulab.engine.piecewise): steps with prompt chunks, padded to a
token bucket, give the eager forward's logits and write K, V only for their real rows.

On a CPU the segments are called instead of replayed (the same static buffers and
order); the GPU tests at the end capture real graphs."""
import pytest
import torch

import gpulab
from gpulab.engine.block_manager import BlockManager
from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.model import NEAR_TIE, TINY, TernaryTransformer, encode_prompt, prepare_for_serving, reference_generate
from gpulab.engine.piecewise import PiecewiseGraphs, token_buckets
from gpulab.engine.runner import ModelRunner
from gpulab.engine.sequence import SamplingParams, Sequence
from gpulab.parallel.tensor_parallel_model import TensorParallelTransformer
from helpers import assert_tokens_match

ON_GPU = gpulab.mode() == "compiled" and torch.cuda.is_available()
BS = 4                                   # tokens per page
MAX_TOKENS = 64                          # buckets 16, 32, 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(4321)
    return TernaryTransformer(TINY).pack().to(gpulab.device())


def decoding(bm, runner, lengths, first_id=0):
    """Sequences of the given lengths whose prompts are in the cache, each with one new
    token to decode."""
    seqs = []
    for i, n in enumerate(lengths):
        s = Sequence(first_id + i, str(first_id + i), [(7 * i + j) % 250 + 1 for j in range(n)], n,
                     SamplingParams(), 0)
        bm.allocate(s, [], n)
        seqs.append(s)
    if seqs:
        runner.forward(runner.plan([(s, s.num_tokens) for s in seqs]))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(3)
        bm.append_slots(s, 1)
    return seqs


def prompt(bm, runner, seq_id, n, computed=0):
    """A sequence of n prompt tokens, the first ``computed`` of them in the cache already."""
    s = Sequence(seq_id, str(seq_id), [(5 * j + seq_id) % 250 + 1 for j in range(n)], n, SamplingParams(), 0)
    bm.allocate(s, [], 0)
    if computed:
        bm.append_slots(s, computed)
        runner.forward(runner.plan([(s, computed)]))
        s.num_computed_tokens = computed
    bm.append_slots(s, n - computed)
    return s


def written_slots(before, after) -> set[int]:
    """The flat slots (page · block_size + offset) where any layer's cache changed."""
    changed = (before != after).flatten(1, 2).flatten(2).any(-1).any(0)
    return set(changed.nonzero().flatten().tolist())


def step_slots(runner, plan) -> set[int]:
    """The slots a step may write: its rows' and the scratch page's (the piecewise
    graphs' padded rows write their K and V there)."""
    scratch = range(runner.scratch_slot, runner.scratch_slot + runner.block_size)
    return set(plan.slot_mapping.tolist()) | set(scratch)


def run_both(runner, pw, items):
    """(eager logits, piecewise logits, K/V before, after eager, after piecewise) of one step."""
    plan = runner.plan(items)
    before = (runner.k_cache.clone(), runner.v_cache.clone())
    want = runner.forward(plan)
    after_eager = (runner.k_cache.clone(), runner.v_cache.clone())
    runner.k_cache.copy_(before[0])
    runner.v_cache.copy_(before[1])
    got = pw.run(plan)
    return plan, want, got, before, after_eager, (runner.k_cache, runner.v_cache)


def test_token_buckets():
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(16) == [16] and token_buckets(5) == [5]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_piecewise_logits_equal_eager_for_every_bucket_edge(model, attention):
    """Token counts 1, a bucket's size, one more, the largest; decode rows with a prompt
    chunk (with history) and a whole prompt: the same logits, bit for bit (float32), and
    the same K/V cache (padded rows write only the scratch page; the real rows the same
    values)."""
    bm = BlockManager(96, BS)
    runner = ModelRunner(model, 96, BS, max_num_seqs=8, attention=attention, linear="torch", cuda_graphs=False)
    pw = PiecewiseGraphs(runner, MAX_TOKENS, cuda=False)
    assert pw.buckets == [16, 32, 64]
    seq_id = 100
    for total in (1, 16, 17, 32, 33, MAX_TOKENS):
        nd = min(3, total - 1) if total > 2 else (1 if total == 1 else 0)
        decodes = decoding(bm, runner, [5, 9, 13][:nd], first_id=seq_id)
        rest = total - nd
        chunks = []
        if rest:
            a = rest // 2 if rest > 3 else 0
            if a:
                chunks.append(prompt(bm, runner, seq_id + 10, a + 6, computed=6))   # a chunk after history
            chunks.append(prompt(bm, runner, seq_id + 11, rest - a))                # a whole prompt
        items = [(s, 1) for s in decodes] + [(s, s.num_tokens - s.num_computed_tokens) for s in chunks]
        assert sum(n for _, n in items) == total
        plan, want, got, before, eager_kv, pw_kv = run_both(runner, pw, items)
        assert plan.input_ids.shape[0] == total and pw.bucket(total) >= total
        assert got.shape == want.shape == (len(plan.sample_seqs), model.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"logits differ at {total} tokens")
        for name, b, e, p in zip("KV", before, eager_kv, pw_kv):
            assert torch.equal(p[:, :-1], e[:, :-1]), f"{name} cache differs from the eager step's at {total} tokens"
            assert written_slots(b, p) <= step_slots(runner, plan), \
                f"{name} written outside the step's slots at {total} tokens"
        for s in decodes + chunks:
            bm.free_sequence(s)
        seq_id += 20


def test_padded_rows_hold_stale_tokens_and_change_nothing(model):
    """A small step after a big one runs in a bucket whose padded rows still hold the big
    step's tokens: the logits equal a fresh eager step's, and only its own slots (and the
    scratch page) change."""
    bm = BlockManager(96, BS)
    runner = ModelRunner(model, 96, BS, attention="torch", linear="torch", cuda_graphs=False)
    pw = PiecewiseGraphs(runner, MAX_TOKENS, cuda=False)
    big = prompt(bm, runner, 1, 60)
    pw.run(runner.plan([(big, 60)]))
    big.num_computed_tokens = 60
    small = prompt(bm, runner, 2, 9)
    plan, want, got, before, eager_kv, pw_kv = run_both(runner, pw, [(small, 9)])
    assert pw.token_ids[9:60].any(), "the padded rows should hold the earlier step's tokens"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for b, p in zip(before, pw_kv):
        assert written_slots(b, p) <= step_slots(runner, plan)


def test_engine_greedy_output_under_piecewise_emulation_equals_reference(model):
    """The whole engine with every step that a decode graph does not run going through
    the piecewise path (emulated): the reference decoder's tokens, under chunked prefill
    mixed with decodes, and steps with prompt chunks ran in both buckets.

    Prompts of 2, 28, 40 and 33 tokens under a budget of 24: four full steps, then one of
    3 decodes and the last 12 prompt tokens (bucket 16). Only steps with prompt rows
    count: decode-only steps replay decode graphs on a GPU (the piecewise path sees them
    only on a CPU, where there are no graphs)."""
    prompts = ["a", "Tyger Tyger, burning bright", "Shall I compare thee to a summer's day?",
               "0123456789abcdef0123456789abcdef"]
    max_tokens = [7, 6, 5, 6]
    want = [reference_generate(model, encode_prompt(p), n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model, EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                                  full_graphs=False))     # (on a GPU these small steps would be full graphs')
    assert llm.runner.piecewise is None or ON_GPU          # nothing captured on a CPU by itself
    assert llm.runner.capture_piecewise(24, emulate=True) and llm.runner.piecewise.buckets == [16, 24]
    calls = []                                             # (rows, decode rows) of each piecewise step
    run = llm.runner.piecewise.run
    llm.runner.piecewise.run = lambda plan: calls.append((plan.input_ids.shape[0], plan.num_decode)) or run(plan)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert_tokens_match(model, prompts, [o.token_ids for o in outs], want)
    chunked = [rows for rows, nd in calls if rows > nd]    # steps that carry prompt chunks
    assert chunked == [24, 24, 24, 24, 15], calls          # the schedule is the same on a CPU and a GPU
    assert llm.idle()


def test_piecewise_is_only_captured_where_graphs_can_run(model):
    runner = ModelRunner(model, 16, BS, attention="torch", linear="torch")
    assert not runner.capture_piecewise(32) and runner.piecewise is None
    llm = LLM(model, EngineConfig(num_blocks=16, block_size=BS, piecewise_graphs=False))
    assert llm.runner.piecewise is None
    # the tensor-parallel model's blocks do not split at attention: its steps stay eager
    tp = TensorParallelTransformer(model, rank=0, world_size=1)
    runner = ModelRunner(tp, 16, BS, attention="torch", linear="torch")
    assert not runner.capture_piecewise(32, emulate=True) and runner.piecewise is None


# -- real CUDA graphs -------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="captures real CUDA graphs: needs a GPU in compiled mode")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_piecewise_graphs_match_eager_on_the_gpu(dtype):
    """Real graphs (gpulab's Triton kernels, padded to the bucket) against the eager step
    on the same plan: the same logits and K/V up to rounding, nothing written elsewhere."""
    torch.manual_seed(0)
    model = prepare_for_serving(TernaryTransformer(TINY), "cuda", dtype)
    bm = BlockManager(96, BS)
    runner = ModelRunner(model, 96, BS, max_num_seqs=8)
    runner.warm_up(MAX_TOKENS)
    assert runner.capture_piecewise(MAX_TOKENS) and runner.piecewise.cuda
    pw = runner.piecewise
    assert all(step.graph is not None for steps in pw.segments.values() for step in steps)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    seq_id = 100
    for total in (3, 16, 17, 40, MAX_TOKENS):          # (a 1-token step is a decode graph's)
        nd = min(3, total - 2)
        decodes = decoding(bm, runner, [5, 9, 13][:nd], first_id=seq_id)
        chunk = prompt(bm, runner, seq_id + 10, 5 + total - nd, computed=5)
        items = [(s, 1) for s in decodes] + [(chunk, total - nd)]
        plan, want, got, before, eager_kv, pw_kv = run_both(runner, pw, items)
        torch.testing.assert_close(got, want, **tol)
        for b, e, p in zip(before, eager_kv, pw_kv):
            torch.testing.assert_close(p[:, :-1], e[:, :-1], **tol)     # the last page is scratch
            assert written_slots(b, p) <= step_slots(runner, plan)
        for s in decodes + [chunk]:
            bm.free_sequence(s)
        seq_id += 20


@needs_gpu
def test_engine_with_captured_piecewise_graphs_serves_what_the_eager_engine_does():
    """Greedy tokens with piecewise graphs equal those of the same engine without them
    (both on gpulab's kernels; test_engine checks the eager engine against the reference)."""
    torch.manual_seed(1234)
    model = TernaryTransformer(TINY).pack().to("cuda")
    prompts = ["a", "Tyger Tyger, burning bright", "Shall I compare thee to a summer's day?",
               "0123456789abcdef0123456789abcdef0123456789"]
    outs = {}
    for on in (False, True):
        llm = LLM(model, EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                                      piecewise_graphs=on, full_graphs=False))   # (small steps: full graphs')
        assert (llm.runner.piecewise is not None) == on
        if on:
            calls = []
            run = llm.runner.piecewise.run
            llm.runner.piecewise.run = lambda plan: calls.append(1) or run(plan)
        outs[on] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
        assert llm.idle()
    assert calls, "no step took the piecewise path"
    assert outs[True] == outs[False]


@needs_gpu
@pytest.mark.parametrize("kv_split", [3, True])
def test_engine_with_split_kv_serves_what_it_does_without(kv_split):
    """EngineConfig(kv_split=...): prompt chunks of 24 tokens over histories of up to 200
    split each attention tile's history (three parts, or as the SMs ask), merged after;
    the same greedy tokens as the engine without it, up to near ties."""
    torch.manual_seed(4321)
    model = TernaryTransformer(TINY).pack().to("cuda")
    prompts = ["Tyger Tyger, burning bright, in the forests of the night; " * 3,
               "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 2]
    outs = {}
    for split in (False, kv_split):
        llm = LLM(model, EngineConfig(num_blocks=160, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                                      kv_split=split, full_graphs=False))   # (full graphs always split)
        plans = []
        plan = llm.runner.plan
        llm.runner.plan = lambda items, feed=None: plans.append(plan(items, feed)) or plans[-1]
        outs[split] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12))]
        assert llm.idle()
        if split == 3:
            assert any(p.append_work is not None and p.append_work[3] is not None for p in plans), \
                "no step split its KV"
    assert_tokens_match(model, prompts, outs[kv_split], outs[False], near_tie=NEAR_TIE[torch.float32])


def test_kv_split_must_be_a_flag_or_a_count():
    with pytest.raises(ValueError, match="kv_split must be True, False or a number of parts"):
        LLM(TernaryTransformer(TINY).pack(), EngineConfig(num_blocks=16, block_size=BS, kv_split=0))


def test_append_work_list_built_once_per_step_gives_the_kernels_result(monkeypatch):
    """The runner builds the append kernel's work list once per step (plan_append_attention)
    and every layer only launches the kernel: the same output as the reference, written
    into ``out`` when given. (The kernel runs in Triton's interpreter on a CPU, compiled on
    a GPU: the inputs live on gpulab's device either way.)"""
    from gpulab.engine import batch_attention
    torch.manual_seed(3)
    dev = gpulab.device()
    hq, hkv, d, pages, page = 4, 2, 16, 12, 8
    kc, vc = torch.randn(pages, page, hkv, d, device=dev), torch.randn(pages, page, hkv, d, device=dev)
    indptr_host = torch.tensor([0, 3, 4, 9], dtype=torch.int32)             # as a plan has it
    indptr = indptr_host.to(dev)
    # 8 pages of 8 per request: 64 positions, room for parts of 16 (interpreter) or 32 positions
    table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 0, 0, 0, 0, 0, 0], [4, 5, 6, 7, 8, 9, 10, 11]],
                         dtype=torch.int32, device=dev)
    lens = torch.tensor([41, 4, 60], dtype=torch.int32, device=dev)
    q = torch.randn(9, hq, d, device=dev)
    want = batch_attention.append_attention_reference(q, kc, vc, indptr, table, lens)
    monkeypatch.setattr(batch_attention.runtime, "mode", lambda: "compiled")
    # built from a host indptr, the list still lands on q's device
    work = batch_attention.plan_append_attention(indptr_host, 9, q.dtype, hq, hkv, d, device=q.device)
    assert all(t.device == q.device for t in work[1:3]), [t.device for t in work[1:3]]
    out = torch.full((9, hq, d), float("nan"), device=dev)
    got = batch_attention.append_attention(q, kc, vc, indptr, table, lens, out=out, work=work)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with the KV of each tile split in parts (a workspace the plan holds), merged after
    split_work = batch_attention.plan_append_attention(indptr_host, 9, q.dtype, hq, hkv, d, device=q.device,
                                                       capacity=table.shape[1] * page, num_splits=3)
    assert split_work[3] is not None and split_work[3].num_splits > 1
    out.fill_(float("nan"))
    got = batch_attention.append_attention(q, kc, vc, indptr, table, lens, out=out, work=split_work)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a work list on another device than q is refused before any launch
    elsewhere = (work[0], *(t.to("meta") for t in work[1:3]), None)
    with pytest.raises(ValueError, match="one device.*work_req on meta"):
        batch_attention.append_attention(q, kc, vc, indptr, table, lens, out=out, work=elsewhere)


# -- whole-step graphs for small steps (gpulab.engine.full_graphs) ---------------------------------
def full_and_eager(runner, items):
    """(plan, eager logits, whole-step logits, K/V before, after eager, after the whole step)
    of one step: the same items planned without and with the runner's full graphs."""
    full, runner.full_graphs = runner.full_graphs, None
    plan = runner.plan(items)
    runner.full_graphs = full
    before = (runner.k_cache.clone(), runner.v_cache.clone())
    want = runner.forward(plan)
    after_eager = (runner.k_cache.clone(), runner.v_cache.clone())
    runner.k_cache.copy_(before[0])
    runner.v_cache.copy_(before[1])
    full_plan = runner.plan(items)
    got = full.replay(full_plan)
    assert full_plan.sample_seqs == plan.sample_seqs
    return full_plan, want, got, before, after_eager, (runner.k_cache, runner.v_cache)


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_full_graph_steps_give_the_eager_logits(attention):
    """Decodes beside prompt chunks (with and without history) as one padded step of append
    rows: the eager step's logits and K/V up to float32 rounding (the graph's matmuls run
    on the bucket's rows, the logits on every padded sample row), nothing written outside
    the step's slots and the scratch page; a step after a bigger one (stale padded rows) too."""
    torch.manual_seed(4321)
    model = TernaryTransformer(TINY).pack().to(gpulab.device())
    bm = BlockManager(128, BS)
    runner = ModelRunner(model, 128, BS, max_num_seqs=8, attention=attention, linear="torch", cuda_graphs=False)
    assert runner.capture_full(MAX_TOKENS, emulate=True)
    full = runner.full_graphs
    assert full.buckets == [16, 32, 64] and full.num_splits >= 1
    tol = dict(rtol=1e-5, atol=1e-5)
    seq_id = 100
    for total in (2, 16, 17, MAX_TOKENS, 5):
        nd = min(3, total - 2)                       # a chunk of one token would be a decode row
        decodes = decoding(bm, runner, [5, 9, 13][:nd], first_id=seq_id)
        rest = total - nd
        chunks = [prompt(bm, runner, seq_id + 10, rest + 6, computed=6)] if rest < 4 else \
            [prompt(bm, runner, seq_id + 10, rest // 2 + 6, computed=6),
             prompt(bm, runner, seq_id + 11, rest - rest // 2)]
        items = [(s, 1) for s in decodes] + [(s, s.num_tokens - s.num_computed_tokens) for s in chunks]
        plan, want, got, before, eager_kv, full_kv = full_and_eager(runner, items)
        assert plan.full_bucket == full.bucket(total, len(items)) >= total and plan.num_decode == 0
        n_req = len(items)
        assert full.views[plan.full_bucket]["indptr"][n_req:].tolist() == [total] * (full.max_requests + 1 - n_req)
        assert full.requests[plan.full_bucket] == full.max_requests
        assert got.shape == want.shape == (len(plan.sample_seqs), model.cfg.vocab_size)
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"logits differ at {total} tokens: {m}")
        for name, b, e, p in zip("KV", before, eager_kv, full_kv):
            torch.testing.assert_close(p[:, :-1], e[:, :-1], **tol, msg=f"{name} cache differs at {total} tokens")
            assert written_slots(b, p) <= step_slots(runner, plan), f"{name} written outside the step at {total}"
        for s in decodes + chunks:
            bm.free_sequence(s)
        seq_id += 20


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_a_step_of_many_requests_takes_a_big_bucket(attention):
    """Buckets above SMALL_TOKENS rows hold as many requests as the runner runs: 20
    decodes beside a prompt chunk (21 requests, more than a small bucket's 16) replay the
    256-row graph, with the eager step's logits and K/V, nothing written elsewhere."""
    torch.manual_seed(99)
    model = TernaryTransformer(TINY).pack().to(gpulab.device())
    bm = BlockManager(160, BS)
    runner = ModelRunner(model, 160, BS, max_num_seqs=24, attention=attention, linear="torch", cuda_graphs=False)
    assert runner.capture_full(256, emulate=True)
    full = runner.full_graphs
    assert full.buckets == [16, 32, 64, 128, 256]
    assert [full.requests[t] for t in full.buckets] == [16, 16, 16, 16, 24]
    assert full.bucket(30, 21) == 256 and full.bucket(30, 16) == 32 and full.bucket(30, 25) == 0
    decodes = decoding(bm, runner, [3 + 2 * i for i in range(20)], first_id=10)
    chunk = prompt(bm, runner, 50, 10 + 9, computed=9)
    items = [(s, 1) for s in decodes] + [(chunk, 10)]
    plan, want, got, before, eager_kv, full_kv = full_and_eager(runner, items)
    assert plan.full_bucket == 256
    # on gpulab's kernels the decodes take the paged decode kernel, the chunk the append kernel
    assert (plan.full_decode_lens is not None) == (attention == "triton")
    if attention == "triton":
        assert plan.full_decode_lens[:21].tolist() == [s.num_tokens for s in decodes] + [0]
        assert plan.full_append_indptr[:22].tolist() == [20] * 21 + [30]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for b, e, p in zip(before, eager_kv, full_kv):
        torch.testing.assert_close(p[:, :-1], e[:, :-1], rtol=1e-5, atol=1e-5)
        assert written_slots(b, p) <= step_slots(runner, plan)


def test_steps_too_big_for_a_full_graph_take_the_other_paths(model):
    """More rows than the largest bucket, more requests than a full graph holds, a decode
    only step, or a cascade decode: no full graph."""
    bm = BlockManager(256, BS)
    runner = ModelRunner(model, 256, BS, max_num_seqs=32, attention="torch", linear="torch", cuda_graphs=False)
    runner.capture_full(32, emulate=True)
    full = runner.full_graphs
    assert full.buckets == [16, 32] and full.bucket(33, 1) == 0 and full.bucket(20, 17) == 0
    assert full.bucket(20, 16) == 32 and full.bucket(0, 0) == 0
    big = prompt(bm, runner, 1, 40)
    assert runner.plan([(big, 40)]).full_bucket == 0
    many = decoding(bm, runner, [5] * 17, first_id=10)
    chunk = prompt(bm, runner, 2, 3)
    assert runner.plan([(s, 1) for s in many] + [(chunk, 3)]).full_bucket == 0
    assert runner.plan([(s, 1) for s in many[:4]] + [(chunk, 3)]).full_bucket == 16
    assert runner.plan([(s, 1) for s in many[:4]]).full_bucket == 0        # decode only


def test_engine_greedy_output_under_full_graph_emulation_equals_reference(model):
    """The engine with its small steps in (emulated) whole-step graphs: the reference
    decoder's tokens, chunked prefill beside decodes, every step with a prompt chunk
    through the full graphs, no page left in use."""
    prompts = ["a", "Tyger Tyger, burning bright", "Shall I compare thee to a summer's day?",
               "0123456789abcdef0123456789abcdef"]
    max_tokens = [7, 6, 5, 6]
    want = [reference_generate(model, encode_prompt(p), n) for p, n in zip(prompts, max_tokens)]
    llm = LLM(model, EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24))
    assert llm.runner.full_graphs is None or ON_GPU             # nothing captured on a CPU by itself
    assert llm.runner.capture_full(24, emulate=True) and llm.runner.full_graphs.buckets == [16, 24]
    calls = []
    replay = llm.runner.full_graphs.replay
    llm.runner.full_graphs.replay = lambda plan: calls.append(plan.input_ids.shape[0]) or replay(plan)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert_tokens_match(model, prompts, [o.token_ids for o in outs], want)
    assert calls[:5] == [24, 24, 24, 24, 15], calls
    assert llm.idle()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_full_graphs_match_eager_on_the_gpu(dtype):
    """Real whole-step graphs (the append kernel's work list and KV split built inside
    them) against the eager step on the same items: the same logits and K/V up to rounding,
    nothing written elsewhere; the engine with them serves the eager engine's tokens."""
    torch.manual_seed(0)
    model = prepare_for_serving(TernaryTransformer(TINY), "cuda", dtype)
    bm = BlockManager(96, BS)
    runner = ModelRunner(model, 96, BS, max_num_seqs=8)
    runner.warm_up(MAX_TOKENS)
    assert runner.capture_full(MAX_TOKENS) and runner.full_graphs.cuda
    full = runner.full_graphs
    assert all(step.graph is not None for step in full.steps.values())
    # the tiny model's context holds 4·BLOCK_N positions twice in float32, not in bfloat16
    assert (full.num_splits > 1) == (dtype == torch.float32), full.num_splits
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    seq_id = 100
    for total in (3, 16, 17, 40, MAX_TOKENS):
        nd = min(3, total - 2)
        decodes = decoding(bm, runner, [5, 9, 13][:nd], first_id=seq_id)
        chunk = prompt(bm, runner, seq_id + 10, 50 + total - nd, computed=50)     # 50 tokens of history
        items = [(s, 1) for s in decodes] + [(chunk, total - nd)]
        plan, want, got, before, eager_kv, full_kv = full_and_eager(runner, items)
        assert plan.full_bucket
        torch.testing.assert_close(got, want, **tol)
        for b, e, p in zip(before, eager_kv, full_kv):
            torch.testing.assert_close(p[:, :-1], e[:, :-1], **tol)
            assert written_slots(b, p) <= step_slots(runner, plan)
        for s in decodes + [chunk]:
            bm.free_sequence(s)
        seq_id += 20


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_captured_big_bucket_matches_eager_on_the_gpu(dtype):
    """A real 256-row whole-step graph (no history split): 20 decodes and a prompt chunk
    over 50 tokens of history give the eager step's logits and K/V up to rounding."""
    torch.manual_seed(1)
    model = prepare_for_serving(TernaryTransformer(TINY), "cuda", dtype)
    bm = BlockManager(400, BS)
    runner = ModelRunner(model, 400, BS, max_num_seqs=24)
    runner.warm_up(256)
    assert runner.capture_full(256) and runner.full_graphs.requests[256] == 24
    decodes = decoding(bm, runner, [5 + 3 * i for i in range(20)], first_id=10)
    chunk = prompt(bm, runner, 50, 50 + 40, computed=50)
    items = [(s, 1) for s in decodes] + [(chunk, 40)]
    plan, want, got, before, eager_kv, full_kv = full_and_eager(runner, items)
    assert plan.full_bucket == 256
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:       # 256 rows and 60 take other matmul tiles: a bf16 rounding flips an int8 code here and there
        off = ~torch.isclose(got, want, rtol=2e-2, atol=2e-2)
        assert off.float().mean() < 0.005 and (got - want).abs().max() < 0.1, (int(off.sum()), (got - want).abs().max())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for b, e, p in zip(before, eager_kv, full_kv):
        torch.testing.assert_close(p[:, :-1], e[:, :-1], **tol)
        assert written_slots(b, p) <= step_slots(runner, plan)


@needs_gpu
def test_engine_with_full_graphs_serves_what_it_does_without():
    """Greedy tokens with whole-step graphs for the small prompt steps equal those of the
    same engine without them (piecewise graphs instead), up to near ties."""
    torch.manual_seed(1234)
    model = TernaryTransformer(TINY).pack().to("cuda")
    prompts = ["a", "Tyger Tyger, burning bright", "Shall I compare thee to a summer's day?",
               "0123456789abcdef0123456789abcdef0123456789"]
    outs = {}
    for on in (False, True):
        llm = LLM(model, EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=24,
                                      full_graphs=on))
        assert (llm.runner.full_graphs is not None) == on
        outs[on] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
        assert llm.idle()
        if on:
            assert any(st.graph and st.prefill_tokens for st in llm.metrics.steps), "no full-graph step"
    assert_tokens_match(model, prompts, outs[True], outs[False], near_tie=NEAR_TIE[torch.float32])

"""Speculative decoding: the acceptance rule keeps the target's distribution (χ² test
that fails for planted wrong rules), greedy output equals the target alone, rollback
leaks no pages, and it works inside continuous batching."""
from types import SimpleNamespace

import pytest
import torch

from gpulab.engine.engine import LLM, EngineConfig
from gpulab.engine.model import TINY, TernaryTransformer
from gpulab.engine.sequence import SamplingParams
from gpulab.engine.sequence import Sequence
from gpulab.engine.spec_graphs import MLGRUGraphDrafter
from gpulab.engine.engine import PLACEHOLDER
from gpulab.engine.speculative import (MLGRUDrafter, SpeculativeLLM, TransformerDrafter, accept_draft,
                                       accept_greedy, best_k, draft_noise, expected_tokens_per_pass,
                                       load_mlgru_draft)
import gpulab
from gpulab.model import MatMulFreeLM
from gpulab.grading.speculative import chi2_pvalue
from helpers import load_tool

CONFIG = dict(num_blocks=48, block_size=4, max_num_seqs=8, max_num_batched_tokens=48)
PROMPTS = ["Tyger Tyger", "a", "Shall I compare thee", "The moon", "0123456789"]


def simulate(rule, p, q, k, length, trials, seed=0):
    """Generate `length` tokens per trial by speculative rounds with context-free
    position-indexed distributions p[t], q[t]; count the token at each position."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(length, p.shape[1], dtype=torch.float64)
    for _ in range(trials):
        t = 0
        while t < length:
            kk = min(k, length - t - 1) if length - t > 1 else 0
            draft = [int(torch.multinomial(q[t + i], 1, generator=gen)) for i in range(kk)]
            out = rule(draft, q[t:t + kk], p[t:t + kk + 1], gen)
            for tok in out[:length - t]:
                counts[t, tok] += 1
                t += 1
    return counts


def distributions(v=6, length=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(length, v, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(length, v, generator=g, dtype=torch.float64) * 1.5, -1)
    q[:, 0] = 0                     # the draft never proposes token 0: only the residual can emit it
    return p, q / q.sum(-1, keepdim=True)


def wrong_ratio(draft, q, p, gen):          # accepts with min(1, q/p): the ratio upside down
    for i, x in enumerate(draft):
        if torch.rand((), generator=gen, dtype=torch.float64) * p[i, x] <= q[i, x]:
            continue
        r = (p[i] - q[i]).clamp_min(0)
        return draft[:i] + [int(torch.multinomial(r / r.sum(), 1, generator=gen))]
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def wrong_residual(draft, q, p, gen):       # on rejection samples from p, not max(0, p - q)
    for i, x in enumerate(draft):
        if torch.rand((), generator=gen, dtype=torch.float64) * q[i, x] <= p[i, x]:
            continue
        return draft[:i] + [int(torch.multinomial(p[i], 1, generator=gen))]
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def test_acceptance_rule_keeps_the_target_distribution():
    p, q = distributions()
    counts = simulate(accept_draft, p, q, k=2, length=3, trials=4000)
    for t in range(3):
        assert chi2_pvalue(counts[t], p[t]) > 1e-3, f"position {t}: emitted tokens are not distributed as p"


@pytest.mark.parametrize("rule", [wrong_ratio, wrong_residual])
def test_distribution_test_catches_wrong_rules(rule):
    p, q = distributions()
    counts = simulate(rule, p, q, k=2, length=3, trials=4000)
    assert min(chi2_pvalue(counts[t], p[t]) for t in range(3)) < 1e-6


def test_greedy_acceptance_and_bonus():
    logits = torch.tensor([[0., 5, 0], [3., 0, 0], [0., 0, 9]])
    assert accept_greedy([1, 0], logits) == [1, 0, 2]            # all accepted + bonus
    assert accept_greedy([1, 2], logits) == [1, 0]               # second rejected: target's argmax
    assert accept_greedy([2, 0], logits) == [1]
    assert expected_tokens_per_pass(0.0, 4) == 1 and expected_tokens_per_pass(1.0, 4) == 5


DEVICE = gpulab.device()


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(11)
    return TernaryTransformer(TINY).pack().to(DEVICE)


def drafters(target):
    torch.manual_seed(12)
    return {"self": TransformerDrafter(target),                   # accepts everything
            "transformer": TransformerDrafter(TernaryTransformer(TINY).pack().to(DEVICE)),
            "mlgru": MLGRUDrafter(MatMulFreeLM(d_model=32, n_layers=1, scan="torch").pack().to(DEVICE))}


def serve(llm, params):
    outs = llm.generate(PROMPTS, params)
    assert llm.idle(), "pages or requests left after speculative decoding"
    assert all(not o.error for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", ["self", "transformer", "mlgru"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_the_target_alone(target, name, k):
    params = [SamplingParams(max_tokens=m) for m in (12, 7, 9, 5, 11)]
    want = serve(LLM(target, EngineConfig(**CONFIG)), params)
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)[name], k=k)
    assert serve(spec, params) == want
    if name == "self":
        assert spec.stats.acceptance_rate() == 1.0
        assert spec.stats.mean_tokens_per_pass() > 1.5


def test_rollback_keeps_exactly_the_pages_of_accepted_tokens(target):
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)["transformer"], k=3)
    for p in PROMPTS:
        spec.add_request(p, SamplingParams(max_tokens=10, temperature=0.9, seed=3))
    while spec.has_unfinished():
        spec.step()
        for seq in spec.scheduler.running:
            need = spec.block_manager.blocks_for(seq.num_tokens)
            assert len(seq.block_table) <= need, "pages of rejected drafts were kept"
            if seq.num_output_tokens:            # decoding: only its newest token lacks K and V
                assert seq.num_computed_tokens == seq.num_tokens - 1
    assert spec.idle()
    assert 0 < spec.stats.acceptance_rate() < 1


def test_sampled_speculation_under_preemption_and_prefix_hits(target):
    """A tiny page pool forces preemption; a shared prefix gives cache hits; seeded
    sampling gives the same text when the same run is repeated."""
    prompts = ["The same old prefix, " + s for s in ("a", "bb", "ccc", "dddd")]
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(4)]
    texts = []
    small = dict(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    for cfg in (small, small, dict(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)):
        spec = SpeculativeLLM(target, EngineConfig(**cfg), drafter=drafters(target)["mlgru"], k=2)
        outs = spec.generate(prompts, params)
        assert spec.idle() and all(not o.error and len(o.token_ids) == 10 for o in outs)
        texts.append([o.token_ids for o in outs])
    assert texts[0] == texts[1]
    assert spec.block_manager.hit_rate() > 0


def test_best_k_follows_the_acceptance_rate():
    assert best_k(0.0, 8, 0.1) == 1                 # nothing is accepted: one draft at most
    assert best_k(0.99, 8, 0.05) == 8               # almost everything is: draft as many as allowed
    assert best_k(0.6, 8, 0.1) < best_k(0.9, 8, 0.1)
    assert best_k(0.8, 8, 0.0) == 8 and best_k(0.8, 8, 1.0) < best_k(0.8, 8, 0.1)


def test_adaptive_k_per_request_keeps_the_output_and_follows_acceptance(target):
    """Requests in one batch draft different numbers of tokens; greedy output still equals
    the target alone. A perfect draft (the target itself) climbs to k, a poor one falls."""
    params = [SamplingParams(max_tokens=m) for m in (12, 7, 9, 5, 11)]
    want = serve(LLM(target, EngineConfig(**CONFIG)), params)
    seen = {}
    for name in ("self", "mlgru"):
        spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)[name], k=4, adaptive=True)
        for p, sp in zip(PROMPTS, params):
            spec.add_request(p, sp)
        ks = []
        while spec.has_unfinished():
            ks += [spec.request_k(s) for s in spec.scheduler.running]
            spec.step()
        assert spec.idle() and not spec.acceptance, "per-request acceptance left after the requests finished"
        seen[name] = ks
        assert serve(SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)[name], k=4,
                                    adaptive=True), params) == want
    assert max(seen["self"]) == 4 and min(seen["mlgru"]) < max(seen["self"])
    with pytest.raises(ValueError, match="draft_cost"):
        SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)["self"], draft_cost=-1)


def test_mixed_greedy_and_sampled_requests_share_a_batch(target):
    """Drafts are drawn and verified for the whole batch at once: greedy requests beside
    sampled ones still equal the target alone."""
    greedy = [SamplingParams(max_tokens=m) for m in (12, 7, 9, 5, 11)]
    want = serve(LLM(target, EngineConfig(**CONFIG)), greedy)
    mixed = [g if i % 2 == 0 else SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i, g in enumerate(greedy)]
    for name in ("mlgru", "transformer"):
        spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)[name], k=3)
        got = serve(spec, mixed)
        assert [got[i] for i in (0, 2, 4)] == [want[i] for i in (0, 2, 4)]
        assert spec.stats.passes > 0


def test_batched_draft_draws_follow_the_draft_distribution():
    """The Gumbel-max draw of a drafted token, one seeded stream per position, is a sample
    from q (χ² over many positions)."""
    from types import SimpleNamespace
    from gpulab.engine.speculative import Drafter
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0, -torch.inf])
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(5, dtype=torch.float64)
    seqs = [SimpleNamespace(params=params, seed=7, index=i, num_tokens=0) for i in range(400)]
    for pos in range(5):
        tokens, q = Drafter._draw(seqs, logits.expand(len(seqs), -1).clone(), pos)
        counts += torch.bincount(tokens, minlength=5).double()
    assert counts[4] == 0
    assert chi2_pvalue(counts, torch.softmax(logits.double(), -1)) > 1e-3


# -- the graph path (spec_graphs): its plumbing on the CPU ("emulate"), real graphs on a GPU ---------------
def graph_steps(llm) -> int:
    return sum(1 for st in llm.metrics.steps if st.graph)


@pytest.mark.parametrize("name", ["self", "mlgru"])
def test_graph_path_greedy_output_equals_the_target_alone(target, name):
    """Verify (and, for the MLGRU draft, drafting) through the graph path's static
    buffers, padded rows and buckets: the same tokens as the target alone."""
    params = [SamplingParams(max_tokens=m) for m in (12, 7, 9, 5, 11)]
    want = serve(LLM(target, EngineConfig(**CONFIG)), params)
    for k, adaptive in ((1, False), (3, False), (4, True)):
        spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)[name], k=k,
                              adaptive=adaptive, graphs="emulate")
        assert serve(spec, params) == want, (k, adaptive)
        assert graph_steps(spec) > 0, "no step went through the verify graph"
    if name == "self":
        assert spec.stats.acceptance_rate() == 1.0


def test_graph_path_runs_the_append_kernel_it_captures_on_a_gpu(target):
    """attention="triton": the verify graph's own launch of the append kernel (tiles for
    k+1 tokens, one work list for all layers, padding requests), here in the interpreter."""
    params = [SamplingParams(max_tokens=11), SamplingParams(max_tokens=8)]
    want = serve_some(LLM(target, EngineConfig(**CONFIG)), params)
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG, attention="triton"), drafter=drafters(target)["self"],
                          k=2, graphs="emulate")
    assert serve_some(spec, params) == want and graph_steps(spec) > 0


def serve_some(llm, params):
    outs = llm.generate(PROMPTS[:len(params)], params)
    assert llm.idle() and all(not o.error for o in outs)
    return [o.token_ids for o in outs]


def test_the_verify_graph_buffers_hold_each_sequences_rows_pages_and_drafts():
    """VerifyGraphs.run fills its buffers for a ragged batch (sequence i's rows from
    i·(k+1)): ids, positions, cache slots through the block table, draft rows read on the
    device (``draft_at``), tables, lengths and indptr with each sequence's padding; a
    smaller batch next resets what the larger one wrote."""
    from gpulab.engine.spec_graphs import VerifyGraphs
    runner = SimpleNamespace(device=torch.device("cpu"), max_blocks=4, scratch_slot=99, block_size=4)
    vg = VerifyGraphs(runner, k=3, max_num_seqs=8, cuda=False)
    vg.graphs = {b: SimpleNamespace(replay=lambda: None) for b in vg.graphs}     # the buffers alone
    class Seq(SimpleNamespace):                            # hashable by identity, as a Sequence
        __hash__ = object.__hash__
    a = Seq(num_computed_tokens=5, token_ids=list(range(10, 19)), block_table=[7, 2, 9])
    b = Seq(num_computed_tokens=2, token_ids=[40, 41, 42], block_table=[4])
    c = Seq(num_computed_tokens=3, token_ids=list(range(50, 56)), block_table=[1, 6])
    pending = SimpleNamespace(column={a: 1, c: 0}, flat=lambda: torch.arange(6))
    vg.run([(a, 4), (b, 1), (c, 3)], pending)              # 3 sequences: the bucket of 4, 16 rows
    pad = [0, 0, 0]
    assert vg.buf["ids"][:16].tolist() == [15, 16, 17, 18, 42] + pad + [53, 54, 55] + [0] * 5
    assert vg.buf["pos"][:16].tolist() == [5, 6, 7, 8, 2] + pad + [3, 4, 5] + [0] * 5
    assert vg.buf["slots"][:16].tolist() == [9, 10, 11, 36, 18] + [99] * 3 + [7, 24, 25] + [99] * 5
    assert vg.buf["draft_at"][:16].tolist() == [-1, 3, 4, 5, -1] + [-1] * 4 + [0, 1] + [-1] * 5
    assert vg.buf["table"][:8:2].tolist() == [[7, 2, 9, 0], [4, 0, 0, 0], [1, 6, 0, 0], [0, 0, 0, 0]]
    assert vg.buf["lens"][:8:2].tolist() == [9, 3, 6, 0]
    assert vg.buf["indptr"][:9].tolist() == [0, 4, 4, 5, 8, 11, 12, 12, 16]
    assert vg.drafts[:6].tolist() == list(range(6))
    vg.run([(b, 1)], None)                                 # one sequence: bucket 1, what A left is gone
    assert vg.buf["ids"][:4].tolist() == [42, 0, 0, 0] and vg.buf["slots"][:4].tolist() == [18, 99, 99, 99]
    assert vg.buf["draft_at"][:4].tolist() == [-1] * 4 and vg.buf["table"][0].tolist() == [4, 0, 0, 0]
    assert vg.buf["indptr"][:3].tolist() == [0, 1, 4] and vg.buf["lens"][0].item() == 3


def test_graph_path_sampled_output_equals_the_eager_path(target):
    """Drafts drawn on the device with the host's seeded noise, states rewound by picking
    a row of the pool: sampled text (mixed with greedy requests) is the eager path's."""
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) if i % 2 else SamplingParams(max_tokens=9)
              for i in range(5)]
    got = {}
    for graphs in ("off", "emulate"):
        spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)["mlgru"], k=3, graphs=graphs)
        got[graphs] = serve(spec, params)
        assert 0 < spec.stats.acceptance_rate() < 1
    assert got["off"] == got["emulate"]
    assert graph_steps(spec) > 0 and isinstance(spec.proposer, MLGRUGraphDrafter)


@pytest.mark.skipif(gpulab.mode() == "compiled", reason="the plumbing on CPU tensors; on a GPU the "
                    "captured graphs are compared with the eager path by the CUDA tests")
def test_graph_drafter_proposes_what_the_eager_drafter_does():
    """Step by step with random acceptance (some drafts taken, then a correction, now and
    then a special token or a step without drafts): the graph drafter's pool rows give
    the eager drafter's proposals, token for token, with the same q."""
    torch.manual_seed(5)
    model = MatMulFreeLM(d_model=32, n_layers=2, scan="torch").pack()
    eager = MLGRUDrafter(model)
    k = 3
    graph = MLGRUGraphDrafter(eager.model, eager.vocab_size, k, 4, draft_noise, cuda=False)
    gen = torch.Generator().manual_seed(0)
    seqs = [Sequence(i, str(i), [256] + list(p.encode()) + [65], 1 + len(p),
                     SamplingParams(temperature=0.7, seed=i) if i % 2 else SamplingParams(), i)
            for i, p in enumerate(["Tyger", "a", "The moon"])]
    checked = 0
    for step in range(12):
        ks = [int(torch.randint(0, k + 1, (), generator=gen)) for _ in seqs]
        want, got = eager.propose(seqs, ks), graph.propose(seqs, ks)
        for seq, kk, (tw, qw), (tg, qg) in zip(seqs, ks, want, got):
            assert tg == tw, f"step {step}, sequence {seq.seq_id}: {tg} != eager {tw}"
            if qw is not None:
                torch.testing.assert_close(qg, qw)
                checked += 1
            if step == 6 and seq.seq_id == 0:      # a special token enters the sequence
                seq.token_ids.append(257)
                continue
            accepted = int(torch.randint(0, len(tw) + 1, (), generator=gen))
            seq.token_ids += tw[:accepted] + [int(torch.randint(0, 256, (), generator=gen))]
        if step == 8:
            graph.forget(2)
            eager.forget(2)
    assert checked > 0 and len(graph.slots) == 3


def test_the_rollout_kernel_drafts_what_the_stepped_graph_does(monkeypatch):
    """Greedy graphs draft with one kernel (gpulab.block_step.draft_rollout) where the
    fused step applies: step by step with random acceptance and a sequence forgotten, its
    drafts and pool rows are those of the graph that steps the model k + 1 times."""
    torch.manual_seed(6)
    model = MatMulFreeLM(d_model=32, n_layers=2, scan="torch")
    with torch.no_grad():                    # non-uniform norms, embeddings of a trained model's size
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
        model.embed.weight.normal_()
    model = model.pack().to(gpulab.device()).eval()
    k = 2
    rolled = MLGRUGraphDrafter(model, 258, k, 4, draft_noise, cuda=False, fused=True)
    monkeypatch.setattr(MLGRUGraphDrafter, "use_rollout", False)
    stepped = MLGRUGraphDrafter(model, 258, k, 4, draft_noise, cuda=False, fused=True)
    assert rolled.rollout is not None and stepped.rollout is None
    gen = torch.Generator().manual_seed(1)
    seqs = [Sequence(i, str(i), [256] + list(p.encode()), len(p) + 1, SamplingParams(), i)
            for i, p in enumerate(["Tyger", "a", "The moon"])]
    for step in range(4):
        ks = [int(torch.randint(0, k + 1, (), generator=gen)) for _ in seqs]
        want, got = stepped.propose(seqs, ks), rolled.propose(seqs, ks)
        assert [t for t, _ in got] == [t for t, _ in want], step
        for seq, (tw, _) in zip(seqs, want):
            accepted = int(torch.randint(0, len(tw) + 1, (), generator=gen))
            seq.token_ids += tw[:accepted] + [int(torch.randint(0, 256, (), generator=gen))]
        if step == 1:
            rolled.forget(1)
            stepped.forget(1)
    torch.testing.assert_close(rolled.pool, stepped.pool, atol=1e-4, rtol=1e-4)


def test_drafting_ahead_changes_no_draft():
    """The next step's drafts launched before the host reads this step's tokens (the
    shipped models, so that drafts are often accepted): the same tokens and the same
    acceptance at every position as drafting after reading, with the drafts adopted in
    most steps and read back where the drafting set changed. The third request does not
    stop at EOS: a drafting sequence whose next token is no byte starts over."""
    from gpulab.engine.model import load_checkpoint
    target, draft = load_checkpoint(device=DEVICE), load_mlgru_draft(device=DEVICE)
    params = [SamplingParams(max_tokens=m) for m in (21, 7, 16, 5, 13)]
    params[2] = SamplingParams(max_tokens=56, stop_at_eos=False)        # its tokens 51 and 52 are EOS
    config = EngineConfig(**CONFIG)
    want = serve(LLM(target, config), params)
    runs = {}
    for ahead in (False, True):
        spec = SpeculativeLLM(target, config, drafter=MLGRUDrafter(draft), k=3, graphs="emulate", draft_ahead=ahead)
        assert serve(spec, params) == want, ahead
        runs[ahead] = (spec.stats.accepted, spec.stats.proposed)
        assert not spec.proposer.slots and not spec.proposer.record
    assert runs[True] == runs[False] and sum(runs[True][0]) > 0
    used, launched = spec.ahead_counts["used"], spec.ahead_counts["launched"]
    assert 0 < used < launched, spec.ahead_counts


def test_the_verify_results_are_on_their_way_to_the_host_before_the_drafts_ahead_launch(monkeypatch):
    """Drafting ahead overlaps the host's reading with the next drafts only if the copy of
    the verify pass's results is queued before the drafts (a copy queued after them waits
    for them): in every step that drafts ahead, the copy starts first, and the host waits
    for it after the launch."""
    from gpulab.engine.model import load_checkpoint
    target, draft = load_checkpoint(device=DEVICE), load_mlgru_draft(device=DEVICE)
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=MLGRUDrafter(draft), k=3, graphs="emulate")
    log = []
    for cls, name in ((SpeculativeLLM, "_send_to_host"), (SpeculativeLLM, "_on_host"),
                      (MLGRUGraphDrafter, "launch_ahead")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _real=real, _name=name, **kw: log.append(_name) or _real(*a, **kw))
    serve_some(spec, [SamplingParams(max_tokens=24)])
    steps = " ".join(log).replace("_on_host", "|").split("|")
    ahead = [s.split() for s in steps if "launch_ahead" in s]
    assert ahead and all(s == ["_send_to_host", "launch_ahead"] for s in ahead), steps


@pytest.mark.skipif(gpulab.mode() != "compiled", reason="CUDA graphs and streams need a GPU")
def test_captured_graphs_draft_what_their_emulation_drafts():
    """On a GPU, the drafter's real CUDA graphs (drafting ahead, the rollout's last step on
    a side stream, the verify graphs) against the same functions called at each step
    (graphs="emulate"): the same tokens and the same acceptance at every position. A
    state read before the side stream wrote it, or a graph output read after a replay
    rewrote it, changes the drafts, which only the acceptance shows (verification keeps
    the tokens the target's either way)."""
    from gpulab.engine.model import load_checkpoint
    target = load_checkpoint(device=DEVICE, dtype=torch.bfloat16)
    draft = load_mlgru_draft(device=DEVICE, dtype=torch.bfloat16)
    params = [SamplingParams(max_tokens=m, stop_at_eos=False) for m in (40, 33, 47, 21, 38)]
    runs = {}
    for graphs in ("emulate", "auto"):
        spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=MLGRUDrafter(draft), k=4, graphs=graphs)
        runs[graphs] = serve(spec, params), spec.stats.accepted, spec.stats.proposed
        assert graphs == "emulate" or spec.ahead_counts["used"] > 0
    assert runs["auto"] == runs["emulate"]


def test_drafting_ahead_under_preemption_keeps_the_target_tokens():
    """A page pool too small for every request: sequences preempted while their next
    drafts run ahead (their drafts dropped, their slots forgotten) recompute later and
    still produce the target's tokens; nothing leaks."""
    from gpulab.engine.model import load_checkpoint
    target, draft = load_checkpoint(device=DEVICE), load_mlgru_draft(device=DEVICE)
    prompts = ["The same old prefix, " + s for s in ("a", "bb", "ccc", "dddd")]
    params = SamplingParams(max_tokens=14)
    small = EngineConfig(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    want = [o.token_ids for o in LLM(target, EngineConfig(**CONFIG)).generate(prompts, params)]
    spec = SpeculativeLLM(target, small, drafter=MLGRUDrafter(draft), k=3, graphs="emulate")
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want and spec.idle() and not spec.proposer.slots
    assert spec.metrics.summary()["preemptions"] > 0 and spec.ahead_counts["used"] > 0


def test_a_request_aborted_while_its_drafts_run_ahead_leaves_the_others_alone():
    """A client that goes away while its next drafts are launched ahead (the server aborts
    it between steps): the other requests' tokens are the target's, and its draft slot and
    pages are all freed."""
    from gpulab.engine.model import load_checkpoint
    target, draft = load_checkpoint(device=DEVICE), load_mlgru_draft(device=DEVICE)
    params = SamplingParams(max_tokens=16)
    want = serve_some(LLM(target, EngineConfig(**CONFIG)), [params] * 3)
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=MLGRUDrafter(draft), k=3, graphs="emulate")
    ids = [spec.add_request(p, params) for p in PROMPTS[:3]]
    done = {}
    while spec.ahead is None or ids[1] not in {s.request_id for s in spec.ahead.seqs}:
        assert spec.has_unfinished(), "no step drafted ahead for the request"
        done.update({o.request_id: o for o in spec.step() if o.finished})
    spec.abort(ids[1])
    while spec.has_unfinished():
        done.update({o.request_id: o for o in spec.step() if o.finished})
    assert [done[ids[0]].token_ids, done[ids[2]].token_ids] == [want[0], want[2]]
    assert spec.idle() and not spec.proposer.slots and not spec.proposer.record


@pytest.mark.skipif(gpulab.mode() == "compiled", reason="the plumbing on CPU tensors")
@pytest.mark.parametrize("rollout", [False, True])
def test_drafts_launched_ahead_start_where_the_accepted_tokens_end(rollout):
    """launch_ahead finds each sequence's accepted count and next token in the verify
    argmax on the device (in PyTorch ops, or in the rollout kernel's own start): after
    the host appends the same tokens, its drafts are those the drafter proposes from the
    tokens themselves; a sequence whose next token is not a byte (EOS) is forgotten on
    landing."""
    from gpulab.engine.sequence import Status
    torch.manual_seed(5)
    model = MatMulFreeLM(d_model=32, n_layers=1, scan="torch").pack()
    k, k1 = 2, 3
    ahead, plain = (MLGRUGraphDrafter(model, 258, k, 4, draft_noise, cuda=False, fused=rollout) for _ in range(2))
    assert (ahead.rollout is not None) == rollout
    seqs = [Sequence(i, str(i), [256] + list(p.encode()), 1 + len(p), SamplingParams(), i)
            for i, p in enumerate(["Tyger", "a", "The moon"])]
    for seq in seqs:
        seq.status = Status.RUNNING
    gen = torch.Generator().manual_seed(0)
    pending = ahead.propose_on_device(seqs, [k] * 3)
    for step in range(3):
        drafts = pending.resolve()
        plain_drafts = plain.propose(seqs, [k] * 3)
        assert [t for t, _ in drafts] == [t for t, _ in plain_drafts], step
        for seq in seqs:                       # and the states after them
            rows = slice(ahead.slots[seq.seq_id] * k1, (ahead.slots[seq.seq_id] + 1) * k1)
            torch.testing.assert_close(ahead.pool[:, rows], plain.pool[:, rows], atol=1e-5, rtol=1e-5)
        best = torch.randint(0, 256, (3 * k1,), generator=gen)
        taken = []
        for i, (tokens, _) in enumerate(drafts):
            a = int(torch.randint(0, k + 1, (), generator=gen))
            best[i * k1:i * k1 + a] = torch.tensor(tokens[:a], dtype=torch.long)
            if step == 1 and i == 1:
                best[i * k1 + a] = 257                         # EOS: no draft input
            taken.append(tokens[:a] + [int(best[i * k1 + a])])
        nxt = ahead.launch_ahead(pending, [(s, k1) for s in seqs], {s: k for s in seqs}, best)
        for seq, tokens in zip(seqs, taken):
            seq.token_ids += tokens
        ahead.land_ahead(nxt)
        if step == 1:
            assert 1 not in ahead.slots and nxt.done[1] is None
            plain.forget(1)
            seqs[1].token_ids.append(65)       # EOS ignored, a byte after it: it catches up
            nxt.resolve()                      # as the engine does before launching anew
            nxt = ahead.propose_on_device(seqs, [k] * 3)
        pending = nxt


def test_verify_graph_lays_out_rows_and_padding(target):
    """Sequence i owns rows i(k+1) ..; its unused rows and whole padded sequences are
    requests of their own with no history; padded rows write to the scratch page. (Whole-step
    graphs off: on a GPU the prompt step would replay one and end the loop below before
    any verification ran.)"""
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG, full_graphs=False), drafter=drafters(target)["mlgru"], k=3,
                          graphs="emulate")
    for p in ("Tyger Tyger", "The moon"):
        spec.add_request(p, SamplingParams(max_tokens=20))
    while not any(st.graph for st in spec.metrics.steps):
        spec.step()
    vg = spec.verify_graphs
    b = vg.bucket(2)
    indptr = vg.buf["indptr"][:2 * b + 1].tolist()
    lens = vg.buf["lens"][:2 * b].tolist()
    assert b == 2 and indptr[0] == 0 and indptr[2] == 4 and indptr[4] == 8
    assert all(lens[i] == 0 for i in range(1, 2 * b, 2)), "padding requests must have no history"
    slots = vg.buf["slots"][:b * 4].tolist()
    for i in range(2):
        n = indptr[2 * i + 1] - 4 * i
        assert 1 <= n <= 4 and all(s == spec.runner.scratch_slot for s in slots[4 * i + n:4 * i + 4])
    assert spec.idle() is False
    while spec.has_unfinished():
        spec.step()
    assert spec.idle() and not spec.proposer.slots, "draft slots left after the requests finished"


def test_staged_buffers_send_the_filled_prefixes_in_one_copy(monkeypatch):
    """One byte buffer behind every field: a send is one copy of a span, which leaves each
    field's device side equal to its host twin, and fields the host did not touch as they
    started (the twins start as copies)."""
    from gpulab.engine.graph_capture import StagedBuffers
    buf = StagedBuffers(ids=torch.arange(10), flag=torch.ones(3, dtype=torch.bool),
                        table=torch.full((4, 5), 7, dtype=torch.int32), noise=torch.zeros(2, 3))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, **kw: copies.append(1) or real_copy(t, src, **kw))
    h = buf.np
    h["ids"][:4] = [9, 8, 7, 6]
    h["table"][:2] = 1
    h["flag"][1] = 0
    buf.send(ids=4, table=2, flag=3)
    assert len(copies) == 1
    assert buf["ids"].tolist() == [9, 8, 7, 6, 4, 5, 6, 7, 8, 9]
    assert buf["flag"].tolist() == [True, False, True]
    assert buf["table"][:2].eq(1).all() and buf["table"][2:].eq(7).all() and buf["noise"].eq(0).all()
    buf.set("noise", torch.ones(2, 3))
    assert buf["noise"].eq(1).all() and (h["noise"] == 1).all()


def test_staged_buffers_wait_for_their_last_copy_before_the_host_rewrites_them():
    """On a GPU a send's copy is asynchronous: the host's way in (``np``, ``set``) waits
    for the event recorded after it, once; without a copy in flight it waits for nothing."""
    from gpulab.engine.graph_capture import StagedBuffers
    buf = StagedBuffers(ids=torch.arange(4))
    waits = []
    buf.sent = SimpleNamespace(synchronize=lambda: waits.append(1), record=lambda: None)
    buf.in_flight = True                  # as after a send on a GPU
    buf.np["ids"][0] = 5
    buf.np["ids"][1] = 6
    assert waits == [1]
    buf.send(ids=2)
    assert buf.in_flight
    buf.set("ids", torch.zeros(4, dtype=torch.long))
    assert waits == [1, 1] and not buf.in_flight


def test_an_emulated_graph_returns_its_outputs_rewritten_as_a_captured_one_does():
    """Without a GPU a CapturedStep calls its function at each replay and, as a CUDA graph
    does, hands back the same output tensors rewritten in place: a caller that keeps an
    output past the next replay sees it change on a CPU too (drafting ahead read one
    sequence's drafts after the next replay had rewritten them, 2026-12-04)."""
    from gpulab.engine.graph_capture import CapturedStep
    calls = iter(range(1, 10))

    def fn():
        n = next(calls)
        return torch.full((3,), n), (torch.tensor([n, -n]), None)
    step = CapturedStep(fn, cuda=False)
    first = step.replay()
    kept = first[0]
    second = step.replay()
    assert second is first and second[0] is kept and kept.tolist() == [2, 2, 2]
    assert second[1][0].tolist() == [2, -2] and second[1][1] is None


@pytest.mark.parametrize("n_seqs", [1, 3])
def test_pending_drafts_read_back_are_a_copy_the_next_replay_leaves_alone(n_seqs):
    """PendingDrafts.flat(): the drafts as the host reads them, copied out of the graph's
    output (a flattened view, for one sequence, would be rewritten by the next replay)."""
    from gpulab.engine.spec_graphs import PendingDrafts
    tokens = torch.arange(4 * 4).view(4, 4)                  # [k, bucket]
    pending = PendingDrafts(None, [object()] * n_seqs, [None] * n_seqs, [4] * n_seqs, tokens, None)
    flat = pending.flat()
    want = tokens[:, :n_seqs].t().flatten().tolist()
    tokens.fill_(-1)                                         # the next replay
    assert flat.tolist() == want and pending.flat() is flat


def test_graph_drafts_reach_the_verify_graph_on_the_device(target):
    """The graph drafter's tokens are not read back before verification: the sequences
    hold placeholders, the verify graph's host-side ids too, and the drafts come back
    with the verification's one copy (then no placeholder is left anywhere)."""
    spec = SpeculativeLLM(target, EngineConfig(**CONFIG), drafter=drafters(target)["mlgru"], k=3,
                          graphs="emulate")
    for p in ("Tyger Tyger", "The moon"):
        spec.add_request(p, SamplingParams(max_tokens=24))
    seen = 0
    real_run = spec.verify_graphs.run

    def run(items, pending=None):
        nonlocal seen
        if pending is not None:
            seen += 1
            assert all(s.token_ids[-1] == PLACEHOLDER for s in pending.seqs if s in dict(items))
        out = real_run(items, pending)
        rows = spec.verify_graphs.bucket(len(items)) * 4
        host_ids = spec.verify_graphs.buf.np["ids"][:rows]
        at = spec.verify_graphs.buf.np["draft_at"][:rows]
        assert (host_ids[at >= 0] == PLACEHOLDER).all() and (at >= 0).any() == (pending is not None)
        return out

    spec.verify_graphs.run = run
    while spec.has_unfinished():
        spec.step()
        assert spec.pending is None
        assert all(PLACEHOLDER not in s.token_ids for g in spec.groups.values() for s in g)
    assert seen > 0 and spec.idle()


gpu_only = pytest.mark.skipif(gpulab.mode() != "compiled",
                              reason="CUDA graphs are captured in compiled mode on a GPU only")


@gpu_only
@pytest.mark.parametrize("sampled", [False, True])
def test_cuda_graph_speculation_equals_the_eager_path(sampled):
    """Real CUDA graphs (the shipped draft on the tiny target): greedy output equals the
    target alone and the eager speculative path; sampled output is reproducible."""
    torch.manual_seed(11)
    model = TernaryTransformer(TINY).pack().to("cuda")
    draft_lm = load_mlgru_draft(device="cuda")
    if sampled:
        params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i) for i in range(5)]
    else:
        params = [SamplingParams(max_tokens=m) for m in (30, 17, 25, 9, 31)]
    want = serve(LLM(model, EngineConfig(**CONFIG)), params)
    runs = []
    for graphs in ("auto", "off", "auto"):
        spec = SpeculativeLLM(model, EngineConfig(**CONFIG), drafter=MLGRUDrafter(draft_lm), k=3, graphs=graphs)
        assert (spec.verify_graphs is not None) == (graphs == "auto")
        runs.append(serve(spec, params))
        if graphs == "auto":
            assert graph_steps(spec) > 0
            assert all(g.graph is not None for g in spec.verify_graphs.graphs.values())
    assert runs[0] == runs[2], "graph speculation is not reproducible"
    if not sampled:
        assert runs[0] == want and runs[1] == want


@gpu_only
def test_cuda_graph_speculation_never_syncs_the_host_while_launching(monkeypatch):
    """Filling the static buffers and replaying (draft and verify) run under
    torch.cuda.set_sync_debug_mode("error"): only the read-backs sync."""
    from gpulab.engine import spec_graphs

    def strict(fn):
        def wrapped(*args, **kw):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return wrapped

    monkeypatch.setattr(spec_graphs.VerifyGraphs, "run", strict(spec_graphs.VerifyGraphs.run))
    monkeypatch.setattr(spec_graphs.CapturedStep, "replay", strict(spec_graphs.CapturedStep.replay))
    monkeypatch.setattr(spec_graphs.StagedBuffers, "send", strict(spec_graphs.StagedBuffers.send))
    monkeypatch.setattr(spec_graphs.MLGRUGraphDrafter, "launch_ahead",
                        strict(spec_graphs.MLGRUGraphDrafter.launch_ahead))
    torch.manual_seed(11)
    model = TernaryTransformer(TINY).pack().to("cuda")
    spec = SpeculativeLLM(model, EngineConfig(**CONFIG), drafter=MLGRUDrafter(load_mlgru_draft(device="cuda")), k=3)
    params = [SamplingParams(max_tokens=20, temperature=0.8 if i % 2 else 0, seed=i) for i in range(5)]
    serve(spec, params)
    serve(spec, [SamplingParams(max_tokens=20)] * 5)         # greedy: the next drafts launched ahead
    assert graph_steps(spec) > 0 and spec.ahead_counts["launched"] > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeLLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG))
    with pytest.raises(ValueError, match="k"):
        SpeculativeLLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG), drafter=object(), k=0)
    with pytest.raises(ValueError, match="graphs"):
        SpeculativeLLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG), drafter=object(), graphs="on")
    with pytest.raises(ValueError, match="draft_ahead must be True or False"):
        SpeculativeLLM(TernaryTransformer(TINY).pack(), EngineConfig(**CONFIG), drafter=object(), draft_ahead="no")


# -- the notebook's checks reject wrong learner code -----------------------------------------------------
from gpulab.engine.speculative import rollback  # noqa: E402
from gpulab.grading.speculative import check_acceptance_rule, check_rollback  # noqa: E402
import gpulab  # noqa: E402
from gpulab.harness.checking import CheckFailure  # noqa: E402


def no_bonus(draft, q, p, gen):
    out = accept_draft(draft, q, p, gen)
    return out[:len(draft)] if len(out) == len(draft) + 1 and out[:len(draft)] == list(draft) else out


def residual_from_q(draft, q, p, gen):
    for i, x in enumerate(draft):
        if torch.rand((), generator=gen, dtype=torch.float64) * q[i, x] <= p[i, x]:
            continue
        return draft[:i] + [int(torch.multinomial(q[i], 1, generator=gen))]
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def keeps_going(draft, q, p, gen):           # does not stop at the first rejection
    out = []
    for i, x in enumerate(draft):
        ok = torch.rand((), generator=gen, dtype=torch.float64) * q[i, x] <= p[i, x]
        out.append(x if ok else int(torch.multinomial((p[i] - q[i]).clamp_min(0) + 1e-12, 1, generator=gen)))
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


@pytest.mark.parametrize("rule, says", [
    (wrong_ratio, "never"), (wrong_residual, "max(0, p"), (no_bonus, "bonus"),
    (residual_from_q, "max(0, p"), (keeps_going, "first rejection"),
])
def test_acceptance_check_names_the_mistake(rule, says):
    with pytest.raises(CheckFailure, match=None) as e:
        check_acceptance_rule(rule, trials=1500)
    assert says in str(e.value), str(e.value)


def test_acceptance_check_passes_the_package_rule(capsys):
    check_acceptance_rule(accept_draft, trials=1500)
    assert "✔" in capsys.readouterr().out


def keep_all_pages(seq, bm, n_drafts, n_accepted):
    del seq.token_ids[seq.num_tokens - (n_drafts - n_accepted):]
    seq.num_computed_tokens += 1 + n_accepted


def off_by_one(seq, bm, n_drafts, n_accepted):
    rollback(seq, bm, n_drafts, n_accepted)
    seq.num_computed_tokens -= 1


def drop_table_entries(seq, bm, n_drafts, n_accepted):   # forgets pages without freeing them
    del seq.token_ids[seq.num_tokens - (n_drafts - n_accepted):]
    seq.num_computed_tokens += 1 + n_accepted
    del seq.block_table[bm.blocks_for(seq.num_computed_tokens):]


def cut_accepted_too(seq, bm, n_drafts, n_accepted):
    rollback(seq, bm, n_drafts, 0)


@pytest.mark.parametrize("fn, says", [(keep_all_pages, "pages"), (off_by_one, "num_computed_tokens"),
                                      (drop_table_entries, "became free"), (cut_accepted_too, "token_ids")])
def test_rollback_check_names_the_mistake(fn, says):
    with pytest.raises(CheckFailure) as e:
        check_rollback(fn)
    assert says in str(e.value), str(e.value)


def test_rollback_check_passes_the_package_rollback(capsys):
    check_rollback(rollback)
    assert "✔" in capsys.readouterr().out


def test_checks_are_called_by_name_like_kernel_checks(capsys):
    gpulab.check("speculative-rollback", rollback)
    assert "✔ rollback" in capsys.readouterr().out


def test_benchmark_accepts_only_near_tie_flips(target, monkeypatch, capsys):
    """tools/speculative_bench.py compares each configuration's greedy tokens with the
    target alone's through gpulab.engine.model.first_flip (the tests' comparison): equal
    outputs pass, a flip at a near tie of the target's logits is reported and counted, any
    other difference fails the run."""
    from types import SimpleNamespace

    from gpulab.engine import model as engine_model
    from gpulab.engine.model import encode_prompt, next_token_logits, reference_generate
    bench = load_tool("speculative_bench")
    prompt = encode_prompt("Tyger Tyger")
    want = reference_generate(target, prompt, 6)
    logits = next_token_logits(target, prompt + want[:3])
    second = int(logits.topk(2).indices[1])              # the target's runner-up at token 3
    flipped = want[:3] + [second] + want[4:]
    out = lambda tokens: SimpleNamespace(prompt_token_ids=prompt, token_ids=tokens)   # noqa: E731
    assert bench.near_tie_flips(target, [out(want)], [out(want)], "same") == []
    with pytest.raises(AssertionError, match="changed the tokens of request 1: token 3 is .*NOT a near tie"):
        bench.near_tie_flips(target, [out(want), out(flipped)], [out(want), out(want)], "flip")
    monkeypatch.setitem(engine_model.NEAR_TIE, next(target.parameters()).dtype, 10.0)   # all ties near
    with pytest.raises(AssertionError, match="agree up to token 4, then one of them stops"):
        bench.near_tie_flips(target, [out(want[:4])], [out(want)], "short")     # no flip: not a tie
    flips = bench.near_tie_flips(target, [out(want), out(flipped)], [out(want), out(want)], "tie")
    assert [(f["request"], f["position"], f["got"], f["want"]) for f in flips] == [(1, 3, second, want[3])]
    assert flips[0]["gap"] == pytest.approx(flips[0]["margin"]) and "a near tie" in capsys.readouterr().out


def test_benchmark_records_a_configuration_that_raises_and_measures_the_rest(target, monkeypatch):
    """One configuration's exception (a KeyError cut a GPU run short on 2026-12-04) is kept
    in the result's errors; the configurations after it still get their rows."""
    from types import SimpleNamespace
    bench = load_tool("speculative_bench")
    outs = [SimpleNamespace(prompt_token_ids=[1], token_ids=[2, 3])]

    def bench_one(llm, waves, params, repeats):
        if getattr(llm, "k", None) == 2:
            raise KeyError(2)
        return outs, 100.0, 0, dict(gc_s=0.0, gc_passes=0, gc_full_passes=0)

    monkeypatch.setattr(bench, "bench_one", bench_one)
    monkeypatch.setattr(bench, "engine_config", lambda batch, multi_step=1: EngineConfig(**CONFIG, multi_step=multi_step))
    monkeypatch.setattr(bench, "graph_times", lambda llm, batch: {})
    errors = []
    rows = bench.bench_speculation(target, {"mlgru": lambda: drafters(target)["mlgru"]}, 1, 4, (2, 3), repeats=1,
                                   wrong=[], errors=errors)
    assert [r["k"] for r in rows if r["draft"] == "mlgru" and not r["adaptive"]] == [3]
    assert len(errors) == 2 and all("k=2" in e and "KeyError: 2" in e for e in errors)
    default = bench.block_step.INT8_WEIGHTS
    assert ("float16 weights" if default else "int8 weights") in errors[1]
    assert bench.block_step.INT8_WEIGHTS is default                                   # switched back


def test_a_16_bit_flip_is_judged_on_float32_logits_and_its_own_drift(monkeypatch):
    """first_flip judges a bf16 model's flip on a float32 copy's logits; its tolerance
    grows to the drift (how far the bf16 forward, plain and with rounding-sized noise,
    moved the gap), never shrinks below the rounding tolerance, and a gap wider than both
    is not a near tie."""
    from gpulab.engine import model as engine_model
    from gpulab.engine.model import JITTER_SAMPLES, first_flip, prepare_for_serving
    model = prepare_for_serving(TernaryTransformer(TINY), dtype=torch.bfloat16)
    seen, own_gap = [], {}

    def logits(m, tokens, jitter=0.0, generator=None):      # token 1 ahead of token 2 by 0.5 in float32
        dtype = m.embed.weight.dtype
        seen.append((dtype, jitter > 0))
        out = torch.zeros(TINY.vocab_size)
        out[1], out[2] = 10.0, 10.0 - (0.5 if dtype == torch.float32 else own_gap["jitter" if jitter else "plain"])
        return out

    monkeypatch.setattr(engine_model, "next_token_logits", logits)
    want, got = [5, 1, 7], [5, 2, 7]
    own_gap.update(plain=0.5, jitter=-0.25)      # the perturbed bf16 forwards moved the gap by 0.75
    flip = first_flip(model, [3], got, want)
    assert seen == [(torch.float32, False), (torch.bfloat16, False)] + [(torch.bfloat16, True)] * JITTER_SAMPLES
    assert model.embed.weight.dtype == torch.bfloat16
    assert (flip.gap, flip.drift, flip.tolerance) == (0.5, 0.75, 0.75) and flip.near_tie
    assert "moved up to 0.75" in flip.describe()
    own_gap.update(plain=0.375, jitter=0.5)      # moved by 0.125 at most: under the rounding tolerance
    flip = first_flip(model, [3], got, want)
    assert flip.drift == 0.125 and flip.tolerance == pytest.approx(10 * 2 ** -6) and not flip.near_tie
    seen.clear()                                 # a float32 model is its own judge: no drift
    flip = first_flip(prepare_for_serving(TernaryTransformer(TINY)), [3], got, want)
    assert seen == [(torch.float32, False)] and flip.drift == 0.0 and not flip.near_tie


def test_the_jittered_reference_is_seeded():
    """next_token_logits' rounding-sized noise: reproducible from its generator, absent at 0."""
    from gpulab.engine.model import encode_prompt, next_token_logits
    model = TernaryTransformer(TINY).pack().to(DEVICE)
    tokens = encode_prompt("Tyger Tyger")
    plain = next_token_logits(model, tokens)
    a = next_token_logits(model, tokens, 2 ** -8, torch.Generator().manual_seed(1))
    b = next_token_logits(model, tokens, 2 ** -8, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, plain)
    assert torch.equal(next_token_logits(model, tokens, 0.0), plain)


def test_results_table_marks_adaptive_rows():
    from gpulab.engine.speculative import format_results
    row = dict(batch=1, draft="mlgru", k=4, tokens_per_s=100.0, speedup=1.5, acceptance=0.7, tokens_per_pass=2.1)
    text = format_results(dict(gpu="GPU", date="d", versions={}, max_tokens=8,
                               rows=[row, dict(row, adaptive=True), dict(row, near_tie_flips=2),
                                     dict(row, graphs=True, draft_ahead=False),
                                     dict(row, draft_weights="int8"), dict(row, draft_weights="float16")]))
    assert "   4 " in text and "<=4" in text
    assert text.count("near-tie flip") == 1 and "(2 near-tie flips)" in text
    assert text.count("(no ahead)") == 1 and text.count("(int8)") == 1


def test_results_table_names_each_way_of_serving():
    from gpulab.engine.speculative import format_results
    sv = dict(clients=64, http_tokens_per_s=40.0, engine_tokens_per_s=50.0, ratio=0.8)
    text = format_results(dict(gpu="GPU", date="d", versions={}, max_tokens=8, rows=[], server=sv,
                               server_engine_process=sv, server_api_servers=dict(sv, api_servers=4)))
    assert "(engine thread)" in text and "(engine process)" in text
    assert "(4 API servers + engine process)" in text and text.count("(80%)") == 3


def test_the_host_cost_tool_times_steps_with_frozen_replays_and_restores_them():
    """tools/spec_host_cost.py: a speculative engine's steps with every replay frozen (the
    host's work alone), each run on a fresh engine; replays compute again afterwards."""
    from gpulab.engine.graph_capture import CapturedStep
    tool = load_tool("spec_host_cost")
    replay = CapturedStep.replay
    r = tool.host_cost(lambda: tool.speculative_engine(2, 3), steps=5, repeats=2, profile=True)
    assert CapturedStep.replay is replay
    assert len(r["runs_us"]) == 2 and r["host_us_per_step"] > 0 and "spec_graphs.py" in r["profile"]
    assert r["drafts_ahead"]["used"] > 0

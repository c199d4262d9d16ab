"""Grading of notebook 08: the learner's acceptance rule and rollback.

The acceptance rule is checked the way its correctness is defined: speculative rounds
are simulated with fixed, position-indexed distributions p (target) and q (draft) over a
small vocabulary, many times with seeded randomness, and the tokens emitted at every
position must follow p (Pearson's χ² test). Before that, a few exact cases catch the
common mistakes with a message naming them: the ratio upside down, the wrong residual
on rejection, a missing bonus token, accepting past the first rejection.

The rollback is checked on scripted sequences against the engine's block manager: after
the learner's function the sequence holds exactly its accepted tokens, the pages of
rejected drafts are free again, and served requests still match the target alone.
"""
from __future__ import annotations

import itertools

import torch

from ..engine.block_manager import BlockManager
from ..engine.engine import EngineConfig
from ..engine.model import TINY, TernaryTransformer
from ..engine.sequence import SamplingParams, Sequence
from ..engine.speculative import SpeculativeLLM, TransformerDrafter
from ..harness.checking import CheckFailure, scenario_check

_ids = itertools.count()


def _fail(part: str, what: str, hint: str = "") -> None:
    raise CheckFailure(f"✘ {part}: {what}" + (f"\n  hint: {hint}" if hint else ""))


# -- statistics -------------------------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's χ² goodness of fit of ``counts`` to ``probs``; the p-value comes from the
    regularized upper incomplete gamma function (1 for a perfect fit, tiny for a bad one)."""
    n = counts.sum()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = max(1, int(keep.sum()) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def simulate_rounds(rule, p: torch.Tensor, q: torch.Tensor, k: int, trials: int, seed: int = 0):
    """Tokens emitted at each of ``len(p)`` positions over ``trials`` generations, each a
    sequence of speculative rounds (draft k tokens from q, then ``rule``). Also returns
    the fraction of drafts accepted."""
    length, vocab = p.shape
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(length, vocab, dtype=torch.float64)
    offered = accepted = 0
    for _ in range(trials):
        t = 0
        while t < length:
            kk = min(k, length - t - 1)
            draft = [int(torch.multinomial(q[t + i], 1, generator=gen)) for i in range(kk)]
            out = list(rule(draft, q[t:t + kk], p[t:t + kk + 1], gen))
            if not 1 <= len(out) <= kk + 1:
                _fail("acceptance rule", f"returned {len(out)} tokens for {kk} drafts: expected between 1 "
                      f"(first draft rejected, one replacement) and {kk + 1} (all accepted, one bonus)")
            n_acc = next((i for i in range(len(out) - 1) if out[i] != draft[i]), len(out) - 1)
            if out[:len(out) - 1] != draft[:len(out) - 1]:
                _fail("acceptance rule", f"drafts {draft} gave {out}: every token before the last must be "
                      f"an accepted draft, in order", "stop at the first rejection")
            offered += min(len(out), kk)           # drafts actually tested
            accepted += n_acc
            for tok in out[:length - t]:
                counts[t, int(tok)] += 1
                t += 1
    return counts, accepted / max(1, offered)


def distributions(vocab: int = 6, length: int = 3, seed: int = 1):
    """Random target and draft distributions; the draft never proposes token 0, so only
    a correct residual can emit it."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(length, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(length, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    q[:, 0] = 0
    return p, q / q.sum(-1, keepdim=True)


def _accept_if(test):
    """A correct rule except for its acceptance ``test(u, p(x), q(x))``."""
    def rule(draft, q, p, gen):
        for i, x in enumerate(draft):
            u = torch.rand((), generator=gen, dtype=torch.float64)
            if test(u, p[i, x], q[i, x]):
                continue
            residual = (p[i] - q[i]).clamp_min(0)
            return list(draft[:i]) + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
        return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]
    return rule


_WRONG_TESTS = {"q over p": _accept_if(lambda u, px, qx: px > 0 and u * px <= qx),
                "accepting with probability p(x)": _accept_if(lambda u, px, qx: u <= px)}
_WRONG_TEST_HINTS = {"q over p": "the ratio is upside down: accept when u <= p(x) / q(x) (p over q, not q over p)",
                     "accepting with probability p(x)": "the test ignores the draft's q(x): accept with "
                     "probability min(1, p(x) / q(x)), i.e. when u · q(x) <= p(x)"}


# -- the acceptance rule --------------------------------------------------------------------------------
@scenario_check("speculative-acceptance")
def check_acceptance_rule(rule, trials: int = 3000) -> None:
    """``rule(draft, q [k, V], p [k+1, V], gen) -> tokens`` must emit tokens distributed as p."""
    part = "acceptance rule"
    eye = torch.eye(4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    # p == q: every draft is accepted, then one bonus token from p[k]
    out = list(rule([1, 2], eye[[1, 2]], eye[[1, 2, 3]], gen))
    if out[:2] != [1, 2]:
        _fail(part, f"with p == q every draft must be accepted; drafts [1, 2] gave {out}",
              "accept x with probability min(1, p(x) / q(x)), which is 1 here")
    if out != [1, 2, 3]:
        _fail(part, f"all drafts accepted but the tokens are {out}, expected [1, 2, 3]",
              "after k accepted drafts, sample one bonus token from p[k] (the target's next position)")
    # p(x) == 0: the draft must be rejected, and the replacement must come from max(0, p - q)
    q1 = torch.tensor([[0, .5, 0, .5]], dtype=torch.float64)
    out = list(rule([1], q1, eye[[2, 3]], gen))
    if len(out) == 2 and out[0] == 1:
        _fail(part, f"a draft the target gives probability 0 was kept: drafts [1] gave {out}",
              "either the test accepted it (accept with probability min(1, p(x) / q(x)): p(x) = 0 means "
              "never), or the rule went on after rejecting it: stop at the first rejection and return "
              "the accepted drafts plus the replacement")
    if len(out) == 2:
        _fail(part, f"the only draft was rejected, yet {out} came back (two tokens)",
              "stop at the first rejection: emit the replacement token and nothing after it")
    if out != [2]:
        _fail(part, f"after rejecting the draft, the replacement was {out[-1]}, but the target puts all its "
              f"mass on token 2", "sample the replacement from norm(max(0, p[i] - q[i])) at the rejected "
              "position i (not from q or p alone, not from the next position)")
    p, q = distributions()
    counts, rate = simulate_rounds(rule, p, q, k=2, trials=trials)
    want_rate = float(torch.minimum(p[:2], q[:2]).sum(-1).mean())
    for t in range(p.shape[0]):
        pv = chi2_pvalue(counts[t], p[t])
        if pv > 1e-4:
            continue
        share = (counts[t] / counts[t].sum()).tolist()
        what = (f"position {t}: emitted tokens have frequencies [{', '.join(f'{x:.3f}' for x in share)}], "
                f"the target's probabilities are [{', '.join(f'{x:.3f}' for x in p[t].tolist())}] "
                f"(χ² p-value {pv:.1e}, {trials} runs)")
        if abs(rate - want_rate) > 0.05:
            hint = (f"drafts were accepted {rate:.0%} of the time; the rule min(1, p/q) accepts "
                    f"Σ min(p, q) = {want_rate:.0%}: check the acceptance test")
            # name the test whose acceptance rate the learner's is closest to
            rates = {name: simulate_rounds(r, p, q, k=2, trials=trials)[1] for name, r in _WRONG_TESTS.items()}
            name = min(rates, key=lambda n: abs(rates[n] - rate))
            if abs(rates[name] - rate) < 0.03:
                hint += f" ({rate:.0%} is what {name} gives): {_WRONG_TEST_HINTS[name]}"
        elif counts[t, 0] == 0:
            hint = ("token 0 (which the draft never proposes) was never emitted: on rejection, sample from "
                    "norm(max(0, p - q)), which holds the mass the draft under-proposes")
        else:
            hint = "the replacement after a rejection must come from norm(max(0, p - q)) at that position"
        _fail(part, what, hint)
    print(f"✔ acceptance rule: exact cases right; {trials} simulated generations follow the target "
          f"at every position (accepted {rate:.0%} of drafts, Σ min(p, q) = {want_rate:.0%})")


# -- rollback --------------------------------------------------------------------------------------------
def _drafted_sequence(bm: BlockManager, committed: int, drafts: int) -> Sequence:
    """A decoding sequence whose last committed token and ``drafts`` draft tokens were
    just run: pages allocated for all of them, as the scheduler does."""
    tokens = list(range(30, 30 + committed + drafts))
    seq = Sequence(next(_ids), "check", tokens[:committed], committed - 2, SamplingParams(max_tokens=64), 0)
    bm.allocate(seq, [], committed - 1)
    seq.num_computed_tokens = committed - 1
    seq.token_ids = tokens
    bm.append_slots(seq, 1 + drafts)
    return seq


@scenario_check("speculative-rollback")
def check_rollback(rollback, block_size: int = 4) -> None:
    """``rollback(seq, block_manager, n_drafts, n_accepted)`` must cut the rejected drafts
    from ``seq.token_ids``, count the last token and the accepted drafts as computed, and
    give back the pages that only held rejected drafts."""
    part = "rollback"
    for committed, drafts, accepted in [(6, 4, 0), (6, 4, 2), (6, 4, 4), (3, 5, 1), (8, 1, 0), (7, 6, 5)]:
        bm = BlockManager(16, block_size)
        seq = _drafted_sequence(bm, committed, drafts)
        free_before, held_before, table_before = bm.num_free, len(seq.block_table), list(seq.block_table)
        tokens = list(seq.token_ids)
        rollback(seq, bm, drafts, accepted)
        want_tokens = tokens[:committed + accepted]
        case = f"{committed} committed tokens, {drafts} drafts, {accepted} accepted"
        if seq.token_ids != want_tokens:
            _fail(part, f"{case}: token_ids end with {seq.token_ids[-4:]}, expected {want_tokens[-4:]}",
                  "keep the committed tokens and the accepted drafts; cut the rest")
        if seq.num_computed_tokens != committed + accepted:
            _fail(part, f"{case}: num_computed_tokens is {seq.num_computed_tokens}, expected "
                  f"{committed + accepted}", "the last committed token and the accepted drafts now have "
                  "keys and values in the cache (the target just ran them); the rejected ones do not count")
        need = bm.blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) != need:
            _fail(part, f"{case}: the sequence holds {len(seq.block_table)} pages, its computed tokens need "
                  f"{need}", "release the pages past blocks_for(num_computed_tokens) with the block "
                  "manager (release_block), last page first")
        if bm.num_free - free_before != held_before - len(seq.block_table):
            _fail(part, f"{case}: {held_before - len(seq.block_table)} pages left the sequence but "
                  f"{bm.num_free - free_before} became free", "give each page back with release_block, "
                  "which also keeps its reference count right")
        if seq.block_table != table_before[:need]:
            _fail(part, f"{case}: the block table went from {table_before} to {seq.block_table}",
                  "the first pages hold the kept tokens: release the pages at the end of the table, "
                  "last page first")
        if any(b in bm.free for b in seq.block_table):
            _fail(part, f"{case}: a page the sequence still uses is on the free list")
    # served end to end: greedy output equals the target alone
    torch.manual_seed(3)
    target = TernaryTransformer(TINY).pack()
    torch.manual_seed(4)
    draft = TernaryTransformer(TINY).pack()
    # the logic is graded, not kernels: the models run as PyTorch ops on the CPU everywhere
    cfg = dict(num_blocks=40, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=32,
               linear="torch", attention="torch")
    prompts = ["Tyger", "The moon", "a b c"]
    params = SamplingParams(max_tokens=8)
    want = SpeculativeLLM(target, EngineConfig(**cfg), drafter=TransformerDrafter(target), k=3).generate(prompts, params)
    llm = SpeculativeLLM(target, EngineConfig(**cfg), drafter=TransformerDrafter(draft), k=3, rollback=rollback)
    got = llm.generate(prompts, params)
    if [o.token_ids for o in got] != [o.token_ids for o in want]:
        _fail(part, "served with your rollback, greedy outputs differ from the target's own")
    if not llm.idle():
        _fail(part, f"after serving, {llm.block_manager.num_used} pages are still in use: a rollback leaks pages")
    print(f"✔ rollback: 6 scripted cases and {len(prompts)} served requests right; no page leaked "
          f"(acceptance {llm.stats.acceptance_rate():.0%})")

"""Grading of notebook 07: the learner's block manager, scheduler step and decode hook.

These exercises are data structures and policies, not kernels, so they have no
KernelSpec: each check plays scripted scenarios against the learner's class, compares
every observable (pages handed out, reference counts, cache hits, what is scheduled)
with the rules of the engine, and stops at the first rule broken with a message naming
it. The last part of each check serves real requests with the learner's class inside
:class:`gpulab.engine.engine.LLM` and compares the tokens with the reference decoder.

An unfinished exercise raises its stub's ``NotImplementedError``, which is let through
unchanged (the grader recognises it).
"""
from __future__ import annotations

import functools
import itertools

import torch

from .. import runtime
from ..engine.block_manager import BlockManager, chain_hash
from ..engine.engine import LLM, EngineConfig
from ..engine.model import TINY, TernaryTransformer, encode_prompt, reference_generate
from ..engine.sequence import SamplingParams, Sequence
from ..harness.checking import CheckFailure, new_memory_is_nan, scenario_check
from ..paged import OutOfPages, paged_decode_reference

_ids = itertools.count()
# The block manager and scheduler checks test logic, not kernels: the model runs as the
# reference decoder's PyTorch ops, so no rounding difference can flip a token.
_EXACT = dict(linear="torch", attention="torch")


def _seq(tokens, max_tokens: int = 8) -> Sequence:
    return Sequence(next(_ids), "check", list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), 0)


def _fail(part: str, what: str, hint: str = "") -> None:
    raise CheckFailure(f"✘ {part}: {what}" + (f"\n  hint: {hint}" if hint else ""))


def _expect(ok: bool, part: str, what: str, hint: str = "") -> None:
    if not ok:
        _fail(part, what, hint)


def _prefill(bm, s: Sequence) -> list[int]:
    """What the scheduler and the step do for a whole prompt: look up, allocate, compute, commit."""
    hits = bm.match_prefix(s)
    bm.allocate(s, hits, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return hits


def _refs(bm, table) -> list[int]:
    return [bm.blocks[b].ref_count for b in table]


# -- block manager ------------------------------------------------------------------------------
def _bm_hashing(cls) -> None:
    part = "prefix hashing"
    bm = cls(16, 4)
    a = _seq(range(10, 24))                         # 3 full pages + 2 tokens
    _expect(_prefill(bm, a) == [], part, "an empty cache reported a hit")
    full = [bm.blocks[b] for b in a.block_table[:3]]
    _expect(all(b.hash is not None for b in full) and bm.blocks[a.block_table[3]].hash is None, part,
            "after commit_full_blocks, each full page must carry a hash and the partial last page none",
            "hash only pages whose block_size tokens have all been computed")
    _expect(full[0].hash == chain_hash(None, range(10, 14)), part,
            "page 0's hash is not chain_hash(None, page 0's tokens)",
            "the first page has no parent: start the chain from None")
    _expect(full[1].hash == chain_hash(full[0].hash, range(14, 18)), part,
            "page 1's hash is not chain_hash(page 0's hash, page 1's tokens)",
            "chain each page's hash with its predecessor's, starting from None")
    b = _seq(list(range(10, 22)) + [99, 98, 97])    # shares 3 full pages with a
    hits = bm.match_prefix(b)
    _expect(hits == a.block_table[:3], part, f"a prompt sharing a's first 3 full pages matched {hits}, "
            f"expected {a.block_table[:3]}",
            "commit_full_blocks stored the right keys (checked above), so match_prefix must compute the "
            "same keys: chain_hash(parent, page tokens) page by page, starting from None, and look them up "
            "in self.cached" if len(hits) < 3 else "")
    c = _seq([0, 0, 0, 0] + list(range(14, 18)) + [1, 2])  # a's page 1 tokens after another page 0
    hits = bm.match_prefix(c)
    _expect(hits == [], part, f"a prompt whose page 1 equals a's page 1 but whose page 0 differs matched {hits}",
            "the key of a page must depend on everything before it: chain_hash(parent hash, tokens)")
    d = _seq(list(range(10, 14)) + [7, 7, 7, 7] + list(range(18, 22)) + [5])
    hits = bm.match_prefix(d)
    _expect(hits == a.block_table[:1], part, f"matching must stop at the first miss: got {hits}, "
            f"expected only a's first page {a.block_table[:1]}")
    e = _seq(range(10, 22))                          # exactly a's 3 full pages
    hits = bm.match_prefix(e)
    _expect(len(hits) == 2, part, f"a 12-token prompt fully in the cache matched {len(hits)} pages, expected 2",
            "leave at least one token to compute (its logits give the first new token): "
            "at most (num_tokens - 1) // block_size pages")
    # a hash collision must not give someone else's keys and values
    fake = _seq([50, 51, 52, 53, 54])
    h = chain_hash(None, (50, 51, 52, 53))
    bm.cached[h] = a.block_table[0]
    _expect(bm.match_prefix(fake) == [], part, "a cached page whose token ids differ from the prompt's was "
            "returned as a hit (a hash collision)", "compare the page's token_ids with the prompt's")
    del bm.cached[h]
    bm2 = cls(8, 4, prefix_caching=False)
    _prefill(bm2, _seq(range(9)))
    _expect(bm2.match_prefix(_seq(range(9))) == [], part, "with prefix_caching=False nothing may hit")


def _bm_refcounts(cls) -> None:
    part = "reference counts"
    bm = cls(10, 4)
    a = _seq(range(10))
    _prefill(bm, a)
    _expect(len(a.block_table) == 3 and len(set(a.block_table)) == 3 and bm.num_free == 7, part,
            f"10 tokens in pages of 4 need 3 distinct pages; got table {a.block_table}, {bm.num_free} of 10 free")
    _expect(_refs(bm, a.block_table) == [1, 1, 1], part, f"fresh pages must have ref_count 1, got {_refs(bm, a.block_table)}")
    b = _seq(list(range(8)) + [40, 41])
    bm.allocate(b, bm.match_prefix(b), b.num_tokens)
    _expect(_refs(bm, a.block_table) == [2, 2, 1], part,
            f"after b reuses a's 2 full pages, a's ref counts should be [2, 2, 1], got {_refs(bm, a.block_table)}",
            "a hit takes a reference on the cached page (share_block)")
    _expect(b.num_computed_tokens == 8 and b.num_cached_tokens == 8, part,
            "allocate must count the hit pages' tokens as computed (num_computed_tokens = num_cached_tokens = 8)")
    b.num_computed_tokens = b.num_tokens
    bm.commit_full_blocks(b)
    bm.free_sequence(a)
    refs = _refs(bm, b.block_table)
    _expect(refs == [1, 1, 1] and bm.num_free == 7, part,
            f"after freeing a, b's pages should have ref counts [1, 1, 1] and 7 pages be free; got "
            f"{refs}, {bm.num_free} free",
            "release_block must drop one reference (ref_count -= 1): b still holds the shared pages"
            if refs != [1, 1, 1] else
            "a page whose ref_count drops to 0 must go back to the free pool (self.free)" if bm.num_free < 7 else
            "a page returns to the free pool only at ref_count 0")
    bm.free_sequence(b)
    _expect(bm.num_free == 10 and all(x.ref_count == 0 for x in bm.blocks), part,
            f"with no sequence left every page must be free with ref_count 0; {bm.num_free} of 10 free")
    _expect(not bm.can_allocate(_seq(range(100, 145)), [], 45), part,
            "can_allocate said yes to 12 pages from a pool of 10")
    c = _seq(range(200, 230))
    free = bm.num_free
    raised = False
    try:
        bm.allocate(_seq(range(300, 345)), [], 45)
    except OutOfPages:
        raised = True
    _expect(raised, part, "allocating more pages than are free must raise gpulab.paged.OutOfPages")
    _expect(bm.num_free == free, part, "a failed allocation must not take any page")
    _prefill(bm, c)
    _expect(not bm.can_append(c, 12) and bm.can_append(c, 10), part,
            "can_append must count the new pages a sequence needs (30 tokens hold 8 pages of 10; "
            "10 more tokens fit in the last page and 2 new ones, 12 do not)")


def _bm_eviction(cls) -> None:
    part = "eviction"
    bm = cls(6, 2)
    a, b = _seq([1, 2, 3, 4, 5]), _seq([6, 7, 8, 9, 10])
    _prefill(bm, a)
    _prefill(bm, b)
    bm.free_sequence(a)
    bm.free_sequence(b)
    _expect(bm.num_free == 6, part, f"freed pages must stay allocatable: {bm.num_free} of 6 free")
    _expect(len(bm.match_prefix(_seq([1, 2, 3, 4, 5]))) == 2 and len(bm.match_prefix(_seq([6, 7, 8, 9, 10]))) == 2,
            part, "freed full pages must stay in the prefix cache until their page is needed again",
            "release_block must keep the page's hash; only take_free_block forgets it")
    order = [bm.blocks[x].hash is None for x in bm.free]    # True: blank
    _expect(order == sorted(order, reverse=True), part,
            f"after freeing a and b, the free list (front first) holds "
            f"{['blank' if x else 'cached' for x in order]}: a cached page is ahead of a blank one, so a new "
            f"sequence would take a cached page while blank pages were free",
            "release blank pages to the front of the free list (handed out first) and cached pages to "
            "the back (evicted last, least recently freed first)")
    c = _seq([20, 21, 22])                           # 2 pages: the 2 blank ones must go first
    _prefill(bm, c)
    _expect(len(bm.match_prefix(_seq([1, 2, 3, 4, 5]))) == 2 and len(bm.match_prefix(_seq([6, 7, 8, 9, 10]))) == 2,
            part, "a new sequence took a cached page while blank pages were free at the front of the free list",
            "take_free_block must hand out the page at the FRONT of self.free (popitem(last=False)): "
            "blank pages first, then the least recently freed cached one")
    d = _seq([30, 31, 32, 33, 34, 35])               # 3 pages: all must be evicted cached ones
    _prefill(bm, d)
    a_hits, b_hits = len(bm.match_prefix(_seq([1, 2, 3, 4, 5]))), len(bm.match_prefix(_seq([6, 7, 8, 9, 10])))
    _expect(a_hits == 0 and b_hits == 1, part,
            f"evicting 3 cached pages should take a's two (freed first) and b's last page (freed last "
            f"sequence, last page first) and keep b's first; a keeps {a_hits}, b keeps {b_hits} pages",
            "take_free_block hands out the FRONT of self.free (least recently freed first); release_block "
            "appends cached pages at the back")
    for x in (c, d):
        bm.free_sequence(x)
    e = _seq([6, 7, 8])
    hits = bm.match_prefix(e)
    free = bm.num_free
    bm.allocate(e, hits, 3)
    _expect(hits and bm.blocks[hits[0]].ref_count == 1 and hits[0] not in bm.free and bm.num_free == free - 2,
            part, "a hit on a cached free page must take it out of the free pool (and count it)")


def _bm_cow(cls) -> None:
    part = "copy-on-write"
    bm = cls(8, 4)
    parent = _seq(range(6))
    _prefill(bm, parent)
    child = _seq(range(6))
    bm.fork(parent, child)
    shared = parent.block_table[1]
    _expect(bm.can_append(child, 1), part, "can_append must allow a copy when one page is free")
    copies = bm.append_slots(child, 1)
    _expect(not (len(copies) == 1 and copies[0][0] != shared), part,
            f"append_slots copied page {copies[0][0] if copies else None}, but the next token (position "
            f"{child.num_computed_tokens}) goes to page {shared}",
            "copy the page block_table[num_computed_tokens // block_size], the one being written")
    _expect(len(copies) == 1 and copies[0][0] == shared, part,
            f"writing into the shared partial page {shared} must first copy it: append_slots returned {copies}",
            "if the page the next token goes to has ref_count > 1, take a fresh page, "
            "return (old, new) and put the new page in the block table")
    new = copies[0][1]
    _expect(child.block_table == [parent.block_table[0], new] and new != shared, part,
            f"the child's block table should now be [{parent.block_table[0]}, {new}], got {child.block_table}",
            "put the new page in the block table in place of the shared one it copies")
    _expect(bm.blocks[shared].ref_count == 1 and bm.blocks[new].ref_count == 1, part,
            f"after the copy the old page is the parent's alone (ref 1) and the copy the child's (ref 1); got "
            f"{bm.blocks[shared].ref_count} and {bm.blocks[new].ref_count}", "release the old page once")
    _expect(bm.blocks[parent.block_table[0]].ref_count == 2, part,
            "the full page 0 is not being written: it must stay shared (ref 2)")
    _expect(bm.append_slots(parent, 1) == [], part, "the parent now owns its page alone: no copy")
    full = _seq(range(8))
    _prefill(bm, full)
    twin = _seq(range(8))
    bm.fork(full, twin)
    copies = bm.append_slots(twin, 1)
    _expect(copies != [] or len(twin.block_table) == 3, part,
            f"8 computed tokens plus 1 need 3 pages of 4; after append_slots(twin, 1) the table has "
            f"{len(twin.block_table)}", "add pages until the table covers num_computed_tokens + num_tokens tokens")
    _expect(copies == [] and len(twin.block_table) == 3 and twin.block_table[:2] == full.block_table, part,
            "a token after two full shared pages goes to a new page: no copy, the full pages stay shared")
    tight = cls(3, 4)
    p = _seq(range(6))
    _prefill(tight, p)
    q = _seq(range(6))
    tight.fork(p, q)
    tight.append_slots(q, 1)
    _expect(not tight.can_append(p, 3) or tight.num_free >= 1, part, "can_append must count the copy's page")
    r = _seq(range(6))
    tight.fork(p, r)
    _expect(not tight.can_append(r, 1), part,
            "with no free page, a write into a shared page cannot be done: can_append must say no")


def _bm_engine(cls) -> None:
    part = "in the engine"
    model = _check_model()
    prompts = ["Tyger Tyger, burning bright, in the forests of the night", "Tyger Tyger, burning bright, what",
               "Shall I compare thee", "Tyger Tyger, burning bright, in the forests of the day"]
    want = [reference_generate(model, encode_prompt(p), 6) for p in prompts]
    llm = LLM(model, EngineConfig(num_blocks=36, block_size=4, max_num_batched_tokens=24, **_EXACT),
              block_manager_cls=cls)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6))]
    _expect(got == want, part, f"the engine with your block manager generated {got}, the reference decoder {want}")
    _expect(llm.idle(), part, "after serving, requests or pages were left over (a leak)")
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=6))[0]
    _expect(again.token_ids == want[0] and again.metrics.num_cached_tokens >= 48, part,
            f"a repeated prompt found {again.metrics.num_cached_tokens} tokens in the prefix cache, expected >= 48")
    pair = llm.generate(prompts[2:3], SamplingParams(max_tokens=6, n=2))[0]     # forks: copy-on-write
    got = [c.token_ids for c in pair.completions]
    _expect(got == [want[2]] * 2, part, f"two greedy completions of one prompt (sharing its pages) gave {got}, "
            f"expected {[want[2]] * 2}")
    _expect(llm.idle(), part, "after serving two completions that shared pages, pages were left over (a leak)")


BLOCK_MANAGER_PARTS = {"hashing": _bm_hashing, "refcounts": _bm_refcounts, "eviction": _bm_eviction,
                       "cow": _bm_cow, "engine": _bm_engine}


@scenario_check("block-manager")
def check_block_manager(cls, parts=tuple(BLOCK_MANAGER_PARTS)) -> None:
    """Scenarios for a BlockManager class (same constructor and methods as
    :class:`gpulab.engine.block_manager.BlockManager`). ``parts``: any of
    hashing, refcounts, eviction, cow, engine."""
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    for p in parts:
        if p not in BLOCK_MANAGER_PARTS:
            raise ValueError(f"unknown part {p!r}: choose from {', '.join(BLOCK_MANAGER_PARTS)}")
        BLOCK_MANAGER_PARTS[p](cls)
    print(f"✔ block manager: {', '.join(parts)} correct")


# -- scheduler step -----------------------------------------------------------------------------
def _sched(cls, num_blocks=64, block_size=4, **kw):
    bm = BlockManager(num_blocks, block_size)
    return cls(bm, **kw), bm


def _items(batch, names):
    return [(names[id(s)], n) for s, n in batch.items]


def _sched_budget(cls) -> None:
    part = "budget and chunking"
    sch, _ = _sched(cls, max_num_batched_tokens=10)
    a, b, c = _seq(range(23)), _seq(range(100, 103)), _seq(range(200, 204))
    names = {id(a): "a", id(b): "b", id(c): "c"}
    for s in (a, b, c):
        sch.add(s)
    expected = [[("a", 10)], [("a", 10)], [("a", 3), ("b", 3), ("c", 4)]]
    hints = ["the head of the queue gets min(its uncomputed tokens, the budget left): a prompt longer "
             "than the budget is chunked", "a running sequence continues its prompt where it stopped",
             "running sequences first, then waiting ones in arrival order while budget remains"]
    for step, (want, hint) in enumerate(zip(expected, hints), 1):
        running = {names[id(s)] for s in sch.running}
        batch = sch.schedule()
        got = _items(batch, names)
        _budget_kept(got, 10, part, step)
        if running and got and got[0][0] not in running and got != want:
            hint = ("running sequences first (oldest first), then admit waiting ones in arrival order "
                    "with the budget left")
        _expect(got == want, part, f"step {step} with a budget of 10 tokens scheduled {got}, expected {want}", hint)
        sch.postprocess(batch)
    for s in (a, b, c):
        s.token_ids.append(1)
    d = _seq(range(300, 320))
    names[id(d)] = "d"
    sch.add(d)
    got = _items(sch.schedule(), names)
    _budget_kept(got, 10, part, 4)
    want = [("a", 1), ("b", 1), ("c", 1), ("d", 7)]
    _expect(got == want, part, f"with three decodes and a waiting 20-token prompt, budget 10, got {got}, "
            f"expected {want}", "decodes cost one token each; the rest of the budget goes to the next prompt")
    sch2, _ = _sched(cls, max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        sch2.add(_seq(range(i, i + 3)))
    n = len(sch2.schedule().items)
    _expect(n == 2, part, f"max_num_seqs=2 allows at most 2 running sequences, {n} were scheduled")
    sch3, _ = _sched(cls, max_num_batched_tokens=64, chunked_prefill=False, max_model_len=64)
    e, f = _seq(range(40)), _seq(range(30))
    names = {id(e): "e", id(f): "f"}
    sch3.add(e)
    sch3.add(f)
    got = _items(sch3.schedule(), names)
    _expect(got == [("e", 40)], part, f"without chunked prefill a prompt that does not fit the budget left "
            f"waits for a later step; got {got}, expected [('e', 40)]",
            "if not self.chunked_prefill and the prompt's tokens exceed the budget left: stop admitting")


def _budget_kept(got, budget: int, part: str, step: int) -> None:
    total = sum(n for _, n in got)
    _expect(total <= budget, part, f"step {step} with a budget of {budget} tokens scheduled {got}: {total} tokens",
            "the budget counts tokens, not sequences: subtract each item's number of tokens from it")


def _sched_fcfs(cls) -> None:
    part = "first come, first served"
    sch, bm = _sched(cls, num_blocks=6, block_size=4, max_num_batched_tokens=64)
    first = _seq(range(200, 217))                            # 17 tokens: 5 of the 6 pages
    sch.add(first)
    sch.postprocess(sch.schedule())
    first.token_ids.append(0)
    second, small = _seq(range(40, 48)), _seq(range(100, 102))  # needs 2 pages (1 free); needs 1
    sch.add(second)
    sch.add(small)
    batch = sch.schedule()
    _expect(all(s is first for s, _ in batch.items), part,
            "a later request was admitted while an earlier one waited for pages",
            "stop admitting at the first waiting request that does not fit (no skipping ahead)")
    _expect(bm.num_free == 1 and second.block_table == [] and small.block_table == [], part,
            "a request that could not be admitted must not hold pages")
    _expect(list(sch.waiting) == [second, small], part, "requests that could not be admitted stay queued, in order")


def _sched_preempt(cls) -> None:
    part = "preemption"
    sch, bm = _sched(cls, num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b, c = _seq([1, 2, 3, 4]), _seq([5, 6]), _seq([7, 8, 9, 10])
    names = {id(a): "a", id(b): "b", id(c): "c"}
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    _expect(_items(batch, names) == [("a", 4), ("b", 2), ("c", 4)], part,
            f"setup: the three prompts fit 5 of the 6 pages, but {_items(batch, names)} was scheduled")
    sch.postprocess(batch)
    for s in (a, b, c):
        s.token_ids.append(0)
    d = _seq([11, 12])
    names[id(d)] = "d"
    sch.add(d)
    batch = sch.schedule()                # a takes the last free page; b needs one too
    pre, got = [names[id(s)] for s in batch.preempted], _items(batch, names)
    _expect(not batch.preempted or batch.preempted[0].block_table == [], part,
            f"preempted {pre}, but {pre[0] if pre else ''} still holds pages {batch.preempted[0].block_table if pre else ''}",
            "a preempted sequence must release its pages and restart (self.preempt(victim) does both)")
    _expect(pre == ["c"], part, f"out of pages, only the newest running sequence (c) should be preempted: "
            f"it frees 2 pages, enough for b; preempted {pre}",
            "preempt the victim popped from the END of the running list, and only while the current one does not fit")
    _expect(got == [("a", 1), ("b", 1)], part, f"after preempting c, a and b decode: got {got}, "
            f"expected [('a', 1), ('b', 1)]")
    _expect(sch.waiting and sch.waiting[0] is c, part, f"a preempted sequence goes back to the FRONT of the "
            f"waiting queue; the queue is {[names.get(id(s), '?') for s in sch.waiting]}", "use self.preempt(victim)")
    _expect(c.block_table == [] and c.num_computed_tokens == 0, part,
            "a preempted sequence must release its pages and restart from 0 computed tokens (recompute)")
    # a step that preempted admits nothing, not even the victim (it would only thrash)
    bm3 = BlockManager(5, 2, prefix_caching=False)
    sch3 = cls(bm3, max_num_batched_tokens=6)
    g, h = _seq(range(7)), _seq([7, 8, 9, 10])        # g: a prompt in chunks; h: decoding
    bm3.allocate(g, [], 2)
    g.num_computed_tokens = 2
    h.token_ids.append(0)
    bm3.allocate(h, [], 4)
    h.num_computed_tokens = 4
    sch3.running = [g, h]
    batch = sch3.schedule()       # g's chunk of 5 needs 3 pages: h is preempted; 1 page, 1 token left
    _expect(batch.preempted == [h] and [(s is g, n) for s, n in batch.items] == [(True, 5)], part,
            "no request may be admitted in a step that had to preempt, not even the one just preempted "
            "(it would fit the page and token left, and be preempted again next step)",
            "skip the waiting queue when this step preempted")
    sch2, _ = _sched(cls, num_blocks=4, block_size=2, max_num_batched_tokens=64)
    e, f = _seq([1, 2, 3]), _seq([4, 5, 6, 7])
    for s in (e, f):
        sch2.add(s)
    sch2.postprocess(sch2.schedule())
    for s in (e, f):
        s.token_ids.append(0)
    batch = sch2.schedule()               # e fits in its page; f needs one and is itself the newest
    _expect(batch.preempted == [f] and [s for s, _ in batch.items] == [e], part,
            "when the sequence that does not fit is itself the newest, it is the one preempted (and not run)")


def _sched_engine(cls) -> None:
    part = "in the engine"
    model = _check_model()
    prompts = ["Tyger Tyger, burning bright", "Shall I compare thee to a summer's day?", "a", "The woods are"]
    want = [reference_generate(model, encode_prompt(p), 8) for p in prompts]
    llm = LLM(model, EngineConfig(num_blocks=14, block_size=4, max_num_batched_tokens=7, **_EXACT),
              scheduler_cls=cls)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    _expect(got == want, part, f"the engine with your scheduler generated {got}, the reference decoder {want}")
    _expect(llm.idle(), part, "after serving, requests or pages were left over")
    _expect(llm.summary()["preemptions"] > 0, part, "this workload should have preempted (14 pages for 4 requests)")


SCHEDULER_PARTS = {"budget": _sched_budget, "fcfs": _sched_fcfs, "preemption": _sched_preempt,
                   "engine": _sched_engine}


@scenario_check("scheduler")
def check_scheduler(cls, parts=tuple(SCHEDULER_PARTS)) -> None:
    """Scenarios for a Scheduler class whose ``schedule`` the learner wrote. ``parts``:
    any of budget, fcfs, preemption, engine."""
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    for p in parts:
        if p not in SCHEDULER_PARTS:
            raise ValueError(f"unknown part {p!r}: choose from {', '.join(SCHEDULER_PARTS)}")
        SCHEDULER_PARTS[p](cls)
    print(f"✔ scheduler step: {', '.join(parts)} correct")


# -- decode hook --------------------------------------------------------------------------------
def _hook_direct(hook) -> None:
    """Call the hook once on a small paged cache (scattered pages, sequences of 1, 2 and 3
    pages) and name what is wrong with its output, before serving with it."""
    part, ps = "decode hook", 4
    g = torch.Generator().manual_seed(11)
    dev, hq, hkv, d = runtime.device(), TINY.n_heads, TINY.n_kv_heads, TINY.head_dim
    k_cache = torch.randn(9, ps, hkv, d, generator=g).to(dev)
    v_cache = torch.randn(9, ps, hkv, d, generator=g).to(dev)
    q = torch.randn(3, hq, d, generator=g).to(dev)
    block_table = torch.tensor([[6, 2, 8], [3, 0, 0], [1, 7, 4]], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([11, 3, 9], dtype=torch.int32, device=dev)
    args = (q.clone(), k_cache.clone(), v_cache.clone(), block_table.clone(), seq_lens.clone())
    with new_memory_is_nan():   # an o never written is NaN (on a GPU it could hold a freed right answer)
        o = hook(*args)
    sig = "decode_hook(q, k_cache, v_cache, block_table, seq_lens)"
    _expect(o is not None, part, f"{sig} returned None", "return o (the attention output), not only fill it")
    _expect(isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(q.shape), part,
            f"{sig} returned {f'a tensor of shape {tuple(o.shape)}' if isinstance(o, torch.Tensor) else type(o).__name__}, "
            f"not q's shape {tuple(q.shape)}", "return o [B, Hq, D] (not lse [B, Hq], not a tuple)")

    def ref(kc, vc, lens):
        return paged_decode_reference(q.double(), kc.double(), vc.double(), block_table, lens)["o"]

    def close(a, b):   # per sequence
        return [bool(torch.allclose(a[i].double().cpu(), b[i].cpu(), atol=2e-3, rtol=2e-3)) for i in range(a.shape[0])]

    ok = close(o, ref(k_cache, v_cache, seq_lens))
    if all(ok):
        return
    what = f"on a paged cache of {ps}-token pages (seq_lens {seq_lens.tolist()}), o is wrong for sequence(s) " \
           f"{[i for i, x in enumerate(ok) if not x]}"
    if all(close(o, ref(k_cache, v_cache, seq_lens - 1))):
        _fail(part, what + ": it is attention over one token short of each sequence",
              "pass seq_lens as given: it counts the token this step just wrote into the cache")
    if all(close(o, ref(v_cache, k_cache, seq_lens))):
        _fail(part, what + ": it is attention with the key and value caches swapped",
              "the launcher takes (q, k_cache, v_cache, ...) in that order")
    long = [int(x) > ps for x in seq_lens]
    if any(ok) and all(x == (not lg) for x, lg in zip(ok, long)):
        _fail(part, what + ": right for the sequence that fits one page, wrong for longer ones",
              "pass the whole block_table: the kernel must read every page of each sequence")
    if o.is_floating_point() and bool(o.isnan().all()):
        _fail(part, what + ": every element is NaN, and the check fills new tensors with NaN",
              "most likely nothing wrote the o you return: pass that very tensor to the launcher as its "
              "output (if it does, look for a 0/0 in the kernel)")
    if not any(ok):
        _fail(part, what + ": no sequence's output is attention's (nor one token short, nor with k and v "
              "swapped)", "check that the launcher writes the o you return (same tensor, same dtype and shape)")
    _fail(part, what, "compare your output with gpulab.paged.paged_decode_reference on small inputs")


@scenario_check("decode-hook")
def check_decode_hook(hook) -> None:
    """The hook on a small paged cache equals paged attention; the engine with ``hook`` as
    its decode attention generates the reference's tokens."""
    _hook_direct(hook)
    model = _check_model()
    prompts = ["Tyger Tyger, burning bright", "Shall I"]
    want = [reference_generate(model, encode_prompt(p), 4) for p in prompts]
    llm = LLM(model, EngineConfig(block_size=8, linear="torch"), decode_hook=hook)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4))]
    _expect(got == want, "decode hook", f"the engine with your decode attention generated {got}, "
            f"the reference decoder {want}", "the hook gets q [B, Hq, D], the layer's caches, block_table "
            "and seq_lens, and returns o [B, Hq, D]")
    print("✔ decode hook: the engine's tokens equal the reference decoder's")


@functools.lru_cache(maxsize=1)
def _check_model() -> TernaryTransformer:
    with torch.random.fork_rng():
        torch.manual_seed(7)
        return TernaryTransformer(TINY).pack().to(runtime.device())

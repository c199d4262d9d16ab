"""Block manager and scheduler of the serving engine, as units (no model)."""
import pytest

from gpulab.engine.block_manager import BlockManager, chain_hash
from gpulab.engine.scheduler import Scheduler
from gpulab.engine.sequence import SamplingParams, Sequence
from gpulab.paged import OutOfPages

_ids = iter(range(10**6))


def seq(tokens, max_tokens=8):
    return Sequence(next(_ids), "r", list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), 0)


def run_prompt(bm, s, n=None):
    """Admit s with its cache hits and compute its whole prompt (as one step would)."""
    hits = bm.match_prefix(s)
    bm.allocate(s, hits, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return hits


def test_hash_chains_each_block_to_its_predecessor():
    a, b = chain_hash(None, (1, 2)), chain_hash(None, (3, 4))
    assert chain_hash(a, (5, 6)) != chain_hash(b, (5, 6))     # same tokens, other prefix
    assert chain_hash(a, (5, 6)) == chain_hash(chain_hash(None, (1, 2)), (5, 6))
    bm = BlockManager(8, 2)
    s1 = seq([1, 2, 5, 6, 7])
    run_prompt(bm, s1)
    # a prompt with the same second block but another first block must miss entirely
    s2 = seq([3, 4, 5, 6, 7])
    assert bm.match_prefix(s2) == []
    s3 = seq([1, 2, 5, 6, 9])
    assert bm.match_prefix(s3) == s1.block_table[:2]


def test_prefix_hit_shares_pages_and_counts_references():
    bm = BlockManager(8, 4)
    a = seq(range(10))                    # 2 full pages + 2 tokens
    run_prompt(bm, a)
    assert [bm.blocks[b].ref_count for b in a.block_table] == [1, 1, 1]
    b = seq(list(range(8)) + [50, 51, 52])
    hits = run_prompt(bm, b)
    assert hits == a.block_table[:2] and b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8 and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[x].ref_count for x in a.block_table[:2]] == [2, 2]
    assert bm.num_used == 4
    bm.free_sequence(a)
    assert [bm.blocks[x].ref_count for x in b.block_table[:2]] == [1, 1] and bm.num_used == 3
    bm.free_sequence(b)
    assert bm.num_used == 0 and bm.num_free == 8
    assert bm.hit_tokens == 8 and bm.queried_tokens == 21


def test_whole_prompt_hit_still_leaves_a_token_to_compute():
    bm = BlockManager(8, 4)
    a = seq(range(8))
    run_prompt(bm, a)
    bm.free_sequence(a)
    b = seq(range(8))
    assert len(bm.match_prefix(b)) == 1          # the last page is recomputed: its logits are needed


def test_freed_cached_pages_are_evicted_least_recently_used_blank_first():
    bm = BlockManager(4, 2)
    a, b = seq([1, 2, 3]), seq([7, 8, 9])
    run_prompt(bm, a)
    run_prompt(bm, b)
    bm.free_sequence(a)        # a's full page cached, then b's: a's is older
    bm.free_sequence(b)
    assert bm.num_cached_free == 2 and bm.num_free == 4
    c = seq([20, 21, 22, 23, 24])     # needs 3 pages: 2 blank ones, then evicts a's page
    run_prompt(bm, c)
    assert bm.match_prefix(seq([1, 2, 3])) == []
    assert len(bm.match_prefix(seq([7, 8, 9]))) == 1
    # a hit revives the cached page: it leaves the free pool and is not evicted
    bm.free_sequence(c)
    d = seq([7, 8, 9])
    hits = run_prompt(bm, d)
    assert len(hits) == 1 and bm.blocks[hits[0]].ref_count == 1 and hits[0] not in bm.free


def test_copy_on_write_of_a_shared_partial_page():
    bm = BlockManager(6, 4)
    parent = seq(range(6))            # 1 full + 1 partial page
    run_prompt(bm, parent)
    child = seq(range(6))
    bm.fork(parent, child)
    shared = parent.block_table[1]
    assert bm.blocks[shared].ref_count == 2
    copies = bm.append_slots(child, 1)
    assert len(copies) == 1 and copies[0][0] == shared and child.block_table[1] == copies[0][1]
    assert child.block_table[0] == parent.block_table[0]          # the full page stays shared
    assert bm.blocks[shared].ref_count == 1
    assert bm.append_slots(parent, 1) == []                         # now parent's alone: no copy


def test_exhaustion_raises_and_never_hands_out_a_used_page():
    bm = BlockManager(3, 2)
    a = seq([1, 2, 3, 4, 5])
    run_prompt(bm, a)
    b = seq([9, 9, 9])
    assert not bm.can_allocate(b, [], 3)
    with pytest.raises(OutOfPages, match="out of KV pages"):
        bm.allocate(b, [], 3)
    assert b.block_table == [] and bm.num_used == 3                # nothing leaked
    assert not bm.can_append(a, 2)
    with pytest.raises(OutOfPages):
        bm.append_slots(a, 2)
    with pytest.raises(RuntimeError, match="released"):
        bm.release_block(a.block_table[0]) or bm.release_block(a.block_table[0])


def test_scheduler_budget_chunks_and_fcfs():
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    long, short = seq(range(23)), seq(range(100, 103))
    sch.add(long)
    sch.add(short)
    b1 = sch.schedule()
    assert [(s is long, n) for s, n in b1.items] == [(True, 10)]       # head of the queue first, chunked
    sch.postprocess(b1)
    b2 = sch.schedule()
    assert [(s is long, n) for s, n in b2.items] == [(True, 10)]
    sch.postprocess(b2)
    b3 = sch.schedule()
    assert [(s is long, n) for s, n in b3.items] == [(True, 3), (False, 3)]   # rest of long + short


def test_scheduler_without_chunking_waits_for_room():
    bm = BlockManager(32, 4)
    with pytest.raises(ValueError, match="chunked prefill"):
        Scheduler(bm, max_num_batched_tokens=10, chunked_prefill=False, max_model_len=64)
    sch = Scheduler(bm, max_num_batched_tokens=64, chunked_prefill=False, max_model_len=64)
    a, b = seq(range(40)), seq(range(30))
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert [(s is a, n) for s, n in batch.items] == [(True, 40)]          # b does not fit whole


def test_scheduler_preempts_newest_and_requeues_it_first():
    bm = BlockManager(4, 2)
    sch = Scheduler(bm, max_num_batched_tokens=64)
    a, b = seq([1, 2, 3, 4]), seq([5, 6, 7, 8])
    sch.add(a)
    sch.add(b)
    sch.postprocess(sch.schedule())          # both prefilled: 2 full pages each, pool full
    for s in (a, b):
        s.token_ids.append(0)
    assert bm.num_free == 0
    batch = sch.schedule()                   # a needs a page for its 5th token: b is preempted
    assert batch.preempted == [b] and [s for s, _ in batch.items] == [a]
    assert sch.waiting[0] is b and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1


def test_registration_resumes_retries_a_held_key_and_restarts_after_preemption():
    """commit_full_blocks runs for every sequence every step, so it resumes where it
    stopped; the result must equal registering every full page from scratch."""
    bm = BlockManager(16, 2)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, [], 5)
    a.num_computed_tokens = 5
    bm.commit_full_blocks(a)
    assert [bm.blocks[b].hash is not None for b in a.block_table] == [True, True, False]
    assert a.num_registered_blocks == 2
    # b computes the same tokens in its own pages (no prefix lookup): a holds the keys
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b, [], 5)
    b.num_computed_tokens = 5
    bm.commit_full_blocks(b)
    assert all(bm.blocks[x].hash is None for x in b.block_table) and b.num_registered_blocks == 0
    # a leaves and its pages are evicted: b's pages take the keys at its next step
    bm.free_sequence(a)
    while any(bm.blocks[x].hash is not None for x in bm.free):
        bm.take_free_block()
    bm.commit_full_blocks(b)
    assert [bm.blocks[x].hash is not None for x in b.block_table[:2]] == [True, True]
    assert bm.match_prefix(seq([1, 2, 3, 4, 9])) == b.block_table[:2]
    # preempted (pages freed) and readmitted into fresh pages: registered from the start
    bm.free_sequence(b)
    assert b.num_registered_blocks == 0
    bm.allocate(b, [], 5)
    b.num_computed_tokens = 5
    bm.commit_full_blocks(b)
    assert all(bm.blocks[x].hash is not None for x in b.block_table[:2])


@pytest.mark.parametrize("reserve, admitted", [(0, 4), (2, 3)])
def test_admission_leaves_pages_for_the_running_sequences_to_grow(reserve, admitted):
    """decode_reserve pages per running sequence stay free when a new one is admitted
    (each preemption recomputes a whole sequence; the engine's default keeps one)."""
    bm = BlockManager(10, 4, prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, decode_reserve=reserve)
    for i in range(4):
        sch.add(seq(range(10 * i, 10 * i + 8)))       # two pages each
    batch = sch.schedule()
    assert len(batch.items) == admitted
    assert len(bm.free) == 10 - 2 * admitted


def test_each_full_page_is_hashed_once_however_often_it_is_looked_up(monkeypatch):
    """A 2K-token prompt has 128 full pages: looking them up (match_prefix, again at every
    step the request waits) and registering them (commit_full_blocks) hash each one once,
    and the keys are those of hashing from scratch."""
    from gpulab.engine import block_manager
    calls = []
    monkeypatch.setattr(block_manager, "chain_hash", lambda p, t: calls.append(1) or chain_hash(p, t))
    bm = BlockManager(16, 2)
    s = seq([1, 2, 3, 4, 5, 6, 7])                    # 3 full pages before the last token
    assert bm.match_prefix(s) == [] and len(calls) == 1           # the first page misses: stop
    assert bm.match_prefix(s) == [] and len(calls) == 1           # waited a step: no new hash
    bm.allocate(s, [], 7)
    s.num_computed_tokens = 7
    bm.commit_full_blocks(s)
    assert len(calls) == 3                                        # the other two, once
    keys = [chain_hash(None, (1, 2))]
    keys += [chain_hash(keys[-1], (3, 4)), chain_hash(chain_hash(keys[-1], (3, 4)), (5, 6))]
    assert s.block_hashes == keys and [bm.blocks[b].hash for b in s.block_table[:3]] == keys
    hit = seq([1, 2, 3, 4, 5, 6, 9])
    assert bm.match_prefix(hit) == s.block_table[:3] and bm.match_prefix(hit) == s.block_table[:3]
    assert len(calls) == 6 and hit.block_hashes == keys           # its own pages, once each


def test_a_delay_factor_admits_requests_that_arrive_one_by_one_together():
    """vLLM's scheduler_delay_factor: while a sequence runs, new requests wait until the
    oldest has waited factor times the last prompt step; then they are admitted together.
    Nothing running, or a preempted request (the oldest), is admitted at once."""
    now = [0.0]
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, delay_factor=2.0, clock=lambda: now[0])

    def arrive(tokens, at):
        s = seq(tokens)
        s.arrival_time = at
        sch.add(s)
        return s

    def step(at):
        now[0] = at
        batch = sch.schedule()
        sch.postprocess(batch)
        for s, _ in batch.items:
            s.token_ids.append(0)                # its sampled token: a decode next step
        return [s for s, _ in batch.items]

    a = arrive(range(6), 0.0)
    assert step(0.0) == [a]                      # nothing runs: admitted at once
    b = arrive(range(10, 14), 0.5)
    assert step(1.0) == [a]                      # the prompt step took 1.0; b waited 0.5 < 2 x 1.0
    c = arrive(range(20, 25), 2.0)
    assert step(2.0) == [a]                      # b waited 1.5
    assert step(2.5) == [a, b, c]                # b waited 2.0: b and c admitted in one step
    d = arrive(range(30, 33), 2.7)
    assert step(3.0) == [a, b, c]                # that prompt step took 0.5: d must wait 1.0
    assert sch.prompt_step_s == 0.5
    assert step(3.7) == [a, b, c, d]
    sch.running.remove(d)                        # as schedule() preempts: requeued first,
    sch.preempt(d)                               # the oldest waiting: no wait
    assert step(3.8) == [a, b, c, d]
    for s in (a, b, c, d):
        sch.finish(s, "length")
    e = arrive(range(40, 43), 4.0)
    assert step(4.0) == [e]                      # nothing runs: at once
    with pytest.raises(ValueError, match="delay_factor"):
        Scheduler(bm, delay_factor=-1.0)
    with pytest.raises(ValueError, match="delay_factor"):
        Scheduler(bm, delay_factor=float("nan"))


def test_without_a_delay_factor_each_arrival_is_admitted_at_its_next_step():
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(range(6)), seq(range(10, 14))
    sch.add(a)
    sch.postprocess(sch.schedule())
    a.token_ids.append(0)
    sch.add(b)
    assert [s for s, _ in sch.schedule().items] == [a, b]

"""Notebook 07's checks accept the engine's own parts and reject planted wrong ones,
each with a message that names the broken rule."""
import pytest
import torch

from gpulab.engine.block_manager import BlockManager, chain_hash
from gpulab.engine.scheduler import ScheduledBatch, Scheduler
from gpulab.grading.engine import check_block_manager, check_decode_hook, check_scheduler
from gpulab.harness.checking import CheckFailure
from gpulab.paged import paged_decode_attention


def test_engine_parts_pass():
    check_block_manager(BlockManager)
    check_scheduler(Scheduler)
    check_decode_hook(paged_decode_attention)


def test_unfinished_exercise_lets_the_stub_error_through():
    class Stub(BlockManager):
        def match_prefix(self, seq):
            raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        check_block_manager(Stub, "hashing")


# -- planted wrong block managers ------------------------------------------------------------
class NoChain(BlockManager):
    """Hashes each page's tokens alone."""
    def commit_full_blocks(self, seq):
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block.hash is None:
                block.hash, block.token_ids = chain_hash(None, tokens), tokens
                self.cached.setdefault(block.hash, block.block_id)

    def match_prefix(self, seq):
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            bid = self.cached.get(chain_hash(None, tokens))
            if bid is None:
                break
            hits.append(bid)
        return hits


class WholePromptHit(BlockManager):
    """Matches every full page, even when nothing would be left to compute."""
    def match_prefix(self, seq):
        hits, h = [], None
        for i in range(seq.num_tokens // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits


class NoTokenCheck(BlockManager):
    def match_prefix(self, seq):
        hits, h = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = chain_hash(h, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        return hits


class HitTakesNoReference(BlockManager):
    def share_block(self, bid):
        if self.blocks[bid].ref_count == 0:
            del self.free[bid]
        self.blocks[bid].ref_count = 1


class FreesSharedPages(BlockManager):
    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count = 0
        self.free[bid] = None


class ForgetsHashOnFree(BlockManager):
    def release_block(self, bid):
        super().release_block(bid)
        block = self.blocks[bid]
        if block.ref_count == 0 and block.hash is not None:
            del self.cached[block.hash]
            block.hash = None


class EvictsNewest(BlockManager):
    def take_free_block(self):
        bid, _ = self.free.popitem(last=True)
        block = self.blocks[bid]
        if block.hash is not None:
            self.cached.pop(block.hash, None)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block


class CachedBeforeBlank(BlockManager):
    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None


class StaleHashAfterEviction(BlockManager):
    def take_free_block(self):
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        block.ref_count = 1
        return block


class NoCopyOnWrite(BlockManager):
    def needs_copy(self, seq):
        return False


class CopyKeepsReference(BlockManager):
    def append_slots(self, seq, num_tokens):
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self.take_free_block().block_id
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


class HashesPartialPages(BlockManager):
    def commit_full_blocks(self, seq):
        super().commit_full_blocks(seq)
        n = seq.num_computed_tokens
        if n % self.block_size:
            block = self.blocks[seq.block_table[n // self.block_size]]
            block.hash = hash(("partial", n))


@pytest.mark.parametrize("wrong, part, message", [
    (NoChain, "hashing", "page 1's hash is not chain_hash"),
    (WholePromptHit, "hashing", "leave at least one token"),
    (NoTokenCheck, "hashing", "hash collision"),
    (HashesPartialPages, "hashing", "partial last page none"),
    (HitTakesNoReference, "refcounts", "should be \\[2, 2, 1\\]"),
    (FreesSharedPages, "refcounts", "b's pages should have ref counts"),
    (ForgetsHashOnFree, "eviction", "stay in the prefix cache"),
    (EvictsNewest, "eviction", "took a cached page while blank pages were free|least recently freed"),
    (CachedBeforeBlank, "eviction", "blank pages were free"),
    (StaleHashAfterEviction, "eviction", "should take a's two|stay in the prefix cache|least recently"),
    (NoCopyOnWrite, "cow", "must first copy it"),
    (CopyKeepsReference, "cow", "release the old page once"),
])
def test_block_manager_check_rejects(wrong, part, message):
    with pytest.raises(CheckFailure, match=message):
        check_block_manager(wrong, part)


def test_wrong_block_manager_fails_in_the_engine_too():
    with pytest.raises(CheckFailure, match="in the engine"):
        check_block_manager(CopyKeepsReference, "engine")


# -- planted wrong schedulers -----------------------------------------------------------------
def _variant(**edits):
    """A Scheduler whose schedule() is the engine's with one rule broken."""
    class Wrong(Scheduler):
        def schedule(self):
            batch = ScheduledBatch()
            budget = 10**9 if edits.get("no_budget") else self.budget
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                n = min(seq.num_uncomputed, budget)
                while not self.bm.can_append(seq, n):
                    victim = self.running.pop(0) if edits.get("oldest") else self.running.pop()
                    if edits.get("requeue_back"):
                        self.bm.free_sequence(victim)
                        self.waiting.append(victim)
                    else:
                        self.preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    batch.copies += self.bm.append_slots(seq, n)
                    batch.items.append((seq, n))
                    budget -= n
                    i += 1
                    continue
                break
            admit = not batch.preempted or edits.get("admit_after_preempt")
            skipped = []
            while self.waiting and admit and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits = self.bm.match_prefix(seq)
                todo = seq.num_tokens - len(hits) * self.bm.block_size
                if todo > budget and (not self.chunked_prefill or edits.get("no_chunking")):
                    break
                n = min(todo, budget)
                if not self.bm.can_allocate(seq, hits, seq.num_tokens - todo + n):
                    if edits.get("skip_ahead"):
                        skipped.append(self.waiting.popleft())
                        continue
                    break
                self.waiting.popleft()
                self.bm.allocate(seq, hits, seq.num_tokens - todo + n)
                self.running.append(seq)
                batch.items.append((seq, n))
                budget -= n
            self.waiting.extendleft(reversed(skipped))
            return batch
    return Wrong


@pytest.mark.parametrize("edit, part, message", [
    ("no_budget", "budget", "step 1 with a budget of 10"),
    ("no_chunking", "budget", "step 1 with a budget of 10"),
    ("skip_ahead", "fcfs", "later request was admitted"),
    ("oldest", "preemption", "newest running sequence"),
    ("requeue_back", "preemption", "FRONT of the waiting queue"),
    ("admit_after_preempt", "preemption", "no request may be admitted in a step that had to preempt"),
])
def test_scheduler_check_rejects(edit, part, message):
    with pytest.raises(CheckFailure, match=message):
        check_scheduler(_variant(**{edit: True}), part)


def test_correct_variant_passes():
    check_scheduler(_variant(), ("budget", "fcfs", "preemption"))


def test_decode_hook_check_rejects_a_wrong_hook():
    def no_scale(q, k_cache, v_cache, block_table, seq_lens):
        return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale=1.0)
    with pytest.raises(CheckFailure, match="decode hook"):
        check_decode_hook(no_scale)


def test_decode_hook_check_names_an_o_never_written_whatever_memory_it_got():
    """On a GPU the caching allocator hands a freed block back as it is: an o the hook
    never wrote once held an earlier call's right answer, and the check let it through.
    The worst case of such an allocator: memory the check did not fill holds the right answer."""
    def never_written(q, k_cache, v_cache, block_table, seq_lens):
        o = torch.empty_like(q)
        if not bool(o.isnan().all()):   # a stale block: a previous call's right answer
            o.copy_(paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens))
        return o
    with pytest.raises(CheckFailure, match="the o you return"):
        check_decode_hook(never_written)
    assert not torch.are_deterministic_algorithms_enabled()   # the check restores PyTorch's mode

"""Notebook 07: the block manager (hashing, reference counts, eviction, copy-on-write),
the scheduler step (budget, preemption) and the decode hook.

Each wrong class is the notebook's solution (``MyBlockManager``/``MyScheduler``, as the
learner's cell writes them) with one method changed the way a learner gets it wrong."""
import torch

from gpulab import paged
from gpulab.engine.block_manager import BlockManager, chain_hash
from gpulab.engine.scheduler import ScheduledBatch, Scheduler
from gpulab.engine.sequence import Status
from gpulab.grading import engine as _engine_checks  # noqa: F401  (registers the checks)
from gpulab.paged import OutOfPages

from . import Mistake


# -- the block manager, as the notebook's solution cell writes it ------------------------------------
class MyBlockManager(BlockManager):

    def match_prefix(self, seq):
        if not self.prefix_caching:
            return []
        hits, h = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits

    def commit_full_blocks(self, seq):
        if not self.prefix_caching:
            return
        h = None
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(h, tokens)
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    def take_free_block(self):
        if not self.free:
            raise OutOfPages("out of KV pages")
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None
            if block.hash is None:
                self.free.move_to_end(bid, last=False)

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self.take_free_block().block_id
            self.release_block(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


# hashing
class NoChain(MyBlockManager):
    """Each page hashed on its own tokens: equal pages after different prefixes collide."""

    def match_prefix(self, seq):
        if not self.prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            bid = self.cached.get(chain_hash(None, tokens))
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits

    def commit_full_blocks(self, seq):
        if not self.prefix_caching:
            return
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(None, tokens)
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id


class HashesPartialPage(MyBlockManager):
    """Rounds the page count up: the partial last page gets a hash too."""

    def commit_full_blocks(self, seq):
        if not self.prefix_caching:
            return
        h = None
        for i in range(self.blocks_for(seq.num_computed_tokens)):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(h, tokens)
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id


class MatchesEveryFullPage(MyBlockManager):
    """num_tokens // block_size pages: a prompt fully in the cache leaves nothing to compute."""

    def match_prefix(self, seq):
        if not self.prefix_caching:
            return []
        hits, h = [], None
        for i in range(seq.num_tokens // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits


class TrustsTheHash(MyBlockManager):
    """A hit on the hash alone, without comparing the page's token ids."""

    def match_prefix(self, seq):
        if not self.prefix_caching:
            return []
        hits, h = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = chain_hash(h, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits


class IgnoresPrefixCachingFlag(MyBlockManager):
    def match_prefix(self, seq):
        hits, h = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits

    def commit_full_blocks(self, seq):
        h = None
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(h, tokens)
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id


class MatchChainStartsAtZero(MyBlockManager):
    """match_prefix starts the chain from 0, commit_full_blocks from None: keys never agree."""

    def match_prefix(self, seq):
        if not self.prefix_caching:
            return []
        hits, h = [], 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
        return hits


# reference counts
class ReleaseFreesAtOnce(MyBlockManager):
    """Forgets the count: one release frees the page even while others hold it."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count = 0
        self.free[bid] = None
        if block.hash is None:
            self.free.move_to_end(bid, last=False)


class ReleaseNeverFrees(MyBlockManager):
    """Decrements, but never puts the page back in the free pool."""

    def release_block(self, bid):
        self.blocks[bid].ref_count -= 1


class ReleaseFreesEveryTime(MyBlockManager):
    """Decrements, and returns the page to the pool whatever the count."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        self.free[bid] = None
        if block.hash is None:
            self.free.move_to_end(bid, last=False)


class FreshPageRefZero(MyBlockManager):
    """take_free_block does not set ref_count = 1."""

    def take_free_block(self):
        if not self.free:
            raise OutOfPages("out of KV pages")
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        return block


class TakeLeavesPageInPool(MyBlockManager):
    """Peeks at the first free page without removing it: the same page is handed out twice."""

    def take_free_block(self):
        if not self.free:
            raise OutOfPages("out of KV pages")
        bid = next(iter(self.free))
        block = self.blocks[bid]
        if block.hash is not None:
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block


# eviction
class ReleaseAllToBack(MyBlockManager):
    """Every freed page goes to the back: blank pages wait behind cached ones."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None


class EvictsMostRecent(MyBlockManager):
    """Hands out the most recently freed page (popitem() takes the back)."""

    def take_free_block(self):
        if not self.free:
            raise OutOfPages("out of KV pages")
        bid, _ = self.free.popitem()
        block = self.blocks[bid]
        if block.hash is not None:
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block


class ReleaseForgetsHash(MyBlockManager):
    """A freed page leaves the prefix cache at once."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.cached.pop(block.hash, None)
                block.hash, block.token_ids = None, ()
            self.free[bid] = None
            self.free.move_to_end(bid, last=False)


class ReleaseOrderInverted(MyBlockManager):
    """The condition upside down: cached pages to the front, blank ones to the back."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None
            if block.hash is not None:
                self.free.move_to_end(bid, last=False)


class ReleaseAllToFront(MyBlockManager):
    """Every freed page to the front: the newest cached page is evicted first."""

    def release_block(self, bid):
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None
            self.free.move_to_end(bid, last=False)


# copy-on-write
class NeverCopies(MyBlockManager):
    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return []


class CopyKeepsSource(MyBlockManager):
    """Copies the shared page but forgets to release the source."""

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self.take_free_block().block_id
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


class CopyNotInTable(MyBlockManager):
    """Takes the copy and releases the source, but the block table still names the source."""

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self.take_free_block().block_id
            self.release_block(src)
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


class CopiesPreviousPage(MyBlockManager):
    """Off by one in the page index: copies the page before the one being written."""

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size - 1
            src, dst = seq.block_table[i], self.take_free_block().block_id
            self.release_block(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


class CopiesSharedLastPage(MyBlockManager):
    """Copies the table's last page whenever it is shared, even when it is full (the token
    goes to a new page)."""

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if seq.block_table and self.blocks[seq.block_table[-1]].ref_count > 1:
            src, dst = seq.block_table[-1], self.take_free_block().block_id
            self.release_block(src)
            seq.block_table[-1] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


class GrowsToNumTokens(MyBlockManager):
    """Covers num_tokens tokens instead of num_computed_tokens + num_tokens."""

    def append_slots(self, seq, num_tokens):
        if not self.can_append(seq, num_tokens):
            raise OutOfPages("out of KV pages")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[i], self.take_free_block().block_id
            self.release_block(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies


# -- the scheduler step, as the notebook's solution cell writes it, with switches -------------------
def _scheduler(mistake=""):
    class MyScheduler(Scheduler):

        def schedule(self):
            batch = ScheduledBatch()
            budget = self.budget
            if mistake == "waiting first":
                self._admit(batch, budget)
                budget -= sum(n for _, n in batch.items)
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                if mistake == "waiting first" and any(s is seq for s, _ in batch.items):
                    i += 1
                    continue
                n = 1 if mistake == "running decode 1" else min(seq.num_uncomputed, budget)
                while not self.bm.can_append(seq, n):
                    if mistake == "preempt oldest":
                        victim = self.running.pop(0)
                    elif mistake == "never preempt self" and self.running[-1] is seq and len(self.running) > 1:
                        victim = self.running.pop(-2)
                        i -= 1
                    else:
                        victim = self.running.pop()
                    if mistake == "requeue at back":
                        self.bm.free_sequence(victim)
                        victim.status = Status.WAITING
                        self.waiting.append(victim)
                    elif mistake == "victim keeps pages":
                        victim.status = Status.WAITING
                        self.waiting.appendleft(victim)
                    else:
                        self.preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    batch.copies += self.bm.append_slots(seq, n)
                    batch.items.append((seq, n))
                    budget -= 1 if mistake == "budget in sequences" else n
                    i += 1
                    continue
                break
            if mistake != "waiting first":
                self._admit(batch, budget)
            return batch

        def _admit(self, batch, budget):
            for seq in list(self.waiting):
                if not (budget > 0 and (mistake == "admits after preempting" or not batch.preempted)
                        and (mistake == "ignores max_num_seqs" or len(self.running) < self.max_num_seqs)):
                    break
                hits = self.bm.match_prefix(seq)
                todo = seq.num_tokens - len(hits) * self.bm.block_size
                if todo > budget and (mistake == "never chunks" or
                                      (not self.chunked_prefill and mistake != "ignores chunked_prefill")):
                    break
                n = min(todo, budget)
                covered = seq.num_tokens - todo + n
                if not self.bm.can_allocate(seq, hits, covered):
                    if mistake == "skips ahead":      # try the next one instead
                        continue
                    break
                self.waiting.remove(seq)
                self.bm.allocate(seq, hits, covered)
                seq.status = Status.RUNNING
                self.running.append(seq)
                batch.items.append((seq, n))
                budget -= 1 if mistake == "budget in sequences" else n
    MyScheduler.__name__ = MyScheduler.__qualname__ = f"MyScheduler[{mistake}]"
    return MyScheduler


# -- the decode hook ---------------------------------------------------------------------------------
decode_launcher = paged.paged_decode_into


def _hook(mistake):
    def decode_hook(q, k_cache, v_cache, block_table, seq_lens):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if mistake == "length minus one":       # "the new token is not in the cache yet"
            decode_launcher(q, k_cache, v_cache, block_table, seq_lens - 1, o, lse)
        elif mistake == "k and v swapped":
            decode_launcher(q, v_cache, k_cache, block_table, seq_lens, o, lse)
        elif mistake == "returns lse":
            decode_launcher(q, k_cache, v_cache, block_table, seq_lens, o, lse)
            return lse
        elif mistake == "no return":
            decode_launcher(q, k_cache, v_cache, block_table, seq_lens, o, lse)
            return None
        elif mistake == "output never written":
            return o
        elif mistake == "first page only":
            decode_launcher(q, k_cache, v_cache, block_table[:, :1], seq_lens.clamp(max=k_cache.shape[1]), o, lse)
        else:                                   # the solution
            decode_launcher(q, k_cache, v_cache, block_table, seq_lens, o, lse)
        return o
    return decode_hook


def _bm(exercise, name, cls, expect, args, **kw):
    return Mistake(f"07/{exercise}", "block-manager", name, cls, expect, args=args, **kw)


def _sch(exercise, name, mistake, expect, args, **kw):
    return Mistake(f"07/{exercise}", "scheduler", name, _scheduler(mistake), expect, args=args, **kw)


H, R, E, C = ("hashing",), ("refcounts",), ("eviction",), (("cow", "engine"),)
B, P = (("budget", "fcfs"),), (("preemption", "engine"),)

MISTAKES = [
    _bm("check-bm-hashing", "each page hashed alone (no chain)", NoChain, ("chain each page's hash",), H),
    _bm("check-bm-hashing", "the partial last page hashed", HashesPartialPage, ("partial last page none",), H),
    _bm("check-bm-hashing", "match_prefix takes every full page", MatchesEveryFullPage,
        ("leave at least one token",), H),
    _bm("check-bm-hashing", "a hit on the hash alone", TrustsTheHash, ("hash collision",), H),
    _bm("check-bm-hashing", "prefix_caching flag ignored", IgnoresPrefixCachingFlag, ("prefix_caching=False",), H),
    _bm("check-bm-hashing", "match_prefix chain starts at 0, commit's at None", MatchChainStartsAtZero,
        ("same keys",), H),
    _bm("check-bm-refcounts", "release frees the page at once", ReleaseFreesAtOnce, ("drop one reference",), R),
    _bm("check-bm-refcounts", "release never returns the page", ReleaseNeverFrees,
        ("ref_count drops to 0 must go back",), R),
    _bm("check-bm-refcounts", "release returns the page whatever the count", ReleaseFreesEveryTime,
        ("only at ref_count 0",), R),
    _bm("check-bm-refcounts", "fresh page left at ref_count 0", FreshPageRefZero, ("ref_count 1",), R),
    _bm("check-bm-refcounts", "take_free_block leaves the page in the pool", TakeLeavesPageInPool,
        ("distinct pages",), R),
    _bm("check-bm-eviction", "blank pages released to the back", ReleaseAllToBack, ("blank pages",), E),
    _bm("check-bm-eviction", "evicts the most recently freed page", EvictsMostRecent, ("least recently freed",), E),
    _bm("check-bm-eviction", "release forgets the hash", ReleaseForgetsHash, ("keep the page's hash",), E),
    _bm("check-bm-eviction", "cached to the front, blank to the back", ReleaseOrderInverted, ("blank pages",), E),
    _bm("check-bm-eviction", "every freed page to the front", ReleaseAllToFront, ("least recently freed",), E),
    _bm("check-bm-cow", "never copies a shared page", NeverCopies, ("must first copy it",), C),
    _bm("check-bm-cow", "copy keeps the source's reference", CopyKeepsSource, ("release the old page",), C),
    _bm("check-bm-cow", "copy not put in the block table", CopyNotInTable, ("new page in the block table",), C),
    _bm("check-bm-cow", "copies the page before the written one", CopiesPreviousPage,
        ("the one being written",), C),
    _bm("check-bm-cow", "copies a full shared last page", CopiesSharedLastPage, ("full pages stay shared",), C),
    _bm("check-bm-cow", "grows to num_tokens, not computed + num_tokens", GrowsToNumTokens,
        ("num_computed_tokens + num_tokens",), C),
    _sch("check-sched-budget", "budget counted in sequences", "budget in sequences", ("tokens, not sequences",), B),
    _sch("check-sched-budget", "a long prompt never chunked", "never chunks", ("chunked",), B),
    _sch("check-sched-budget", "waiting requests before running ones", "waiting first", ("running sequences first",), B),
    _sch("check-sched-budget", "a running sequence gets one token", "running decode 1", ("continues its prompt",), B),
    _sch("check-sched-budget", "skips ahead of a request that does not fit", "skips ahead", ("no skipping ahead",), B),
    _sch("check-sched-budget", "max_num_seqs ignored", "ignores max_num_seqs", ("max_num_seqs",), B),
    _sch("check-sched-budget", "chunked_prefill=False ignored", "ignores chunked_prefill", ("chunked prefill",), B),
    _sch("check-sched-preemption", "preempts the oldest", "preempt oldest", ("only the newest",), P),
    _sch("check-sched-preemption", "victim requeued at the back", "requeue at back", ("FRONT of the waiting queue",), P),
    _sch("check-sched-preemption", "victim keeps its pages", "victim keeps pages", ("release its pages",), P),
    _sch("check-sched-preemption", "admits in a step that preempted", "admits after preempting",
         ("skip the waiting queue when this step preempted",), P),
    _sch("check-sched-preemption", "never preempts the sequence itself", "never preempt self",
         ("itself the newest",), P),
    Mistake("07/check-decode-hook", "decode-hook", "seq_lens - 1 passed", _hook("length minus one"),
            ("one token short",)),
    Mistake("07/check-decode-hook", "decode-hook", "k and v caches swapped", _hook("k and v swapped"),
            ("swapped",)),
    Mistake("07/check-decode-hook", "decode-hook", "returns lse", _hook("returns lse"), ("not q's shape",)),
    Mistake("07/check-decode-hook", "decode-hook", "forgets to return o", _hook("no return"), ("returned None",)),
    Mistake("07/check-decode-hook", "decode-hook", "o never written", _hook("output never written"),
            ("the o you return",)),
    Mistake("07/check-decode-hook", "decode-hook", "only the first page passed", _hook("first page only"),
            ("every page",)),
]

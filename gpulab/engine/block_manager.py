"""KV pages: who holds which page, which full pages can be shared, and which to evict.

The KV cache is a pool of ``num_blocks`` pages ("blocks") of ``block_size`` tokens
(notebook 05). A sequence's ``block_table`` lists its pages in order; token t lives in
page ``block_table[t // block_size]``, slot ``t % block_size``.

* **Reference counts.** A page may be in several block tables at once (a shared prompt,
  the n completions of one request). ``ref_count`` says how many; a page returns to the
  free pool only when it drops to 0.
* **Prefix caching.** A *full* page's identity is a hash of its tokens chained with the
  hash of the page before it: ``h_i = hash(h_{i-1}, tokens of page i)``. Equal hashes
  mean equal prefixes up to and including that page, so a new request whose prompt
  starts the same way can reuse the pages instead of recomputing them. (A hit also
  compares the token ids, so a hash collision costs a miss, never a wrong answer.)
* **Eviction.** A freed page keeps its hash and contents: it stays findable until it
  is needed for something else. Free pages are handed out least recently used first,
  and blank pages before cached ones; handing out a cached page evicts it.
* **Copy-on-write.** A page shared by several sequences is never written: a sequence
  about to write into a shared, partly filled page first gets its own copy (the
  runner copies the keys and values), then writes there.
* **Never a silent overwrite.** Asking for more pages than are free raises
  :class:`gpulab.paged.OutOfPages`; callers check ``can_allocate``/``can_append`` first.
"""
from __future__ import annotations

from collections import OrderedDict

from ..paged import OutOfPages
from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None           # set once the page is full and registered
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_count}, hash={'-' if self.hash is None else 'yes'})"


def chain_hash(parent_hash: int | None, token_ids) -> int:
    """The prefix-cache key of a full page: its tokens chained with the previous page's key."""
    return hash((-1 if parent_hash is None else parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}        # hash -> block id
        self.cached_free = 0                    # free pages that still carry a hash (kept up to date)
        self.queried_tokens = 0                 # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0                     # ... and found there

    # -- counting ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (blank or cached with no holder)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free pages still findable in the prefix cache (a counter: read every step)."""
        return self.cached_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages that hold the first full pages of ``seq``'s tokens, in order,
        stopping at the first miss. At least one token is always left to compute (its
        logits give the next token), so at most ``(num_tokens - 1) // block_size`` pages."""
        if not self.prefix_caching:
            return []
        # A full page's tokens never change, so its key is computed once and kept in
        # seq.block_hashes, where commit_full_blocks finds it (a 2K-token prompt has 128).
        # A request's time to first token waits for this loop: the pages' token tuples are
        # cut in C (zip over one iterator), and the loop does only the lookups.
        hits, keys, bs, cached, blocks = [], seq.block_hashes, self.block_size, self.cached, self.blocks
        pages = zip(*[iter(seq.token_ids[:(seq.num_tokens - 1) // bs * bs])] * bs)
        for i, tokens in enumerate(pages):
            if i == len(keys):
                keys.append(chain_hash(keys[-1] if keys else None, tokens))
            bid = cached.get(keys[i])
            if bid is None or blocks[bid].token_ids != tokens:
                break
            hits.append(bid)
        return hits

    def take_free_block(self) -> Block:
        """A free page: blank pages first, then the least recently used cached one
        (evicted: its hash is forgotten)."""
        if not self.free:
            raise OutOfPages(f"out of KV pages: all {self.num_blocks} pages are held by running sequences")
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            self.cached_free -= 1
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def share_block(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]               # a cached free page comes back into use
            self.cached_free -= block.hash is not None
        block.ref_count += 1

    def release_block(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise RuntimeError(f"page {bid} released more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None            # most recently used: evicted last
            if block.hash is None:
                self.free.move_to_end(bid, last=False)   # blank: hand out before cached pages
            else:
                self.cached_free += 1

    # -- admission and growth ---------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int], num_tokens: int, keep_free: int = 0) -> bool:
        """Can ``seq`` (holding no pages) get pages for its first ``num_tokens`` tokens,
        reusing the cached pages ``hits``, and leave ``keep_free`` pages free? Reused
        pages that sit in the free pool count against it too."""
        fresh = max(0, self.blocks_for(num_tokens) - len(hits))
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return fresh + revived + keep_free <= len(self.free)

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give ``seq`` the cached pages ``hits`` and fresh pages up to ``num_tokens``
        tokens; the hit tokens count as computed."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds pages")
        if not self.can_allocate(seq, hits, num_tokens):
            raise OutOfPages(f"out of KV pages: sequence {seq.seq_id} needs "
                             f"{self.blocks_for(num_tokens)} pages, {len(self.free)} are free")
        for bid in hits:
            self.share_block(bid)
        seq.block_table = list(hits)
        seq.num_registered_blocks = 0
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached_tokens

    def needs_copy(self, seq: Sequence) -> bool:
        """Will the next write land in a page shared with another sequence?"""
        pos = seq.num_computed_tokens
        i = pos // self.block_size
        return i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Can ``seq`` write ``num_tokens`` more tokens (new pages + a copy on write)?"""
        # called for every running sequence every step: the arithmetic of blocks_for and
        # needs_copy inline (most decode steps need neither a page nor a copy)
        bs, pos, table = self.block_size, seq.num_computed_tokens, seq.block_table
        need = (pos + num_tokens + bs - 1) // bs - len(table)
        i = pos // bs
        copy = i < len(table) and self.blocks[table[i]].ref_count > 1
        return (need <= 0 and not copy) or max(0, need) + copy <= len(self.free)

    def append_slots(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_tokens`` more tokens of ``seq``; returns the page copies
        ``(src, dst)`` the runner must do before writing (copy-on-write)."""
        bs, pos, table = self.block_size, seq.num_computed_tokens, seq.block_table
        i = pos // bs
        if (pos + num_tokens + bs - 1) // bs <= len(table) and (i >= len(table)
                                                                 or self.blocks[table[i]].ref_count <= 1):
            return []                        # room in its own pages already: nothing to do
        if not self.can_append(seq, num_tokens):
            raise OutOfPages(f"out of KV pages: sequence {seq.seq_id} cannot grow by {num_tokens} tokens "
                             f"({len(self.free)} pages free)")
        copies = []
        if self.needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            dst = self.take_free_block().block_id
            self.release_block(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self.blocks_for(seq.num_computed_tokens + num_tokens):
            seq.block_table.append(self.take_free_block().block_id)
        return copies

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the pages that the last step filled completely (their tokens' keys and
        values are now in the cache), so later requests can find them."""
        if not self.prefix_caching:
            return
        bs, full = self.block_size, seq.num_computed_tokens // self.block_size
        if full == seq.num_registered_blocks:
            return                           # no page filled since the last call (most steps)
        # Called for every running sequence every step, so it resumes where it stopped:
        # a full, computed page's tokens never change, so its key is computed once
        # (seq.block_hashes), and pages registered before are not looked at again.
        keys = seq.block_hashes
        while len(keys) < full:
            i = len(keys)
            keys.append(chain_hash(keys[-1] if keys else None, seq.token_ids[i * bs:(i + 1) * bs]))
        first_open = None
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            if keys[i] in self.cached:           # another page holds these tokens: retry later
                first_open = i if first_open is None else first_open
                continue
            block.hash, block.token_ids = keys[i], tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached[keys[i]] = block.block_id
        seq.num_registered_blocks = full if first_open is None else first_open

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s pages (its partial last page included:
        the first write to it copies it)."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already holds pages")
        for bid in parent.block_table:
            self.share_block(bid)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes[:child.num_computed_tokens // self.block_size])
        child.num_registered_blocks = parent.num_registered_blocks

    def free_sequence(self, seq: Sequence) -> None:
        """Release ``seq``'s pages, last page first (so a chain's tail is evicted before
        its head), and forget what was computed."""
        for bid in reversed(seq.block_table):
            self.release_block(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0

    # -- views ------------------------------------------------------------------------------
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def snapshot(self) -> list[str]:
        """Per page: 'used', 'shared' (ref > 1), 'cached' (free, findable) or 'free'."""
        out = []
        for b in self.blocks:
            out.append("shared" if b.ref_count > 1 else "used" if b.ref_count == 1
                       else "cached" if b.hash is not None else "free")
        return out

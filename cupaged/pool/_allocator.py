"""Physical block bookkeeping behind :class:`cupaged.pool.BlockPool`: reference counts, the free
list, the prefix cache (content hash -> block) with its LRU of evictable blocks, and pending
copy-on-write copies.

Every block is in exactly one of four states, which ``check`` verifies:
  * owned   -- ``ref[b] > 0``: in at least one sequence's block table;
  * free    -- ``ref[b] == 0``, holds nothing worth keeping: on the free stack;
  * cached  -- ``ref[b] == 0``, full and hashed: in the LRU, reusable by a prefix hit until a
               fresh block is needed and it is evicted (oldest first);
  * pinned  -- ``ref[b] == 0`` but the source of a copy not yet taken by ``take_pending_copies``:
               handing it out now could make it the destination of another copy in the same
               ``copy_blocks`` launch, whose pairs run in parallel.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class OutOfBlocks(RuntimeError):
    """The pool cannot hold the requested tokens; nothing was changed. A RuntimeError, not a
    MemoryError: the process is fine, the scheduler should preempt a sequence or wait.
    ``needed`` and ``available`` count fresh blocks."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"out of KV cache blocks: the request needs {needed} fresh blocks, "
                         f"{available} are free or evictable")
        self.needed, self.available = needed, available

    def __reduce__(self):  # picklable (e.g. across a worker process) despite the two-argument __init__
        return type(self), (self.needed, self.available)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, np.int32)
        self._stack = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached free blocks, oldest first
        self._pinned: set[int] = set()
        self._key: list = [None] * num_blocks  # prefix-cache key of a hashed block
        self._cache: dict = {}  # key -> block
        self._copies: dict[int, int] = {}  # pending copy-on-write: dst -> src, in order

    @property
    def num_free(self) -> int:
        """Blocks a fresh allocation may take now (free, or cached and evictable)."""
        return len(self._stack) + len(self._lru)

    @property
    def num_cached_free(self) -> int:
        return len(self._lru)

    def is_reclaimable(self, block: int) -> bool:
        """Whether reviving ``block`` by a prefix hit takes it out of the allocatable supply."""
        return block in self._lru

    def check_supply(self, needed: int, revived: int = 0) -> None:
        """Raise OutOfBlocks unless ``needed`` fresh blocks can be taken once ``revived`` cached
        blocks have been claimed by prefix hits."""
        available = self.num_free - revived
        if needed > available:
            raise OutOfBlocks(needed, available)

    def take(self, k: int) -> np.ndarray:
        """``k`` fresh blocks (ref 1): never-cached ones first, then evicting the least recently
        used cached ones. The caller has checked ``k <= num_free``."""
        n = min(k, len(self._stack))
        out = self._stack[len(self._stack) - n:][::-1]
        del self._stack[len(self._stack) - n:]
        for _ in range(k - n):
            block, _ = self._lru.popitem(last=False)
            del self._cache[self._key[block]]
            self._key[block] = None
            out.append(block)
        blocks = np.array(out, np.int64)
        self.ref[blocks] = 1
        return blocks

    def retain(self, blocks) -> None:
        """One more owner for each block (distinct blocks); revives cached or pinned ones."""
        blocks = np.asarray(blocks, np.int64)
        for b in blocks[self.ref[blocks] == 0].tolist():
            if b in self._lru:
                del self._lru[b]
            else:
                self._pinned.remove(b)
        self.ref[blocks] += 1

    def release(self, blocks) -> None:
        """One owner fewer for each block (distinct). Blocks reaching zero are released in the
        order given, so they are evicted in that order: callers pass a table tail first, since a
        prefix hit on a later block needs every earlier one."""
        blocks = np.asarray(blocks, np.int64)
        self.ref[blocks] -= 1
        for b in blocks[self.ref[blocks] == 0].tolist():
            self._copies.pop(b, None)  # its owner is gone: the copy into it is moot
            if b in self._copies.values():
                self._pinned.add(b)
            elif self._key[b] is not None:
                self._lru[b] = None
            else:
                self._stack.append(b)

    def add_copy(self, src: int, dst: int) -> None:
        """Queue a copy-on-write. A source that is itself an untaken destination is resolved to
        that copy's source: both pairs run in one parallel launch, so ``dst`` must not read a
        block another pair is still writing."""
        self._copies[dst] = self._copies.get(src, src)

    def take_pending_copies(self) -> np.ndarray:
        pairs = np.array([(s, d) for d, s in self._copies.items()], np.int64).reshape(-1, 2)
        self._copies.clear()
        for b in sorted(self._pinned):
            if self._key[b] is not None:
                self._lru[b] = None
            else:
                self._stack.append(b)
        self._pinned.clear()
        return pairs

    def lookup(self, key):
        return self._cache.get(key)

    def register(self, block: int, key) -> None:
        """Make a just-filled block findable by its content key; a key already cached keeps its
        first block (the duplicate stays uncached and returns to the free stack when released)."""
        if key not in self._cache:
            self._cache[key] = block
            self._key[block] = key

    def unregister(self, block: int) -> None:
        """Take an owned block out of the prefix cache: its owner is about to change what it holds."""
        key = self._key[block]
        if key is not None:
            del self._cache[key]
            self._key[block] = None

    def is_hashed(self, block: int) -> bool:
        return self._key[block] is not None

    def cached_blocks(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first."""
        return list(self._lru)

    def check(self, owners: np.ndarray) -> list[str]:
        """Descriptions of broken invariants, given each block's owner count from the tables."""
        errors = []
        bad = np.flatnonzero(owners != self.ref)
        if bad.size:
            b = int(bad[0])
            errors.append(f"block {b} has reference count {self.ref[b]} but {owners[b]} owners "
                          f"({bad.size} blocks disagree)")
        groups = {"free stack": self._stack, "cached LRU": list(self._lru), "pinned": sorted(self._pinned)}
        seen: dict[int, str] = {}
        for name, blocks in groups.items():
            for b in blocks:
                if b in seen:
                    errors.append(f"block {b} is both in the {seen[b]} and the {name}")
                seen[b] = name
                if not 0 <= b < self.num_blocks:
                    errors.append(f"{name} holds block {b} outside the pool of {self.num_blocks}")
                elif self.ref[b] != 0:
                    errors.append(f"block {b} is in the {name} but owned (reference count {self.ref[b]})")
        owned = set(np.flatnonzero(self.ref > 0).tolist())
        lost = set(range(self.num_blocks)) - owned - set(seen)
        if lost:
            errors.append(f"{len(lost)} blocks leaked (neither owned nor free), e.g. {min(lost)}")
        for key, b in self._cache.items():
            if self._key[b] != key:
                errors.append(f"prefix cache maps a key to block {b}, which holds another key")
        hashed = sum(k is not None for k in self._key)
        if hashed != len(self._cache):
            errors.append(f"{hashed} blocks carry a key but the prefix cache has {len(self._cache)} entries")
        errors += [f"free-stack block {b} still carries a prefix-cache key" for b in self._stack
                   if self._key[b] is not None]
        errors += [f"cached block {b} has no prefix-cache key" for b in self._lru if self._key[b] is None]
        errors += [f"pinned block {b} is not the source of a pending copy" for b in self._pinned
                   if b not in self._copies.values()]
        for dst, src in self._copies.items():
            if self.ref[dst] == 0:
                errors.append(f"pending copy {src} -> {dst} writes a block nobody owns")
            if src in self._copies:
                errors.append(f"pending copy {src} -> {dst} reads block {src}, which another pair writes")
        return errors

"""Block pool: the host side of a paged KV cache, after vLLM's block manager (PagedAttention).

A sequence's tokens live in fixed-size blocks named by its block table; a token at position p
sits in slot ``table[p // block_size] * block_size + p % block_size``. Blocks are allocated as a
sequence grows, so at most one partly filled block per sequence is wasted. Blocks are reference
counted: ``fork`` shares every block of a sequence (parallel sampling, beam search) and the first
append into a shared, partly filled block gets a private copy (copy-on-write; the copies to run
come from ``take_pending_copies``, for ``cache_ops.copy_blocks``). With prefix caching, full
blocks are found by a hash chained over the token ids of every block up to them, so requests
with a common prompt prefix share its blocks.

Per-sequence state is kept in numpy arrays indexed by a row number, so a decode step
(``plan_decode``) updates only the entries that change and does no per-token Python work.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from cupaged._allocator import BlockAllocator
from cupaged._plan import BatchPlan, PinnedStaging
from cupaged._pool_state import SequenceTable

__all__ = ["BlockPool", "OutOfBlocks", "PoolUsage"]


class OutOfBlocks(RuntimeError):
    """The pool cannot hold the requested tokens; nothing was changed. A RuntimeError (not a
    MemoryError): the process is fine, the scheduler should preempt or wait. ``needed`` and
    ``available`` count fresh blocks."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"out of KV cache blocks: the request needs {needed} fresh blocks, "
                         f"{available} are free or evictable")
        self.needed, self.available = needed, available


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """``waste``: the fraction of slots in blocks in use that hold no token (PagedAttention's
    figure; shared blocks count once). ``blocks_cached``: free blocks kept for prefix hits."""

    num_seqs: int
    blocks_in_use: int
    blocks_cached: int
    tokens_stored: int
    waste: float


@dataclasses.dataclass
class _Request:
    seq_id: object
    num_tokens: int
    token_ids: np.ndarray | None
    row: int | None = None
    hits: list = dataclasses.field(default_factory=list)
    parent_hash: object = None  # chain hash after the prefix hits
    cow: bool = False


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _token_ids(name: str, token_ids) -> np.ndarray:
    a = np.asarray(token_ids)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots shared by any number of sequences
    (any hashable id). ``max_blocks_per_seq`` caps a sequence's table and fixes the width of
    ``plan().block_tables`` (fixed shapes for CUDA-graph capture)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 max_blocks_per_seq: int | None = None):
        if _count("num_blocks", num_blocks) < 1 or _count("block_size", block_size) < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        if max_blocks_per_seq is not None and _count("max_blocks_per_seq", max_blocks_per_seq) < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1 or None, got {max_blocks_per_seq}")
        self._alloc = BlockAllocator(int(num_blocks))
        self._seqs = SequenceTable(int(block_size), max_blocks_per_seq, bool(enable_prefix_caching))
        self._staging = PinnedStaging()

    num_blocks = property(lambda self: self._alloc.num_blocks)
    block_size = property(lambda self: self._seqs.block_size)
    max_blocks_per_seq = property(lambda self: self._seqs.max_blocks)
    enable_prefix_caching = property(lambda self: self._seqs.prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take now: free ones plus cached ones it would evict.
        (Blocks released while a pending copy still reads them count after
        ``take_pending_copies``.)"""
        return self._alloc.num_free

    def __len__(self) -> int:
        return len(self._seqs.rows)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs.rows

    def seq_len(self, seq_id) -> int:
        return int(self._seqs.lens[self._seqs.row(seq_id)])

    def block_table(self, seq_id) -> list[int]:
        s = self._seqs
        row = s.row(seq_id)
        return s.tables[row, :s.nblocks[row]].tolist()

    def num_cached_tokens(self, seq_id) -> int:
        """Tokens of the sequence's first append served by the prefix cache (at most its
        length - 1, so the last prompt token is always computed): the caller skips them."""
        return int(self._seqs.cached[self._seqs.row(seq_id)])

    def take_pending_copies(self) -> np.ndarray:
        """int64 [n, 2] (src, dst) block copies owed to copy-on-write since the last call; run
        them (``cache_ops.copy_blocks``) before this step writes the cache."""
        return self._alloc.take_pending_copies()

    # -- growing sequences ------------------------------------------------------------------

    def append(self, seq_id, num_tokens: int | None = None, *, token_ids=None) -> np.ndarray:
        """Grow ``seq_id`` (created on first use) by ``num_tokens`` or ``len(token_ids)`` tokens;
        return the int64 slot mapping of the new positions, -1 where the prefix cache already
        holds the token. Raises OutOfBlocks (changing nothing) when the pool cannot hold them."""
        if token_ids is None:
            if num_tokens is None:
                raise TypeError("append needs num_tokens or token_ids")
            request = _Request(seq_id, _count("num_tokens", num_tokens), None)
        else:
            ids = _token_ids("token_ids", token_ids)
            if num_tokens is not None and _count("num_tokens", num_tokens) != ids.size:
                raise ValueError(f"num_tokens={num_tokens} disagrees with len(token_ids)={ids.size}")
            request = _Request(seq_id, ids.size, ids)
        return self._apply([request])[0]

    def plan(self, batch) -> BatchPlan:
        """Append to every sequence of ``batch`` -- ``(seq_id, num_new_tokens)`` pairs, or
        ``(seq_id, token_ids)`` to feed the prefix cache -- all or nothing, and return the
        step's index arrays."""
        requests = []
        for i, entry in enumerate(batch):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise TypeError(f"batch[{i}] must be a (seq_id, num_new_tokens) pair, got {entry!r}")
            seq_id, what = entry
            if np.ndim(what) == 0:
                requests.append(_Request(seq_id, _count(f"batch[{i}] num_new_tokens", what), None))
            else:
                ids = _token_ids(f"batch[{i}] token_ids", what)
                requests.append(_Request(seq_id, ids.size, ids))
        slots = self._apply(requests)
        rows = np.array([r.row for r in requests], np.int64)
        q_lens = np.array([r.num_tokens for r in requests], np.int64)
        lens = self._seqs.lens[rows]
        token_starts = np.cumsum(q_lens) - q_lens  # where each sequence's tokens begin in the batch
        positions = np.repeat(lens - q_lens - token_starts, q_lens) + np.arange(q_lens.sum())
        return self._build_plan(rows, lens, q_lens,
                                np.concatenate(slots) if slots else np.zeros(0, np.int64), positions)

    def plan_decode(self, seq_ids, token_ids=None) -> BatchPlan:
        """``plan`` for a decode step, vectorized: one new token for each of ``seq_ids`` (1-D;
        reusing the previous step's ids is cheapest). ``token_ids`` [S] keeps prefix caching fed."""
        s = self._seqs
        rows = s.decode_rows(seq_ids)
        ids = None if token_ids is None else _token_ids("token_ids", token_ids)
        if ids is not None and ids.size != rows.size:
            raise ValueError(f"token_ids must have one id per sequence ({rows.size}), got {ids.size}")
        lens, nblocks = s.lens[rows], s.nblocks[rows]
        offset = lens % s.block_size
        new_block = offset == 0
        last = s.tables[rows, np.maximum(nblocks - 1, 0)].astype(np.int64)
        cow = ~new_block & (self._alloc.ref[last] > 1)
        if cow.any():  # sequential semantics: the last appender into a shared block writes in place
            remaining = {}
            for i in np.flatnonzero(cow).tolist():
                b = int(last[i])
                remaining[b] = remaining.get(b, int(self._alloc.ref[b])) - 1
                cow[i] = remaining[b] >= 1
        grow = np.flatnonzero(new_block)
        if s.max_blocks is not None and grow.size and int(nblocks[grow].max()) >= s.max_blocks:
            i = int(grow[np.argmax(nblocks[grow])])
            raise ValueError(f"sequence {s.seq_id_of(int(rows[i]))!r} would need more than "
                             f"max_blocks_per_seq={s.max_blocks} blocks")
        copy = np.flatnonzero(cow)
        self._check_supply(grow.size + copy.size, 0)
        fresh = self._alloc.take(grow.size + copy.size)
        if grow.size:
            s.ensure_width(int(nblocks[grow].max()) + 1)
            s.tables[rows[grow], nblocks[grow]] = fresh[:grow.size]
            s.nblocks[rows[grow]] += 1
        for i, dst in zip(copy.tolist(), fresh[grow.size:].tolist()):
            self._copy_on_write(int(rows[i]), int(nblocks[i]) - 1, dst)
        s.lens[rows] = lens + 1
        slot_mapping = s.tables[rows, nblocks + new_block - 1].astype(np.int64) * s.block_size + offset
        if s.prefix_caching:
            s.record_decode_tokens(rows, offset, ids, self._alloc)
        return self._build_plan(rows, lens + 1, np.ones(rows.size, np.int64), slot_mapping, lens)

    # -- sharing and freeing ----------------------------------------------------------------

    def fork(self, parent_id, child_id) -> None:
        """``child_id`` shares every block of ``parent_id`` (its tokens so far, no copy)."""
        s = self._seqs
        parent = s.row(parent_id)
        if child_id in s.rows:
            raise ValueError(f"child_id {child_id!r} is already a sequence of the pool")
        child = s.fork_row(parent, child_id)
        self._alloc.retain(s.tables[child, :s.nblocks[child]])

    def free(self, seq_id) -> None:
        """Drop the sequence; its blocks go back to the pool when no other sequence shares them
        (kept for prefix hits when cached, evicted tail first)."""
        s = self._seqs
        row = s.row(seq_id)
        self._alloc.release(s.tables[row, :s.nblocks[row]][::-1].copy())
        s.free_row(seq_id)

    # -- accounting ---------------------------------------------------------------------------

    def usage(self) -> PoolUsage:
        fill = self._seqs.block_fill(self.num_blocks)
        in_use = int((self._alloc.ref > 0).sum())
        stored = int(fill[fill > 0].sum())
        waste = 1.0 - stored / (in_use * self.block_size) if in_use else 0.0
        return PoolUsage(len(self), in_use, self._alloc.num_cached_free, stored, waste)

    def check(self) -> None:
        """Verify every invariant; raise AssertionError describing each broken one."""
        errors = self._seqs.check(self._alloc)
        if errors:
            raise AssertionError("BlockPool invariants broken: " + "; ".join(errors))

    # -- internals ----------------------------------------------------------------------------

    def _check_supply(self, needed: int, revived: int) -> None:
        available = self._alloc.num_free - revived
        if needed > available:
            raise OutOfBlocks(needed, available)

    def _copy_on_write(self, row: int, index: int, dst: int) -> None:
        s = self._seqs
        src = int(s.tables[row, index])
        s.tables[row, index] = dst
        self._alloc.release([src])
        self._alloc.add_copy(src, dst)

    def _apply(self, requests: list[_Request]) -> list[np.ndarray]:
        """Validate and size every request first, then commit them all: a request that does not
        fit changes nothing, for the whole batch."""
        s, bs, ref = self._seqs, self._seqs.block_size, self._alloc.ref
        seen, cow_claims, revived, needed = set(), {}, set(), 0
        for r in requests:
            if r.seq_id in seen:
                raise ValueError(f"seq_id {r.seq_id!r} appears twice in one batch")
            seen.add(r.seq_id)
            r.row = s.rows.get(r.seq_id)
            length = 0 if r.row is None else int(s.lens[r.row])
            have = 0 if r.row is None else int(s.nblocks[r.row])
            blocks = -(-(length + r.num_tokens) // bs)
            if s.max_blocks is not None and blocks > s.max_blocks:
                raise ValueError(f"sequence {r.seq_id!r} would need {blocks} blocks, more than "
                                 f"max_blocks_per_seq={s.max_blocks}")
            if length == 0 and r.token_ids is not None and s.prefix_caching:
                if r.row is None or s.tracked[r.row]:
                    r.hits, r.parent_hash = s.prefix_hits(r.token_ids, self._alloc)
                    revived.update(b for b in r.hits if self._alloc.is_reclaimable(b))
            if r.num_tokens and length % bs:
                last = int(s.tables[r.row, have - 1])
                claims = cow_claims.get(last, 0)
                r.cow = ref[last] - claims > 1
                cow_claims[last] = claims + r.cow
            needed += blocks - have - len(r.hits) + r.cow
        self._check_supply(needed, len(revived))
        for r in requests:
            self._alloc.retain(r.hits)
        return [self._commit(r) for r in requests]

    def _commit(self, r: _Request) -> np.ndarray:
        s, bs = self._seqs, self._seqs.block_size
        if r.row is None:
            r.row = s.new_row(r.seq_id)
        row, hit_tokens = r.row, len(r.hits) * bs
        if r.hits:
            s.ensure_width(len(r.hits))
            s.tables[row, :len(r.hits)] = r.hits
            s.nblocks[row] = len(r.hits)
            s.lens[row] = s.cached[row] = hit_tokens
            s.last_hash[row] = r.parent_hash
        start, have = int(s.lens[row]), int(s.nblocks[row])
        stop = start + r.num_tokens - hit_tokens
        if r.cow:
            self._copy_on_write(row, have - 1, int(self._alloc.take(1)[0]))
        blocks = -(-stop // bs)
        s.ensure_width(blocks)
        s.tables[row, have:blocks] = self._alloc.take(blocks - have)
        s.nblocks[row], s.lens[row] = blocks, stop
        positions = np.arange(start, stop)
        slots = s.tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        if s.prefix_caching:
            s.record_tokens(row, start, None if r.token_ids is None else r.token_ids[hit_tokens:], self._alloc)
        return np.concatenate([np.full(hit_tokens, -1, np.int64), slots]) if hit_tokens else slots

    def _build_plan(self, rows, seq_lens, q_lens, slot_mapping, positions) -> BatchPlan:
        s = self._seqs
        width = s.max_blocks if s.max_blocks is not None else int(s.nblocks[rows].max(initial=0))
        query_start_loc = np.zeros(rows.size + 1, np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        return BatchPlan(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=np.take(s.tables[:, :width], rows, axis=0),
            slot_mapping=slot_mapping,
            positions=positions.astype(np.int64, copy=False),
            max_seq_len=int(seq_lens.max(initial=0)),
            max_query_len=int(q_lens.max(initial=0)),
            _staging=self._staging,
        )

"""Block pool: the host side of a paged KV cache, after vLLM's block manager (PagedAttention).

A sequence's tokens live in fixed-size blocks named by its block table; a token at position p
sits in slot ``table[p // block_size] * block_size + p % block_size``. Blocks are allocated as a
sequence grows, so at most one partly filled block per sequence is wasted. Blocks are reference
counted: ``fork`` shares every block of a sequence (parallel sampling, beam search) and the first
append into a shared, partly filled block gets a private copy (copy-on-write; the copies to run
come from ``take_pending_copies``, for ``cupaged.copy_blocks``). With prefix caching, full
blocks are found by a hash chained over the token ids of every block up to them, so requests
with a common prompt prefix share its blocks.

A step of an engine: ``plan`` (or ``plan_decode``) the batch, run ``take_pending_copies()``
through ``copy_blocks``, then write the step's keys and values with ``reshape_and_cache*`` at
``plan.slot_mapping``; fork and free between steps. Every call either succeeds whole or raises
and changes nothing (``OutOfBlocks`` when the blocks run out: preempt, or wait).

Per-sequence state is kept in numpy arrays indexed by a row number, so a decode step
(``plan_decode``) updates only the entries that change and does no per-sequence Python work.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cupaged._allocator import BlockAllocator, OutOfBlocks
from cupaged._checks import check_bool, check_int
from cupaged._plan import BatchPlan, PinnedStaging
from cupaged._pool_state import SequenceTable

__all__ = ["BlockPool", "OutOfBlocks", "PoolUsage"]


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
    hits: list = dataclasses.field(default_factory=list)  # prefix-cache blocks it starts with
    hit_tokens: int = 0
    parent_hash: object = None  # chain hash after the hits
    cow: bool = False


def _count(name: str, value) -> int:
    return check_int(name, value, 0)


def _token_ids(name: str, token_ids) -> np.ndarray:
    a = np.asarray(token_ids)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def _request(name: str, seq_id, num_tokens, token_ids) -> _Request:
    if token_ids is None:
        if num_tokens is None:
            raise TypeError(f"{name}: give num_tokens or token_ids")
        return _Request(seq_id, _count(f"{name} num_tokens", num_tokens), None)
    ids = _token_ids(f"{name} token_ids", token_ids)
    if num_tokens is not None and _count(f"{name} num_tokens", num_tokens) != ids.size:
        raise ValueError(f"{name}: num_tokens={num_tokens} disagrees with len(token_ids)={ids.size}")
    return _Request(seq_id, ids.size, ids)


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
        self._seqs = SequenceTable(int(block_size), max_blocks_per_seq,
                                   check_bool("enable_prefix_caching", enable_prefix_caching))
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
        """int64 [n, 2] (src, dst) block copies owed to copy-on-write since the last call. Run
        them (``cache_ops.copy_blocks``) before this step writes the cache: a copy carries the
        tokens the sequences shared, and the step's new tokens go on top."""
        return self._alloc.take_pending_copies()

    # -- growing sequences ------------------------------------------------------------------

    def append(self, seq_id, num_tokens: int | None = None, *, token_ids=None) -> np.ndarray:
        """Grow ``seq_id`` (created on first use) by ``num_tokens`` or ``len(token_ids)`` tokens;
        return the int64 slot mapping of the new positions, -1 where the prefix cache already
        holds the token. Raises OutOfBlocks (changing nothing) when the pool cannot hold them."""
        requests = [_request("append", seq_id, num_tokens, token_ids)]
        self._apply(requests)
        return self._token_arrays(requests)[1]

    def plan(self, batch) -> BatchPlan:
        """Append to every sequence of ``batch`` -- ``(seq_id, num_new_tokens)`` pairs, or
        ``(seq_id, token_ids)`` to feed the prefix cache -- all or nothing, and return the
        step's index arrays (sequences in batch order; positions served by the prefix cache
        stay in the batch with slot -1)."""
        requests = []
        for i, entry in enumerate(batch):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise TypeError(f"batch[{i}] must be a (seq_id, num_new_tokens) pair, got {entry!r}")
            seq_id, what = entry
            if isinstance(what, (int, np.integer)) or np.ndim(what) == 0:
                requests.append(_request(f"batch[{i}]", seq_id, what, None))
            else:
                requests.append(_request(f"batch[{i}]", seq_id, None, what))
        self._apply(requests)
        rows, slot_mapping, positions, q_lens = self._token_arrays(requests)
        s = self._seqs
        width = s.max_blocks if s.max_blocks is not None else int(s.nblocks[rows].max(initial=0))
        return self._plan(q_lens, s.lens[rows], np.take(s.tables[:, :width], rows, axis=0),
                          slot_mapping, positions)

    def plan_decode(self, seq_ids, token_ids=None) -> BatchPlan:
        """``plan`` for a decode step, vectorized: one new token for each of ``seq_ids`` (1-D,
        e.g. an int array; repeating the previous step's ids is cheapest). ``token_ids`` [S]:
        the new tokens, which keeps the sequences' future blocks eligible for prefix caching."""
        s = self._seqs
        batch = s.decode_batch(seq_ids)
        ids = None if token_ids is None else _token_ids("token_ids", token_ids)
        if ids is not None and ids.size != batch.rows.size:
            raise ValueError(f"token_ids must hold one id per sequence ({batch.rows.size}), got {ids.size}")
        positions, slot_mapping = batch.step(s, self._alloc, ids)
        return BatchPlan(query_start_loc=np.arange(batch.rows.size + 1, dtype=np.int32),
                         seq_lens=batch.lens.astype(np.int32), block_tables=batch.tables.copy(),
                         slot_mapping=slot_mapping, positions=positions, max_seq_len=batch.max_len,
                         max_query_len=int(batch.rows.size > 0), _staging=self._staging)

    # -- sharing and freeing ----------------------------------------------------------------

    def fork(self, parent_id, child_id) -> None:
        """``child_id`` shares every block of ``parent_id`` (its tokens so far, no copy): parallel
        sampling, beam search. Fork between steps: the child sees the cache as it is once the
        step's copies and writes have run."""
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
        stored = int(fill.sum())
        waste = 1.0 - stored / (in_use * self.block_size) if in_use else 0.0
        return PoolUsage(len(self), in_use, self._alloc.num_cached_free, stored, waste)

    def check(self) -> None:
        """Verify every invariant (reference counts equal owners; free, cached, pinned and owned
        blocks partition the pool; tables, lengths and the prefix cache agree); raise
        AssertionError describing each broken one."""
        errors = self._seqs.check(self._alloc)
        if errors:
            raise AssertionError("BlockPool invariants broken: " + "; ".join(errors))

    # -- internals ----------------------------------------------------------------------------

    def _apply(self, requests: list[_Request]) -> None:
        """Validate and size every request first, then commit them all: a request that does not
        fit changes nothing, for the whole batch. Prefix hits are looked up against the cache as
        it was before the batch, and claimed before any fresh block is taken (which could evict
        them)."""
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
            if length == 0 and r.token_ids is not None and s.prefix_caching and (r.row is None or s.tracked[r.row]):
                r.hits, r.parent_hash = s.prefix_hits(r.token_ids, self._alloc)
                r.hit_tokens = len(r.hits) * bs
                revived.update(b for b in r.hits if self._alloc.is_reclaimable(b))
            if r.num_tokens and length % bs:
                last = int(s.tables[r.row, have - 1])
                claims = cow_claims.get(last, 0)
                r.cow = ref[last] - claims > 1
                cow_claims[last] = claims + r.cow
            needed += blocks - have - len(r.hits) + r.cow
        self._alloc.check_supply(needed, len(revived))
        s.epoch += 1
        for r in requests:
            if r.hits:
                self._alloc.retain(r.hits)
        for r in requests:
            self._commit(r)

    def _commit(self, r: _Request) -> None:
        s, bs = self._seqs, self._seqs.block_size
        if r.row is None:
            r.row = s.new_row(r.seq_id)
        row = r.row
        if r.hits:
            s.ensure_width(len(r.hits))
            s.tables[row, :len(r.hits)] = r.hits
            s.nblocks[row] = len(r.hits)
            s.lens[row] = s.cached[row] = r.hit_tokens
            s.last_hash[row] = r.parent_hash
        start, have = int(s.lens[row]), int(s.nblocks[row])
        stop = start + r.num_tokens - r.hit_tokens
        if r.cow:
            s.copy_on_write(row, have - 1, int(self._alloc.take(1)[0]), self._alloc)
        blocks = -(-stop // bs)
        if blocks > have:
            s.ensure_width(blocks)
            s.tables[row, have:blocks] = self._alloc.take(blocks - have)
            s.nblocks[row] = blocks
        s.lens[row] = stop
        if s.prefix_caching and r.num_tokens:  # an empty append breaks no chain
            s.record_tokens(row, start, None if r.token_ids is None else r.token_ids[r.hit_tokens:], self._alloc)

    def _token_arrays(self, requests):
        """rows [S], slot_mapping [T], positions [T], q_lens [S] of committed requests, for all
        tokens at once (the prefix hits' positions get slot -1)."""
        s, bs = self._seqs, self._seqs.block_size
        rows = np.fromiter((r.row for r in requests), np.int64, len(requests))
        q_lens = np.fromiter((r.num_tokens for r in requests), np.int64, len(requests))
        token_starts = np.cumsum(q_lens) - q_lens  # where each sequence's tokens begin in the batch
        first = s.lens[rows] - q_lens  # position of each sequence's first new token
        positions = np.repeat(first - token_starts, q_lens) + np.arange(q_lens.sum())
        token_rows = np.repeat(rows, q_lens)
        slot_mapping = s.tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        if any(r.hits for r in requests):
            hit_tokens = np.fromiter((r.hit_tokens for r in requests), np.int64, len(requests))
            slot_mapping[positions < np.repeat(first + hit_tokens, q_lens)] = -1
        return rows, slot_mapping, positions, q_lens

    def _plan(self, q_lens, seq_lens, block_tables, slot_mapping, positions) -> BatchPlan:
        query_start_loc = np.zeros(q_lens.size + 1, np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        return BatchPlan(query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32),
                         block_tables=block_tables, slot_mapping=slot_mapping, positions=positions,
                         max_seq_len=int(seq_lens.max(initial=0)), max_query_len=int(q_lens.max(initial=0)),
                         _staging=self._staging)

"""``BlockPool``: the pool's public face. It owns a :class:`BlockAllocator` (physical blocks),
a :class:`SequenceTable` (per-sequence rows) and the pinned staging its plans upload from; the
append transaction is in ``_append.py``, the vectorized decode step in ``_decode_step.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cupaged._checks import check_bool, check_int
from cupaged.pool import _append
from cupaged.pool._allocator import BlockAllocator
from cupaged.pool._batch_plan import BatchPlan, PinnedStaging, shared_prefix_blocks
from cupaged.pool._sequence_table import SequenceTable, check_hashable

__all__ = ["BlockPool", "PoolUsage"]

_MAX_BLOCKS = 2**31 - 1  # block tables are int32


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """``waste``: the fraction of slots in blocks in use that hold no token (PagedAttention's
    figure; shared blocks count once). ``blocks_cached``: free blocks kept for prefix hits."""

    num_seqs: int
    blocks_in_use: int
    blocks_cached: int
    tokens_stored: int
    waste: float


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots shared by any number of sequences
    (any hashable id). ``max_blocks_per_seq`` caps a sequence's table and fixes the width of
    ``plan().block_tables`` (fixed shapes for CUDA-graph capture)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 max_blocks_per_seq: int | None = None):
        if _append.count("num_blocks", num_blocks) < 1 or _append.count("block_size", block_size) < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        if num_blocks > _MAX_BLOCKS:
            raise ValueError(f"num_blocks must be <= {_MAX_BLOCKS} (block tables hold int32 block ids), "
                             f"got {num_blocks}")
        if max_blocks_per_seq is not None and _append.count("max_blocks_per_seq", max_blocks_per_seq) < 1:
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
        try:
            return seq_id in self._seqs.rows
        except TypeError:
            check_hashable("seq_id", seq_id)
            raise

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

    def cached_prefix_len(self, token_ids) -> int:
        """How many leading tokens of a new sequence starting with ``token_ids`` the prefix cache
        holds now (full blocks, leaving the last token to compute): what ``num_cached_tokens``
        would say after a first append of ``token_ids``. Changes nothing; a scheduler sizes a
        prefill chunk by it, as vLLM's scheduler counts computed blocks before budgeting."""
        ids = _append.token_id_array("token_ids", token_ids)
        if not self._seqs.prefix_caching:
            return 0
        return len(self._seqs.prefix_hits(ids, self._alloc)[0]) * self.block_size

    def take_pending_copies(self) -> np.ndarray:
        """int64 [n, 2] (src, dst) block copies owed to copy-on-write since the last call. Run
        them (``cupaged.copy_blocks``) before this step writes the cache: a copy carries the
        tokens the sequences shared, and the step's new tokens go on top."""
        return self._alloc.take_pending_copies()

    # -- growing sequences ------------------------------------------------------------------

    def append(self, seq_id, num_tokens: int | None = None, *, token_ids=None) -> np.ndarray:
        """Grow ``seq_id`` (created on first use) by ``num_tokens`` or ``len(token_ids)`` tokens;
        return the int64 slot mapping of the new positions, -1 where the prefix cache already
        holds the token. Raises OutOfBlocks (changing nothing) when the pool cannot hold them."""
        requests = [_append.request("append", seq_id, num_tokens, token_ids)]
        _append.apply(self._seqs, self._alloc, requests)
        return _append.token_arrays(self._seqs, requests)[1]

    def plan(self, batch) -> BatchPlan:
        """Append to every sequence of ``batch`` -- ``(seq_id, num_new_tokens)`` pairs, or
        ``(seq_id, token_ids)`` to feed the prefix cache -- all or nothing, and return the
        step's index arrays (sequences in batch order; positions served by the prefix cache
        stay in the batch with slot -1)."""
        requests = _append.batch_requests(batch)
        _append.apply(self._seqs, self._alloc, requests)
        rows, slot_mapping, positions, q_lens = _append.token_arrays(self._seqs, requests)
        s = self._seqs
        width = s.max_blocks if s.max_blocks is not None else int(s.nblocks[rows].max(initial=0))
        return self._plan(q_lens, s.lens[rows], np.take(s.tables[:, :width], rows, axis=0),
                          slot_mapping, positions, tuple(r.seq_id for r in requests))

    def plan_decode(self, seq_ids, token_ids=None) -> BatchPlan:
        """``plan`` for a decode step, vectorized: one new token for each of ``seq_ids`` (1-D,
        e.g. an int array; repeating the previous step's ids is cheapest). ``token_ids`` [S]:
        the new tokens, which keeps the sequences' future blocks eligible for prefix caching."""
        s = self._seqs
        batch = s.decode_batch(seq_ids)
        ids = None if token_ids is None else _append.token_id_array("token_ids", token_ids)
        if ids is not None and ids.size != batch.rows.size:
            raise ValueError(f"token_ids must hold one id per sequence ({batch.rows.size}), got {ids.size}")
        positions, slot_mapping = batch.step(s, self._alloc, ids)
        return BatchPlan(query_start_loc=np.arange(batch.rows.size + 1, dtype=np.int32),
                         seq_lens=batch.lens.astype(np.int32), block_tables=batch.tables.copy(),
                         slot_mapping=slot_mapping, positions=positions, max_seq_len=batch.max_len,
                         max_query_len=int(batch.rows.size > 0), seq_ids=batch.ids.copy(), block_size=s.block_size,
                         shared_prefix_blocks=shared_prefix_blocks(batch.tables, batch.lens, 1, s.block_size),
                         _staging=self._staging)

    # -- sharing and freeing ----------------------------------------------------------------

    def fork(self, parent_id, child_id) -> None:
        """``child_id`` shares every block of ``parent_id`` (its tokens so far, no copy): parallel
        sampling, beam search. Fork between steps: the child sees the cache as it is once the
        step's copies and writes have run."""
        s = self._seqs
        parent = s.row(parent_id, "parent_id")
        check_hashable("child_id", child_id)
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

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq_id`` and drop the rest: speculative decoding gives back
        the slots of rejected draft tokens. Blocks past the kept tokens are released (tail first). What the dropped
        tokens held is not trusted: blocks they filled that only this sequence holds leave the prefix cache, and
        when a full block is cut the sequence stops feeding the prefix cache (the pool keeps no chain hashes of
        earlier blocks to resume from). A cut inside a block another sequence shares is a ValueError, as is
        ``num_tokens`` past the sequence's length; either changes nothing."""
        s, alloc, bs = self._seqs, self._alloc, self.block_size
        row = s.row(seq_id)
        length = int(s.lens[row])
        keep = check_int("num_tokens", num_tokens, 0, length)
        kept_blocks, have = -(-keep // bs), int(s.nblocks[row])
        blocks = s.tables[row, :have].astype(np.int64)
        if keep % bs and keep < length and alloc.ref[blocks[kept_blocks - 1]] > 1:
            raise ValueError(f"truncate: position {keep} of sequence {seq_id!r} is inside block "
                             f"{blocks[kept_blocks - 1]}, which another sequence shares")
        if keep == length:
            return
        touched = blocks[kept_blocks - 1 if keep % bs else kept_blocks:]
        for b in touched[alloc.ref[touched] == 1].tolist():
            alloc.unregister(b)
        alloc.release(blocks[kept_blocks:][::-1].copy())
        s.tables[row, kept_blocks:have] = 0
        s.nblocks[row], s.lens[row] = kept_blocks, keep
        s.cached[row] = min(int(s.cached[row]), max(keep - 1, 0))
        if keep // bs < length // bs:
            s.tracked[row] = False
        s.epoch += 1

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

    def _plan(self, q_lens, seq_lens, block_tables, slot_mapping, positions, seq_ids) -> BatchPlan:
        query_start_loc = np.zeros(q_lens.size + 1, np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        return BatchPlan(query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32),
                         block_tables=block_tables, slot_mapping=slot_mapping, positions=positions,
                         max_seq_len=int(seq_lens.max(initial=0)), max_query_len=int(q_lens.max(initial=0)),
                         seq_ids=seq_ids, block_size=self.block_size,
                         shared_prefix_blocks=shared_prefix_blocks(block_tables, seq_lens, q_lens, self.block_size),
                         _staging=self._staging)

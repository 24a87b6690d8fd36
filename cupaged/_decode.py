"""The vectorized decode step of :meth:`cupaged.pool.BlockPool.plan_decode`.

A decode step appends one token to each of S sequences and must hand the kernels a fresh
``[S, max_blocks]`` block table. Gathering it from the per-row tables every step costs a strided
copy of every row; instead :class:`DecodeBatch` keeps the batch's rows in batch order (tables,
lengths, last block ids) between steps, patches only the entries a step changes (about S /
block_size new blocks, plus copy-on-write), and returns one contiguous copy. It is valid while
the same ids come back and nothing else touched the pool (``SequenceTable.epoch``).
"""

from __future__ import annotations

import numpy as np


class DecodeBatch:
    def __init__(self, seqs, ids: np.ndarray, rows: np.ndarray):
        self.ids, self.rows, self.epoch = ids, rows, seqs.epoch
        self.lens = seqs.lens[rows]
        self.nblocks = seqs.nblocks[rows]
        width = seqs.max_blocks if seqs.max_blocks is not None else int(self.nblocks.max(initial=0))
        self.tables = np.ascontiguousarray(seqs.tables[rows, :width])  # [S, width], 0-padded
        self.last = self.tables[np.arange(rows.size), np.maximum(self.nblocks - 1, 0)].astype(np.int64)

    def matches(self, seqs, ids: np.ndarray) -> bool:
        prev = self.ids
        return (self.epoch == seqs.epoch and prev.shape == ids.shape and prev.dtype == ids.dtype
                and np.array_equal(prev, ids))

    def step(self, seqs, alloc, token_ids) -> tuple[np.ndarray, np.ndarray]:
        """Append one token to every sequence: (positions, slot_mapping), both int64 [S]."""
        bs = seqs.block_size
        offset = self.lens % bs
        new_block = offset == 0
        cow = alloc.ref[self.last] > 1
        cow &= ~new_block
        if cow.any():  # sequential semantics: the last appender into a shared block writes in place
            remaining = {}
            for i in np.flatnonzero(cow).tolist():
                b = int(self.last[i])
                remaining[b] = remaining.get(b, int(alloc.ref[b])) - 1
                cow[i] = remaining[b] >= 1
        grow, copy = np.flatnonzero(new_block), np.flatnonzero(cow)
        if seqs.max_blocks is not None and grow.size and int(self.nblocks[grow].max()) >= seqs.max_blocks:
            i = int(grow[np.argmax(self.nblocks[grow])])
            raise ValueError(f"sequence {seqs.seq_id_of(int(self.rows[i]))!r} would need more than "
                             f"max_blocks_per_seq={seqs.max_blocks} blocks")
        alloc.check_supply(grow.size + copy.size)
        if grow.size:
            fresh, cols = alloc.take(grow.size), self.nblocks[grow]
            width = int(cols.max()) + 1
            if width > self.tables.shape[1]:
                tables = np.zeros((self.rows.size, width), np.int32)
                tables[:, :self.tables.shape[1]] = self.tables
                self.tables = tables
            seqs.ensure_width(width)
            self.tables[grow, cols] = fresh
            seqs.tables[self.rows[grow], cols] = fresh
            self.nblocks[grow] += 1
            seqs.nblocks[self.rows[grow]] = self.nblocks[grow]
            self.last[grow] = fresh
        if copy.size:
            for i, dst in zip(copy.tolist(), alloc.take(copy.size).tolist()):
                index = int(self.nblocks[i]) - 1
                seqs.copy_on_write(int(self.rows[i]), index, dst, alloc)
                self.tables[i, index] = self.last[i] = dst
        positions = self.lens.copy()
        slot_mapping = self.last * bs + offset
        self.lens += 1
        seqs.lens[self.rows] = self.lens
        if seqs.prefix_caching:
            seqs.record_decode_tokens(self.rows, offset, token_ids, alloc)
        return positions, slot_mapping

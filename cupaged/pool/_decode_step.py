"""The vectorized decode step of :meth:`cupaged.pool.BlockPool.plan_decode`.

A decode step appends one token to each of S sequences and must hand the kernels a fresh
``[S, max_blocks]`` block table. Gathering it from the per-row tables every step costs a strided
copy of every row plus a dozen gathers; instead :class:`DecodeBatch` keeps the batch's state in
batch order between steps (tables, lengths, the next slot of each sequence), patches only what a
step changes -- about S / block_size new blocks -- and returns one contiguous copy of the tables.
Which sequences cross a block boundary at step j is known in advance (length + j ≡ 0 mod
block_size), so a step does no search. The mirror is valid while the same ids come back and
nothing else touched the pool (``SequenceTable.epoch``): every other change rebuilds it.
"""

from __future__ import annotations

import numpy as np


class DecodeBatch:
    def __init__(self, seqs, ids: np.ndarray, rows: np.ndarray):
        bs = seqs.block_size
        self.ids, self.id_bytes, self.rows, self.epoch = ids, ids.tobytes(), rows, seqs.epoch
        self.lens = seqs.lens[rows]
        self.nblocks = seqs.nblocks[rows]
        width = seqs.max_blocks if seqs.max_blocks is not None else int(self.nblocks.max(initial=0))
        self.tables = np.ascontiguousarray(seqs.tables[rows, :width])  # [S, width], 0-padded
        offset = self.lens % bs
        last = seqs.tables[rows, np.maximum(self.nblocks - 1, 0)].astype(np.int64)  # (width may be 0)
        self.next_slot = last * bs + offset  # stale where offset == 0: set when the block is taken
        due = (-self.lens) % bs  # step (mod block_size) at which each sequence needs a new block
        order = np.argsort(due, kind="stable")
        bounds = np.searchsorted(due[order], np.arange(bs + 1))
        self.due = [order[bounds[j]:bounds[j + 1]] for j in range(bs)]
        self.step_index = 0
        self.max_len = int(self.lens.max(initial=0))
        # Only fork/free/append (which rebuild the mirror) make a last block shared; after one
        # step every sequence of the batch owns its last block, so later steps skip the check.
        self.may_share = True

    def matches(self, seqs, ids: np.ndarray) -> bool:
        return (self.epoch == seqs.epoch and ids.shape == self.ids.shape and ids.dtype == self.ids.dtype
                and ids.tobytes() == self.id_bytes)

    def step(self, seqs, alloc, token_ids) -> tuple[np.ndarray, np.ndarray]:
        """Append one token to every sequence: (positions, slot_mapping), both int64 [S]."""
        bs = seqs.block_size
        grow = self.due[self.step_index % bs]
        copy = self._copy_on_write_rows(alloc) if self.may_share else ()
        cols = self.nblocks[grow]
        if grow.size and seqs.max_blocks is not None and int(cols.max()) >= seqs.max_blocks:
            i = int(grow[np.argmax(cols)])
            raise ValueError(f"sequence {seqs.seq_id_of(int(self.rows[i]))!r} would need more than "
                             f"max_blocks_per_seq={seqs.max_blocks} blocks")
        alloc.check_supply(grow.size + len(copy))
        if grow.size:
            fresh, grow_rows = alloc.take(grow.size), self.rows[grow]
            if seqs.max_blocks is None:
                width = int(cols.max()) + 1
                if width > self.tables.shape[1]:
                    tables = np.zeros((self.rows.size, width), np.int32)
                    tables[:, :self.tables.shape[1]] = self.tables
                    self.tables = tables
                    seqs.ensure_width(width)
            self.tables[grow, cols] = fresh
            seqs.tables[grow_rows, cols] = fresh
            cols += 1
            self.nblocks[grow] = cols
            seqs.nblocks[grow_rows] = cols
            self.next_slot[grow] = fresh * bs
        for i, dst in zip(copy, alloc.take(len(copy)).tolist()):
            index = int(self.nblocks[i]) - 1
            seqs.copy_on_write(int(self.rows[i]), index, dst, alloc)
            self.tables[i, index] = dst
            self.next_slot[i] = dst * bs + int(self.lens[i]) % bs
        self.may_share = False
        if seqs.prefix_caching:
            completing = self.due[(self.step_index + 1) % bs]  # offset bs - 1: the block fills
            seqs.record_decode_tokens(self.rows, self.lens % bs, token_ids, completing,
                                      self.next_slot[completing] // bs, alloc)
        positions, slot_mapping = self.lens.copy(), self.next_slot.copy()
        self.lens += 1
        self.next_slot += 1
        self.max_len += bool(self.rows.size)
        self.step_index += 1
        seqs.lens[self.rows] = self.lens
        return positions, slot_mapping

    def _copy_on_write_rows(self, alloc) -> list[int]:
        """Batch indices appending into a shared, partly filled last block. Sequential
        semantics: of k sharers in the batch, the last one to append writes in place."""
        bs, out, remaining = len(self.due), [], {}
        partial = np.flatnonzero(self.lens % bs)
        last = (self.next_slot[partial] - self.lens[partial] % bs) // bs
        for i, b in zip(partial[alloc.ref[last] > 1].tolist(), last[alloc.ref[last] > 1].tolist()):
            remaining[b] = remaining.get(b, int(alloc.ref[b])) - 1
            if remaining[b] >= 1:
                out.append(i)
        return out

"""Per-sequence state of a :class:`cupaged.pool.BlockPool`, one numpy row per live sequence.

Rows, not Python objects, so that a decode step gathers and updates whole columns at once: the
block tables stay materialised as one int32 matrix whose unused entries are 0, so a step copies
out the batch's rows instead of rebuilding them. For prefix caching a row also keeps the chain
hash of its last full block and the token ids of its partly filled one; ``tracked`` turns off for
good once tokens arrive without ids, since no later block of that sequence can then be named.
"""

from __future__ import annotations

import numpy as np

from cupaged.pool._decode_step import DecodeBatch

_ROWS = 8


def check_hashable(name: str, seq_id) -> None:
    """Sequence ids are dict keys: an unhashable one is a TypeError naming the argument."""
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"{name} must be hashable, got {type(seq_id).__name__} {seq_id!r}") from None


def _grown(a: np.ndarray, rows: int, width: int | None = None) -> np.ndarray:
    out = np.zeros((rows,) + ((width,) if width is not None else a.shape[1:]), a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


class SequenceTable:
    def __init__(self, block_size: int, max_blocks: int | None, prefix_caching: bool):
        self.block_size, self.max_blocks, self.prefix_caching = block_size, max_blocks, prefix_caching
        self.rows: dict = {}  # seq_id -> row
        self._ids: list = [None] * _ROWS  # row -> seq_id
        self._free_rows = list(range(_ROWS - 1, -1, -1))
        self.tables = np.zeros((_ROWS, max_blocks or 8), np.int32)
        self.nblocks = np.zeros(_ROWS, np.int64)
        self.lens = np.zeros(_ROWS, np.int64)
        self.cached = np.zeros(_ROWS, np.int64)  # num_cached_tokens
        self.tracked = np.zeros(_ROWS, bool)
        self.last_hash: list = [None] * _ROWS
        self.partial = np.zeros((_ROWS, block_size), np.int64)
        self.epoch = 0  # bumped by every change outside a decode step: invalidates the DecodeBatch
        self._decode: DecodeBatch | None = None

    # -- rows ---------------------------------------------------------------------------------

    def row(self, seq_id, name: str = "seq_id") -> int:
        try:
            return self.rows[seq_id]
        except KeyError:
            raise KeyError(f"seq_id {seq_id!r} is not a sequence of the pool") from None
        except TypeError:
            check_hashable(name, seq_id)
            raise

    def seq_id_of(self, row: int):
        return self._ids[row]

    def new_row(self, seq_id) -> int:
        if not self._free_rows:
            cap = len(self._ids)
            for name in ("tables", "nblocks", "lens", "cached", "tracked", "partial"):
                setattr(self, name, _grown(getattr(self, name), 2 * cap))
            self._ids += [None] * cap
            self.last_hash += [None] * cap
            self._free_rows = list(range(2 * cap - 1, cap - 1, -1))
        row = self._free_rows.pop()
        self.epoch += 1
        self.rows[seq_id], self._ids[row] = row, seq_id
        self.tracked[row] = True
        return row

    def fork_row(self, parent: int, child_id) -> int:
        row = self.new_row(child_id)
        for a in (self.tables, self.nblocks, self.lens, self.cached, self.tracked, self.partial):
            a[row] = a[parent]
        self.last_hash[row] = self.last_hash[parent]
        return row

    def free_row(self, seq_id) -> None:
        row = self.rows.pop(seq_id)
        for a in (self.tables, self.nblocks, self.lens, self.cached, self.tracked, self.partial):
            a[row] = 0
        self._ids[row] = self.last_hash[row] = None
        self._free_rows.append(row)
        self.epoch += 1

    def ensure_width(self, width: int) -> None:
        if width > self.tables.shape[1]:
            self.tables = _grown(self.tables, self.tables.shape[0], max(width, 2 * self.tables.shape[1]))

    def copy_on_write(self, row: int, index: int, dst: int, alloc) -> None:
        """Give ``row`` the private block ``dst`` in place of its shared block at ``index``."""
        src = int(self.tables[row, index])
        self.tables[row, index] = dst
        alloc.release([src])
        alloc.add_copy(src, dst)

    def decode_batch(self, seq_ids) -> DecodeBatch:
        """The batch-ordered mirror of ``seq_ids`` (1-D, distinct, all known), reused while the
        same ids come back and nothing else changed the pool."""
        ids = np.asarray(seq_ids)
        if ids.ndim != 1:
            raise ValueError(f"seq_ids must be 1-D, got shape {ids.shape}")
        if self._decode is not None and self._decode.matches(self, ids):
            return self._decode
        rows = np.fromiter((self.row(x, "each of seq_ids") for x in ids.tolist()), np.int64, ids.size)
        if np.unique(rows).size != rows.size:
            _, first, counts = np.unique(rows, return_index=True, return_counts=True)
            raise ValueError(f"seq_ids holds {ids[first[np.argmax(counts > 1)]]!r} more than once")
        self._decode = DecodeBatch(self, ids.copy(), rows)
        return self._decode

    # -- prefix caching -----------------------------------------------------------------------

    def prefix_hits(self, token_ids: np.ndarray, alloc) -> tuple[list[int], object]:
        """Cached blocks for the longest cached prefix of a new sequence, leaving at least its
        last token to compute (its logits are needed); and the chain hash after them."""
        bs, parent, hits = self.block_size, None, []
        full = (token_ids.size - 1) // bs
        for chunk in token_ids[:full * bs].reshape(full, bs).tolist():
            key = (parent, tuple(chunk))
            block = alloc.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits, parent

    def record_tokens(self, row: int, start: int, token_ids, alloc) -> None:
        """Hash and cache the blocks that tokens from position ``start`` on complete."""
        if token_ids is None:
            self.tracked[row] = False
        if not self.tracked[row]:
            return
        bs = self.block_size
        pending = np.concatenate([self.partial[row, :start % bs], token_ids])
        full, parent = pending.size // bs, self.last_hash[row]
        blocks = self.tables[row, start // bs:start // bs + full].tolist()
        for block, chunk in zip(blocks, pending[:full * bs].reshape(full, bs).tolist()):
            key = (parent, tuple(chunk))
            alloc.register(block, key)
            parent = hash(key)
        self.last_hash[row] = parent
        rest = pending[full * bs:]
        self.partial[row, :rest.size] = rest

    def record_decode_tokens(self, rows, offsets, token_ids, completing, blocks, alloc) -> None:
        """``record_tokens`` for one new token per row (``rows[i]`` at ``offsets[i]`` of its last
        block); ``rows[completing]`` fill their last block, ``blocks``, and hash it."""
        if token_ids is None:
            self.tracked[rows] = False
            return
        tracked = self.tracked[rows]
        if tracked.all():
            self.partial[rows, offsets] = token_ids
        else:
            self.partial[rows[tracked], offsets[tracked]] = token_ids[tracked]
            completing, blocks = completing[tracked[completing]], blocks[tracked[completing]]
        done = rows[completing]
        for row, block, chunk in zip(done.tolist(), blocks.tolist(), self.partial[done].tolist()):
            key = (self.last_hash[row], tuple(chunk))
            alloc.register(block, key)
            self.last_hash[row] = hash(key)

    # -- accounting and invariants ------------------------------------------------------------

    def entries(self):
        """(row, block, fill) of every block-table entry of every live sequence."""
        live = np.array(sorted(self.rows.values()), np.int64)
        nb, lens = self.nblocks[live], self.lens[live]
        cols = np.arange(self.tables.shape[1])
        used = cols < nb[:, None]
        fill = np.where(cols == nb[:, None] - 1, (lens - (nb - 1) * self.block_size)[:, None], self.block_size)
        return np.broadcast_to(live[:, None], used.shape)[used], self.tables[live][used].astype(np.int64), fill[used]

    def block_fill(self, num_blocks: int) -> np.ndarray:
        """Tokens held by each block (the owners of a shared block agree on it)."""
        fill = np.zeros(num_blocks, np.int64)
        _, blocks, fills = self.entries()
        np.maximum.at(fill, blocks, fills)
        return fill

    def check(self, alloc) -> list[str]:
        errors, bs = [], self.block_size
        live = sorted(self.rows.values())
        if len(set(live)) != len(live) or set(live) & set(self._free_rows) or \
                len(live) + len(self._free_rows) != len(self._ids) or len(set(self._free_rows)) != len(self._free_rows):
            errors.append("sequence rows are shared, lost or both live and free")
        errors += [f"row {r} of {s!r} is labelled {self._ids[r]!r}" for s, r in self.rows.items() if self._ids[r] != s]
        for seq_id, r in self.rows.items():
            if self.nblocks[r] != -(-self.lens[r] // bs):
                errors.append(f"{seq_id!r} holds {self.lens[r]} tokens in {self.nblocks[r]} blocks of {bs}")
            if self.max_blocks is not None and self.nblocks[r] > self.max_blocks:
                errors.append(f"{seq_id!r} has {self.nblocks[r]} blocks, over max_blocks_per_seq")
            if self.cached[r] > max(self.lens[r] - 1, 0):
                errors.append(f"{seq_id!r} has {self.cached[r]} cached tokens of {self.lens[r]}")
            if np.unique(self.tables[r, :self.nblocks[r]]).size != self.nblocks[r]:
                errors.append(f"{seq_id!r} lists a block twice in its table")
        cols = np.arange(self.tables.shape[1])
        padding = cols >= self.nblocks[:, None]
        if (self.tables[padding] != 0).any() or self.lens[self._free_rows].any():
            errors.append("block-table padding (or a free row) is not all 0")
        rows, blocks, fills = self.entries()
        if blocks.size and (blocks.min() < 0 or blocks.max() >= alloc.num_blocks):
            return errors + [f"a block table holds a block outside 0..{alloc.num_blocks - 1}"]
        errors += alloc.check(np.bincount(blocks, minlength=alloc.num_blocks))
        low, high = np.full(alloc.num_blocks, bs + 1), np.zeros(alloc.num_blocks, np.int64)
        np.minimum.at(low, blocks, fills)
        np.maximum.at(high, blocks, fills)
        errors += [f"shared block {b} holds {low[b]} tokens for one owner and {high[b]} for another"
                   for b in np.flatnonzero((high > 0) & (low != high)).tolist()]
        for r, b, f in zip(rows.tolist(), blocks.tolist(), fills.tolist()):
            if f < bs and alloc.is_hashed(b):
                errors.append(f"partly filled block {b} of {self._ids[r]!r} is in the prefix cache "
                              "(a later append would change cached content)")
        return errors

"""Appending tokens to a batch of sequences, all or nothing: :meth:`BlockPool.append` and
:meth:`BlockPool.plan` parse their arguments into requests, size every request against the pool
before anything changes (blocks to allocate, prefix-cache hits, copy-on-write of a shared last
block), then commit them all, and derive the step's per-token index arrays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cupaged._checks import check_int
from cupaged.pool._sequence_table import check_hashable


@dataclasses.dataclass
class Request:
    seq_id: object
    num_tokens: int
    token_ids: np.ndarray | None
    row: int | None = None
    hits: list = dataclasses.field(default_factory=list)  # prefix-cache blocks it starts with
    hit_tokens: int = 0
    parent_hash: object = None  # chain hash after the hits
    cow: bool = False


def count(name: str, value) -> int:
    return check_int(name, value, 0)


def token_id_array(name: str, token_ids) -> np.ndarray:
    a = np.asarray(token_ids)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def request(name: str, seq_id, num_tokens, token_ids) -> Request:
    check_hashable(f"{name} seq_id", seq_id)
    if token_ids is None:
        if num_tokens is None:
            raise TypeError(f"{name}: give num_tokens or token_ids")
        return Request(seq_id, count(f"{name} num_tokens", num_tokens), None)
    ids = token_id_array(f"{name} token_ids", token_ids)
    if num_tokens is not None and count(f"{name} num_tokens", num_tokens) != ids.size:
        raise ValueError(f"{name}: num_tokens={num_tokens} disagrees with len(token_ids)={ids.size}")
    return Request(seq_id, ids.size, ids)


def batch_requests(batch) -> list[Request]:
    """``plan``'s batch: ``(seq_id, num_new_tokens)`` or ``(seq_id, token_ids)`` pairs."""
    requests = []
    for i, entry in enumerate(batch):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"batch[{i}] must be a (seq_id, num_new_tokens) pair, got {entry!r}")
        seq_id, what = entry
        if isinstance(what, (int, np.integer)) or np.ndim(what) == 0:
            requests.append(request(f"batch[{i}]", seq_id, what, None))
        else:
            requests.append(request(f"batch[{i}]", seq_id, None, what))
    return requests


def apply(seqs, alloc, requests: list[Request]) -> None:
    """Validate and size every request first, then commit them all: a request that does not
    fit changes nothing, for the whole batch. Prefix hits are looked up against the cache as
    it was before the batch, and claimed before any fresh block is taken (which could evict
    them)."""
    s, bs, ref = seqs, seqs.block_size, alloc.ref
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
            r.hits, r.parent_hash = s.prefix_hits(r.token_ids, alloc)
            r.hit_tokens = len(r.hits) * bs
            revived.update(b for b in r.hits if alloc.is_reclaimable(b))
        if r.num_tokens and length % bs:
            last = int(s.tables[r.row, have - 1])
            claims = cow_claims.get(last, 0)
            r.cow = ref[last] - claims > 1
            cow_claims[last] = claims + r.cow
        needed += blocks - have - len(r.hits) + r.cow
    alloc.check_supply(needed, len(revived))
    s.epoch += 1
    for r in requests:
        if r.hits:
            alloc.retain(r.hits)
    for r in requests:
        _commit(s, alloc, r)


def _commit(s, alloc, r: Request) -> None:
    bs = s.block_size
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
        s.copy_on_write(row, have - 1, int(alloc.take(1)[0]), alloc)
    blocks = -(-stop // bs)
    if blocks > have:
        s.ensure_width(blocks)
        s.tables[row, have:blocks] = alloc.take(blocks - have)
        s.nblocks[row] = blocks
    s.lens[row] = stop
    if s.prefix_caching and r.num_tokens:  # an empty append breaks no chain
        s.record_tokens(row, start, None if r.token_ids is None else r.token_ids[r.hit_tokens:], alloc)


def token_arrays(s, requests: list[Request]):
    """rows [S], slot_mapping [T], positions [T], q_lens [S] of committed requests, for all
    tokens at once (the prefix hits' positions get slot -1)."""
    bs = s.block_size
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

"""References of the cache reads and block moves (cupaged/cache_gather.py): gathers of a sequence's
rows through its block table, block copies within a cache and swaps between caches."""

from __future__ import annotations

import numpy as np

from cupaged.reference.fp8 import dequantize_fp8


def _positions(cu_seq_lens, seq_starts, seqs, tokens):
    cu = np.asarray(cu_seq_lens).astype(np.int64)
    pos = tokens - cu[seqs]
    if seq_starts is not None:
        pos = pos + np.asarray(seq_starts).astype(np.int64)[seqs]
    return pos


def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                   kv_cache_dtype="auto", scale=1.0, seq_starts=None):
    """Return a copy of dst with row t = cache row of token t (dequantized to dst's dtype); tokens at or
    past their sequence's end, or whose position runs past the block-table row, are skipped (vLLM)."""
    dst = np.array(dst, copy=True)
    tokens = np.arange(int(num_tokens))
    seqs = np.asarray(token_to_seq).astype(np.int64)[:num_tokens]
    live = tokens < np.asarray(cu_seq_lens).astype(np.int64)[seqs + 1]
    tokens, seqs = tokens[live], seqs[live]
    pos = _positions(cu_seq_lens, seq_starts, seqs, tokens)
    block_size = src_cache.shape[1]
    inside = pos // block_size < np.asarray(block_table).shape[1]
    tokens, seqs, pos = tokens[inside], seqs[inside], pos[inside]
    rows = np.asarray(src_cache)[np.asarray(block_table)[seqs, pos // block_size], pos % block_size]
    if kv_cache_dtype != "auto":
        rows = dequantize_fp8(rows, scale, kv_cache_dtype)
    dst[tokens] = rows.astype(dst.dtype)
    return dst


def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None):
    """Return a copy of dst with every token of the first batch_size sequences gathered."""
    dst = np.array(dst, copy=True)
    cu = np.asarray(cu_seq_lens).astype(np.int64)
    block_size = src_cache.shape[1]
    for b in range(int(batch_size)):
        tokens = np.arange(cu[b], cu[b + 1])
        pos = _positions(cu_seq_lens, seq_starts, np.full(tokens.shape, b), tokens)
        dst[tokens] = np.asarray(src_cache)[np.asarray(block_table)[b, pos // block_size], pos % block_size]
    return dst


def copy_blocks(key_caches, value_caches, block_mapping):
    """Return copies of every cache with cache[dst] = cache[src] for each (src, dst) pair."""
    out = [np.array(c, copy=True) for c in list(key_caches) + list(value_caches or [])]
    for src, dst in np.asarray(block_mapping).reshape(-1, 2):
        for cache in out:
            cache[dst] = cache[src]
    n = len(key_caches)
    return out[:n], (out[n:] if value_caches is not None else None)


def swap_blocks(src, dst, block_mapping):
    dst = np.array(dst, copy=True)
    for s, d in np.asarray(block_mapping).reshape(-1, 2):
        dst[d] = np.asarray(src)[s]
    return dst

"""Each op's declared minimum memory traffic and FLOPs: what the traffic ratios and % of peak are
measured against (the profiler's tables, the H200 model, the benches' rows).

Attention reads the K/V bytes of the keys some query of a sequence can see, once per KV head per
sequence (every query head of a GQA group shares them), plus q, out, LSE, the block-table entries of
those keys and the per-sequence lengths; its FLOPs are 2·(head_size + v_head_size) per visible
(query head, key) pair (q·k and p·v; the softmax's exponentials are not counted). Streaming ops
(cache writes, merges) move every byte they must read and write once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Cost", "attention_cost", "visible_pairs"]


@dataclasses.dataclass(frozen=True)
class Cost:
    """An op's declared minimum global-memory bytes and FLOPs."""

    min_bytes: int
    flops: int


def _window_sum(lo: np.ndarray, hi: np.ndarray, window: int) -> np.ndarray:
    """Σ_{p=lo}^{hi} min(p + 1, window) per element (window 0: no cap), for lo <= hi + 1."""
    def upto(x):  # Σ_{p=0}^{x-1} min(p + 1, W)
        if not window:
            return x * (x + 1) // 2
        capped = np.minimum(x, window)
        return capped * (capped + 1) // 2 + (x - capped) * window
    return upto(hi + 1) - upto(lo)


def visible_pairs(seq_lens, q_lens, causal: bool, window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(distinct visible keys per sequence, Σ over its queries of the keys each sees). Queries are
    bottom-right aligned: query i of a sequence of q_len n sits at position seq_len - n + i."""
    seq_lens = np.asarray(seq_lens, np.int64)
    q_lens = np.asarray(q_lens, np.int64)
    if not causal:
        return seq_lens, q_lens * seq_lens
    first = seq_lens - q_lens  # position of the first query
    pairs = _window_sum(first, seq_lens - 1, window)
    keys = seq_lens - (np.maximum(first - window + 1, 0) if window else 0)
    return np.where(q_lens > 0, keys, 0), np.where(q_lens > 0, pairs, 0)


def attention_cost(seq_lens, q_lens, *, num_heads: int, num_kv_heads: int, head_size: int, v_head_size: int,
                   kv_itemsize: int, q_itemsize: int, out_itemsize: int, block_size: int | None, causal: bool,
                   window: int = 0, lse: bool = False, shared_kv: bool = False, query_start_loc: bool = True) -> Cost:
    """Paged (block_size) or dense (block_size None) attention of one batch; ``shared_kv``: MLA,
    where a key's value is part of its latent row (read once); ``query_start_loc``: whether the call
    reads one (decode does not)."""
    keys, pairs = visible_pairs(seq_lens, q_lens, causal, window)
    tokens = int(np.sum(q_lens))
    row_bytes = head_size if shared_kv else head_size + v_head_size
    kv = int(keys.sum()) * num_kv_heads * row_bytes * kv_itemsize
    io = tokens * num_heads * (head_size * q_itemsize + v_head_size * out_itemsize + (4 if lse else 0))
    tables = 4 * int(np.sum(-(-np.asarray(seq_lens, np.int64) // block_size))) if block_size else 0
    seqs = len(np.atleast_1d(seq_lens))
    lengths = 4 * (seqs + (seqs + 1 if query_start_loc else 0))
    flops = 2 * (head_size + v_head_size) * num_heads * int(pairs.sum())
    return Cost(kv + io + tables + lengths, flops)

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


def visible_pairs(seq_lens, q_lens, window=(-1, 0)) -> tuple[np.ndarray, np.ndarray]:
    """(distinct visible keys per sequence, Σ over its queries of the keys each sees). Queries are
    bottom-right aligned: query i of a sequence of q_len n sits at position seq_len - n + i and sees keys
    position - left .. position + right of ``window`` (left, right), -1 unbounded: (-1, 0) is causal."""
    left, right = window
    keys, pairs = [], []
    for length, n in zip(np.atleast_1d(np.asarray(seq_lens, np.int64)), np.atleast_1d(np.asarray(q_lens, np.int64))):
        pos = length - n + np.arange(n)
        lo = np.maximum(pos - left, 0) if left >= 0 else np.zeros_like(pos)
        hi = np.minimum(pos + right, length - 1) if right >= 0 else np.full_like(pos, length - 1)
        seen = hi >= lo
        pairs.append(int(np.sum(hi - lo + 1, where=seen)))
        keys.append(int(hi[seen].max() - lo[seen].min() + 1) if seen.any() else 0)
    return np.array(keys, np.int64), np.array(pairs, np.int64)


def attention_cost(seq_lens, q_lens, *, num_heads: int, num_kv_heads: int, head_size: int, v_head_size: int,
                   kv_itemsize: int, q_itemsize: int, out_itemsize: int, block_size: int | None,
                   causal: bool = True, window=None, lse: bool = False, shared_kv: bool = False,
                   query_start_loc: bool = True) -> Cost:
    """Paged (block_size) or dense (block_size None) attention of one batch; ``window``: (left, right) as
    visible_pairs takes it (None: causal or not, no window); ``shared_kv``: MLA, where a key's value is part of its
    latent row (read once); ``query_start_loc``: whether the call reads one (decode does not)."""
    keys, pairs = visible_pairs(seq_lens, q_lens, window if window is not None else (-1, 0 if causal else -1))
    tokens = int(np.sum(q_lens))
    row_bytes = head_size if shared_kv else head_size + v_head_size
    kv = int(keys.sum()) * num_kv_heads * row_bytes * kv_itemsize
    io = tokens * num_heads * (head_size * q_itemsize + v_head_size * out_itemsize + (4 if lse else 0))
    tables = 4 * int(np.sum(-(-np.asarray(seq_lens, np.int64) // block_size))) if block_size else 0
    seqs = len(np.atleast_1d(seq_lens))
    lengths = 4 * (seqs + (seqs + 1 if query_start_loc else 0))
    flops = 2 * (head_size + v_head_size) * num_heads * int(pairs.sum())
    return Cost(kv + io + tables + lengths, flops)

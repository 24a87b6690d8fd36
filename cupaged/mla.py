"""MLA (DeepSeek multi-head latent attention): decode over the latent paged cache, and the
chunked-context prefill driver composing gather, up-projection, varlen attention and LSE merges."""

from __future__ import annotations

import numpy as np

from cupaged._attention_args import check_out, check_q, check_tables
from cupaged._cache_args import cache_dtype, host_copy
from cupaged._checks import address, check_last_contiguous, check_ndim, element_strides, validate_enabled
from cupaged._runtime import array_module
from cupaged.paged_attention import MLA_BUCKET, ROWS, _validate_contents, choose_split, launch

__all__ = ["mla_decode"]


def mla_decode(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank=512, scale, kv_cache_dtype="auto", k_scale=1.0,
               kv_split_size=None, max_seq_len=None, out=None, return_lse=False, validate=None):
    """Decode attention of absorbed queries ``q`` ``[num_seqs, num_heads, kv_lora_rank + rope_dim]``
    over the latent cache ``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: the key
    is the whole latent row, the value its first ``kv_lora_rank`` entries (FlashMLA / vLLM MLA
    decode). All query heads share the one latent head; 16 heads per CTA, the CTAs of one split
    adjacent so they share the cache bytes in L2. Split-KV with an LSE merge for long contexts (a
    fixed ``kv_split_size`` is batch-invariant); fp8 caches (uint8) with one ``k_scale``.
    Returns out ``[num_seqs, num_heads, kv_lora_rank]`` (and LSE ``[num_heads, num_seqs]``)."""
    xp = array_module(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    check_ndim("q", q, 3, "[num_seqs, num_heads, kv_lora_rank + rope_dim]")
    num_seqs, num_heads, head_size = q.shape
    if head_size > MLA_BUCKET[0] or not 0 < kv_lora_rank <= min(MLA_BUCKET[1], head_size):
        raise NotImplementedError(f"kv_lora_rank={kv_lora_rank} with q's head size {head_size}: MLA decode supports "
                                  f"latent rows up to {MLA_BUCKET[0]} and kv_lora_rank up to {MLA_BUCKET[1]}")
    check_q(q[:, :, :1])  # dtype, contiguity, head count
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, kv_lora_rank + rope_dim]")
    want = cache_dtype(kv_cache_dtype, q.dtype)
    if kv_cache.dtype != want:
        raise TypeError(f"kv_cache must have dtype {want} for q {q.dtype} and kv_cache_dtype={kv_cache_dtype!r}, "
                        f"got {kv_cache.dtype}")
    if kv_cache.shape[2] != head_size:
        raise ValueError(f"kv_cache rows must have q's head size {head_size}, got shape {tuple(kv_cache.shape)}")
    check_last_contiguous("kv_cache", kv_cache)
    if hasattr(k_scale, "size") and k_scale.size != 1:
        raise ValueError(f"k_scale must be one value (the latent cache has one head), got {k_scale.size}")
    check_tables(block_tables, seq_lens, None, num_seqs)
    out = check_out(out, q, "out", shape=(num_seqs, num_heads, kv_lora_rank))
    lse = xp.empty((num_heads, num_seqs), np.float32) if return_lse else None
    if validate_enabled(validate):
        _validate_contents(block_tables, seq_lens, None, kv_cache.shape[0], kv_cache.shape[1], num_seqs)
    if num_seqs == 0:
        return (out, lse) if return_lse else out
    s = element_strides("kv_cache", kv_cache)
    x = 16 // kv_cache.itemsize
    vec = int(address(kv_cache) % 16 == 0 and s[0] % x == 0 and s[1] % x == 0)
    caches = dict(kv_heads=1, block_size=kv_cache.shape[1], vec_k=vec, vec_v=0, k_block_stride=s[0],
                  k_head_stride=0, k_chunk_stride=x, k_page_stride=s[1], v_block_stride=s[0], v_head_stride=0,
                  v_page_stride=s[1], v_dim_stride=1)
    tiles = -(-num_heads // ROWS)
    max_kv = int(max_seq_len or block_tables.shape[1] * kv_cache.shape[1])
    split = int(kv_split_size) if kv_split_size is not None else choose_split(xp, num_seqs * tiles, max_kv)
    if split < 0 or (kv_split_size is not None and split < 1):
        raise ValueError(f"kv_split_size must be None or >= 1, got {kv_split_size}")
    max_splits = max(1, -(-max_kv // split)) if split else 1
    launch(xp, q, kv_cache, kv_cache, caches, block_tables, seq_lens, None, out, lse, scale=float(scale), causal=True,
           window=0, sinks=None, alibi=None, softcap=None, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
           v_scale=k_scale, kv_split_size=split if max_splits > 1 else 0, max_splits=max_splits, tiles=tiles, mla=True)
    return (out, lse) if return_lse else out

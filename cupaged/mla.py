"""MLA (DeepSeek multi-head latent attention): decode over the latent paged cache, and the
chunked-context prefill driver composing gather, up-projection, varlen attention and LSE merges."""

from __future__ import annotations

import numpy as np

from cupaged._attention_args import check_out, check_q, check_tables
from cupaged._cache_args import cache_dtype, host_copy, scale_args
from cupaged._checks import address, check_last_contiguous, check_ndim, element_strides, validate_enabled
from cupaged._runtime import array_module
from cupaged.paged_attention import MLA_BUCKET, ROWS, _validate_contents, choose_split, launch

__all__ = ["mla_decode", "mla_chunked_prefill"]


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


def mla_chunked_prefill(q, k_new, v_new, kv_cache, block_tables, cu_seqlens_q, context_lens, up_proj, *,
                        workspace_tokens=8192, scale=None, kv_cache_dtype="auto", k_scale=1.0, workspace=None,
                        out=None, return_lse=False):
    """MLA prefill of new tokens over an already cached latent context, in bounded memory.

    q ``[total_q, num_heads, qk_head_size]``; k_new / v_new ``[total_q, num_kv_heads, qk /
    v_head_size]`` (the new tokens, already up-projected); kv_cache ``[num_blocks, block_size,
    latent]`` holds each sequence's ``context_lens[b]`` cached tokens (host int array; the chunk plan
    is made on the host) through ``block_tables``. For each chunk of at most ``workspace_tokens``
    context tokens (over the whole batch): ``gather_and_maybe_dequant_cache`` into the workspace
    ``[workspace_tokens, latent]`` (q's dtype; allocated when not given), ``up_proj(latent_rows) ->
    (k, v)`` (caller-supplied: no weights live in cupaged), non-causal ``varlen_attention`` with LSE,
    merged into the running state with ``merge_attn_states``; finally causal attention over the new
    tokens, merged last. Returns out ``[total_q, num_heads, v_head_size]`` (and LSE)."""
    from cupaged.cache_gather import gather_and_maybe_dequant_cache
    from cupaged.merge_attn_states import merge_attn_states
    from cupaged.varlen_attention import varlen_attention

    xp = array_module(q=q, k_new=k_new, v_new=v_new, kv_cache=kv_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, out=out, workspace=workspace)
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, latent]")
    contexts = host_copy(context_lens).astype(np.int64).reshape(-1)
    batch = cu_seqlens_q.shape[0] - 1
    if contexts.shape[0] != batch or (contexts.size and contexts.min() < 0):
        raise ValueError(f"context_lens must hold batch={batch} values >= 0, got {contexts.shape[0]}")
    if int(workspace_tokens) < 1:
        raise ValueError(f"workspace_tokens must be >= 1, got {workspace_tokens}")
    scale_args("k_scale", k_scale, xp, kv_cache_dtype, None)  # checked up front, even with no context
    latent, block_size = kv_cache.shape[2], kv_cache.shape[1]
    if workspace is None:
        workspace = xp.empty((int(workspace_tokens), latent), q.dtype)
    elif workspace.ndim != 2 or workspace.shape[1] != latent or workspace.dtype != q.dtype:
        raise ValueError(f"workspace must be [workspace_tokens, {latent}] of q's dtype {q.dtype}, got "
                         f"{workspace.dtype} {tuple(workspace.shape)}")
    chunk = max(1, workspace.shape[0] // max(batch, 1))
    chunk = chunk // block_size * block_size or chunk  # whole blocks per sequence when the workspace allows
    state = None
    for start in range(0, int(contexts.max(initial=0)), chunk):
        lens = np.clip(contexts - start, 0, chunk)
        cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        token_to_seq = np.repeat(np.arange(batch, dtype=np.int32), lens)
        n = int(cu_k[-1])
        rows = workspace[:n]
        gather_and_maybe_dequant_cache(kv_cache, rows, block_tables, xp.asarray(cu_k), xp.asarray(token_to_seq), n,
                                       kv_cache_dtype, k_scale, xp.asarray(np.full(batch, start, np.int32)))
        k_c, v_c = up_proj(rows)
        part = varlen_attention(q, k_c, v_c, cu_seqlens_q, xp.asarray(cu_k), scale=scale, causal=False,
                                max_seqlen_k=chunk, return_lse=True)
        state = part if state is None else _merge(merge_attn_states, xp, state, part)
    new = varlen_attention(q, k_new, v_new, cu_seqlens_q, cu_seqlens_q, scale=scale, causal=True,
                           out=out if state is None else None, return_lse=True)
    if state is not None:
        new = _merge(merge_attn_states, xp, state, new, out=out)
    return new if return_lse else new[0]


def _merge(merge_attn_states, xp, prefix, suffix, out=None):
    output = xp.empty_like(prefix[0]) if out is None else out
    output_lse = xp.empty_like(prefix[1])
    merge_attn_states(output, prefix[0], prefix[1], suffix[0], suffix[1], output_lse)
    return output, output_lse

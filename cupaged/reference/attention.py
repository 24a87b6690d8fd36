"""References of attention (kernels_cu/paged_attention.cu): paged attention over flash (NHD/HND) and
vLLM caches, vLLM's v1 output and v2 partitions, FlashAttention varlen and MLA decode. Each gathers a
sequence's K/V densely (dense_kv) and runs a two-pass softmax (attention_rows) in float64."""

from __future__ import annotations

import numpy as np

from cupaged.reference.fp8 import dequantize_fp8


def dense_kv(key_cache, value_cache, block_table_row, seq_len, *, layout="NHD", kv_cache_dtype="auto",
             k_scale=1.0, v_scale=1.0):
    """The first seq_len keys and values of one sequence as float64 [seq_len, num_kv_heads, head_size]."""
    seq_len = int(seq_len)
    key_cache, value_cache = np.asarray(key_cache), np.asarray(value_cache)
    block_size = {"NHD": key_cache.shape[1], "HND": key_cache.shape[2], "vllm": key_cache.shape[3]}[layout]
    ids = np.asarray(block_table_row)[:-(-seq_len // block_size)].astype(np.int64)
    k, v = key_cache[ids], value_cache[ids]
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    elif layout == "vllm":  # K [n, H, D/x, bs, x] -> [n, bs, H, D]; V [n, H, D, bs] -> [n, bs, H, D]
        n, h, chunks, bs, x = k.shape
        k = k.transpose(0, 3, 1, 2, 4).reshape(n, bs, h, chunks * x)
        v = v.transpose(0, 3, 1, 2)
    k = k.reshape(-1, *k.shape[2:])[:seq_len]
    v = v.reshape(-1, *v.shape[2:])[:seq_len]
    if kv_cache_dtype != "auto":
        k = dequantize_fp8(k, np.asarray(k_scale, np.float32).reshape(-1)[:, None], kv_cache_dtype)
        v = dequantize_fp8(v, np.asarray(v_scale, np.float32).reshape(-1)[:, None], kv_cache_dtype)
    return k.astype(np.float64), v.astype(np.float64)


def attention_rows(q, k, v, positions, *, scale, causal=True, sliding_window=None, window_size=None, sink=None,
                   alibi_slope=None, softcap=None, key_offset=0, mask=None):
    """Two-pass softmax attention of query rows q [n, D] at ``positions`` over keys k/v [L, D]
    (key j at position key_offset + j). ``window_size`` (left, right): FlashAttention's window, a query at p
    sees keys p - left .. p + right, -1 unbounded. ``mask`` (bool [n, L]): row i sees key j only where
    mask[i, j], AND-ed with the causal / window masks. Returns (out [n, Dv] float64, lse [n] float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    key_pos = key_offset + np.arange(k.shape[0])
    pos = np.asarray(positions)[:, None]
    visible = np.ones((q.shape[0], k.shape[0]), bool)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != bool or mask.shape != visible.shape:
            raise ValueError(f"mask must be bool {visible.shape}, got {mask.dtype} {mask.shape}")
        visible &= mask
    if causal:
        visible &= key_pos[None, :] <= pos
    if sliding_window:
        visible &= key_pos[None, :] > pos - sliding_window
    left, right = window_size if window_size is not None else (-1, -1)
    if left >= 0:
        visible &= key_pos[None, :] >= pos - left
    if right >= 0:
        visible &= key_pos[None, :] <= pos + right
    with np.errstate(invalid="ignore", over="ignore"):
        logits = scale * (q @ np.where(visible.any(axis=0)[:, None], k, 0.0).T)
        if softcap:
            logits = softcap * np.tanh(logits / softcap)
        if alibi_slope is not None:
            logits = logits - alibi_slope * np.abs(key_pos[None, :] - pos)
    logits = np.where(visible, logits, -np.inf)
    sink = -np.inf if sink is None else float(sink)
    m = np.maximum(logits.max(axis=1, initial=-np.inf), sink)  # pass 1: the row maximum
    finite = np.isfinite(m)
    m_safe = np.where(finite, m, 0.0)
    w = np.where(visible, np.exp(logits - m_safe[:, None]), 0.0)  # pass 2: weights, then their sum
    denom = w.sum(axis=1) + (np.exp(sink - m_safe) if np.isfinite(sink) else 0.0)
    out = w @ np.where(visible.any(axis=0)[:, None], v, 0.0)
    ok = denom > 0
    out = np.where(ok[:, None], out / np.where(ok, denom, 1.0)[:, None], 0.0)
    lse = np.where(ok, m_safe + np.log(np.where(ok, denom, 1.0)), -np.inf)
    return out, lse


def unpack_custom_mask(custom_mask, mask_indptr, q_lens, kv_lens):
    """FlashInfer's custom mask as one bool [q_lens[s], kv_lens[s]] array per request. Request s's mask is
    its q_len x kv_len matrix, row-major flattened, the requests' segments concatenated. ``custom_mask`` is
    bool (unpacked; mask_indptr [num_seqs + 1] in elements) or uint8 bit-packed little-endian per request
    (each segment starts on a byte; bit b of byte i of a segment is element 8i + b; mask_indptr in bytes).
    mask_indptr None: the segments packed back to back (ceil(q_len * kv_len / 8) bytes each when uint8)."""
    custom_mask = np.asarray(custom_mask).reshape(-1)
    q_lens = np.asarray(q_lens).astype(np.int64).reshape(-1)
    kv_lens = np.asarray(kv_lens).astype(np.int64).reshape(-1)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"q_lens {q_lens.shape} and kv_lens {kv_lens.shape} differ")
    sizes = q_lens * kv_lens
    if custom_mask.dtype == bool:
        packed = False
        seg = sizes
    elif custom_mask.dtype == np.uint8:
        packed = True
        seg = (sizes + 7) // 8
    else:
        raise TypeError(f"custom_mask must be bool or uint8, got {custom_mask.dtype}")
    if mask_indptr is None:
        indptr = np.concatenate([[0], np.cumsum(seg)]).astype(np.int64)
    else:
        indptr = np.asarray(mask_indptr).astype(np.int64).reshape(-1)
        if indptr.shape != (len(sizes) + 1,):
            raise ValueError(f"mask_indptr must have {len(sizes) + 1} entries, got {indptr.shape}")
    masks = []
    for s in range(len(sizes)):
        lo, hi = int(indptr[s]), int(indptr[s + 1])
        if hi - lo < seg[s] or lo < 0 or hi > custom_mask.size:
            raise ValueError(f"request {s}: mask segment [{lo}, {hi}) of a {custom_mask.size}-entry custom_mask "
                             f"cannot hold {sizes[s]} elements")
        part = custom_mask[lo:hi]
        bits = np.unpackbits(part, bitorder="little").astype(bool) if packed else part
        masks.append(bits[:sizes[s]].reshape(q_lens[s], kv_lens[s]).copy())
    return masks


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    causal=True, sliding_window=None, window_size=None, sinks=None, alibi_slopes=None, softcap=None,
                    kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, layout="NHD", custom_mask=None,
                    mask_indptr=None):
    """(out [num_tokens, num_heads, head_size] float64, lse [num_heads, num_tokens] float64): gather
    each sequence's K/V densely, then attention_rows per head. Positions are bottom-right aligned.
    ``custom_mask`` / ``mask_indptr``: FlashInfer's per-request q_len x kv_len mask (see unpack_custom_mask),
    AND-ed with the causal / window masks."""
    q = np.asarray(q)
    num_tokens, num_heads, head_size = q.shape
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    qsl = np.arange(len(seq_lens) + 1) if query_start_loc is None else np.asarray(query_start_loc).astype(np.int64)
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    masks = (None if custom_mask is None
             else unpack_custom_mask(custom_mask, mask_indptr, np.diff(qsl)[:len(seq_lens)], seq_lens))
    out = np.zeros((num_tokens, num_heads, head_size))
    lse = np.full((num_heads, num_tokens), -np.inf)
    for s, seq_len in enumerate(seq_lens):
        t0, t1 = qsl[s], qsl[s + 1]
        k, v = dense_kv(key_cache, value_cache, np.asarray(block_tables)[s], seq_len, layout=layout,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        group = num_heads // k.shape[1]
        positions = seq_len - (t1 - t0) + np.arange(t1 - t0)
        for h in range(num_heads):
            o, l = attention_rows(q[t0:t1, h], k[:, h // group], v[:, h // group], positions, scale=scale,
                                  causal=causal, sliding_window=sliding_window, window_size=window_size,
                                  sink=None if sinks is None else np.asarray(sinks)[h],
                                  alibi_slope=None if alibi_slopes is None else np.asarray(alibi_slopes)[h],
                                  softcap=softcap, mask=None if masks is None else masks[s])
            out[t0:t1, h], lse[h, t0:t1] = o, l
    return out, lse


def cascade_attention(q, key_cache, value_cache, shared_levels, block_tables, seq_lens, query_start_loc=None, *,
                      scale=None, causal=True, sinks=None, softcap=None, kv_cache_dtype="auto", k_scale=1.0,
                      v_scale=1.0, layout="NHD"):
    """(out, lse) float64 of cascade attention: each request's context gathered densely as its groups' shared keys,
    level by level ((group_start_loc, block_tables, kv_lens) each), then its own seq_lens[s] keys; then
    attention_rows over that whole context, the queries at its end (causal over the whole context)."""
    q = np.asarray(q)
    num_tokens, num_heads, head_size = q.shape
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    qsl = np.arange(len(seq_lens) + 1) if query_start_loc is None else np.asarray(query_start_loc).astype(np.int64)
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    gather = dict(layout=layout, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    out, lse = np.zeros((num_tokens, num_heads, head_size)), np.full((num_heads, num_tokens), -np.inf)
    for s, own in enumerate(seq_lens):
        parts = []
        for starts, tables, lens in shared_levels:
            g = int(np.searchsorted(np.asarray(starts), s, side="right")) - 1  # the group holding request s
            parts.append(dense_kv(key_cache, value_cache, np.asarray(tables)[g], np.asarray(lens)[g], **gather))
        parts.append(dense_kv(key_cache, value_cache, np.asarray(block_tables)[s], own, **gather))
        k, v = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        t0, t1 = qsl[s], qsl[s + 1]
        positions = k.shape[0] - (t1 - t0) + np.arange(t1 - t0)
        group = num_heads // k.shape[1]
        for h in range(num_heads):
            o, l = attention_rows(q[t0:t1, h], k[:, h // group], v[:, h // group], positions, scale=scale,
                                  causal=causal, sink=None if sinks is None else np.asarray(sinks)[h], softcap=softcap)
            out[t0:t1, h], lse[h, t0:t1] = o, l
    return out, lse


def paged_attention_v1(query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                       alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """vLLM's v1 semantics (decode, vLLM cache layout): the output as float64."""
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale,
                           alibi_slopes=alibi_slopes, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                           v_scale=v_scale, layout="vllm")[0]


def paged_attention_v2_partitions(query, key_cache, value_cache, scale, block_tables, seq_lens, max_num_partitions,
                                  alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                                  partition_size=512):
    """vLLM v2's per-partition values: (exp_sums, max_logits) [num_seqs, num_heads, partitions] and
    tmp_output [..., head_size], float64; partitions at or past ceil(seq_len / 512) stay NaN."""
    query = np.asarray(query)
    num_seqs, num_heads, head_size = query.shape
    exp_sums = np.full((num_seqs, num_heads, max_num_partitions), np.nan)
    max_logits = np.full_like(exp_sums, np.nan)
    tmp = np.full((num_seqs, num_heads, max_num_partitions, head_size), np.nan)
    for s, seq_len in enumerate(np.asarray(seq_lens).astype(np.int64)):
        k, v = dense_kv(key_cache, value_cache, np.asarray(block_tables)[s], seq_len, layout="vllm",
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        group = num_heads // k.shape[1]
        for p in range(-(-seq_len // partition_size)):
            lo, hi = p * partition_size, min(seq_len, (p + 1) * partition_size)
            for h in range(num_heads):
                logits = scale * (k[lo:hi, h // group] @ query[s, h].astype(np.float64))
                if alibi_slopes is not None:
                    logits = logits + np.asarray(alibi_slopes)[h] * (np.arange(lo, hi) - (seq_len - 1))
                m = logits.max()
                w = np.exp(logits - m)
                max_logits[s, h, p], exp_sums[s, h, p] = m, w.sum()
                tmp[s, h, p] = w @ v[lo:hi, h // group] / w.sum()
    return exp_sums, max_logits, tmp


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=True, window_size=None, softcap=None,
                     alibi_slopes=None, sinks=None, seqused_k=None):
    """FlashAttention varlen semantics (bottom-right alignment against each sequence's key count, which is
    ``seqused_k[b]`` when given): (out float64 [total_q, num_heads, v_head_size], lse float64 [num_heads, total_q])."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    total_q, num_heads, _ = q.shape
    scale = 1.0 / np.sqrt(q.shape[2]) if scale is None else scale
    cq, ck = np.asarray(cu_seqlens_q).astype(np.int64), np.asarray(cu_seqlens_k).astype(np.int64)
    out = np.zeros((total_q, num_heads, v.shape[2]))
    lse = np.full((num_heads, total_q), -np.inf)
    group = num_heads // k.shape[1]
    for b in range(len(cq) - 1):
        q0, q1, k0 = cq[b], cq[b + 1], ck[b]
        k1 = ck[b + 1] if seqused_k is None else k0 + int(np.asarray(seqused_k)[b])
        positions = (k1 - k0) - (q1 - q0) + np.arange(q1 - q0)
        for h in range(num_heads):
            o, l = attention_rows(q[q0:q1, h], k[k0:k1, h // group], v[k0:k1, h // group], positions, scale=scale,
                                  causal=causal, window_size=window_size, softcap=softcap,
                                  sink=None if sinks is None else np.asarray(sinks)[h],
                                  alibi_slope=None if alibi_slopes is None else np.asarray(alibi_slopes)[h])
            out[q0:q1, h], lse[h, q0:q1] = o, l
    return out, lse


def mla_decode(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank=512, scale, kv_cache_dtype="auto", k_scale=1.0):
    """MLA decode over the latent cache [num_blocks, block_size, kv_lora_rank + rope_dim]: K is the
    whole latent row, V its first kv_lora_rank entries. (out float64 [num_seqs, num_heads,
    kv_lora_rank], lse float64 [num_heads, num_seqs])."""
    q = np.asarray(q)
    num_seqs, num_heads, _ = q.shape
    out = np.zeros((num_seqs, num_heads, kv_lora_rank))
    lse = np.full((num_heads, num_seqs), -np.inf)
    cache = np.asarray(kv_cache)
    for s, seq_len in enumerate(np.asarray(seq_lens).astype(np.int64)):
        k, _ = dense_kv(cache[:, :, None, :], cache[:, :, None, :], np.asarray(block_tables)[s], seq_len,
                        kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=k_scale)
        k = k[:, 0]
        o, l = attention_rows(q[s], k, k[:, :kv_lora_rank], np.full(num_heads, seq_len - 1), scale=scale)
        out[s], lse[:, s] = o, l
    return out, lse

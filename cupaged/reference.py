"""numpy references: the oracle of every test (docs/conventions.md §3).

Written as a different algorithm from the kernels (whole-array fancy indexing and reshapes instead
of per-thread index arithmetic, float64 where arithmetic happens) and never calling a kernel.
Inputs are numpy arrays; results are new arrays. Quantization follows DESIGN §4 exactly:
x / scale in float32, clipped to the format's finite range, rounded to nearest even.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["quantize_fp8", "dequantize_fp8", "reshape_and_cache_flash", "reshape_and_cache",
           "concat_and_cache_mla", "gather_and_maybe_dequant_cache", "cp_gather_cache", "copy_blocks",
           "swap_blocks", "dense_kv", "attention_rows", "paged_attention", "paged_attention_v1",
           "paged_attention_v2_partitions", "merge_attn_states", "varlen_attention", "mla_decode"]

FP8 = {"fp8": ml_dtypes.float8_e4m3fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def quantize_fp8(x, scale, kv_cache_dtype="fp8"):
    """uint8 codes of saturate(x / scale); ``scale`` broadcasts against x."""
    fmt = FP8[kv_cache_dtype]
    limit = np.float32(ml_dtypes.finfo(fmt).max)
    q = np.asarray(x).astype(np.float32) / np.asarray(scale, dtype=np.float32)
    codes = np.clip(q, -limit, limit).astype(fmt).view(np.uint8)
    return np.where(np.isnan(q), np.uint8(0x7F), codes)  # CUDA's canonical fp8 NaN, in both formats


def dequantize_fp8(codes, scale, kv_cache_dtype="fp8"):
    """float32 values float(code) * scale of uint8 codes."""
    values = np.asarray(codes).view(FP8[kv_cache_dtype]).astype(np.float32)
    return values * np.asarray(scale, dtype=np.float32)


def _store(x, scale, kv_cache_dtype, head_axis):
    """What a cache holds for x: x itself ("auto") or its fp8 codes with a per-tensor or per-head scale."""
    if kv_cache_dtype == "auto":
        return np.asarray(x)
    scale = np.asarray(scale, dtype=np.float32).reshape(-1)
    shape = [1] * np.ndim(x)
    if scale.size > 1:
        shape[head_axis] = scale.size
    return quantize_fp8(x, scale.reshape(shape), kv_cache_dtype)


def _slots(slot_mapping, block_size):
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = np.flatnonzero(slots >= 0)
    blocks, offsets = np.divmod(slots[keep], block_size)
    return keep, blocks, offsets


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=1.0, v_scale=1.0, *, layout="NHD"):
    """Return (key_cache, value_cache) copies with every token of a non-negative slot written."""
    key_cache, value_cache = np.array(key_cache, copy=True), np.array(value_cache, copy=True)
    block_size = key_cache.shape[1] if layout == "NHD" else key_cache.shape[2]
    keep, blocks, offsets = _slots(slot_mapping, block_size)
    for cache, new, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        rows = _store(np.asarray(new)[keep], scale, kv_cache_dtype, head_axis=1)
        if layout == "NHD":
            cache[blocks, offsets] = rows
        else:
            cache[blocks, :, offsets] = rows
    return key_cache, value_cache


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=1.0, v_scale=1.0):
    """vLLM layout: K [blocks, heads, head_size // x, block_size, x], V [blocks, heads, head_size, block_size]."""
    key_cache, value_cache = np.array(key_cache, copy=True), np.array(value_cache, copy=True)
    _, num_kv_heads, chunks, block_size, x = key_cache.shape
    keep, blocks, offsets = _slots(slot_mapping, block_size)
    k = _store(np.asarray(key)[keep], k_scale, kv_cache_dtype, head_axis=1)
    v = _store(np.asarray(value)[keep], v_scale, kv_cache_dtype, head_axis=1)
    key_cache[blocks, :, :, offsets, :] = k.reshape(len(keep), num_kv_heads, chunks, x)
    value_cache[blocks, :, :, offsets] = v
    return key_cache, value_cache


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=1.0):
    kv_cache = np.array(kv_cache, copy=True)
    keep, blocks, offsets = _slots(slot_mapping, kv_cache.shape[1])
    rows = np.concatenate([np.asarray(kv_c)[keep], np.asarray(k_pe)[keep]], axis=1)
    kv_cache[blocks, offsets] = _store(rows, scale, kv_cache_dtype, head_axis=0)
    return kv_cache


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


# ---------------------------------------------------------------- attention
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


def attention_rows(q, k, v, positions, *, scale, causal=True, sliding_window=None, sink=None, alibi_slope=None,
                   softcap=None, key_offset=0):
    """Two-pass softmax attention of query rows q [n, D] at ``positions`` over keys k/v [L, D]
    (key j at position key_offset + j). Returns (out [n, Dv] float64, lse [n] float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    key_pos = key_offset + np.arange(k.shape[0])
    pos = np.asarray(positions)[:, None]
    visible = np.ones((q.shape[0], k.shape[0]), bool)
    if causal:
        visible &= key_pos[None, :] <= pos
    if sliding_window:
        visible &= key_pos[None, :] > pos - sliding_window
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


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    causal=True, sliding_window=None, sinks=None, alibi_slopes=None, softcap=None,
                    kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, layout="NHD"):
    """(out [num_tokens, num_heads, head_size] float64, lse [num_heads, num_tokens] float64): gather
    each sequence's K/V densely, then attention_rows per head. Positions are bottom-right aligned."""
    q = np.asarray(q)
    num_tokens, num_heads, head_size = q.shape
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    qsl = np.arange(len(seq_lens) + 1) if query_start_loc is None else np.asarray(query_start_loc).astype(np.int64)
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
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
                                  causal=causal, sliding_window=sliding_window,
                                  sink=None if sinks is None else np.asarray(sinks)[h],
                                  alibi_slope=None if alibi_slopes is None else np.asarray(alibi_slopes)[h],
                                  softcap=softcap)
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


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context=None):
    """vLLM's merge of two partial attention states (outputs [num_tokens, num_heads, head_size],
    LSEs [num_heads, num_tokens]) -> (output float64, output_lse float64). A +inf LSE counts as -inf;
    both sides -inf: the prefix output and -inf; tokens at or past prefill_tokens_with_context take
    the suffix verbatim."""
    po, so = np.asarray(prefix_output, np.float64), np.asarray(suffix_output, np.float64)
    pl, sl = np.asarray(prefix_lse, np.float64).T, np.asarray(suffix_lse, np.float64).T  # [tokens, heads]
    pl = np.where(np.isposinf(pl), -np.inf, pl)
    sl = np.where(np.isposinf(sl), -np.inf, sl)
    mx = np.maximum(pl, sl)
    both_empty = np.isneginf(mx)
    mx_safe = np.where(both_empty, 0.0, mx)
    pw, sw = np.exp(pl - mx_safe), np.exp(sl - mx_safe)
    total = np.where(both_empty, 1.0, pw + sw)
    out = (po * (pw / total)[..., None] + so * (sw / total)[..., None])
    out = np.where(both_empty[..., None], po, out)
    lse = np.where(both_empty, -np.inf, mx_safe + np.log(total))
    n = po.shape[0] if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    out[n:], lse[n:] = so[n:], np.asarray(suffix_lse, np.float64).T[n:]
    return out, lse.T


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=True):
    """FlashAttention varlen semantics (bottom-right causal alignment): (out float64 [total_q,
    num_heads, v_head_size], lse float64 [num_heads, total_q])."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    total_q, num_heads, _ = q.shape
    scale = 1.0 / np.sqrt(q.shape[2]) if scale is None else scale
    cq, ck = np.asarray(cu_seqlens_q).astype(np.int64), np.asarray(cu_seqlens_k).astype(np.int64)
    out = np.zeros((total_q, num_heads, v.shape[2]))
    lse = np.full((num_heads, total_q), -np.inf)
    group = num_heads // k.shape[1]
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        positions = (k1 - k0) - (q1 - q0) + np.arange(q1 - q0)
        for h in range(num_heads):
            o, l = attention_rows(q[q0:q1, h], k[k0:k1, h // group], v[k0:k1, h // group], positions, scale=scale,
                                  causal=causal)
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

"""numpy references: the oracle of every test (DESIGN.md §3).

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
           "swap_blocks"]

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
    """Return a copy of dst with row t = cache row of token t (dequantized to dst's dtype)."""
    dst = np.array(dst, copy=True)
    tokens = np.arange(int(num_tokens))
    seqs = np.asarray(token_to_seq).astype(np.int64)[:num_tokens]
    live = tokens < np.asarray(cu_seq_lens).astype(np.int64)[seqs + 1]
    tokens, seqs = tokens[live], seqs[live]
    pos = _positions(cu_seq_lens, seq_starts, seqs, tokens)
    block_size = src_cache.shape[1]
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

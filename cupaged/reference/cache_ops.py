"""References of the cache writes (kernels_cu/cache_ops.cu, cupaged/cache_ops.py): every token of a
non-negative slot written into a copy of the cache, quantized to fp8 codes where asked; and of the
family's whole-array fp8 conversion (cupaged/convert_fp8.py)."""

from __future__ import annotations

import numpy as np

from cupaged.reference.fp8 import dequantize_fp8, quantize_fp8


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


def convert_fp8(dst, src, scale=1.0, kv_dtype="fp8"):
    """A new array of dst's dtype and src's shape: float src quantized to uint8 codes (x / scale in
    float32, clipped to the format's range, rounded to nearest even, NaN to 0x7F), uint8 src dequantized
    (float32 code * scale, rounded to dst's dtype). The direction follows the dtypes, as the op's."""
    src, dtype = np.asarray(src), np.asarray(dst).dtype
    scale = np.asarray(scale, dtype=np.float32).reshape(())
    if src.dtype == np.uint8:
        with np.errstate(over="ignore"):  # e.g. 57344 · 2 past float16's range: inf, as the kernel rounds it
            return dequantize_fp8(src, scale, kv_dtype).astype(dtype)
    if dtype != np.uint8:
        raise TypeError(f"quantizing {src.dtype} needs a uint8 dst, got {dtype}")
    return quantize_fp8(src, scale, kv_dtype)

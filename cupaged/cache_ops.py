"""KV cache operations: write new keys and values into the paged cache (kernels_cu/cache_ops.cu)."""

from __future__ import annotations

import numpy as np

from cupaged._checks import (
    CTYPE,
    FLOAT_DTYPES,
    address,
    check_choice,
    check_dtype,
    check_last_contiguous,
    check_ndim,
    element_strides,
    validate_enabled,
)
from cupaged._runtime import KernelFamily, array_module

__all__ = ["reshape_and_cache_flash"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LAYOUTS = ("NHD", "HND")
SLOT_DTYPES = (np.int64, np.int32)
_THREADS = 256


def _flash_name(dtype, slot_dtype, vec: int) -> str:
    return f"cupaged::reshape_and_cache_flash_kernel<{CTYPE[np.dtype(dtype)]}, {CTYPE[np.dtype(slot_dtype)]}, {vec}>"


FAMILY = KernelFamily("cache_ops", [
    _flash_name(dt, st, vec)
    for dt in FLOAT_DTYPES for st in SLOT_DTYPES for vec in sorted({1, 16 // np.dtype(dt).itemsize})
])


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"kv_cache_dtype={kv_cache_dtype!r}: fp8 KV caches are not implemented yet "
                                  "(only 'auto', the cache holding the key/value dtype)")


def _vector_width(dtype, head_size: int, arrays, strides) -> int:
    """Elements per 16-byte access when every address and stride allows it, else 1."""
    vec = 16 // dtype.itemsize
    aligned = all(address(a) % 16 == 0 for a in arrays) and all(s % vec == 0 for s in strides)
    return vec if aligned and head_size % vec == 0 else 1


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=1.0, v_scale=1.0, *, layout="NHD", validate=None):
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into flash-layout caches.

    ``slot_mapping[t]`` (int64 or int32) = block_id * block_size + offset; negative slots are
    skipped. ``layout`` "NHD": caches ``[num_blocks, block_size, num_kv_heads, head_size]``;
    "HND": ``[num_blocks, num_kv_heads, block_size, head_size]``. key/value may be views with any
    token stride (slices of a fused QKV buffer). Scales are ignored for ``kv_cache_dtype="auto"``.
    With ``validate=True`` (or ``CUPAGED_VALIDATE=1``) slots are checked against the pool on the
    host first; otherwise an out-of-range slot is undefined behaviour on the GPU, as in vLLM.
    """
    xp = array_module(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    check_choice("layout", layout, LAYOUTS)
    _check_kv_cache_dtype(kv_cache_dtype)
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    check_ndim("value", value, 3, "[num_tokens, num_kv_heads, head_size]")
    dims = "[num_blocks, block_size, num_kv_heads, head_size]" if layout == "NHD" else \
        "[num_blocks, num_kv_heads, block_size, head_size]"
    check_ndim("key_cache", key_cache, 4, dims)
    check_ndim("value_cache", value_cache, 4, dims)
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("key", key, FLOAT_DTYPES)
    for name, a in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if a.dtype != key.dtype:
            raise TypeError(f"{name} must have key's dtype {key.dtype} (kv_cache_dtype='auto'), got {a.dtype}")
    check_dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    num_tokens, num_kv_heads, head_size = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have num_tokens={num_tokens} entries, got {slot_mapping.shape[0]}")
    heads_axis, page_axis = (2, 1) if layout == "NHD" else (1, 2)
    if key_cache.shape[heads_axis] != num_kv_heads or key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache must be {layout} {dims} with num_kv_heads={num_kv_heads} and "
                         f"head_size={head_size}, got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache must have key_cache's shape {tuple(key_cache.shape)}, got {tuple(value_cache.shape)}")
    for name, a in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_contiguous(name, a)
    if slot_mapping.strides[0] != slot_mapping.itemsize and num_tokens > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.strides[0]} bytes")
    cache_strides = element_strides("key_cache", key_cache)
    if element_strides("value_cache", value_cache) != cache_strides:
        raise ValueError(f"value_cache must have key_cache's strides {tuple(key_cache.strides)}, "
                         f"got {tuple(value_cache.strides)}")
    key_strides, value_strides = element_strides("key", key), element_strides("value", value)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[page_axis]
    if validate_enabled(validate):
        slots = np.asarray(slot_mapping.get() if xp is not np else slot_mapping)
        bad = np.flatnonzero(slots >= num_blocks * block_size)
        if bad.size:
            raise ValueError(f"slot_mapping[{bad[0]}] = {slots[bad[0]]} is outside the pool of "
                             f"{num_blocks} blocks x {block_size} slots")
    if num_tokens == 0 or num_kv_heads == 0 or head_size == 0:
        return
    strides = (key_strides[0], key_strides[1], value_strides[0], value_strides[1],
               cache_strides[0], cache_strides[page_axis], cache_strides[heads_axis])
    vec = _vector_width(key.dtype, head_size, (key, value, key_cache, value_cache), strides)
    kernel = FAMILY.function(_flash_name(key.dtype, slot_mapping.dtype, vec), xp)
    threads = min(_THREADS, max(32, -(-num_kv_heads * head_size // vec // 32) * 32))
    kernel((num_tokens,), (threads,),
           (key, value, key_cache, value_cache, slot_mapping, *(np.int64(s) for s in strides),
            np.int32(num_kv_heads), np.int32(head_size), np.int32(block_size)))

"""KV cache writes (kernels_cu/cache_ops.cu): new keys/values into the paged cache in the flash,
vLLM and MLA layouts, fp8 with scales. Gathers, block copies and swaps: cache_gather.py; the family's
standalone fp8 conversion: convert_fp8.py."""

from __future__ import annotations

import functools

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._cache_args import (
    KV_CODE,
    KV_KINDS,
    cache_dtype,
    check_no_overlap,
    check_scale_values,
    check_slot_mapping,
    check_slots_in_pool,
    kernel_scalar_type,
    kv_dtype_name,
    kv_scale_args,
    op_array_module,
    scale_args,
)
from cupaged._checks import (
    CTYPE,
    FLOAT_DTYPES,
    address,
    check_choice,
    check_last_contiguous,
    check_ndim,
    check_writable,
    element_strides,
    int64s,
    validate_enabled,
)
from cupaged._annotate import op_launch
from cupaged._cost import Cost
from cupaged._mirror import constants
from cupaged._runtime import KernelFamily

__all__ = ["reshape_and_cache_flash", "reshape_and_cache", "concat_and_cache_mla"]

LAYOUTS = ("NHD", "HND")
SLOTS = ("int", "long long")



@functools.cache
def _threads() -> int:
    return constants(FAMILY.source, "CACHE_OPS_THREADS")["CACHE_OPS_THREADS"]


def _flash(t, kv, slot, vec):
    return f"cupaged::reshape_and_cache_flash_kernel<{t}, {kv}, {slot}, {vec}>"


def _vllm(t, kv, slot, vec):
    return f"cupaged::reshape_and_cache_kernel<{t}, {kv}, {slot}, {'true' if vec else 'false'}>"


def _mla(t, kv, slot):
    return f"cupaged::concat_and_cache_mla_kernel<{t}, {kv}, {slot}>"


def convert_fp8_name(t: str, kv: str, quantize: bool) -> str:
    """convert_fp8_kernel's name expression (launched from cupaged/convert_fp8.py): float type, fp8 kind,
    direction (True: floats to codes)."""
    return f"cupaged::convert_fp8_kernel<{t}, {kv}, {'true' if quantize else 'false'}>"


_TYPES = [(CTYPE[d], 16 // d.itemsize) for d in FLOAT_DTYPES]
FAMILY = KernelFamily("cache_ops", [
    *(_flash(t, kv, s, v) for t, vec in _TYPES for kv in KV_KINDS for s in SLOTS for v in (1, vec)),
    *(_vllm(t, kv, s, v) for t, _ in _TYPES for kv in KV_KINDS for s in SLOTS for v in (False, True)),
    *(_mla(t, kv, s) for t, _ in _TYPES for kv in KV_KINDS for s in SLOTS),
    *(convert_fp8_name(t, kv, q) for t, _ in _TYPES for kv in KV_KINDS if kv != KV_CODE["auto"] for q in (True, False)),
])


def _write_cost(slot_mapping, elements: int, src_itemsize: int, cache_itemsize: int) -> Cost:
    """A cache write's minimum: each valid token's ``elements`` read and written once, and the slots."""
    valid = int(np.count_nonzero(slot_mapping >= 0))
    return Cost(valid * elements * (src_itemsize + cache_itemsize) + slot_mapping.nbytes, 0)


def _aligned(arrays, strides, vec_elems) -> bool:
    """Every address 16-byte aligned and every stride a multiple of the vector width."""
    return all(address(a) % 16 == 0 for a in arrays) and all(s % vec_elems == 0 for s in strides)


def _check_key_value(key, value, kv_cache_dtype, names=("key", "value")):
    """``names``: the op's own names of key and value (rope_and_cache: k and v)."""
    k, v = names
    check_ndim(k, key, 3, "[num_tokens, num_kv_heads, head_size]")
    check_ndim(v, value, 3, "[num_tokens, num_kv_heads, head_size]")
    ctype = kernel_scalar_type(k, key)
    if value.dtype != key.dtype:
        raise TypeError(f"{v} must have {k}'s dtype {key.dtype}, got {value.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"{v} must have {k}'s shape {tuple(key.shape)}, got {tuple(value.shape)}")
    check_last_contiguous(k, key)
    check_last_contiguous(v, value)
    return ctype, cache_dtype(kv_cache_dtype, key.dtype)


def _check_cache_dtype(name, cache, want, kv_cache_dtype):
    if cache.dtype != want:
        raise TypeError(f"{name} must have dtype {want} for kv_cache_dtype={kv_cache_dtype!r}, got {cache.dtype}")
    check_writable(name, cache)


def check_flash_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, layout,
                      validate, xp, names=("key", "value")):
    """A flash-layout cache write's checks, all before any launch (reshape_and_cache_flash, rope_and_cache,
    whose ``names`` of key and value are k and v) but for overlaps, which the caller checks with its own
    arrays: (key's C type, the caches' (block, slot-in-block, head) element strides, the kernel's scale
    arguments, block_size)."""
    check_choice("layout", layout, LAYOUTS)
    ctype, want = _check_key_value(key, value, kv_cache_dtype, names)
    dims = "[num_blocks, block_size, num_kv_heads, head_size]" if layout == "NHD" else \
        "[num_blocks, num_kv_heads, block_size, head_size]"
    num_tokens, num_kv_heads, head_size = key.shape
    heads_axis, page_axis = (2, 1) if layout == "NHD" else (1, 2)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_ndim(name, cache, 4, dims)
        _check_cache_dtype(name, cache, want, kv_cache_dtype)
        check_last_contiguous(name, cache)
    if key_cache.shape[heads_axis] != num_kv_heads or key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache must be {layout} {dims} with num_kv_heads={num_kv_heads} and "
                         f"head_size={head_size}, got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache must have key_cache's shape {tuple(key_cache.shape)}, got {tuple(value_cache.shape)}")
    check_slot_mapping(slot_mapping, num_tokens)
    cache_strides = element_strides("key_cache", key_cache)
    if element_strides("value_cache", value_cache) != cache_strides:
        raise ValueError(f"value_cache must have key_cache's strides {tuple(key_cache.strides)}, "
                         f"got {tuple(value_cache.strides)}")
    scales = kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, num_kv_heads)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[page_axis]
    if validate_enabled(validate):
        check_slots_in_pool(slot_mapping, num_blocks * block_size, f"{num_blocks} blocks x {block_size} slots")
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    return ctype, (cache_strides[0], cache_strides[page_axis], cache_strides[heads_axis]), scales, block_size


@accepts_foreign_arrays
def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=1.0, v_scale=1.0, *, layout="NHD", validate=None):
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into flash-layout caches.

    ``slot_mapping[t]`` (int64 or int32) = block_id * block_size + offset; negative slots are
    skipped. ``layout`` "NHD": caches ``[num_blocks, block_size, num_kv_heads, head_size]``;
    "HND": ``[num_blocks, num_kv_heads, block_size, head_size]``. key/value may be views with any
    token stride (slices of a fused QKV buffer). fp8 caches (kv_cache_dtype "fp8", "fp8_e4m3",
    "fp8_e5m2") are uint8 and store saturate(x / scale); ``k_scale``/``v_scale`` are floats or
    float32 arrays of 1 or ``[num_kv_heads]`` values. With ``validate=True`` (or
    ``CUPAGED_VALIDATE=1``) slots are checked against the pool first; otherwise an out-of-range
    slot is undefined behaviour on the GPU, as in vLLM.
    """
    xp = op_array_module(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    ctype, cache_strides, scales, block_size = check_flash_write(key, value, key_cache, value_cache, slot_mapping,
                                                                kv_cache_dtype, k_scale, v_scale, layout, validate, xp)
    check_no_overlap((("key_cache", key_cache), ("value_cache", value_cache)), (("key", key), ("value", value)))
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0 or num_kv_heads * head_size == 0:
        return
    strides = (*element_strides("key", key)[:2], *element_strides("value", value)[:2], *cache_strides)
    vec = 16 // key.itemsize
    if not (head_size % vec == 0 and _aligned((key, value, key_cache, value_cache), strides, vec)):
        vec = 1
    kernel = FAMILY.function(_flash(ctype, KV_CODE[kv_cache_dtype], CTYPE[slot_mapping.dtype], vec), xp)
    threads = min(_threads(), max(32, -(-num_kv_heads * head_size // vec // 32) * 32))
    with op_launch(xp, "reshape_and_cache_flash", lambda: f"t={num_tokens} h={num_kv_heads} d={head_size} "
                   f"bs={block_size} {layout} {kv_dtype_name(kv_cache_dtype, key.dtype)}",
                   lambda: _write_cost(slot_mapping, 2 * num_kv_heads * head_size, key.itemsize, key_cache.itemsize)):
        kernel((num_tokens,), (threads,),
               (key, value, key_cache, value_cache, slot_mapping, *scales, *int64s(strides),
                np.int32(num_kv_heads), np.int32(head_size), np.int32(block_size)))


@accepts_foreign_arrays
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                      k_scale=1.0, v_scale=1.0, *, validate=None):
    """vLLM's ``reshape_and_cache`` for the v1/v2 paged-attention layout.

    key cache ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``, value cache
    ``[num_blocks, num_kv_heads, head_size, block_size]``, x = 16 // cache itemsize (8 for 16-bit
    caches, 4 for float32, 16 for fp8); head_size must be a multiple of x. Otherwise as
    :func:`reshape_and_cache_flash`.
    """
    xp = op_array_module(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    ctype, want = _check_key_value(key, value, kv_cache_dtype)
    num_tokens, num_kv_heads, head_size = key.shape
    x = 16 // want.itemsize
    if head_size % x:
        raise ValueError(f"the vLLM cache layout packs x={x} elements of a {want} cache: head_size={head_size} "
                         f"(key's last dimension) must be a multiple of {x}")
    check_ndim("key_cache", key_cache, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
    check_ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, head_size, block_size]")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache_dtype(name, cache, want, kv_cache_dtype)
        check_last_contiguous(name, cache)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    if key_cache.shape[1:] != (num_kv_heads, head_size // x, block_size, x):
        raise ValueError(f"key_cache must be [num_blocks, {num_kv_heads}, {head_size // x}, block_size, {x}], "
                         f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != (num_blocks, num_kv_heads, head_size, block_size):
        raise ValueError(f"value_cache must be [{num_blocks}, {num_kv_heads}, {head_size}, {block_size}], "
                         f"got shape {tuple(value_cache.shape)}")
    check_slot_mapping(slot_mapping, num_tokens)
    check_no_overlap((("key_cache", key_cache), ("value_cache", value_cache)), (("key", key), ("value", value)))
    scales = kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, num_kv_heads)
    if validate_enabled(validate):
        check_slots_in_pool(slot_mapping, num_blocks * block_size, f"{num_blocks} blocks x {block_size} slots")
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if num_tokens == 0 or num_kv_heads * head_size == 0:
        return
    kv_strides = (*element_strides("key", key)[:2], *element_strides("value", value)[:2])
    kc = element_strides("key_cache", key_cache)[:4]
    vc = element_strides("value_cache", value_cache)[:3]
    vec = _aligned((key, value), kv_strides, 16 // key.itemsize) and _aligned((key_cache,), kc, x)
    kernel = FAMILY.function(_vllm(ctype, KV_CODE[kv_cache_dtype], CTYPE[slot_mapping.dtype], vec), xp)
    with op_launch(xp, "reshape_and_cache", lambda: f"t={num_tokens} h={num_kv_heads} d={head_size} bs={block_size} "
                   f"{kv_dtype_name(kv_cache_dtype, key.dtype)}", lambda: _write_cost(slot_mapping, 2 * num_kv_heads * head_size,
                                                                           key.itemsize, key_cache.itemsize)):
        kernel((num_tokens,), (_threads(),),
               (key, value, key_cache, value_cache, slot_mapping, *scales,
                *int64s(kv_strides + kc + vc), np.int32(num_kv_heads), np.int32(head_size),
                np.int32(block_size)))


@accepts_foreign_arrays
def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="auto", scale=1.0, *, validate=None):
    """vLLM's ``concat_and_cache_mla``: ``kv_c`` ``[num_tokens, kv_lora_rank]`` and ``k_pe``
    ``[num_tokens, rope_dim]`` written side by side into ``kv_cache``
    ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (uint8 with one ``scale`` for fp8)."""
    xp = op_array_module(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    check_ndim("kv_c", kv_c, 2, "[num_tokens, kv_lora_rank]")
    check_ndim("k_pe", k_pe, 2, "[num_tokens, rope_dim]")
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, kv_lora_rank + rope_dim]")
    ctype = kernel_scalar_type("kv_c", kv_c)
    if k_pe.dtype != kv_c.dtype:
        raise TypeError(f"k_pe must have kv_c's dtype {kv_c.dtype}, got {k_pe.dtype}")
    num_tokens, kv_lora_rank = kv_c.shape
    if k_pe.shape[0] != num_tokens:
        raise ValueError(f"k_pe must have num_tokens={num_tokens} rows like kv_c, got shape {tuple(k_pe.shape)}")
    rope_dim = k_pe.shape[1]
    _check_cache_dtype("kv_cache", kv_cache, cache_dtype(kv_cache_dtype, kv_c.dtype), kv_cache_dtype)
    if kv_cache.shape[2] != kv_lora_rank + rope_dim:
        raise ValueError(f"kv_cache's last dimension must be kv_lora_rank + rope_dim = {kv_lora_rank + rope_dim}, "
                         f"got shape {tuple(kv_cache.shape)}")
    for name, a in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        check_last_contiguous(name, a)
    check_slot_mapping(slot_mapping, num_tokens)
    check_no_overlap((("kv_cache", kv_cache),), (("kv_c", kv_c), ("k_pe", k_pe)))
    ptr, value, _ = scale_args("scale", scale, xp, kv_cache_dtype, None)
    num_blocks, block_size = kv_cache.shape[:2]
    if validate_enabled(validate):
        check_slots_in_pool(slot_mapping, num_blocks * block_size, f"{num_blocks} blocks x {block_size} slots")
        check_scale_values(kv_cache_dtype, scale=scale)
    if num_tokens == 0:
        return
    strides = (element_strides("kv_c", kv_c)[0], element_strides("k_pe", k_pe)[0],
               *element_strides("kv_cache", kv_cache)[:2])
    kernel = FAMILY.function(_mla(ctype, KV_CODE[kv_cache_dtype], CTYPE[slot_mapping.dtype]), xp)
    with op_launch(xp, "concat_and_cache_mla", lambda: f"t={num_tokens} rank={kv_lora_rank} rope={rope_dim} "
                   f"bs={block_size} {kv_dtype_name(kv_cache_dtype, kv_c.dtype)}",
                   lambda: _write_cost(slot_mapping, kv_lora_rank + rope_dim, kv_c.itemsize, kv_cache.itemsize)):
        kernel((num_tokens,), (_threads(),),
               (kv_c, k_pe, kv_cache, slot_mapping, ptr, value, *int64s(strides),
                np.int32(kv_lora_rank), np.int32(rope_dim), np.int32(block_size)))


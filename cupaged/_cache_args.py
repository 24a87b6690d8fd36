"""Argument checks shared by the cache ops: kv_cache_dtype, scales, slot mappings, index arrays, block mappings,
required arrays and arrays that must not overlap."""

from __future__ import annotations

import numbers

import numpy as np

from cupaged._backend import (array_kind, array_module, host_copy, is_device_array, is_host_array, module_of, on_sim,
                              upload)
from cupaged._checks import (CTYPE, FLOAT_DTYPES, address, check_choice, check_dtype, check_ndim, float32_value,
                             validate_enabled)

__all__ = ["KV_CACHE_DTYPES", "KV_CODE", "KV_KINDS", "kv_dtype_name", "cache_dtype", "scale_args", "kv_scale_args",
           "check_slot_mapping", "check_index", "kernel_scalar_type", "check_scale_values", "check_block_mapping",
           "op_array_module", "check_no_overlap", "layout"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# A kv_cache_dtype's template argument: enum KvDtype of kernels_cu/common.cuh by name, so compiled
# names read cupaged::reshape_and_cache_flash_kernel<__half, cupaged::KV_E4M3, ...>.
KV_CODE = {"auto": "cupaged::KV_AUTO", "fp8": "cupaged::KV_E4M3", "fp8_e4m3": "cupaged::KV_E4M3",
           "fp8_e5m2": "cupaged::KV_E5M2"}
KV_KINDS = ("cupaged::KV_AUTO", "cupaged::KV_E4M3", "cupaged::KV_E5M2")  # every one, for name expressions
SLOT_DTYPES = (np.int64, np.int32)


def cache_dtype(kv_cache_dtype: str, dtype) -> np.dtype:
    """The dtype a cache must have for data of ``dtype``: the same for "auto", uint8 for fp8."""
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    return np.dtype(dtype) if kv_cache_dtype == "auto" else np.dtype(np.uint8)


def kv_dtype_name(kv_cache_dtype: str, dtype) -> str:
    """The KV cache's element format as bench rows name it: fp32 / fp16 / bf16 / fp8_e4m3 / fp8_e5m2."""
    if kv_cache_dtype != "auto":
        return "fp8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "fp8_e4m3"
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(np.dtype(dtype).name, np.dtype(dtype).name)


def kernel_scalar_type(name: str, a) -> str:
    """C++ name of a data array's element type (float32 / float16 / bfloat16)."""
    check_dtype(name, a, FLOAT_DTYPES)
    return CTYPE[a.dtype]


_NO_SCALE = (None, np.float32(1.0), np.int32(0))  # "auto": the kernel ignores its scale


def scale_args(name: str, scale, xp, kv_cache_dtype: str, num_kv_heads: int | None):
    """(device array or None, float32 value, per_head flag) for a kernel's scale parameters.

    A float is passed by value (nothing to upload, so graph-capturable); an array of 1 or
    ``[num_kv_heads]`` float32 values is read by the kernel through a pointer, never on the host.
    A numpy scale array beside cupy data is uploaded. Scales are ignored for "auto".
    """
    if kv_cache_dtype == "auto" and type(scale) in (float, int):  # the common call, without the checks below
        return _NO_SCALE
    number = isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_))
    if not number and array_kind(scale) is None:
        raise TypeError(f"{name} must be a float or a float32 array, got {type(scale).__name__} {scale!r}")
    if kv_cache_dtype == "auto":
        return _NO_SCALE
    if number:
        value = float32_value(float(scale))  # what the kernel's float parameter holds
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive float that is finite and not 0 as a float32, got {scale!r}")
        return None, np.float32(value), np.int32(0)
    if scale.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 array, got dtype {scale.dtype}")
    allowed = (1,) if num_kv_heads is None else (1, num_kv_heads)
    if scale.ndim > 1 or scale.size not in allowed:
        what = "1 value" if num_kv_heads is None else f"1 or num_kv_heads={num_kv_heads} values"
        raise ValueError(f"{name} must hold {what}, got shape {tuple(scale.shape)}")
    if is_device_array(scale):
        if on_sim(xp):
            raise TypeError(f"{name} is a cupy array but the data arrays are numpy (sim backend)")
    elif on_sim(xp):
        scale = np.ascontiguousarray(scale)
    else:
        scale = upload(xp, scale, name)
    return scale.reshape(-1), np.float32(1.0), np.int32(scale.size > 1)


def kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, num_kv_heads):
    """(k ptr, v ptr, k value, v value, per_head) for kernels taking a key and a value scale;
    per-head scales come in pairs."""
    if kv_cache_dtype == "auto" and type(k_scale) in (float, int) and type(v_scale) in (float, int):
        return None, None, _NO_SCALE[1], _NO_SCALE[1], _NO_SCALE[2]
    k = scale_args("k_scale", k_scale, xp, kv_cache_dtype, num_kv_heads)
    v = scale_args("v_scale", v_scale, xp, kv_cache_dtype, num_kv_heads)
    per_head = np.int32(max(k[2], v[2]))
    if per_head and (k[0] is None or v[0] is None or k[0].size != v[0].size):
        raise ValueError("k_scale and v_scale must both be per-head arrays when one of them is")
    return k[0], v[0], k[1], v[1], per_head


def check_scale_values(kv_cache_dtype: str, **scales) -> None:
    """validate=True: scale arrays hold finite values > 0, as a scalar scale must (reads device arrays)."""
    if kv_cache_dtype == "auto":
        return
    for name, scale in scales.items():
        if hasattr(scale, "dtype"):
            values = host_copy(scale).reshape(-1)
            bad = np.flatnonzero(~(np.isfinite(values) & (values > 0)))
            if bad.size:
                raise ValueError(f"{name} must hold finite values > 0, got {name}[{bad[0]}] = {values[bad[0]]}")


def check_slot_mapping(slot_mapping, num_tokens: int) -> None:
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have num_tokens={num_tokens} entries, got {slot_mapping.shape[0]}")
    if num_tokens > 1 and slot_mapping.strides[0] != slot_mapping.itemsize:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.strides[0]} bytes")


def check_index(name: str, a, ndim: int, dims: str, dtypes=(np.int32,)) -> None:
    """An index array: given rank and dtype, C-contiguous rows (the kernels take a row stride)."""
    check_ndim(name, a, ndim, dims)
    check_dtype(name, a, dtypes)
    if a.size > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(a.strides)}")


def check_slots_in_pool(slot_mapping, num_slots: int, what: str) -> None:
    slots = host_copy(slot_mapping)
    bad = np.flatnonzero(slots >= num_slots)
    if bad.size:
        raise ValueError(f"slot_mapping[{bad[0]}] = {slots[bad[0]]} is outside the pool of {what}")


def check_block_mapping(block_mapping, xp, bounds, validate, *, parallel=False):
    """block_mapping int64 [n, 2] of (src, dst) of any strides, each column inside its cache's blocks
    (checked always for a host mapping, under validate for a device one), returned C-contiguous (as the
    kernel reads it) on the caches' side. ``bounds``: (name, src num_blocks, dst num_blocks) per cache.
    ``parallel``: the pairs run at once (copy_blocks), so under validate no block may be both a source
    and a destination, and no destination may be named twice."""
    op_array_module(block_mapping=block_mapping)  # a TypeError naming it unless a numpy or cupy array
    check_ndim("block_mapping", block_mapping, 2, "[num_pairs, 2] (src, dst)")
    check_dtype("block_mapping", block_mapping, (np.int64,))
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got shape {tuple(block_mapping.shape)}")
    host, validating = is_host_array(block_mapping), validate_enabled(validate)
    if block_mapping.shape[0] and (host or validating):
        ids = host_copy(block_mapping)
        src_max, dst_max = ids.max(axis=0)
        # One pass over the ids against the smallest caches; only a failure looks for the first bad entry.
        if bounds and (ids.min() < 0 or src_max >= min(b[1] for b in bounds)
                       or dst_max >= min(b[2] for b in bounds)):
            for name, src_blocks, dst_blocks in bounds:
                for col, what, n in ((0, "source", src_blocks), (1, "destination", dst_blocks)):
                    bad = np.flatnonzero((ids[:, col] < 0) | (ids[:, col] >= n))
                    if bad.size:
                        raise ValueError(f"block_mapping[{bad[0]}] has {what} block {ids[bad[0], col]}, outside "
                                         f"{name}'s {n} blocks")
        if parallel and validating:
            _check_no_race(ids)
    if host and not on_sim(xp):
        return xp.asarray(np.ascontiguousarray(block_mapping))
    return module_of(block_mapping).ascontiguousarray(block_mapping)


def _check_no_race(ids: np.ndarray) -> None:
    """Pairs copied at once: a block both read and written, or written twice, ends up holding either value."""
    src, dst = ids[:, 0], ids[:, 1]
    both = np.intersect1d(src, dst)
    if both.size:
        block = both[0]
        raise ValueError(f"block_mapping: block {block} is both a source and a destination (row "
                         f"{np.flatnonzero(src == block)[0]} reads it, row {np.flatnonzero(dst == block)[0]} writes "
                         "it): the pairs run in parallel, so the copy may read it before or after the write")
    blocks, counts = np.unique(dst, return_counts=True)
    if counts.max() > 1:
        rows = np.flatnonzero(dst == blocks[np.argmax(counts > 1)])
        raise ValueError(f"block_mapping: destination block {dst[rows[0]]} appears twice (rows {rows[0]} and "
                         f"{rows[1]}): the pairs run in parallel, so either source may land")


def op_array_module(optional=(), **arrays):
    """The array module of an op's arrays (cupaged._backend.array_module), where a required array passed as
    None is a TypeError naming it (not an AttributeError from a later check); ``optional``: names that may be
    None."""
    for name, a in arrays.items():
        if a is None and name not in optional:
            raise TypeError(f"{name} must be a numpy or cupy array, got None")
    return array_module(**arrays)


def check_no_overlap(written, read=()) -> None:
    """No array an op writes shares memory with another array it writes or with one it reads: a kernel
    writes while other threads still read (in parallel on a GPU), so an overlap corrupts the result or
    races. ``written`` / ``read``: (name, array) pairs of one backend. Bounds first (one C call per pair),
    then the exact test, so views interleaved in one buffer pass: the halves of vLLM's [num_blocks, 2, ...]
    KV tensor, the slices of a fused QKV buffer. Reads shapes, strides and addresses, never contents."""
    others = (*written, *read)
    for i, (name, a) in enumerate(written):
        host = is_host_array(a)
        for j in range(i + 1, len(others)):
            b = others[j][1]
            if np.may_share_memory(a, b) if host else module_of(a).may_share_memory(a, b):
                # cupy's exact test launches a kernel and reads the device: numpy solves it on the layouts
                if np.shares_memory(a, b) if host else np.shares_memory(layout(a), layout(b)):
                    other, how = others[j][0], "writes" if j < len(written) else "reads"
                    raise ValueError(f"{name} and {other} share memory: the op writes {name} while it {how} "
                                     f"{other}; pass arrays that do not overlap")


class _Layout:
    def __init__(self, a):
        self.__array_interface__ = {"data": (address(a), False), "shape": tuple(a.shape),
                                    "strides": tuple(a.strides), "typestr": f"|V{a.itemsize}", "version": 3}


def layout(a) -> np.ndarray:
    """A numpy array with ``a``'s address, shape and strides over memory it never reads (``a`` may be a
    device array): what numpy's overlap test needs."""
    return np.asarray(_Layout(a))

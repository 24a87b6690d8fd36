"""Argument checks shared by the cache ops: kv_cache_dtype, scales, slot mappings, index arrays."""

from __future__ import annotations

import numbers

import numpy as np

from cupaged._backend import array_kind, host_copy, upload
from cupaged._checks import CTYPE, FLOAT_DTYPES, check_choice, check_dtype, check_ndim

__all__ = ["KV_CACHE_DTYPES", "KV_CODE", "KV_KINDS", "kv_dtype_name", "cache_dtype", "scale_args", "kv_scale_args", "check_slot_mapping", "check_index",
           "kernel_scalar_type", "check_scale_values"]

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
    module = array_kind(scale)
    if not number and module is None:
        raise TypeError(f"{name} must be a float or a float32 array, got {type(scale).__name__} {scale!r}")
    if kv_cache_dtype == "auto":
        return _NO_SCALE
    if number:
        value = float(scale)
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite positive float, got {scale!r}")
        return None, np.float32(value), np.int32(0)
    if scale.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 array, got dtype {scale.dtype}")
    allowed = (1,) if num_kv_heads is None else (1, num_kv_heads)
    if scale.ndim > 1 or scale.size not in allowed:
        what = "1 value" if num_kv_heads is None else f"1 or num_kv_heads={num_kv_heads} values"
        raise ValueError(f"{name} must hold {what}, got shape {tuple(scale.shape)}")
    if module == "cupy" and xp is np:
        raise TypeError(f"{name} is a cupy array but the data arrays are numpy (sim backend)")
    if module == "numpy" and xp is not np:
        scale = upload(xp, scale, name)
    elif module == "numpy":
        scale = np.ascontiguousarray(scale)
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

"""fp8 codes as the kernels store and read them (docs/conventions.md §4): x / scale in float32, clipped to
the format's finite range, rounded to nearest even; read = value · scale."""

from __future__ import annotations

import ml_dtypes
import numpy as np

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

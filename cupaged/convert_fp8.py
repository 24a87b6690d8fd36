"""vLLM's standalone fp8 conversion, ``convert_fp8`` (kernels_cu/cache_ops.cu, convert_fp8_kernel): a whole
array of uint8 fp8 codes to or from float32 / float16 / bfloat16, the direction chosen by the dtypes. vLLM's
own tests round-trip caches through it; here it also turns a float cache into an fp8 one and back."""

from __future__ import annotations

import functools

import numpy as np

from cupaged._annotate import op_launch
from cupaged._cache_args import KV_CODE, check_no_overlap, check_scale_values, kv_dtype_name, op_array_module, \
    scale_args
from cupaged._checks import CTYPE, FLOAT_DTYPES, address, check_choice, check_writable, validate_enabled
from cupaged._cost import Cost
from cupaged._interop import accepts_foreign_arrays
from cupaged._mirror import constants
from cupaged.cache_ops import FAMILY, convert_fp8_name

__all__ = ["convert_fp8"]

KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# The grid-stride kernel's grid cap: ~8 CTAs of 256 threads on each of an H200's 132 SMs, every thread resident
# at once; a larger array loops. Tests lower it to make a small array loop.
MAX_BLOCKS = 1056


@functools.cache
def _threads() -> int:
    return constants(FAMILY.source, "CACHE_OPS_THREADS")["CACHE_OPS_THREADS"]


def _direction(dst, src):
    """(True: floats to codes, else codes to floats; the float dtype). vLLM decides on src first, as here."""
    if src.dtype in FLOAT_DTYPES:
        if dst.dtype != np.uint8:
            raise TypeError(f"dst must be uint8 (fp8 codes) to quantize src of dtype {src.dtype}, got {dst.dtype}")
        return True, src.dtype
    if src.dtype != np.uint8:
        raise TypeError(f"src must be uint8 (fp8 codes) or float32, float16 or bfloat16, got {src.dtype}")
    if dst.dtype not in FLOAT_DTYPES:
        raise TypeError(f"dst must be float32, float16 or bfloat16 to dequantize src's uint8 fp8 codes, "
                        f"got {dst.dtype}")
    return False, dst.dtype


def _check_contiguous(name: str, a) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got shape {tuple(a.shape)} with strides {tuple(a.strides)}")


def vectorized(dst, src) -> bool:
    """Whether the kernel takes its vector path: both arrays start 16-byte aligned (C-contiguous, so every
    16-byte step of floats and its codes stay aligned)."""
    return address(dst) % 16 == 0 and address(src) % 16 == 0


@accepts_foreign_arrays
def convert_fp8(dst, src, scale=1.0, kv_dtype="fp8", *, validate=None):
    """vLLM's ``ops.convert_fp8(output, input, scale, kv_dtype)``: ``dst`` and ``src`` of one shape (any
    number of dimensions, both C-contiguous), one of them uint8 fp8 codes and the other float32, float16 or
    bfloat16. A float ``src`` is quantized: ``dst = saturate(src / scale)`` rounded to nearest even, NaN to
    the canonical NaN code 0x7F (CUDA's __NV_SATFINITE); uint8 ``src`` is dequantized: ``dst = float(code) *
    scale`` rounded to dst's dtype. ``kv_dtype`` "fp8" / "fp8_e4m3" (OCP e4m3fn, ±448) or "fp8_e5m2"
    (±57344). "auto" is rejected: it names no fp8 format, and vLLM's kernel asserts on the device for it.
    ``scale``: a positive finite float, or a float32 array of 1 value read by the kernel (its value is
    checked only with ``validate=True`` or ``CUPAGED_VALIDATE=1``). Launches on the current stream.
    """
    xp = op_array_module(dst=dst, src=src)
    if kv_dtype == "auto":
        raise ValueError("kv_dtype='auto' names no fp8 format to convert to or from (vLLM's convert_fp8 "
                         f"asserts on the device for it): pass one of {', '.join(map(repr, KV_DTYPES))}")
    check_choice("kv_dtype", kv_dtype, KV_DTYPES)
    quantize, dtype = _direction(dst, src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"dst must have src's shape {tuple(src.shape)}, got {tuple(dst.shape)}")
    _check_contiguous("dst", dst)
    _check_contiguous("src", src)
    check_writable("dst", dst)
    check_no_overlap((("dst", dst),), (("src", src),))
    ptr, value, _ = scale_args("scale", scale, xp, kv_dtype, None)
    if validate_enabled(validate):
        check_scale_values(kv_dtype, scale=scale)
    n = int(src.size)
    if n == 0:
        return
    per_step = 16 // dtype.itemsize  # elements of one vector step (the kernel's N)
    vec = vectorized(dst, src)
    work = max(n // per_step, n % per_step) if vec else n  # items of the kernel's longer loop
    threads = min(_threads(), -(-work // 32) * 32)
    blocks = min(-(-work // threads), MAX_BLOCKS)
    kernel = FAMILY.function(convert_fp8_name(CTYPE[dtype], KV_CODE[kv_dtype], quantize), xp)
    fmt, name = kv_dtype_name(kv_dtype, dtype), kv_dtype_name("auto", dtype)
    with op_launch(xp, "convert_fp8", lambda: f"n={n} {f'{name}->{fmt}' if quantize else f'{fmt}->{name}'}",
                   lambda: Cost(n * (dtype.itemsize + 1), 0)):
        kernel((blocks,), (threads,), (dst, src, ptr, value, np.int64(n), np.int32(vec)))

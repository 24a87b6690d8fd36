"""Argument validation shared by the ops: every message names the argument, what was expected and
what came (docs/conventions.md §5). Nothing here reads the contents of a device array."""

from __future__ import annotations

import functools
import math
import numbers
import os
import struct

import ml_dtypes
import numpy as np

from cupaged._backend import is_device_array, is_host_array

__all__ = ["CTYPE", "FLOAT_DTYPES", "check_ndim", "check_dtype", "check_last_contiguous",
           "element_strides", "int64s", "address", "validate_enabled", "check_choice", "check_int", "check_optional_int",
           "check_bool", "check_float", "float32_value", "check_writable", "check_array"]

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
CTYPE = {  # numpy dtype -> C++ type in name expressions
    np.dtype(np.float32): "float", np.dtype(np.float16): "__half", np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16",
    np.dtype(np.int32): "int", np.dtype(np.int64): "long long",
}


def float_dtype(name: str, value) -> np.dtype:
    """``value`` as a numpy dtype of data (float32, float16 or bfloat16); a TypeError naming ``name`` otherwise."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {value!r}") from None
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def check_array(name: str, a) -> None:
    """A numpy or cupy array: anything else (None, a list) is a TypeError naming ``name``."""
    if not is_host_array(a) and not is_device_array(a):
        raise TypeError(f"{name} must be a numpy or cupy array, got {type(a).__name__}")


def check_ndim(name: str, a, ndim: int, layout: str) -> None:
    """``ndim`` dimensions; not an array at all (None, a list) is a TypeError naming ``name``."""
    try:
        got = a.ndim
    except AttributeError:  # free when it is an array: the common call pays nothing for the TypeError
        raise TypeError(f"{name} must be a numpy or cupy array {layout}, got {type(a).__name__}") from None
    if got != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(a.shape)}")


def check_dtype(name: str, a, allowed) -> None:
    if a.dtype in allowed:  # numpy dtypes compare equal to their scalar types: no conversion on the way in
        return
    allowed = tuple(np.dtype(d) for d in allowed)
    if a.dtype not in allowed:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)}, got {a.dtype}")


def check_last_contiguous(name: str, a) -> None:
    if a.strides[-1] != a.itemsize and a.size and a.shape[-1] > 1:  # the common, contiguous case: one test
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(a.strides)} "
                         f"for itemsize {a.itemsize}")


def element_strides(name: str, a) -> tuple[int, ...]:
    """Strides in elements (a byte stride that is not a whole number of elements is an error)."""
    got = _element_strides(a.strides, a.itemsize)
    if got is None:
        raise ValueError(f"{name} has strides {tuple(a.strides)} that are not multiples of its itemsize {a.itemsize}")
    return got


@functools.lru_cache(maxsize=4096)
def _element_strides(strides, itemsize):  # memoized: an op asks for the same few layouts every call
    if any(s % itemsize for s in strides):
        return None
    return tuple(s // itemsize for s in strides)


@functools.lru_cache(maxsize=4096)
def int64s(values: tuple) -> tuple:
    """``values`` as np.int64 kernel arguments (CuPy and the sim pass a Python int as int64 too, but
    the kernels' ``long long`` parameters say so explicitly); memoized per strides tuple."""
    return tuple(np.int64(v) for v in values)


def address(a) -> int:
    """Device or host address of the first element (numpy or cupy)."""
    if is_host_array(a):
        return a.__array_interface__["data"][0]
    return a.data.ptr


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def validate_enabled(validate) -> bool:
    """Content checks run with validate=True, or CUPAGED_VALIDATE=1 when validate is None."""
    if validate is None:
        return os.environ.get("CUPAGED_VALIDATE", "") not in ("", "0")
    return check_bool("validate", validate)


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """An int (not a bool) in [minimum, maximum], as a Python int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_optional_int(name: str, value, minimum: int, maximum: int = 2**31 - 1) -> int | None:
    """None, or an int in [minimum, maximum] (a kernel's int32 by default)."""
    return None if value is None else check_int(name, value, minimum, maximum)


def check_bool(name: str, value, *, strict: bool = False) -> bool:
    """A bool (numpy's too; 0 and 1 pass as False and True unless ``strict``)."""
    if value is True or value is False:  # the common call, first: run_attention pays this per layer
        return value
    if isinstance(value, (bool, np.bool_)) or (not strict and isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_float(name: str, value, *, positive: bool = False) -> float:
    """A finite real number (Python or numpy scalar, not a bool or an array), as a Python float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value}")
    return value


_FLOAT32 = struct.Struct("f")


def float32_value(value: float) -> float:
    """``value`` rounded to float32 (to nearest even, as a kernel's float parameter holds it); inf past its range."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_writable(name: str, a) -> None:
    """An array the op writes must not be a read-only numpy view (it would silently stay unwritten)."""
    if is_host_array(a) and not a.flags.writeable:
        raise ValueError(f"{name} is read-only, but the op writes it: pass a writable array")

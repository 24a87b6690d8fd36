"""Arrays from other libraries (torch, JAX, numba, ...), seen without a copy.

Every public op is wrapped by :func:`accepts_foreign_arrays`: before the op runs, each argument that
is an array of another library becomes a view of the same memory, routed by the array's device --

- on a GPU (``__cuda_array_interface__``, or ``__dlpack__`` on a CUDA device): a cupy array
  (``cupy.asarray`` / ``cupy.from_dlpack``, both zero-copy), so the op runs on the GPU;
- on the CPU (``__dlpack__`` on the CPU or pinned host memory, ``__array_interface__``,
  ``__array_struct__``, or an ``__array__`` that numpy can take without a copy): a numpy array, so
  the op runs on the sim and writes caches and outputs passed that way in place.

numpy and cupy arrays, scalars and everything else pass through untouched (a wrong type still gets
the op's own TypeError naming the argument). Lists and tuples of arrays (``copy_blocks``' per-layer
caches) are converted element by element. Arrays an op returns are numpy or cupy arrays.
"""

from __future__ import annotations

import ctypes
import functools
import inspect

import numpy as np

from cupaged._backend import array_kind

__all__ = ["accepts_foreign_arrays", "as_native", "passes_as_is"]

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13  # DLPack's DLDeviceType codes
_PLAIN_TYPES = {np.ndarray, type(None), type, bool, int, float, str}  # grows with each type seen to pass as it is


def _cupy(name: str, what: str):
    try:
        import cupy
    except Exception as e:
        raise TypeError(f"{name} is a GPU array ({what}) but cupy cannot be imported ({type(e).__name__}: {e}): "
                        "install cupaged[cuda12] or cupaged[cuda13]") from e
    return cupy


def _view(name: str, fn, a, what: str):
    try:
        return fn(a)
    except Exception as e:
        raise TypeError(f"{name} ({type(a).__name__}, {what}) cannot be viewed without a copy: "
                        f"{type(e).__name__}: {e}") from e


def as_native(name: str, a):
    """``a`` as a numpy or cupy array sharing its memory when it is another library's array; any
    other value as it is. ``name`` (the argument) is named in the TypeError of an array that cannot
    be viewed: on an unsupported device, or needing cupy where it is missing."""
    t = type(a)
    if t in _PLAIN_TYPES:
        return a
    if t in (list, tuple):
        return t(as_native(f"{name}[{i}]", x) for i, x in enumerate(a))
    if array_kind(a) is not None:
        _PLAIN_TYPES.add(t)  # numpy and cupy arrays (subclasses too) and numpy scalars
        return a
    try:
        has_cai = hasattr(a, "__cuda_array_interface__")  # torch raises inside it for CPU tensors
    except Exception:
        has_cai = False
    if has_cai:
        return _view(name, _cupy(name, "__cuda_array_interface__").asarray, a, "__cuda_array_interface__")
    if hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
        device = int(a.__dlpack_device__()[0])
        if device in (_DL_CUDA, _DL_CUDA_MANAGED):
            return _view(name, _cupy(name, "__dlpack__ on CUDA").from_dlpack, a, "__dlpack__ on CUDA")
        if device in (_DL_CPU, _DL_CUDA_HOST):
            return _view(name, _from_cpu_dlpack, a, "__dlpack__ on the CPU")
        raise TypeError(f"{name} is a DLPack array on device type {device}: cupaged takes CUDA (2, 13) or CPU "
                        f"(1, 3) arrays")
    if any(hasattr(a, attr) for attr in ("__array_interface__", "__array_struct__", "__array__")):
        return _view(name, functools.partial(np.asarray, copy=False), a, "numpy array protocol")
    return a


def _plain(values) -> bool:
    """Nothing to convert: plain values and numpy/cupy arrays, also inside lists and tuples (partials,
    per-layer caches)."""
    types = set(map(type, values))
    if _PLAIN_TYPES.issuperset(types):
        return True
    return all(t in _PLAIN_TYPES or ((t is tuple or t is list) and all(_plain(v) for v in values if type(v) is t))
               for t in types)


def passes_as_is(cls):
    """Class decorator: instances of ``cls`` (plans, K/V views) are no arrays; wrapped ops pass them
    on the fast path."""
    _PLAIN_TYPES.add(cls)
    return cls


def accepts_foreign_arrays(fn):
    """Wrap a public op (function or classmethod's function) so that every argument goes through
    :func:`as_native` first; the fast path (only numpy/cupy arrays and plain values) costs ~1 µs."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (_plain(args) and _plain(kwargs.values())):
            args = tuple(as_native(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args))
            kwargs = {k: as_native(k, v) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    return wrapper


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor)))]
_DL_BFLOAT = 4  # DLDataTypeCode kDLBfloat: numpy's from_dlpack refuses it


def _from_cpu_dlpack(a) -> np.ndarray:
    try:
        return np.from_dlpack(a)
    except (BufferError, RuntimeError):  # numpy 2 refuses a dtype it lacks (torch.bfloat16) with a RuntimeError
        return _bfloat16_from_dlpack(a)


class _CapsuleOwner:
    """Keeps a consumed DLPack tensor alive for the numpy view over it; its deleter runs with the view."""

    def __init__(self, managed, interface):
        self._managed, self.__array_interface__ = managed, interface

    def __del__(self):
        if self._managed.contents.deleter:
            self._managed.contents.deleter(self._managed)


def _bfloat16_from_dlpack(a) -> np.ndarray:
    """A bfloat16 CPU DLPack tensor (torch's ``torch.bfloat16`` on the CPU) as an ml_dtypes.bfloat16
    view: read from the legacy ``dltensor`` capsule, which every producer still offers."""
    import ml_dtypes

    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                                           ctypes.c_char_p]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsule = a.__dlpack__()
    managed = ctypes.cast(api.PyCapsule_GetPointer(capsule, b"dltensor"), ctypes.POINTER(_DLManagedTensor))
    t = managed.contents.dl_tensor
    if (t.code, t.bits, t.lanes) != (_DL_BFLOAT, 16, 1):
        raise BufferError(f"DLPack dtype (code {t.code}, {t.bits} bits, {t.lanes} lanes) has no numpy equivalent")
    api.PyCapsule_SetName(capsule, b"used_dltensor")  # ours now: the capsule's destructor must not free it
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = None if not t.strides else tuple(2 * t.strides[i] for i in range(t.ndim))
    owner = _CapsuleOwner(managed, {"data": ((t.data or 0) + t.byte_offset, False), "shape": shape,
                                    "strides": strides, "typestr": "<u2", "version": 3})
    return np.asarray(owner).view(ml_dtypes.bfloat16)

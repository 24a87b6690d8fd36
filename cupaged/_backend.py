"""The one place numpy (run by the sim), ``cupaged.sim`` and CuPy differ.

``xp`` everywhere in cupaged is the array module of an op's data: ``numpy`` (the kernels run on the
sim, and the arrays an op allocates live in the sim's guarded memory, so they are passed without a
copy) or ``cupy`` (the GPU). Nothing else in the package tests which one it has.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["array_module", "array_kind", "module_of", "is_device_array", "empty", "upload", "host_copy", "struct_arg",
           "gpu_module", "sm_count", "device_shared_limit"]

NOMINAL_SMS = 132  # H100/H200: what the sim sizes grids for


def _cupy():
    return sys.modules.get("cupy")


def is_device_array(a) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(a, cupy.ndarray)


def array_kind(a) -> str | None:
    """"numpy" for a numpy array or scalar, "cupy" for a cupy array, None for anything else."""
    if isinstance(a, (np.ndarray, np.generic)):
        return "numpy"
    return "cupy" if is_device_array(a) else None


def module_of(a):
    """numpy or cupy, the module of array ``a``."""
    return _cupy() if is_device_array(a) else np


def array_module(**arrays):
    """numpy for numpy arrays (the sim), cupy for cupy arrays; a mix raises TypeError.

    ``None`` values are ignored. Every other value must be an array of one of the two kinds.
    """
    kinds: dict[str, list[str]] = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            kinds.setdefault("numpy", []).append(name)
        elif is_device_array(a):
            kinds.setdefault("cupy", []).append(name)
        else:
            raise TypeError(f"{name} must be a numpy or cupy array, got {type(a).__name__}")
    if len(kinds) > 1:
        raise TypeError(
            "arrays on different backends: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(kinds.items()))
            + " (numpy arrays run on the sim, cupy arrays on the GPU: pass one kind)"
        )
    return _cupy() if "cupy" in kinds else np


def empty(xp, shape, dtype):
    """A new array an op hands to a kernel: guarded sim memory for numpy (no copy per launch)."""
    if xp is np:
        from cupaged import sim

        return sim.empty(shape, dtype)
    return xp.empty(shape, dtype)


def upload(xp, a):
    """A small host array (indices, scales) as ``xp``'s array: uploaded for cupy, as it is for numpy."""
    return a if xp is np else xp.asarray(a)


def host_copy(a) -> np.ndarray:
    """A numpy copy of a numpy or cupy array (only for validate=True content checks and host plans)."""
    return np.asarray(a.get() if is_device_array(a) else a)


def struct_arg(value: np.ndarray, xp):
    """A kernel argument for a C struct passed by value, from a 0-d numpy structured array whose
    dtype matches the struct's layout (``align=True``). The sim takes the numpy scalar and checks
    its size against the parameter; CuPy passes a ``CPointer`` to the bytes as the argument's
    address (what cuLaunchKernel reads a by-value parameter from), which works whether or not the
    installed CuPy knows structured scalars. ``value`` must stay alive until the launch returns."""
    if xp is np:
        return value[()]
    from cupy.cuda.function import CPointer

    return CPointer(value.ctypes.data)


def gpu_module():
    """cupy when it imports and sees a device, else None (no cupy, driver or device: the sim)."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # any failure to reach a GPU means "run on the sim"
        return None


def sm_count(xp) -> int:
    """The device's SMs (a nominal H200's on the sim, so grids are sized as on the GPU)."""
    return NOMINAL_SMS if xp is np else xp.cuda.Device().attributes["MultiProcessorCount"]


def device_shared_limit(xp) -> tuple[int, str]:
    """(the current device's opt-in shared memory per block in bytes, its name) for cupy."""
    device = xp.cuda.Device()
    name = xp.cuda.runtime.getDeviceProperties(device.id)["name"]
    return device.attributes["MaxSharedMemoryPerBlockOptin"], name.decode() if isinstance(name, bytes) else name

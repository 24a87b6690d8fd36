"""The one place numpy (run by the sim), ``cupaged.sim`` and CuPy differ.

``xp`` everywhere in cupaged is the array module of an op's data: ``numpy`` (the kernels run on the
sim, and the arrays an op allocates live in the sim's guarded memory, so they are passed without a
copy) or ``cupy`` (the GPU); what KVCache and BatchPlan allocate with is ``cupaged.sim`` or ``cupy``
(``resolve_array_module``). Nothing else in the package tests which one it has (tests/test_backend_seam.py
reads every module for such tests).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np

from cupaged._gpu_probe import (GpuProbe, GpuUnavailableError, GpuUnavailableWarning, gpu_module, probe_gpu,
                                require_gpu)

__all__ = ["array_module", "array_kind", "module_of", "is_device_array", "is_host_array", "on_sim", "device_key",
           "empty", "capturing", "upload", "to_device", "host_copy", "struct_arg", "default_array_module",
           "resolve_array_module", "gpu_module", "probe_gpu", "require_gpu", "GpuProbe", "GpuUnavailableWarning",
           "GpuUnavailableError", "sm_count", "device_shared_limit"]

NOMINAL_SMS = 132  # H100/H200: what the sim sizes grids for


def _cupy():
    return sys.modules.get("cupy")


def is_device_array(a) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(a, cupy.ndarray)


def is_host_array(a) -> bool:
    """A numpy array: host memory, where the sim's kernels run (or a small host index array beside cupy data)."""
    return isinstance(a, np.ndarray)


def on_sim(xp) -> bool:
    """Whether ``xp``'s kernels run on the sim: numpy (an op's array module) or ``cupaged.sim`` (what KVCache
    and BatchPlan allocate with); cupy's run on the GPU."""
    return xp is np or xp is sys.modules.get("cupaged.sim")  # an xp that is the sim has imported it


def device_key(xp):
    """What is kept per backend and device (uploaded tables, frequencies) is keyed by: "numpy" for the sim,
    ("cupy", the current device's id) for the GPU."""
    return "numpy" if xp is np else ("cupy", xp.cuda.Device().id)


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
    types = set(map(type, arrays.values()))
    types.discard(type(None))
    if len(types) == 1:  # the common call: one kind of array
        t = types.pop()
        if t is np.ndarray:
            return np
        cupy = _cupy()
        if cupy is not None and t is cupy.ndarray:
            return cupy
    kinds: dict[str, list[str]] = {}
    for name, a in arrays.items():
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            kinds.setdefault("numpy", []).append(name)
        elif is_device_array(a):
            kinds.setdefault("cupy", []).append(name)
        else:
            raise TypeError(f"{name} must be a numpy or cupy array, got {type(a).__name__} (arrays of other libraries "
                            "are taken through __cuda_array_interface__, __dlpack__ or numpy's array interface)")
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


def capturing(xp) -> bool:
    """True while CuPy's current stream captures a CUDA graph (never on the sim)."""
    return xp is not np and xp.cuda.get_current_stream().is_capturing()


def upload(xp, a, name: str = "a host index array"):
    """A small host array (indices, scales) as ``xp``'s array: uploaded for cupy, as it is for numpy.
    A synchronous upload cannot be captured: during CUDA graph capture it is a ValueError naming it."""
    if xp is np or is_device_array(a):
        return a
    if capturing(xp):
        raise ValueError(f"{name} is a host (numpy) array: pass it as a cupy array while capturing a CUDA graph "
                         "(a host-to-device upload cannot be captured)")
    return xp.asarray(a)


def to_device(xp, a, name: str):
    """Host array ``a`` where ``xp``'s kernels read it: in guarded sim memory for numpy (``a`` itself when it is
    there already), uploaded for cupy (so not during CUDA graph capture: a ValueError naming it)."""
    if xp is np:
        from cupaged import sim

        return sim.asarray(a)
    return upload(xp, a, name)


def default_array_module():
    """cupy when it imports and sees a device, else ``cupaged.sim`` (guarded numpy); cupy installed
    but unusable warns (GpuUnavailableWarning: cause, driver, extra to install) before the sim."""
    from cupaged import sim

    return gpu_module() or sim


def resolve_array_module(xp, name="xp"):
    """What KVCache and BatchPlan allocate with: ``None`` -> the default; numpy or ``cupaged.sim`` ->
    ``cupaged.sim``; cupy -> cupy."""
    from cupaged import sim

    if xp is None:
        return default_array_module()
    if xp is np or xp is sim:
        return sim
    if xp is _cupy():
        return xp
    raise TypeError(f"{name} must be None, numpy, cupaged.sim or cupy, got {xp!r}")


def host_copy(a) -> np.ndarray:
    """A numpy copy of a numpy or cupy array (for validate=True content checks, host plans and results read back).
    Reading a device array back cannot be captured: during CUDA graph capture it is a RuntimeError."""
    if not is_device_array(a):
        return np.asarray(a)
    if capturing(module_of(a)):
        raise RuntimeError("this call reads device arrays on the host (validate=True / CUPAGED_VALIDATE=1, or an "
                           "op planned on the host such as mla_chunked_prefill), which CUDA graph capture forbids")
    return a.get()


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


def sm_count(xp) -> int:
    """The device's SMs (a nominal H200's on the sim, so grids are sized as on the GPU)."""
    return NOMINAL_SMS if xp is np else _device_sms(xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_sms(device: int) -> int:  # a driver query (CuPy builds every attribute): once per device
    return _cupy().cuda.Device(device).attributes["MultiProcessorCount"]


NOMINAL_SM_SHARED = 228 * 1024  # H100/H200 (sm_90): shared memory per SM, what the sim sizes occupancy for


def sm_shared_bytes(xp) -> int:
    """The device's shared memory per SM (a nominal H200's on the sim): how many CTAs can be resident."""
    return NOMINAL_SM_SHARED if xp is np else _device_sm_shared(xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_sm_shared(device: int) -> int:
    return _cupy().cuda.Device(device).attributes["MaxSharedMemoryPerMultiprocessor"]


SIM_ARCH = "sm_80"  # the kernels the sim's plans take while CUPAGED_SIM_ARCH is unset


def device_arch(xp) -> str:
    """The architecture whose kernels a plan takes by default: the device's ("sm_90"); on the sim the one
    CUPAGED_SIM_ARCH names (it holds launches to that architecture's shared memory too: cupaged/sim/_env.py), and
    while it is unset sm_80's, the kernels every GPU runs (the sim's launches are held to sm_90's limits then)."""
    if xp is np:
        if not os.environ.get("CUPAGED_SIM_ARCH"):
            return SIM_ARCH
        from cupaged.sim import _env

        return check_arch("CUPAGED_SIM_ARCH", _env.arch())
    return _device_arch(xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _device_arch(device: int) -> str:
    return f"sm_{_cupy().cuda.Device(device).compute_capability}"


def check_arch(name: str, arch) -> str:
    """A CUDA architecture as plans name it: "sm_80", "sm_86", "sm_90" (sm_90a is sm_90's), "sm_100", ...; sm_80 at
    least (the tensor-core kernels' floor)."""
    m = re.fullmatch(r"sm_(\d{2,3})a?", arch) if isinstance(arch, str) else None
    if m is None or int(m.group(1)) < 80:
        raise ValueError(f"{name} must name a CUDA architecture from sm_80 on, like 'sm_80' or 'sm_90', got {arch!r}")
    return f"sm_{m.group(1)}"


def device_shared_limit(xp) -> tuple[int, str]:
    """(the current device's opt-in shared memory per block in bytes, its name) for cupy."""
    device = xp.cuda.Device()
    name = xp.cuda.runtime.getDeviceProperties(device.id)["name"]
    return device.attributes["MaxSharedMemoryPerBlockOptin"], name.decode() if isinstance(name, bytes) else name

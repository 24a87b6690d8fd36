"""The one place numpy (run by the sim), ``cupaged.sim`` and CuPy differ.

``xp`` everywhere in cupaged is the array module of an op's data: ``numpy`` (the kernels run on the
sim, and the arrays an op allocates live in the sim's guarded memory, so they are passed without a
copy) or ``cupy`` (the GPU). Nothing else in the package tests which one it has.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings

import numpy as np

__all__ = ["array_module", "array_kind", "module_of", "is_device_array", "empty", "capturing", "upload", "host_copy",
           "struct_arg",
           "gpu_module", "probe_gpu", "require_gpu", "GpuProbe", "GpuUnavailableWarning",
           "GpuUnavailableError", "sm_count", "device_shared_limit"]

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


def host_copy(a) -> np.ndarray:
    """A numpy copy of a numpy or cupy array (only for validate=True content checks and host plans).
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


class GpuUnavailableWarning(RuntimeWarning):
    """CuPy is installed but cannot use the GPU: the caller falls back to the sim."""


class GpuUnavailableError(RuntimeError):
    """CuPy is installed but cannot use the GPU, and the caller needs it (selftest --backend cuda)."""


@dataclasses.dataclass(frozen=True)
class GpuProbe:
    """What ``probe_gpu`` found. ``state``: "gpu" (``cupy`` is usable), "absent" (no cupy),
    "no_device" (cupy sees zero devices) or "unusable" (cupy installed but broken: ``cause``).
    ``driver_version``: cudaDriverGetVersion's number (12040 for 12.4), None when unreadable."""

    state: str
    cupy: object = None
    cause: str | None = None
    driver_version: int | None = None

    @property
    def unusable(self) -> bool:
        return self.state == "unusable"

    def message(self) -> str:
        """One paragraph: the cause, the driver version, which cupaged extra to install."""
        if self.state == "gpu":
            return "cupy sees a GPU"
        if self.state == "absent":
            return "cupy is not installed: install cupaged[cuda12] (driver < r580) or cupaged[cuda13] (driver r580+)"
        if self.state == "no_device":
            return "cupy is installed but sees no CUDA device"
        return (f"cupy is installed but cannot use the GPU: {self.cause}; NVIDIA driver: {_driver_text(self.driver_version)}; "
                f"{_extra_advice(self.driver_version)}")


def _driver_text(version: int | None) -> str:
    if version is None:
        return "version unreadable"
    if version == 0:
        return "none found"
    return f"CUDA {version // 1000}.{version % 1000 // 10}"


def _extra_advice(version: int | None) -> str:
    if version and version < 13000:  # r580 is the first driver for CUDA 13
        return ("this driver is older than r580 (CUDA 13): install cupaged[cuda12] (cupy-cuda12x) in place of "
                "cupy-cuda13x, or update the driver to r580+ for cupaged[cuda13]")
    if version and version >= 13000:
        return "the driver supports CUDA 13: install cupaged[cuda13] (cupy-cuda13x)"
    return ("install cupaged[cuda12] (cupy-cuda12x) for a driver older than r580, cupaged[cuda13] (cupy-cuda13x) for "
            "r580+; check the driver with nvidia-smi")


def _driver_version(cupy) -> int | None:
    try:
        return int(cupy.cuda.runtime.driverGetVersion())
    except Exception:  # the version only decorates the message: any failure reads as unknown
        return None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@functools.lru_cache(maxsize=None)
def probe_gpu() -> GpuProbe:
    """The one GPU probe (memoized): no cupy or zero devices mean the sim, silently; cupy installed
    but unusable (an import error inside cupy, a CUDA runtime error such as cudaErrorInsufficientDriver
    on a driver older than the wheel's CUDA) is ``unusable``, with its cause, for each caller to
    report: a warning and the sim (``gpu_module``), or an error (selftest/tests ``--backend cuda``)."""
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name == "cupy":
            return GpuProbe("absent")
        return GpuProbe("unusable", cause=f"importing cupy failed: {_describe(e)}")
    except Exception as e:  # a broken install: missing libcudart, an ABI mismatch, ...
        return GpuProbe("unusable", cause=f"importing cupy failed: {_describe(e)}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        if "cudaErrorNoDevice" in str(e):
            return GpuProbe("no_device", driver_version=_driver_version(cupy))
        return GpuProbe("unusable", cause=f"cupy.cuda.runtime.getDeviceCount() raised {_describe(e)}",
                        driver_version=_driver_version(cupy))
    if count <= 0:
        return GpuProbe("no_device", driver_version=_driver_version(cupy))
    return GpuProbe("gpu", cupy=cupy, driver_version=_driver_version(cupy))


def gpu_module():
    """cupy when it imports and sees a device, else None (the sim). No cupy or no device is silent;
    cupy installed but unusable warns with GpuUnavailableWarning (cause, driver, extra) and falls back."""
    probe = probe_gpu()
    if probe.unusable:
        warnings.warn(probe.message() + " -- running on the sim", GpuUnavailableWarning, stacklevel=2)
    return probe.cupy


def require_gpu():
    """cupy, or GpuUnavailableError saying why not (for callers that must not fall back to the sim)."""
    probe = probe_gpu()
    if probe.cupy is None:
        raise GpuUnavailableError(probe.message())
    return probe.cupy


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


def device_shared_limit(xp) -> tuple[int, str]:
    """(the current device's opt-in shared memory per block in bytes, its name) for cupy."""
    device = xp.cuda.Device()
    name = xp.cuda.runtime.getDeviceProperties(device.id)["name"]
    return device.attributes["MaxSharedMemoryPerBlockOptin"], name.decode() if isinstance(name, bytes) else name

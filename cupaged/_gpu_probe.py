"""Whether CuPy can use a GPU, and when not, why: the cause, the driver and which cupaged extra to install."""

from __future__ import annotations

import dataclasses
import functools
import warnings

__all__ = ["GpuProbe", "GpuUnavailableWarning", "GpuUnavailableError", "probe_gpu", "gpu_module", "require_gpu"]


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

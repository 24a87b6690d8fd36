"""Kernel runtime: one CUDA source, two launchers.

A :class:`KernelFamily` is a ``kernels_cu/<stem>.cu`` file plus the C++ name expressions the
package launches from it. Its source is read once, our own ``#include "x.cuh"`` lines are inlined
(so CuPy's cache key covers the headers), and it is compiled for the backend of the data arrays:
CuPy ``RawModule`` (NVRTC) for cupy arrays, one instantiation at a time on first use, memoized per
(device, source, options, name expression); :mod:`cupaged.sim` (g++) for numpy arrays, the whole
family in one module, memoized per (source, options, build mode). Both launchers share CuPy's call
convention ``kernel(grid, block, args, shared_mem=n)``; launches go to CuPy's current stream and
never synchronize.

A compile is announced on stderr (``_notice.py``), since the first call of a family can take a
minute: the sim prints a line while g++ runs (a miss in its cache), the cuda path one after NVRTC
took at least CUDA_NOTICE_S seconds (CuPy's own cache hits are fast). ``CUPAGED_QUIET=1`` silences
them.

A Hopper family (``KernelFamily(stem, names, arch=HOPPER)``: wgmma, setmaxnreg, TMA) is built for
``sm_90a`` only. Its cuda path needs a device of compute capability exactly 9.0 (arch-specific
code loads nowhere else, sm_100 included) and raises NotImplementedError naming the family and the
device's arch otherwise, before compiling: there is no other kernel to fall back to. CuPy's
RawModule has no arch argument and appends its own ``-arch=sm_90`` after our options
(cupy/cuda/compiler.py, _compile_using_nvrtc_no_warning); we put ``-arch=sm_90a`` first, and NVRTC
>= 12.9 keeps the ``a`` of an earlier sm_90a for the later sm_90 (a cubin for sm_90a; the option is
in CuPy's cache key), while NVRTC <= 12.8 rejects a second ``-arch``, so that is refused up front
too. The sim compiles a Hopper family like any other (it emulates those instructions).
"""

from __future__ import annotations

import functools
import os
import re
import threading

from cupaged._backend import on_sim
from cupaged._notice import compile_notice

__all__ = ["HOPPER", "KernelFamily", "cuda_arch_options", "families", "kernels_dir"]

CUDA_NOTICE_S = 1.0
HOPPER = "sm_90a"  # the one arch-specific target: compute capability 9.0 only
ARCH_NVRTC = {HOPPER: (12, 9)}  # the oldest NVRTC that takes our -arch before CuPy's own

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)
_FAMILIES: dict[str, "KernelFamily"] = {}
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def kernels_dir() -> str:
    """``kernels_cu`` inside an installed wheel, else beside the package in a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "kernels_cu"), os.path.join(os.path.dirname(here), "kernels_cu")):
        if os.path.isdir(cand):
            return cand
    raise FileNotFoundError(f"kernels_cu not found next to {here}")


def _inline(path: str, seen: set[str]) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()

    def repl(m: re.Match) -> str:
        inc = os.path.join(os.path.dirname(path), m.group(1))
        if not os.path.isfile(inc):
            return m.group(0)
        key = os.path.realpath(inc)
        if key in seen:
            return f"// {m.group(1)}: already inlined"
        seen.add(key)
        return f"// ---- begin {m.group(1)}\n{_inline(inc, seen)}\n// ---- end {m.group(1)}"

    return _INCLUDE.sub(repl, text).replace("#pragma once", "")


class KernelFamily:
    """One ``kernels_cu/<stem>.cu`` file and the name expressions launched from it."""

    options = ("-std=c++17",)
    arch = None  # HOPPER: built for sm_90a only (the compile gate too); None: every architecture

    def __init__(self, stem: str, name_expressions, *, arch: str | None = None):
        if arch not in (None, *ARCH_NVRTC):
            raise ValueError(f"arch must be None or one of {sorted(ARCH_NVRTC)}, got {arch!r}")
        self.stem, self.arch = stem, arch
        self.name_expressions = tuple(name_expressions)
        self._functions: dict = {}  # (name, sim build flags or device id) -> kernel: one dict lookup per launch
        with _LOCK:
            _FAMILIES[stem] = self

    @functools.cached_property
    def source(self) -> str:
        path = os.path.join(kernels_dir(), self.stem + ".cu")
        return _inline(path, {os.path.realpath(path)})

    def function(self, name: str, xp):
        """The launchable kernel ``name`` (one of the name expressions) for array module ``xp``."""
        if on_sim(xp):
            from cupaged.sim import _compile

            key = (name, _compile.cxxflags())  # CUPAGED_SIM_FMA / _BOUNDS may change between calls (tests)
        else:
            key = (name, xp.cuda.Device().id)
        kernel = self._functions.get(key)
        if kernel is None:
            if name not in self.name_expressions:
                raise KeyError(f"{name!r} is not a name expression of kernels_cu/{self.stem}.cu")
            label = f"kernels_cu/{self.stem}.cu"
            if on_sim(xp):  # the sim builds the family once: one g++ object serves every instantiation
                kernel = sim_module(self.source, self.options, self.name_expressions, label).get_function(name)
            else:
                kernel = _cuda_kernel(key[1], self.source, self.options, name, label, self.arch)
            self._functions[key] = kernel
        return kernel


def families() -> list[KernelFamily]:
    """Every kernel family the package ships: its op modules register theirs when the package is
    imported, which Python does before it imports this module."""
    return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def sim_module(source, options, names, label):
    """The sim module of a source, memoized per build mode too (CUPAGED_SIM_FMA / _BOUNDS may change
    between calls, e.g. in tests)."""
    from cupaged.sim import _compile

    return _sim_module(source, options, names, label, _compile.cxxflags())


@functools.lru_cache(maxsize=None)
def _sim_module(source, options, names, label, flags):
    from cupaged import sim

    return sim.RawModule(code=source, options=options, name_expressions=names, label=label)


@functools.lru_cache(maxsize=None)
def _cuda_kernel(device, source, options, name, label, arch=None):
    """One instantiation, compiled on first use: NVRTC builds just that name expression (a family's
    every instantiation in one program took 42-122 s on 2 cores), and the kernel object is reused
    across calls."""
    return _cuda_module(device, source, options, (name,), label, arch).get_function(name)


def cuda_arch_options(arch, compute_capability: str, nvrtc_version, label=None) -> tuple[str, ...]:
    """The options that make CuPy's RawModule build for ``arch`` (None: CuPy's own ``-arch=sm_<cc>``,
    nothing added) on a device of ``compute_capability`` ("90") with CuPy's NVRTC ``nvrtc_version``.
    NotImplementedError, naming ``label`` and the device's arch, where that code cannot load or
    that NVRTC cannot build it."""
    if arch is None:
        return ()
    what = label or "this source"
    if f"sm_{compute_capability}a" != arch:
        raise NotImplementedError(
            f"{what} is built for {arch} only (Hopper's wgmma / setmaxnreg / TMA), which loads on compute "
            f"capability 9.0 only; this device is sm_{compute_capability}, and cupaged has no other kernel for it")
    if tuple(nvrtc_version) < ARCH_NVRTC[arch]:
        raise NotImplementedError(
            f"{what} needs NVRTC >= {'.'.join(map(str, ARCH_NVRTC[arch]))} for {arch}: CuPy appends its own "
            f"-arch=sm_{compute_capability} to RawModule's options and NVRTC "
            f"{'.'.join(map(str, nvrtc_version))} rejects a second -arch (install cupaged[cuda13], or "
            f"nvidia-cuda-nvrtc-cu12>=12.9 with cupaged[cuda12])")
    return (f"-arch={arch}",)


@functools.lru_cache(maxsize=None)
def _cuda_module(device, source, options, names, label, arch=None):
    import cupy

    from cupaged._cuda_paths import cupy_include_dirs

    with cupy.cuda.Device(device):
        cc = str(cupy.cuda.Device(device).compute_capability)
        nvrtc_version = None if arch is None else cupy.cuda.nvrtc.getVersion()
        target = cuda_arch_options(arch, cc, nvrtc_version, label)  # before any compile
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        includes = tuple(f"-I{d}" for d in cupy_include_dirs(major))
        with compile_notice(label, arch or f"sm_{cc}", "NVRTC", len(names), min_seconds=CUDA_NOTICE_S):
            module = cupy.RawModule(code=source, options=target + options + includes, name_expressions=names)
            module.compile()  # CuPy compiles lazily: here, inside the notice
        return module

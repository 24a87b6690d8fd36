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
"""

from __future__ import annotations

import functools
import os
import re
import threading

from cupaged._backend import on_sim
from cupaged._notice import compile_notice

__all__ = ["KernelFamily", "families", "kernels_dir"]

CUDA_NOTICE_S = 1.0

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

    def __init__(self, stem: str, name_expressions):
        self.stem = stem
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
                kernel = _cuda_kernel(key[1], self.source, self.options, name, label)
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
def _cuda_kernel(device, source, options, name, label):
    """One instantiation, compiled on first use: NVRTC builds just that name expression (a family's
    every instantiation in one program took 42-122 s on 2 cores), and the kernel object is reused
    across calls."""
    return _cuda_module(device, source, options, (name,), label).get_function(name)


@functools.lru_cache(maxsize=None)
def _cuda_module(device, source, options, names, label):
    import cupy

    from cupaged._cuda_paths import cupy_include_dirs

    with cupy.cuda.Device(device):
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        includes = tuple(f"-I{d}" for d in cupy_include_dirs(major))
        arch = f"sm_{cupy.cuda.Device(device).compute_capability}"
        with compile_notice(label, arch, "NVRTC", len(names), min_seconds=CUDA_NOTICE_S):
            module = cupy.RawModule(code=source, options=options + includes, name_expressions=names)
            module.compile()  # CuPy compiles lazily: here, inside the notice
        return module


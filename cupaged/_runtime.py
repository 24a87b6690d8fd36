"""Kernel runtime: one CUDA source, two launchers.

A :class:`KernelFamily` is a ``kernels_cu/<stem>.cu`` file plus the C++ name expressions the
package launches from it. Its source is read once, our own ``#include "x.cuh"`` lines are inlined
(so CuPy's cache key covers the headers), and it is compiled for the backend of the data arrays:
CuPy ``RawModule`` (NVRTC) for cupy arrays, one instantiation at a time on first use, memoized per
(device, source, options, name expression); :mod:`cupaged.sim` (g++) for numpy arrays, the whole
family in one module, memoized per (source, options, build mode). Both launchers share CuPy's call
convention ``kernel(grid, block, args, shared_mem=n)``; launches go to CuPy's current stream and
never synchronize.

A compile is announced on stderr, since the first call of a family can take a minute: the sim
prints a line while g++ runs (a miss in its cache), the cuda path one after NVRTC took at least
CUDA_NOTICE_S seconds (CuPy's own cache hits are fast). ``CUPAGED_QUIET=1`` silences them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import threading
import time

import numpy as np

__all__ = ["KernelFamily", "families", "kernels_dir", "quiet", "compile_notice"]

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
        if xp is np:
            from cupaged.sim import _compile

            key = (name, _compile.cxxflags())  # CUPAGED_SIM_FMA / _BOUNDS may change between calls (tests)
        else:
            key = (name, xp.cuda.Device().id)
        kernel = self._functions.get(key)
        if kernel is None:
            if name not in self.name_expressions:
                raise KeyError(f"{name!r} is not a name expression of kernels_cu/{self.stem}.cu")
            label = f"kernels_cu/{self.stem}.cu"
            if xp is np:  # the sim builds the family once: one g++ object serves every instantiation
                kernel = sim_module(self.source, self.options, self.name_expressions, label).get_function(name)
            else:
                kernel = _cuda_kernel(key[1], self.source, self.options, name, label)
            self._functions[key] = kernel
        return kernel


def families() -> list[KernelFamily]:
    """Every kernel family the package ships (importing cupaged registers them all)."""
    import cupaged  # noqa: F401  (op modules register their families on import)

    return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def quiet() -> bool:
    """True when ``CUPAGED_QUIET`` is set (to anything but 0): no notices or progress on stderr."""
    return os.environ.get("CUPAGED_QUIET", "0") not in ("", "0")


@contextlib.contextmanager
def compile_notice(label: str, target: str, tool: str, count: int, min_seconds: float = 0.0):
    """Announce a compile on stderr: ``cupaged: compiling LABEL for TARGET (TOOL, N kernels) ... 12.3 s``
    (finished with ``failed after 3.1 s`` when it raises). With ``min_seconds`` (a compile that may
    be a fast cache hit, like CuPy's) one line afterwards, and only when it took that long."""
    what = f"{label} for {target} ({tool}, {count} kernel{'' if count == 1 else 's'})"
    start = time.perf_counter()
    if quiet() or min_seconds:
        yield
        took = time.perf_counter() - start
        if min_seconds and took >= min_seconds and not quiet():
            print(f"cupaged: compiled {what} in {took:.1f} s", file=sys.stderr, flush=True)
        return
    print(f"cupaged: compiling {what} ...", end="", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        print(f" failed after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


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


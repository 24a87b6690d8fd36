"""Locate the CUDA headers and NVRTC library without a GPU or a driver, and the headers that
match CuPy's CUDA major for its NVRTC (:func:`cupy_include_dirs`).

Search order: the pip wheels of the ``sim`` extra (``nvidia/cu13/include``, ``nvidia/cu13/lib``),
then ``$CUDA_HOME`` / ``$CUDA_PATH``, then ``/usr/local/cuda``. The headers must provide
``cuda_fp16.h`` and CCCL's ``<nv/target>`` (which CUDA 13's fp16 header includes).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re

__all__ = ["cuda_include_dirs", "cupy_include_dirs", "nvrtc_library", "CudaNotFoundError"]


class CudaNotFoundError(RuntimeError):
    """The CUDA headers or NVRTC could not be found."""


def _nvidia_dirs() -> list[str]:
    """The directories of the ``nvidia`` namespace package (one per site-packages holding wheels)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return list(spec.submodule_search_locations)


def _wheel_roots() -> list[str]:
    roots = []
    for base in _nvidia_dirs():
        roots += sorted(glob.glob(os.path.join(base, "cu1[0-9]")), reverse=True)
    return roots


def _toolkit_roots() -> list[str]:
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    roots.append("/usr/local/cuda")
    return [r for r in roots if r and os.path.isdir(r)]


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Include directories that hold cuda_fp16.h and <nv/target>, most specific first."""
    for root in _wheel_roots() + _toolkit_roots():
        inc = os.path.join(root, "include")
        if not os.path.isfile(os.path.join(inc, "cuda_fp16.h")):
            continue
        dirs = [inc]
        for cccl in (os.path.join(inc, "cccl"), inc):
            if os.path.isfile(os.path.join(cccl, "nv", "target")):
                if cccl not in dirs:
                    dirs.append(cccl)
                return tuple(dirs)
    raise CudaNotFoundError(
        "CUDA headers not found: install the sim extra (pip install 'cupaged[sim]', which brings "
        "nvidia-cuda-runtime, nvidia-cuda-crt and nvidia-cuda-cccl) or set CUDA_HOME to a CUDA "
        "toolkit that has include/cuda_fp16.h and include/nv/target"
    )


def _cudart_major(include_dir: str) -> int | None:
    """The CUDA major of the runtime headers in ``include_dir`` (CUDART_VERSION 12090 -> 12)."""
    try:
        with open(os.path.join(include_dir, "cuda_runtime_api.h"), encoding="utf-8", errors="replace") as f:
            m = re.search(r"^#define\s+CUDART_VERSION\s+(\d+)", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) // 1000 if m else None


def cupy_include_dirs(cuda_major: int) -> tuple[str, ...]:
    """``-I`` directories for CuPy's NVRTC of CUDA ``cuda_major``: the pip wheels' headers of that
    major only. CuPy's own search (cuda.pathfinder) prefers ``nvidia/cu13/include``, which the sim
    extra installs, so a CUDA 12 NVRTC would compile against CUDA 13 headers unless ours come first.

    CUDA 13 wheels share ``nvidia/cu13/include`` (CCCL also under ``include/cccl``); CUDA 12 wheels
    are splayed, one ``nvidia/<component>/include`` each (``cuda_runtime``, ``cuda_cccl``, ...),
    and so are CUDA 11's: the runtime header's CUDART_VERSION tells them apart. With a system
    toolkit named by CUDA_PATH / CUDA_HOME the headers are CuPy's to find: nothing is passed.
    """
    if any(os.environ.get(v) for v in ("CUDA_PATH", "CUDA_HOME")):
        return ()
    dirs: list[str] = []
    for base in _nvidia_dirs():
        if cuda_major >= 13:
            inc = os.path.join(base, f"cu{cuda_major}", "include")
            if _cudart_major(inc) == cuda_major:
                dirs += [d for d in (inc, os.path.join(inc, "cccl")) if os.path.isdir(d)]
            continue
        runtime = os.path.join(base, "cuda_runtime", "include")
        if _cudart_major(runtime) != cuda_major:
            continue
        splayed = sorted(d for d in glob.glob(os.path.join(base, "*", "include"))
                         if os.path.isdir(d) and not re.fullmatch(r"cu\d+", os.path.basename(os.path.dirname(d))))
        first = [d for d in (runtime, os.path.join(base, "cuda_cccl", "include")) if os.path.isdir(d)]
        dirs += first + [d for d in splayed if d not in first]
    return tuple(dirs)


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> str:
    """Path of libnvrtc.so (the newest found)."""
    for root in _wheel_roots() + _toolkit_roots():
        for lib in ("lib", "lib64"):
            hits = sorted(glob.glob(os.path.join(root, lib, "libnvrtc.so*")))
            hits = [h for h in hits if "builtins" not in h and "alt" not in os.path.basename(h)]
            if hits:
                return hits[-1]
    raise CudaNotFoundError(
        "NVRTC not found: install the sim extra (pip install 'cupaged[sim]', which brings "
        "nvidia-cuda-nvrtc) or set CUDA_HOME to a CUDA toolkit with lib64/libnvrtc.so"
    )

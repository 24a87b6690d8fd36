"""Locate the CUDA headers and NVRTC library without a GPU or a driver.

Search order: the pip wheels of the ``sim`` extra (``nvidia/cu13/include``, ``nvidia/cu13/lib``),
then ``$CUDA_HOME`` / ``$CUDA_PATH``, then ``/usr/local/cuda``. The headers must provide
``cuda_fp16.h`` and CCCL's ``<nv/target>`` (which CUDA 13's fp16 header includes).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os

__all__ = ["cuda_include_dirs", "nvrtc_library", "CudaNotFoundError"]


class CudaNotFoundError(RuntimeError):
    """The CUDA headers or NVRTC could not be found."""


def _wheel_roots() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    roots = []
    for base in spec.submodule_search_locations:
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

"""The compile gate's per-user result cache (cupaged/resources.py) and its record type.

Results are cached per (family, arch) in the ``resources`` directory of the per-user cache
(``cupaged/sim/_cache.py``), keyed by the source, options, name expressions, arch, the NVRTC
version, its header directories and the text of the modules that compile and parse (resources.py,
_nvrtc.py, this one). The H200 model (cupaged/sim/_launch_model.py) caches one launched kernel's
figures here too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

from cupaged import _nvrtc
from cupaged._cuda_paths import cuda_include_dirs
from cupaged.sim._cache import cache_dir, usable, write_private

__all__ = ["KernelResources", "cache_path", "load", "store"]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """ptxas's statistics for one kernel compiled for one architecture (sizes in bytes)."""

    family: str
    name_expression: str  # as launched; the mangled name for a kernel no name expression names
    arch: str
    registers: int        # per thread
    spill_stores: int     # the kernel and the device functions it calls
    spill_loads: int
    shared_bytes: int     # static __shared__ only; dynamic shared memory is a launch parameter
    stack_bytes: int      # local memory per thread, callees included: local arrays and spills
    mangled_name: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@functools.lru_cache(maxsize=None)
def _code_version() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = (os.path.join(here, "resources.py"), _nvrtc.__file__, __file__)
    text = "".join(open(path, encoding="utf-8").read() for path in paths)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_path(stem, source, names, options, arch) -> str:
    key = "\0".join([source, *options, "|", *names, "|", arch, repr(_nvrtc.version()), *cuda_include_dirs(),
                     _code_version()])
    return os.path.join(cache_dir("resources"), f"{stem}-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json")


def load(path):
    """Cached records, or None (missing, not ours, or unreadable: then recompiled and replaced)."""
    if not usable(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return [KernelResources(**r) for r in json.load(f)]
    except (ValueError, TypeError):
        return None


def store(path, records) -> None:
    write_private(path, json.dumps([dataclasses.asdict(r) for r in records]).encode())

"""Source locations of the profiler's instruction sites (``sim.profile()``: ``shared.by_line``).

A site is either the return address of the ``__tsan_*`` hook an access called, in the profiled
build's code, or ``2**63 + line`` for an emulated PTX instruction (the line of its asm statement).
The profiled build carries line tables (``-g1``); one ``addr2line -i`` per launch maps the code
addresses (less 1: the call, not the instruction after it) to their locations, inlined calls
included. The location kept is the innermost one outside the sim's own headers, CUDA's and the
system's (an access inside ``atomicAdd``, ``__hadd`` or ``std::max`` belongs to the line that called it).

A location in the module's code is its 1-based line (an int): the sim compiles the code string
from ``kernel.cu`` in a temporary directory next to the cached object, whose lines are the
string's. A location in another file (a header) is ``"path:line"``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

from cupaged._cuda_paths import CudaNotFoundError, cuda_include_dirs
from cupaged.sim._compile import INCLUDE_DIRS

__all__ = ["locations", "own_locations"]

_LINE_SITE = 1 << 63  # kLineSite in cupaged_sim_profile.h
_RESOLVED: dict[str, dict[int, tuple]] = {}  # per object file: address -> (location, innermost frame is it)


def _skipped() -> tuple[str, ...]:
    """Directories whose code is not the kernel's: the sim's headers, CUDA's and the system's."""
    try:
        cuda = cuda_include_dirs()
    except CudaNotFoundError:
        cuda = ()
    return (*(os.path.join(os.path.realpath(d), "") for d in (*INCLUDE_DIRS, *cuda)), "/usr/")


def _object_of(lib) -> tuple[str, int]:
    """(path, load address) of a loaded sim module. From /proc/self/maps, not dladdr: a module is
    loaded before it is moved into the cache, and the kernel's map shows where the file is now."""
    address = ctypes.cast(lib.cupaged_sim_error, ctypes.c_void_p).value
    maps = []  # (start, end, file offset, path) of the file mappings
    with open("/proc/self/maps") as f:
        for row in f:
            span, _, offset, _, _, *path = row.split(maxsplit=5)
            if path:
                start, end = (int(x, 16) for x in span.split("-"))
                maps.append((start, end, int(offset, 16), path[0].strip()))
    path = next(p for start, end, _, p in maps if start <= address < end)
    base = min(start for start, _, offset, p in maps if p == path and offset == 0)
    # Replaced since by another process's build of the same cache key: the same inputs, the same code.
    return path.removesuffix(" (deleted)"), base


def _key(path: str, line: int, so: str):
    where = os.path.realpath(path)
    if os.path.basename(where) == "kernel.cu" and os.path.dirname(os.path.dirname(where)) == os.path.dirname(so):
        return line
    return f"{path}:{line}"


def _addr2line(so: str, addresses) -> dict[int, tuple]:
    """(location, whether the innermost frame is that location) of each file address, from
    ``addr2line -i``'s frames (innermost first)."""
    tool = shutil.which("addr2line")
    if tool is None:
        raise RuntimeError("sim.profile(): shared.by_line needs addr2line (binutils) on PATH")
    out = subprocess.run([tool, "-i", "-a", "-e", so, *(hex(a) for a in addresses)], capture_output=True, text=True,
                         check=True).stdout
    frames: dict[int, list] = {}
    current = None
    for row in out.splitlines():
        if row.startswith("0x"):
            current = frames.setdefault(int(row, 16), [])
            continue
        path, _, line = row.split(" (discriminator")[0].rpartition(":")
        if line.isdigit() and path != "??":
            current.append((path, int(line)))
    found, skipped = {}, _skipped()
    for address, chain in frames.items():
        kept = next((f for f in chain if not os.path.realpath(f[0]).startswith(skipped)), chain[0] if chain else None)
        own = bool(chain) and kept is chain[0] and not os.path.realpath(kept[0]).startswith(skipped)
        found[address] = (_key(*kept, so) if kept else "??", own)
    return found


def _resolved(lib, code) -> dict[int, tuple]:
    so, base = _object_of(lib)
    known = _RESOLVED.setdefault(so, {})
    missing = sorted({s - base - 1 for s in code} - known.keys())
    if missing:
        known.update(_addr2line(so, missing))
    return {s: known[s - base - 1] for s in code}


def locations(lib, sites) -> dict[int, object]:
    """Source location of each site of a launch of the module loaded as ``lib`` (see above)."""
    result = {s: s - _LINE_SITE for s in sites if s >= _LINE_SITE}
    code = [s for s in sites if s < _LINE_SITE]
    if code:
        result.update({s: where for s, (where, _) in _resolved(lib, code).items()})
    return result


def own_locations(lib, addresses) -> dict[int, object]:
    """Source location of each code address whose innermost frame is the kernel's own code, or None:
    a basic block inside the sim's emulation of an instruction or a CUDA header is not one of the
    kernel's source blocks (its line is reached through the kernel's own block that called it)."""
    return {a: where if own else None for a, (where, own) in _resolved(lib, list(addresses)).items()}

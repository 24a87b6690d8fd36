"""The profiler's side of a launch (see ``_profile.py``): the counters the engine fills
(cupaged_sim_profile.h) and the memory it watches, pointer arguments and pointers inside by-value
struct arguments."""

from __future__ import annotations

import ctypes

import numpy as np

from cupaged.sim._memory import GuardedBuffer, live_buffers

__all__ = ["LaunchStructs", "pointer_fields"]


class _ProfArg(ctypes.Structure):  # ProfArg in cupaged_sim_profile.h
    _fields_ = [("lo", ctypes.c_ulonglong), ("hi", ctypes.c_ulonglong), ("bytes_read", ctypes.c_ulonglong),
                ("bytes_written", ctypes.c_ulonglong), ("sectors_read", ctypes.c_ulonglong),
                ("sectors_written", ctypes.c_ulonglong), ("useful_read", ctypes.c_ulonglong),
                ("useful_written", ctypes.c_ulonglong), ("seen_read", ctypes.c_void_p),
                ("seen_written", ctypes.c_void_p)]


class _ProfSite(ctypes.Structure):  # ProfSite in cupaged_sim_profile.h
    _fields_ = [("site", ctypes.c_ulonglong), ("wavefronts", ctypes.c_ulonglong),
                ("ideal_wavefronts", ctypes.c_ulonglong)]


class _ProfBlock(ctypes.Structure):  # ProfBlock in cupaged_sim_profile.h
    _fields_ = [("pc", ctypes.c_ulonglong), ("count", ctypes.c_ulonglong)]


class _ProfLaunch(ctypes.Structure):  # ProfLaunch in cupaged_sim_profile.h
    _fields_ = [("nargs", ctypes.c_int), ("args", ctypes.POINTER(_ProfArg)), ("wavefronts", ctypes.c_ulonglong),
                ("ideal_wavefronts", ctypes.c_ulonglong), ("cp_async_bytes", ctypes.c_ulonglong),
                ("mma_flops", ctypes.c_ulonglong), ("max_inflight_bytes_per_cta", ctypes.c_ulonglong),
                ("block_stride", ctypes.c_uint * 3), ("ctas_profiled", ctypes.c_ulonglong),
                ("sites", ctypes.POINTER(_ProfSite)), ("site_capacity", ctypes.c_ulonglong),
                ("blocks", ctypes.POINTER(_ProfBlock)), ("block_capacity", ctypes.c_ulonglong),
                ("gmma_flops", ctypes.c_ulonglong), ("gmma_fp8_flops", ctypes.c_ulonglong),
                ("bulk_copy_bytes", ctypes.c_ulonglong)]


class LaunchStructs:
    """The ProfLaunch of one launch over the memory ranges [lo, hi) of its arguments, in order
    (bitmaps ``seen[k]``: one bit per byte of argument k read / written)."""

    def __init__(self, ranges, block_stride):
        self.seen = [np.zeros((2, -(-(hi - lo) // 64)), np.uint64) for lo, hi in ranges]
        rows = [_ProfArg(lo, hi, 0, 0, 0, 0, 0, 0, seen[0].ctypes.data, seen[1].ctypes.data)
                for (lo, hi), seen in zip(ranges, self.seen)]
        self.args = (_ProfArg * max(1, len(rows)))(*rows)
        self.launch = _ProfLaunch(len(rows), self.args)
        self.launch.block_stride[:] = block_stride

    @property
    def address(self) -> int:
        return ctypes.addressof(self.launch)

    def sites(self) -> list[tuple[int, int, int]]:
        """(site, wavefronts, ideal wavefronts) of every instruction site that accessed shared memory."""
        table = self.launch.sites[:self.launch.site_capacity] if self.launch.site_capacity else []
        return [(s.site, s.wavefronts, s.ideal_wavefronts) for s in table if s.site]

    def blocks(self) -> list[tuple[int, int]]:
        """(code address, warp-level executions) of every basic block the launch's threads ran."""
        table = self.launch.blocks[:self.launch.block_capacity] if self.launch.block_capacity else []
        return [(b.pc, b.count) for b in table if b.pc]


def _fields(name, dtype, value):
    """(dotted name, value) of every 8-byte integer field of a structured value, nested ones too."""
    for field in dtype.names or ():
        sub, label = dtype.fields[field][0], f"{name}.{field}"
        if sub.names:
            yield from _fields(label, sub, value[field])
        elif sub.subdtype is not None and sub.base.kind in "iu" and sub.base.itemsize == 8:
            for index in np.ndindex(sub.shape):
                yield label + "".join(f"[{i}]" for i in index), int(value[field][index])
        elif sub.kind in "iu" and sub.itemsize == 8:
            yield label, int(value[field])


def pointer_fields(names, types, args) -> list[tuple[str, GuardedBuffer]]:
    """(``param.field``, buffer) for each 8-byte integer field of a by-value struct argument that
    holds an address inside a live guarded array's bytes (``buffer.valid``)."""
    structs = [(n, a) for n, code, a in zip(names, types, args)
               if code.startswith("struct:") and isinstance(a, np.generic) and a.dtype.names]
    if not structs:
        return []
    live = live_buffers()
    found = []
    for name, value in structs:
        for label, address in _fields(name, value.dtype, value):
            for buf in live:
                if buf.valid[0] <= address < buf.valid[1]:
                    found.append((label, buf))
                    break
    return found

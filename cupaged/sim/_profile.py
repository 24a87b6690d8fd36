"""``cupaged.sim.profile()``: the memory traffic of every sim launch, as Nsight Compute would count it.

Inside ``with sim.profile() as prof:`` each launch runs a second, instrumented build of its module
(g++ ``-fsanitize=thread`` whose entry points are the sim's own: cupaged_sim_profile.h) and appends
a :class:`Launch` to ``prof.launches``. Per pointer argument: bytes requested, distinct bytes and
32-byte sectors touched per warp-level instruction; shared-memory wavefronts against the ideal;
``cp.async`` bytes and ``mma.sync`` FLOPs counted by the emulations.

``max_inflight_bytes_per_cta``: the bytes a CTA keeps in flight, a documented approximation: a
plain global load counts until its thread's next scheduling point (at most 8 loads per lane), a
``cp.async`` group from its commit until a wait covers it; a CTA's figure is the sum of its
threads' peaks (they run concurrently on a GPU), the largest over the grid's CTAs.

A first step of the profiler: the H200 time model, ``prof.table()``, per-line shared detail and
struct-field pointers come with the rest of the profiler work.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses

import numpy as np

__all__ = ["profile", "Profile", "Launch", "ArgTraffic", "SharedTraffic"]


class _ProfArg(ctypes.Structure):  # ProfArg in cupaged_sim_profile.h
    _fields_ = [("lo", ctypes.c_ulonglong), ("hi", ctypes.c_ulonglong), ("bytes_read", ctypes.c_ulonglong),
                ("bytes_written", ctypes.c_ulonglong), ("sectors_read", ctypes.c_ulonglong),
                ("sectors_written", ctypes.c_ulonglong), ("useful_read", ctypes.c_ulonglong),
                ("useful_written", ctypes.c_ulonglong), ("seen_read", ctypes.c_void_p),
                ("seen_written", ctypes.c_void_p)]


class _ProfLaunch(ctypes.Structure):  # ProfLaunch in cupaged_sim_profile.h
    _fields_ = [("nargs", ctypes.c_int), ("args", ctypes.POINTER(_ProfArg)), ("wavefronts", ctypes.c_ulonglong),
                ("ideal_wavefronts", ctypes.c_ulonglong), ("cp_async_bytes", ctypes.c_ulonglong),
                ("mma_flops", ctypes.c_ulonglong), ("max_inflight_bytes_per_cta", ctypes.c_ulonglong)]


@dataclasses.dataclass(frozen=True)
class ArgTraffic:
    """Global-memory traffic of one pointer argument in one launch."""

    bytes_read: int
    bytes_written: int
    unique_bytes_read: int
    unique_bytes_written: int
    sectors_read: int
    sectors_written: int
    useful_bytes: int = dataclasses.field(default=0, repr=False)  # distinct bytes per warp-level instruction

    @property
    def sector_efficiency(self) -> float:
        """Bytes requested / bytes of the 32-byte sectors touched, ≤ 1 (1.0: perfectly coalesced);
        bytes several lanes of one instruction read (a broadcast) count once."""
        sectors = self.sectors_read + self.sectors_written
        return self.useful_bytes / (32 * sectors) if sectors else 1.0


@dataclasses.dataclass(frozen=True)
class SharedTraffic:
    """Shared-memory wavefronts of one launch (32 banks of 4 bytes)."""

    wavefronts: int
    ideal_wavefronts: int

    @property
    def bank_conflicts(self) -> int:
        return self.wavefronts - self.ideal_wavefronts


@dataclasses.dataclass(frozen=True)
class Launch:
    """One profiled launch."""

    kernel: str
    grid: tuple
    block: tuple
    shared_mem: int
    args: dict
    shared: SharedTraffic
    cp_async_bytes: int
    mma_flops: int
    max_inflight_bytes_per_cta: int


class Profile:
    """The launches recorded inside one ``with sim.profile()`` block."""

    def __init__(self):
        self.launches: list[Launch] = []


_ACTIVE: list[Profile] = []


@contextlib.contextmanager
def profile():
    """Record every sim launch made inside the block: ``with sim.profile() as prof: ...``."""
    prof = Profile()
    _ACTIVE.append(prof)
    try:
        yield prof
    finally:
        _ACTIVE.remove(prof)


def active() -> bool:
    return bool(_ACTIVE)


class LaunchProbe:
    """The counters of one launch: built before it, read into a :class:`Launch` after it."""

    def __init__(self, names, staged):
        self.names, self._keep = [], []
        rows = []
        for i, buf in sorted(staged.buffers.items()):
            lo, hi = buf.valid
            seen = np.zeros((2, hi - lo), np.uint8)
            self._keep.append(seen)
            rows.append(_ProfArg(lo, hi, 0, 0, 0, 0, 0, 0, seen[0].ctypes.data, seen[1].ctypes.data))
            self.names.append(names[i])
        self._args = (_ProfArg * max(1, len(rows)))(*rows)
        self.struct = _ProfLaunch(len(rows), self._args, 0, 0, 0, 0, 0)

    def record(self, kernel, grid, block, shared_mem) -> None:
        args = {}
        for k, name in enumerate(self.names):
            a, seen = self._args[k], self._keep[k]
            args[name] = ArgTraffic(a.bytes_read, a.bytes_written, int(np.count_nonzero(seen[0])),
                                    int(np.count_nonzero(seen[1])), a.sectors_read, a.sectors_written,
                                    a.useful_read + a.useful_written)
        s = self.struct
        launch = Launch(kernel, tuple(grid), tuple(block), int(shared_mem), args,
                        SharedTraffic(s.wavefronts, s.ideal_wavefronts), s.cp_async_bytes, s.mma_flops,
                        s.max_inflight_bytes_per_cta)
        for prof in _ACTIVE:
            prof.launches.append(launch)

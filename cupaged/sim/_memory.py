"""Guarded memory: every buffer a sim kernel touches sits between PROT_NONE pages.

Layout of one allocation (page = 4 KiB)::

    [guard zone][pad ........ | data (nbytes) | slack < 16][guard zone]
                               ^ 16-byte aligned            ^ page aligned

The data ends (up to 15 bytes of slack) right at the trailing guard zone, so a read or write past
the end faults at once; pad and slack are filled with poison (see ``poison_byte``). Every store of
a kernel is checked (cupaged_sim_bounds.h), so a write into pad or slack is an error at once; a
read there cannot fault and yields poison bytes (CUPAGED_SIM_BOUNDS=1 checks reads too). Pad and
slack are also checked after each launch, for the profiler's build, which checks no store. Each
guard zone is GUARD = 1 GiB of PROT_NONE address space (nothing is touched, so it costs no memory,
only address space: 2 GiB an array of the 128 TiB a process has): an access up to that far before
or after the data -- a block id or a slot far out of range -- faults and is attributed to this
buffer, instead of landing in some other mapping.

``empty/zeros/asarray`` return numpy arrays that live in such memory from birth and are passed to
kernels without a copy; plain numpy arrays are copied into a temporary one per launch and back.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref

import numpy as np

__all__ = ["GuardedBuffer", "empty", "zeros", "empty_like", "zeros_like", "asarray", "guarded_buffer", "live_buffers",
           "physical_memory", "regions"]

PAGE = mmap.PAGESIZE
GUARD = 1 << 30  # bytes of PROT_NONE address space on each side of the data
POISON = {"nan": 0xFF, "large": 0x7B}  # 0x7B..: f32 1.3e36, f16 61280, bf16 1.3e36, int32 2.07e9, e4m3 352


def poison_byte() -> int:
    """The byte the sim fills what a kernel must not read with (``CUPAGED_SIM_POISON``): 0xFF (NaN
    in every float format, -1 as an integer) by default; 0x7B ("large": a big positive value in
    every format) catches what NaN cannot, e.g. a max reduction missing its initializer (fmaxf
    ignores NaN) or a -1 read as padding."""
    name = os.environ.get("CUPAGED_SIM_POISON", "nan")
    if name not in POISON:
        raise ValueError(f"CUPAGED_SIM_POISON must be nan or large, got {name!r}")
    return POISON[name]
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0  # the guard zones need no swap reserve
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def physical_memory() -> int:
    """Bytes of RAM: sim memory is written whole at birth (poison), so more than this cannot work."""
    return os.sysconf("SC_PHYS_PAGES") * PAGE


class GuardedBuffer(mmap.mmap):
    """An anonymous mapping with a PROT_NONE guard zone on each side of ``nbytes`` of data."""

    def __new__(cls, nbytes: int):
        nbytes = int(nbytes)
        # Round up to a multiple of 16 (not nbytes + 15: that left 16 bytes of slack when nbytes is
        # already a multiple of 16, so a read just past the end of most arrays did not fault).
        span = -(-nbytes // 16) * 16
        inner = max(PAGE, -(-span // PAGE) * PAGE)
        if inner > physical_memory():  # every byte is written (poison): past RAM the OOM killer would end the process
            raise MemoryError(f"cannot allocate {nbytes} bytes of guarded sim memory: more than this machine's "
                              f"{physical_memory()} bytes of RAM")
        self = super().__new__(cls, -1, inner + 2 * GUARD,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.nbytes = nbytes
        self.base_addr = ctypes.addressof(ctypes.c_char.from_buffer(self))
        self.offset = GUARD + inner - span  # data start, 16-byte aligned
        self.data_addr = self.base_addr + self.offset
        self.lo = self.base_addr + GUARD  # first byte after the leading guard zone
        self.hi = self.base_addr + GUARD + inner  # first byte of the trailing guard zone
        self.end_addr = self.hi + GUARD  # end of the mapping
        self.fill = poison_byte()
        self.valid = (self.data_addr, self.data_addr + nbytes)  # the array's own bytes (a copy may narrow it)
        _LIVE.add(self)
        ctypes.memset(self.lo, self.fill, inner)
        for start in (self.base_addr, self.hi):
            if _libc.mprotect(start, GUARD, 0) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed for a guard zone")
        return self

    def array(self, shape, dtype) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self, offset=self.offset)

    def damaged(self) -> tuple[int, int] | None:
        """(first damaged byte offset relative to the data, count) in pad or slack, or None."""
        for start, end in ((self.lo, self.data_addr), (self.data_addr + self.nbytes, self.hi)):
            if end <= start or ctypes.string_at(start, end - start) == bytes([self.fill]) * (end - start):
                continue
            view = np.frombuffer((ctypes.c_ubyte * (end - start)).from_address(start), np.uint8)
            bad = np.flatnonzero(view != self.fill)
            if bad.size:
                return start + int(bad[0]) - self.data_addr, int(bad.size)
        return None

    def repair(self) -> None:
        ctypes.memset(self.lo, self.fill, self.data_addr - self.lo)
        ctypes.memset(self.data_addr + self.nbytes, self.fill, self.hi - self.data_addr - self.nbytes)


_LIVE: "weakref.WeakSet[GuardedBuffer]" = weakref.WeakSet()


def live_buffers() -> list[GuardedBuffer]:
    """Every guarded buffer still alive (not yet collected or closed)."""
    return [b for b in list(_LIVE) if not b.closed]


def regions(targets, every_live: bool = False) -> np.ndarray:
    """The engine's table for its access checks (``Region`` in cupaged_sim_bounds.h): the buffers
    ``targets`` a launch may write, and with ``every_live`` every other live guarded buffer too, as
    [mapping base, first valid byte, end of valid bytes, mapping end, is a target] (uint64, sorted
    by base)."""
    targets = set(targets)
    others = [b for b in live_buffers() if b not in targets] if every_live else []
    rows = sorted([(b.base_addr, *b.valid, b.end_addr, 1) for b in targets] +
                  [(b.base_addr, *b.valid, b.end_addr, 0) for b in others])
    return np.array(rows, dtype=np.uint64).reshape(-1, 5)


def guarded_buffer(a: np.ndarray) -> GuardedBuffer | None:
    """The GuardedBuffer that ``a``'s memory belongs to, if any."""
    obj = a
    while obj is not None:
        if isinstance(obj, GuardedBuffer):
            return obj
        if isinstance(obj, memoryview):
            obj = obj.obj
        else:
            obj = getattr(obj, "base", None)
    return None


def empty(shape, dtype=np.float32, order="C") -> np.ndarray:
    """Like numpy.empty, in guarded memory. Contents are poison bytes (0xFF: NaN for floats)."""
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    buf = GuardedBuffer(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    a = buf.array(shape[::-1] if order == "F" else shape, dtype)
    return a.T if order == "F" else a


def zeros(shape, dtype=np.float32, order="C") -> np.ndarray:
    a = empty(shape, dtype, order)
    a[...] = 0
    return a


def empty_like(a, dtype=None) -> np.ndarray:
    return empty(np.shape(a), dtype or np.asarray(a).dtype)


def zeros_like(a, dtype=None) -> np.ndarray:
    return zeros(np.shape(a), dtype or np.asarray(a).dtype)


def asarray(a, dtype=None) -> np.ndarray:
    """``a`` itself when it already lives in guarded memory (and has the dtype), else a copy."""
    if isinstance(a, np.ndarray) and guarded_buffer(a) is not None and (dtype is None or a.dtype == dtype):
        return a
    src = np.asarray(a, dtype=dtype)
    out = empty(src.shape, src.dtype)
    out[...] = src
    return out

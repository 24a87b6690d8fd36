"""Array arguments of a sim launch in guarded memory, and what a memory fault hit.

Guarded arrays (``cupaged.sim.empty/zeros/asarray``) are passed as they are; plain numpy arrays
are copied into guarded memory (overlapping views of one buffer share a copy) and written back
after the launch. A fault is attributed to the argument whose memory or guard zones hold the
address, or else to the one the faulting instruction's base or index register points into (a wild
index far past every guard zone, or a non-canonical address).
"""

from __future__ import annotations

import ctypes

import numpy as np

from cupaged.sim._compile import DYN_SMEM_CAPACITY
from cupaged.sim._errors import SimMemoryError
from cupaged.sim._memory import GuardedBuffer, guarded_buffer, live_buffers

__all__ = ["Staging", "fault_message"]


def _non_canonical(addr: int) -> bool:
    return 1 << 47 <= addr < (1 << 64) - (1 << 47)


def _offset(addr: int, ptr: int) -> int:
    """Byte offset of ``addr`` from an argument's pointer, as the kernel's int64 arithmetic wraps."""
    return (addr - ptr + (1 << 63)) % (1 << 64) - (1 << 63)


def fault_message(err, staged: "Staging", shared_mem: int) -> str:
    """The message of a memory fault recorded by the engine (``ErrorInfo`` in cupaged_sim_engine.h),
    whose own text (``invalid memory access``, maybe naming a stack overflow) serves when the
    address is in no argument."""
    kind = "write" if err.fault_write else "access"
    addr, dyn = err.fault_addr, err.dyn_smem
    if dyn <= addr < dyn + DYN_SMEM_CAPACITY:
        return (f"dynamic shared memory {kind} at byte offset {addr - dyn}, past the launch's "
                f"shared_mem={shared_mem} bytes")
    if err.fault_decoded == 3:  # found by instrumentation: the engine's message, plus whose memory it is
        return _instrumented(err, staged, addr)
    if err.fault_decoded == 2:
        return ("invalid memory access, address unknown: general-protection fault (a non-canonical address, "
                "e.g. from a huge index, in an instruction the sim cannot decode)")
    found = staged.locate(addr, (err.fault_base, err.fault_index), tuple(err.regs))
    if found is not None:
        i, inside = found
        name, off = staged.names[i], _offset(addr, staged.ptr[i])
    if err.fault_decoded == 1 and not _non_canonical(addr):
        where = f" ({name} at byte offset {off})" if found else ""
        return (f"general-protection fault at address {addr:#x}{where}: a canonical address, so likely a "
                "misaligned 16-byte access (the GPU faults on a misaligned vector access too)")
    note = " (non-canonical: a huge or negative index?)" if _non_canonical(addr) else ""
    if found is None:
        return f"{err.msg.decode(errors='replace')} at address {addr:#x} (not inside any argument){note}"
    if inside:
        buf = staged.buffers[i]
        return (f"out-of-bounds {kind} of {name} at byte offset {off} "
                f"(its memory spans {buf.data_addr - staged.ptr[i]}..{buf.data_addr + buf.nbytes - staged.ptr[i]})")
    return f"out-of-bounds {kind} of {name} at byte offset {off}: address {addr:#x}, far outside its memory{note}"


def _instrumented(err, staged: "Staging", addr: int) -> str:
    """The engine's message of an access its instrumentation stopped, and whose memory it hit; a wild
    store (outside every argument's memory) is named after the argument its address was computed
    from, as the registers tell."""
    msg = err.msg.decode(errors="replace")
    found = staged.locate(addr, (), tuple(err.regs) if err.fault_write else ())
    if found is not None and found[1]:
        i = found[0]
        return (f"{msg}: {staged.names[i]} at byte offset {_offset(addr, staged.ptr[i])} (its bytes span "
                f"{staged.span(i)}; address {addr:#x})")
    other = next((b for b in live_buffers() if b.base_addr <= addr < b.end_addr), None)
    note = (f" (in the memory of a {other.nbytes}-byte guarded array that is not an argument of this launch)"
            if other is not None else "")
    if found is None:
        return f"{msg}: address {addr:#x} (not inside any argument){note}"
    i = found[0]
    return (f"out-of-bounds write of {staged.names[i]} at byte offset {_offset(addr, staged.ptr[i])}: address "
            f"{addr:#x}, far outside its memory (its bytes span {staged.span(i)}){note}; stopped before it landed")


class Staging:
    """Pointers for array arguments; plain numpy memory goes through a guarded copy."""

    def __init__(self, views, names):
        self.names = names
        self.groups = []  # [lo, hi, buffer, writable, [(i, array)]]: overlapping plain arrays share one copy
        self.ptr = {}
        direct, plain = [], []
        for i, a in views:
            buf = guarded_buffer(a)
            if buf is not None:
                direct.append((i, a, buf))
            else:
                plain.append((*np.lib.array_utils.byte_bounds(a), i, a))
        for lo, hi, i, a in sorted(plain, key=lambda t: t[:3]):
            g = self.groups[-1] if self.groups else None
            if g is not None and lo < g[1]:
                g[1] = max(g[1], hi)
                g[3] = g[3] or a.flags.writeable
                g[4].append((i, a))
            else:
                self.groups.append([lo, hi, None, a.flags.writeable, [(i, a)]])
        self.buffers = {}
        for g in self.groups:
            # keep the copy's address congruent to the original's mod 16, so a kernel that chose
            # 16-byte accesses from the original alignment gets the same alignment here
            lead = g[0] % 16
            g[2] = GuardedBuffer(g[1] - g[0] + lead)
            g[2].valid = (g[2].data_addr + lead, g[2].data_addr + lead + g[1] - g[0])  # not the lead bytes
            ctypes.memmove(g[2].data_addr + lead, g[0], g[1] - g[0])
            for i, a in g[4]:
                self.ptr[i] = g[2].data_addr + lead + a.__array_interface__["data"][0] - g[0]
                self.buffers[i] = g[2]
        for i, a, buf in direct:
            self.ptr[i] = a.__array_interface__["data"][0]
            self.buffers[i] = buf

    def span(self, i) -> str:
        """Argument i's own bytes, as byte offsets from its pointer."""
        lo, hi = self.buffers[i].valid
        return f"{lo - self.ptr[i]}..{hi - self.ptr[i]}"

    def _pointed(self, r):
        """The argument whose own bytes hold address r (its guard zones are too wide to tell: a
        register holding some other value lands in one easily)."""
        for i, buf in self.buffers.items():
            if r and buf.valid[0] <= r < buf.valid[1]:
                return i
        return None

    def locate(self, addr, registers=(), all_registers=()):
        """(argument index, True) for the argument whose memory or guard zones hold ``addr``, else
        (index, False) for one a register of the faulting operand points into, else for one that
        ``addr`` - scale × some register points into (the operand's base, rebuilt from its index
        when the compiler had folded them into one address before the access, as the sim's
        instrumentation makes it do), else None."""
        for i, buf in self.buffers.items():
            if buf.base_addr <= addr < buf.end_addr:
                return i, True
        for r in registers:
            i = self._pointed(r)
            if i is not None:
                return i, False
        for x in all_registers:
            for scale in (1, 2, 4, 8, 16):
                i = self._pointed((addr - scale * x) % (1 << 64)) if x else None
                if i is not None:
                    return i, False
        return None

    def check_slack(self):
        """Pad and slack of every argument, then of every other live guarded array: a stray write
        far past one array (beyond its guard zones) into another's is reported by this launch."""
        for i, buf in self.buffers.items():
            bad = buf.damaged()
            if bad is not None:
                buf.repair()
                off = bad[0] + buf.data_addr - self.ptr[i]
                raise SimMemoryError(f"out-of-bounds write to {self.names[i]}: {bad[1]} byte(s) changed "
                                     f"around byte offset {off}, outside its {buf.nbytes} bytes")
        mine = set(self.buffers.values())
        for buf in live_buffers():
            bad = None if buf in mine else buf.damaged()
            if bad is not None:
                buf.repair()
                raise SimMemoryError(f"out-of-bounds write: {bad[1]} byte(s) changed around byte offset {bad[0]} of "
                                     f"a {buf.nbytes}-byte guarded array that is not an argument of this launch "
                                     "(a stray write far past some argument)")

    def repair(self):
        """After a failed launch: restore pad and slack, so the error does not resurface as a bogus
        out-of-bounds write in the next launch that uses the same (guarded) array."""
        for buf in set(self.buffers.values()):
            if buf.damaged() is not None:
                buf.repair()

    def finish(self):
        for lo, hi, buf, writable, _ in self.groups:
            if writable:
                ctypes.memmove(lo, buf.data_addr + lo % 16, hi - lo)

"""The source lines of g++'s basic blocks in a profiled sim build (``Launch.line_executions``).

The profiled build calls ``__sanitizer_cov_trace_pc`` at the start of every basic block; the call's
return address names the block. A block's code runs from its call to the next such call in the
object's ``.text`` (found by scanning the code for direct calls to the hook, from the ELF symbol
table's address of it), and its lines are the line-table locations of addresses sampled through that
range, within its function (``addr2line -i``, kept as in ``_lines.py``: an inlined sim or CUDA helper belongs to the line
that called it). A block whose own first location is inside such a helper (a loop of an emulated
instruction) is the helper's, not the kernel's: it is left out. Blocks that did not run are listed
too, with 0 executions (a loop that did not run is seen as such).
"""

from __future__ import annotations

import bisect
import functools
import struct

import numpy as np

from cupaged.sim.profiler import _lines

__all__ = ["host_blocks"]

_SAMPLE = 2          # bytes between sampled addresses (x86-64 instructions are 1-15 bytes, most 3-7)
_MAX_SAMPLES = 512   # per block


def _sections(data: bytes) -> dict:
    """name -> (address, file offset, size, link) of an ELF64 object's sections."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    rows = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    names = rows[shstrndx][4]
    out = {}
    for name, _, _, addr, offset, size, link, _ in rows:
        end = data.index(b"\0", names + name)
        out[data[names + name:end].decode()] = (addr, offset, size, link, rows)
    return out


def _symbols(data: bytes, sections: dict) -> list[tuple[str, int, int, int]]:
    """(name, type, address, size) of every defined symbol of the ELF symbol table."""
    if ".symtab" not in sections:
        return []
    _, offset, size, link, rows = sections[".symtab"]
    strtab = rows[link][4]
    out = []
    for i in range(offset, offset + size, 24):
        name, info, _, shndx, value, length = struct.unpack_from("<IBBHQQ", data, i)
        if shndx:
            out.append((data[strtab + name:data.index(b"\0", strtab + name)].decode(errors="replace"), info & 15,
                        value, length))
    return out


@functools.lru_cache(maxsize=8)
def _code(so: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted file addresses just after every direct call of __sanitizer_cov_trace_pc, sorted
    function starts, their ends) of the object ``so``."""
    with open(so, "rb") as f:
        data = f.read()
    sections = _sections(data)
    symbols = _symbols(data, sections)
    hook = next((value for name, _, value, _ in symbols if name == "__sanitizer_cov_trace_pc"), None)
    functions = sorted((value, value + length) for _, kind, value, length in symbols if kind == 2 and length)
    starts = np.array([f[0] for f in functions], np.int64)
    ends = np.array([f[1] for f in functions], np.int64)
    if hook is None or ".text" not in sections:
        return np.zeros(0, np.int64), starts, ends
    addr, offset, size = sections[".text"][:3]
    code = np.frombuffer(data, np.uint8, size, offset)
    at = np.flatnonzero(code[:-4] == 0xE8)
    rel = code[at + 1].astype(np.int64) | code[at + 2].astype(np.int64) << 8 | code[at + 3].astype(np.int64) << 16 \
        | code[at + 4].astype(np.int64) << 24
    rel = np.where(rel >= 1 << 31, rel - (1 << 32), rel)
    returns = addr + at + 5
    return np.sort(returns[returns + rel == hook]), starts, ends


def host_blocks(lib, counts: dict) -> list[tuple[frozenset, int]]:
    """(source lines, warp-level executions) of every basic block of the kernel's own code in the
    module loaded as ``lib``; ``counts``: pc (a run-time return address of the hook) -> executions
    (a block that did not run counts 0)."""
    so, base = _lines._object_of(lib)
    returns, starts, ends = _code(so)
    pcs = [base + int(r) for r in returns]
    first = _lines.own_locations(lib, pcs)
    samples = {}
    for k, pc in enumerate(pcs):
        if first[pc] is None:
            continue
        start = pc - base
        end = int(returns[k + 1]) - 5 if k + 1 < len(returns) else start + 1
        f = bisect.bisect_right(starts, start) - 1
        if f >= 0 and start < ends[f]:  # not past its function's end
            end = min(end, int(ends[f]))
        samples[pc] = [base + a + 1 for a in range(start, max(end, start + 1), _SAMPLE)][:_MAX_SAMPLES]
    where = _lines.locations(lib, sorted({a for group in samples.values() for a in group}))
    return [(frozenset(w for a in group if (w := where[a]) != "??") | {first[pc]}, counts.get(pc, 0))
            for pc, group in samples.items()]
